"""The vision tower run block by block (HF backend), so encode methods can merge or drop tokens between its blocks
(`vtc.core.bases.TowerMerger`, `vtc.core.tower.TowerTokens`).

vtc calls the tower's own modules in the tower's own order (patch embedding, position embeddings, every block's
norm / attention / MLP, DeepStack taps, merger) and, after every block's attention and after every block, hands each
video's tokens to the pipeline's tower methods (`Pipeline.run_encode_block`). What it keeps for the tokens itself:
their rotary rows (Qwen: a merged token keeps its own), their frame and window (the attention segments: Qwen attends
per temporal patch, Qwen2.5-VL within windows in most blocks, SigLIP / CLIP per frame) and their sizes.

Attention: the block's own attention module (the model's attention implementation, FlashAttention varlen included)
unless a method asks for proportional attention (ToMe: log(size) added to every key's logits), which vtc then
computes with SDPA and that bias from the block's own projections. The keys a method reads are the block's key
projection before the rotary embedding (`needs_keys`). The Qwen towers:

    QwenTower.run: the survivors of the pre-tower methods in, every video's merger output out, scattered onto its
    whole token grid (merged-away units are zero rows; the LLM keeps only the survivors, at their own (t, h, w)).

SigLIP / CLIP (LLaVA): `LlavaTower.run` runs the encoder up to the layer whose output the projector reads (the
later layers' outputs are never used), then unmerges every frame's tokens onto its patch grid (each patch gets the
token holding it, ToMe's source map) so the model's own projector and pooling see a whole grid; a frame folded into
another frame (EarlyTom) is a zero frame there and leaves the LLM's input.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context
from vtc.core.tower import (
    MergeUnitTower,
    TowerRun,
    TowerTokens,
    initial_tokens,
    scatter_by_cell,
    segment_attention,
    unit_tokens,
)

Tensor = torch.Tensor


# --- the Qwen towers ----------------------------------------------------------------------------------------------


class QwenTower(MergeUnitTower):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL's towers block by block (a token is one merge unit): the loop is
    `vtc.core.tower.MergeUnitTower`'s, shared with vLLM's towers (`vtc.vllm.tower`); this class calls transformers'
    modules."""

    def __init__(self, adapter) -> None:
        visual = adapter.vision_tower
        config = adapter.model.config.vision_config
        merge = int(config.spatial_merge_size)
        window = None
        if hasattr(visual, "fullatt_block_indexes"):  # units per window side (the tower's `vit_merger_window_size`)
            window = int(config.window_size) // merge // int(config.patch_size)
        super().__init__(
            adapter.family,
            list(visual.blocks),
            merge,
            window,
            getattr(visual, "fullatt_block_indexes", None) or (),
            getattr(visual, "deepstack_visual_indexes", None) or (),
        )
        self.adapter = adapter
        self.visual = visual

    def run(
        self, pixels: Tensor, grid_thw: Tensor, kept: list[Tensor], pipeline: Pipeline, ctxs: list[Context]
    ) -> tuple[Any, TowerRun]:
        """The tower on the survivors `kept` (units per video, ascending) of `pixels` [rows, C*tp*P*P], with the
        pipeline's tower methods between blocks. Returns the tower's output (pooler_output: one [units, D] per video
        on its whole grid, zero rows where no token survived; DeepStack features alike) and the run."""
        from vtc.hf.encode import survivor_rows

        visual, unit, merge = self.visual, self.unit, self.merge
        grids = [(int(t), int(h) // merge, int(w) // merge) for t, h, w in grid_thw.tolist()]
        units = [t * h * w for t, h, w in grids]
        rows = survivor_rows(kept, units, unit).to(pixels.device)
        inputs = self.adapter.survivor_tower_inputs(grid_thw, kept, rows)
        x = visual.patch_embed(pixels[rows].type(visual.dtype))
        if "interp_indices" in inputs:  # Qwen3-VL: the learned position embedding, interpolated to the grid
            pos = (visual.pos_embed(inputs["interp_indices"]) * inputs["interp_weights"][:, :, None]).sum(1)
            x = x + pos.to(x.dtype)
        cos, sin = visual.rotary_pos_emb(x, inputs["position_ids"])
        dim = x.shape[-1]
        x = x.view(-1, unit, dim)
        cos, sin = cos.reshape(x.shape[0], unit, -1), sin.reshape(x.shape[0], unit, -1)
        patches = pixels[rows].view(x.shape[0], unit, -1)
        run = TowerRun(pipeline, ctxs, unit_tokens(x, kept, grids, len(visual.blocks)))
        x, taps = self.run_blocks(run, x, cos, sin, patches)
        merged = visual.merger(x.flatten(0, 1))
        return self._output(x, merged, run.tokens, units, taps), run

    def attend(self, block, x, cos, sin, lengths, bias, keys_wanted):
        attn = block.attn
        h = block.norm1(x)
        n = h.shape[0]
        keys = None
        if bias is None:
            captured: list[Tensor] = []
            handle = attn.qkv.register_forward_hook(lambda m, a, out: captured.append(out)) if keys_wanted else None
            cu = F.pad(torch.tensor(lengths, device=h.device).cumsum(0, dtype=torch.int32), (1, 0))
            try:
                out = attn(h, cu_seqlens=cu, position_embeddings=(cos, sin))
            finally:
                if handle is not None:
                    handle.remove()
            if keys_wanted:
                keys = captured[0].view(n, 3, attn.num_heads, -1)[:, 1]
            return out, keys
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb_vision
        q, k, v = attn.qkv(h).view(n, 3, attn.num_heads, -1).unbind(1)
        keys = k
        q, k = rotate(q, k, cos, sin)
        return attn.proj(segment_attention(q, k, v, lengths, attn.scaling, bias).reshape(n, -1)), keys

    def mlp(self, block, x):
        return block.mlp(block.norm2(x))

    def tap(self, index, x):
        return self.visual.deepstack_merger_list[index](x)

    def _output(self, x: Tensor, merged: Tensor, tokens: list[TowerTokens], units: list[int], taps):
        """The tower's output object, each video's rows scattered onto its whole grid by their cells."""
        pooler = scatter_by_cell(merged, tokens, units)
        module = sys.modules[type(self.visual).__module__]
        if self.deepstack:
            features = [scatter_by_cell(tap, at, units) for tap, at in taps]
            return module.BaseModelOutputWithDeepstackFeatures(
                last_hidden_state=x.flatten(0, 1), pooler_output=pooler, deepstack_features=features
            )
        return module.BaseModelOutputWithPooling(last_hidden_state=x.flatten(0, 1), pooler_output=pooler)


# --- SigLIP / CLIP (LLaVA) ---------------------------------------------------------------------------------------


class LlavaTower:
    """LLaVA's SigLIP / CLIP tower block by block: every frame is one batch item of `side x side` patches (plus a
    CLIP class token); tokens stay dense (every frame of a call keeps the same count)."""

    def __init__(self, adapter) -> None:
        self.adapter = adapter
        self.model = getattr(adapter.vision_tower, "vision_model", adapter.vision_tower)
        self.layers = list(self.model.encoder.layers)
        self.side = adapter.patch_side
        self.class_token = "cls_token" in adapter.record.features

    def run(
        self, pixels: Tensor, frames: list[int], last_layer: int, pipeline: Pipeline, ctxs: list[Context]
    ) -> tuple[list[Tensor], list[Tensor], TowerRun]:
        """The encoder on `pixels` [sum frames, C, H, W] up to encoder layer `last_layer` (0-based) with the pipeline's
        tower methods between blocks. Returns per video the output of `last_layer` unmerged onto every frame's
        tokens [frames, (1 +) side * side, D] (a frame folded into another: zeros), the frames that kept tokens of
        their own, and the run."""
        side, cls = self.side, int(self.class_token)
        per_frame = side * side + cls
        x = self.model.embeddings(pixels.type(self.model.embeddings.patch_embedding.weight.dtype))
        if hasattr(self.model, "pre_layrnorm"):  # CLIP
            x = self.model.pre_layrnorm(x)
        dim = x.shape[-1]
        x = x.reshape(-1, 1, dim)
        tokens, start = [], 0
        patch = torch.arange(side * side, device=x.device)
        for f in frames:
            frame = torch.arange(f, device=x.device).repeat_interleave(per_frame)
            cells = torch.cat([torch.cat([patch.new_full((cls,), -1), i * side * side + patch]) for i in range(f)])
            tokens.append(
                initial_tokens(x[start : start + f * per_frame], cells, frame, (f, side, side), last_layer + 1)
            )
            start += f * per_frame
        run = TowerRun(pipeline, ctxs, tokens)
        keys_wanted, proportional = pipeline.tower_needs_keys, pipeline.proportional_attention
        attention_layers = pipeline.tower_attention_layers(last_layer + 1)
        x = self._hook(run, x, -1, "embedded", pixels=self._patches(pixels, x.dtype))
        for layer in range(last_layer + 1):
            block = self.layers[layer]
            dense = self._dense(run, x, dim)
            bias = torch.cat([t.size for t in run.tokens]).log().view(dense.shape[:2]) if proportional else None
            normed = block.layer_norm1(dense)
            attended, keys = self._attention(block, normed, bias, keys_wanted)
            received = self._received(block.self_attn, normed) if layer in attention_layers else None
            x = (dense + attended).reshape(-1, 1, dim)
            x = self._hook(run, x, layer, "after_attention", keys=keys, received=received)
            dense = self._dense(run, x, dim)
            x = (dense + block.mlp(block.layer_norm2(dense))).reshape(-1, 1, dim)
            x = self._hook(run, x, layer, "after_block")
        features, alive, offset = [], [], 0
        for t, f in zip(run.tokens, frames):
            hidden = x[offset : offset + len(t), 0]
            offset += len(t)
            features.append(self._unmerge(t, hidden, f))
            alive.append(torch.unique(t.frame))
        return features, alive, run

    def _dense(self, run: TowerRun, x: Tensor, dim: int) -> Tensor:
        """x as [frames, tokens per frame, D]; refuses a call whose frames were left with different counts."""
        lengths = torch.cat([t.frame_lengths() for t in run.tokens])
        lengths = lengths[lengths > 0]
        if bool((lengths != lengths[0]).any()):
            raise RuntimeError(
                f"the tower methods {', '.join(e.card.name for e in run.pipeline.tower_entries())} left the frames of "
                f"one SigLIP/CLIP call with different token counts ({sorted(set(lengths.tolist()))}); this tower runs "
                "every frame as one batch item, so every frame must keep the same number of tokens"
            )
        return x.view(-1, int(lengths[0]), dim)

    def _hook(self, run: TowerRun, x: Tensor, layer: int, point: str, **extra) -> Tensor:
        gather = run.hook(x, layer, point, **extra)
        return x if gather is None else run.new_hidden

    def _patches(self, pixels: Tensor, dtype: torch.dtype) -> Tensor:
        """[frames * tokens, 1, C * P * P]: every frame's patches in the patch embedding's weight order (a class
        token: zeros)."""
        patch = self.model.embeddings.patch_embedding.kernel_size[0]
        patches = F.unfold(pixels.to(dtype), kernel_size=patch, stride=patch).transpose(1, 2)  # [F, S, C*P*P]
        if self.class_token:
            patches = F.pad(patches, (0, 0, 1, 0))
        return patches.reshape(-1, 1, patches.shape[-1])

    @staticmethod
    def _received(attn, normed: Tensor) -> Tensor:
        """[frames * n]: the attention each token receives in its frame, mean over heads and queries."""
        from vtc.core.vision_stats import frame_stats

        frames, n, _ = normed.shape
        shape = (frames, n, attn.num_heads, -1)
        q, k = (proj(normed).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj))
        return (frame_stats(q, k, attn.scale, {"received"})["received"] / n).flatten()

    def _attention(self, block, h: Tensor, bias: Tensor | None, keys_wanted: bool):
        """The layer's attention on normed `h` [frames, n, D]: its own module, or SDPA with the per-key `bias`
        [frames, n]; and the keys [frames * n, 1, heads, head_dim] when asked."""
        attn = block.self_attn
        frames, n, dim = h.shape
        keys = None
        if bias is None:
            out = attn(hidden_states=h, attention_mask=None)[0]
            if keys_wanted:
                keys = attn.k_proj(h).view(frames * n, 1, attn.num_heads, -1)
            return out, keys
        shape = (frames, n, attn.num_heads, -1)
        q, k, v = (proj(h).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        mask = bias[:, None, None, :].to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)
        out = attn.out_proj(out.transpose(1, 2).reshape(frames, n, dim))
        if keys_wanted:
            keys = k.transpose(1, 2).reshape(frames * n, 1, attn.num_heads, -1)
        return out, keys

    def _unmerge(self, tokens: TowerTokens, hidden: Tensor, frames: int) -> Tensor:
        """[frames, (1 +) side^2, D]: every cell of a frame that kept tokens of its own gets the token holding it
        (the class token its own), other frames zeros."""
        side2 = self.side * self.side
        cls = int(self.class_token)
        out = hidden.new_zeros(frames, side2 + cls, hidden.shape[-1])
        alive = torch.unique(tokens.frame)
        cells = (alive[:, None] * side2 + torch.arange(side2, device=alive.device)).flatten()
        holder = tokens.holder[cells]
        if bool((holder < 0).any()):
            raise RuntimeError("a tower method dropped patches of a frame whose grid LLaVA's pooling needs whole")
        out[alive, cls:] = hidden[holder].view(alive.numel(), side2, -1)
        if cls:
            first = torch.nonzero(tokens.cell < 0).flatten()
            out[tokens.frame[first], 0] = hidden[first]
        return out
