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
