"""Independent reference implementations, for tests only.

`ManualLLM` runs an *unpatched* model's language model layer by layer, the way the official FastV and
FrameFusion code does (hidden states sliced between layers, RoPE rows sliced with them, attention
probabilities of the last prompt rows computed explicitly from the layer's query/key). vtc's hooks are not
involved, so agreement between the two is evidence that the plugin + runtime reproduce the algorithm.
Batch size 1, no padding (what the official code supports).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vtc.hf.adapters import resolve_adapter

CAPTURED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_NAME = "vtc_test_capture"


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    CAPTURED[module.layer_idx] = (query, key)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(_NAME, _capture_attention)
AttentionMaskInterface.register(_NAME, sdpa_mask)


def last_rows_attention(query, key, num: int, upcast: bool) -> torch.Tensor:
    """softmax(q_last K^T / sqrt(d) + causal) for the last `num` query rows -> [1, H, num, S]."""
    q = query[:, :, -num:, :]
    n_rep = q.shape[1] // key.shape[1]
    k = key.repeat_interleave(n_rep, dim=1)
    L, S = q.shape[-2], k.shape[-2]
    bias = torch.zeros(L, S, dtype=q.dtype)
    bias.masked_fill_(torch.ones(L, S, dtype=torch.bool).triu(diagonal=S - L + 1), float("-inf"))
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias
    if upcast:
        return torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.softmax(logits, dim=-1)


class ManualLLM:
    def __init__(self, model):
        self.model = model
        self.adapter = resolve_adapter(model)
        self.text = self.adapter.text_model
        self.layers = self.adapter.decoder_layers

    @contextlib.contextmanager
    def capturing(self):
        config = self.text.config
        before = config._attn_implementation
        config._attn_implementation = _NAME
        try:
            yield
        finally:
            config._attn_implementation = before
            CAPTURED.clear()

    def llm_inputs(self, inputs) -> dict:
        """What the (unpatched) model feeds its language model for `inputs`."""
        seen = {}

        def hook(module, args, kwargs):
            seen.update(kwargs)
            raise _Stop

        handle = self.text.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                self.model(**inputs)
        except _Stop:
            pass
        finally:
            handle.remove()
        return seen

    def rope(self, embeds, position_ids):
        if self.adapter.mrope and position_ids.dim() == 3 and position_ids.shape[0] == 4:
            position_ids = position_ids[1:]
        if position_ids is None:
            position_ids = torch.arange(embeds.shape[1])[None]
        return self.text.rotary_emb(embeds, position_ids)

    def attention_block(self, i, hidden, cos, sin, mask=None):
        """h + Attn(LN(h)); `mask` [L, L] bool (True = may attend), default causal."""
        layer = self.layers[i]
        out, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(hidden),
            attention_mask=None if mask is None else mask[None, None],
            position_embeddings=(cos, sin),
        )
        return hidden + out

    def mlp_block(self, i, hidden):
        layer = self.layers[i]
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def deepstack(self, i, hidden, visual_mask, deepstack_embeds):
        if deepstack_embeds is None or i >= len(deepstack_embeds):
            return hidden
        hidden = hidden.clone()
        hidden[0, visual_mask] = hidden[0, visual_mask] + deepstack_embeds[i].to(hidden.dtype)
        return hidden

    def logits(self, hidden):
        return self.model.lm_head(self.text.norm(hidden))


class _Stop(Exception):
    pass


def start(model, inputs, new_tokens=None):
    """Everything a reference run starts from: the runner, the (extended) inputs, the LLM inputs, the
    embeddings, RoPE (cos, sin) of the whole sequence and the mask of compressible video tokens."""
    ref = ManualLLM(model)
    if new_tokens is not None:
        inputs = extend_inputs(inputs, new_tokens)
    x = ref.llm_inputs(inputs)
    hidden = x["inputs_embeds"]
    cos, sin = ref.rope(hidden, x.get("position_ids"))
    return ref, inputs, x, hidden, cos, sin, compressible_video_mask(model, inputs["input_ids"])


def compressible_video_mask(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[L] video tokens the methods may touch (LLaVA-OneVision's trailing newline excluded)."""
    adapter = resolve_adapter(model)
    mask = input_ids[0] == adapter.video_token_id
    if adapter.family == "llava_onevision":
        idx = torch.nonzero(mask).flatten()
        mask[idx[-1]] = False
    return mask


def extend_inputs(inputs, new_tokens: torch.Tensor) -> dict:
    """The same processor inputs with generated tokens appended to the prompt."""
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], new_tokens], dim=1)
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    if "mm_token_type_ids" in inputs:
        out["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(new_tokens)], dim=1)
    return out


# --- DIG's CAFS scene cuts (vtc.media.frame_selection: dig and infoshot) ---------------------------------------
def official_get_r_frames(features_of, total_frames, fps, samples_per_sec=2):
    """Jialuo-Li/DIG (ffe6d25) pipeline/cafs.py::get_r_frames, transcribed (DIG's r-frames; InfoShot's shots use the
    same cuts); `features_of(indices)` stands in for decord + DINOv2 mean features. Also returns the 2-fps
    candidates."""
    import torch.nn.functional as F
    from scipy.signal import find_peaks

    video_len_sec = int(total_frames / fps)
    num_segments = math.ceil(video_len_sec / 60)
    target_frame_indices = np.linspace(0, total_frames - 1, video_len_sec * samples_per_sec, dtype=int)
    segment_boundaries = np.linspace(0, total_frames - 1, num_segments + 1, dtype=int)
    frame_chunks = []
    for i, (start, end) in enumerate(zip(segment_boundaries[:-1], segment_boundaries[1:])):
        mask = (target_frame_indices >= start) & (
            target_frame_indices <= end if i == len(segment_boundaries) - 2 else target_frame_indices < end
        )
        frame_chunks.append(target_frame_indices[mask])
    cuts, result_frames = [0], []
    for i, chunk_indices in enumerate(frame_chunks):
        if len(chunk_indices) == 0:
            continue
        chunk_features = features_of(chunk_indices)
        if chunk_features.shape[0] > 1:
            diffs = 1 - F.cosine_similarity(chunk_features[:-1], chunk_features[1:], dim=1)
            peaks, _ = find_peaks(diffs.detach().cpu().numpy(), prominence=0.1)
            current_peaks = chunk_indices[peaks].tolist()
            temp_cuts = [cuts[-1]] + current_peaks
            cuts.extend(current_peaks)
        else:
            temp_cuts = [cuts[-1]]
        if i == len(frame_chunks) - 1:
            cuts.append(total_frames - 1)
            temp_cuts.append(total_frames - 1)
        mid_points = [(start + end) // 2 for start, end in zip(temp_cuts[:-1], temp_cuts[1:])]
        if mid_points:
            sample_frames_np = np.array(target_frame_indices)
            nearest_indices = [np.abs(sample_frames_np - m).argmin() for m in mid_points]
            result_frames.extend(sample_frames_np[nearest_indices].tolist())
    return {"r_frame_idx": result_frames, "boundaries": cuts, "candidates": target_frame_indices.tolist()}
