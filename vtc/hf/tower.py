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

SigLIP / CLIP (LLaVA): `LlavaTower.run` (the loop of `vtc.core.tower.FrameTower`, shared with vLLM's towers) runs
the encoder up to the layer whose output the projector reads (the later layers' outputs are never used), then
unmerges every frame's tokens onto its patch grid (each patch gets the token holding it, ToMe's source map) so the
model's own projector and pooling see a whole grid; a frame folded into another frame (EarlyTom) is a zero frame
there and leaves the LLM's input.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context
from vtc.core.tower import (
    FrameTower,
    MergeUnitTower,
    TowerRun,
    TowerTokens,
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


class LlavaTower(FrameTower):
    """LLaVA's SigLIP / CLIP tower block by block (transformers' modules): the loop is
    `vtc.core.tower.FrameTower`'s, shared with vLLM's towers (`vtc.vllm.tower.VllmFrameTower`); this class calls
    transformers' attention modules (their `q_proj`, `k_proj`, `v_proj`, `out_proj`, or the module itself with the
    model's attention implementation)."""

    def __init__(self, adapter) -> None:
        super().__init__(
            getattr(adapter.vision_tower, "vision_model", adapter.vision_tower),
            adapter.patch_side,
            "cls_token" in adapter.record.features,
        )
        self.adapter = adapter

    def projections(self, attn, h):
        shape = (*h.shape[:-1], attn.num_heads, -1)
        return tuple(proj(h).view(shape) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))

    def project_out(self, attn, x):
        return attn.out_proj(x)

    def own_attention(self, attn, h, keys_wanted):
        out = attn(hidden_states=h, attention_mask=None)[0]
        keys = attn.k_proj(h).view(*h.shape[:-1], attn.num_heads, -1) if keys_wanted else None
        return out, keys
