"""vLLM's vision towers block by block (the Qwen towers, and LLaVA's SigLIP / CLIP below), so the encode methods that
act between a tower's blocks (`vtc.core.bases.TowerMerger`: ToMe, GRT) run inside a served model; for Qwen2-VL,
Qwen2.5-VL and Qwen3-VL the vLLM counterpart of `vtc.hf.tower.QwenTower`, sharing its loop
(`vtc.core.tower.MergeUnitTower`: hooks, rotary rows carried through merges, attention segments, DeepStack taps).

What runs is vLLM's own modules, in the order the tower's `forward` calls them: `input_norm` (vLLM 0.32 normalises raw
uint8 pixels on the device) and `patch_embed` on the surviving units' patch rows; the rotary rows from the tower's
own `rot_pos_emb` (Qwen2.5-VL: `rotary_pos_emb_thw`, in the grid's order, not the window order) and Qwen3-VL's
interpolated position embedding (`fast_pos_embed_interpolate`), computed for the whole grid and taken at the
survivors; then every block's `norm1`, attention, `norm2` and `mlp`, the DeepStack mergers after their blocks, the
merger. A token is one merge unit (its 4 patches stay together, so the merger gets complete units); the merger output
is scattered back onto each video's whole grid (zeros where no token survived), DeepStack features alike, and
concatenated as the tower's output is (`[merger ; deepstack levels]` per row).

Attention: the block's own attention module (`Qwen2VisionAttention` / `Qwen2_5_VisionAttention` with vLLM's
`MMEncoderAttention`: FlashAttention varlen on GPU, SDPA on CPU), on x in its own layout [s, b=1, c], with the
segments of the tokens left: one per temporal patch, one per window on Qwen2.5-VL's windowed blocks (vLLM's window
layout: `vit_merger_window_size` units a side, row-major), in the form its backend takes (`cu_seqlens`,
`max_seqlen`, FlashInfer's `sequence_lengths`). The keys a method reads are the `qkv` projection's key part, before
the rotary embedding (a forward hook on `qkv`). When a method asks for proportional attention (ToMe) the block's own
`qkv`, `apply_rotary_emb` and `proj` run around `vtc.core.tower.segment_attention` (SDPA with log(size) added to
every key's logits).

Tensor parallelism: refused when the tower itself is split across ranks (`vtc.vllm.config.check_tower_parallelism`,
at start); with `--mm-encoder-tp-mode data` every rank runs the whole tower here (its linears are not sharded).

LLaVA's SigLIP / CLIP (`VllmFrameTower`, the counterpart of `vtc.hf.tower.LlavaTower`, sharing its loop:
`vtc.core.tower.FrameTower`): every frame one batch item of patches (plus CLIP's class token), the tower's own
`embeddings` (and CLIP's `pre_layrnorm`), then every layer vLLM holds (it builds the tower only up to the layer the
projector reads) with its `layer_norm1`, attention, `layer_norm2` and `mlp`; every frame is then unmerged onto its
patch grid and goes through the tower's own output step, so the model's projector and pooling see a whole grid.
Attention: the layer's own `SiglipAttention` / `CLIPAttention` (`qkv_proj`, `MMEncoderAttention`, `out_proj`) on
[frames, n, D]; the keys a method reads are `qkv_proj`'s key part (a forward hook); proportional attention runs the
same projections around SDPA with log(size) added to every key's logits. vLLM's LLaVA models take no
`--mm-encoder-tp-mode data`, so tower methods there need one tensor-parallel rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context
from vtc.core.tower import FrameTower, MergeUnitTower, TowerRun, scatter_by_cell, segment_attention, unit_tokens
from vtc.hf.encode import survivor_rows

Tensor = torch.Tensor


class VllmQwenTower(MergeUnitTower):
    """vLLM's `Qwen2VisionTransformer`, `Qwen2_5_VisionTransformer` or `Qwen3_VisionTransformer` block by block."""

    def __init__(self, visual: torch.nn.Module, family: str) -> None:
        merge = int(visual.spatial_merge_size)
        windowed = hasattr(visual, "fullatt_block_indexes")
        window = int(visual.window_size) // merge // int(visual.patch_size) if windowed else None
        super().__init__(
            family,
            list(visual.blocks),
            merge,
            window,
            visual.fullatt_block_indexes if windowed else (),
            getattr(visual, "deepstack_visual_indexes", None) or (),
        )
        self.visual = visual
        ranks = max((int(getattr(b.attn, "tp_size", 1)) for b in self.blocks), default=1)
        if ranks > 1:  # checked at start too (check_tower_parallelism); a tower split by heads cannot merge here
            raise RuntimeError(
                f"vtc runs tower methods on an unsplit vision tower; this {family} tower is split across {ranks} "
                "tensor-parallel ranks (start with --mm-encoder-tp-mode data)"
            )

    def run(
        self, pixels: Tensor, grid_thw: Tensor, kept: list[Tensor], pipeline: Pipeline, ctxs: list[Context]
    ) -> tuple[tuple[Tensor, ...], TowerRun]:
        """The tower on the surviving units `kept` (per video, ascending) of `pixels` (the videos' patch rows, as
        vLLM's processor made them), the pipeline's tower methods between blocks. Returns per video its output on
        the whole unit grid [units, D] (D: the merger's width, times 1 + DeepStack levels on Qwen3-VL; zero rows
        where no token survived) and the run (`run.tokens`: the survivors, their cells and sizes)."""
        visual, unit, merge = self.visual, self.unit, self.merge
        patch_grids = [[int(v) for v in size] for size in grid_thw.tolist()]
        grids = [(t, h // merge, w // merge) for t, h, w in patch_grids]
        units = [t * h * w for t, h, w in grids]
        kept = [k.to(torch.long).cpu() for k in kept]
        rows = survivor_rows(kept, units, unit)
        normed = visual.input_norm(pixels[rows.to(pixels.device)].to(device=visual.device), visual.dtype)
        x = visual.patch_embed(normed)
        cos, sin, pos = self._positions(patch_grids)
        at = rows.to(cos.device)
        cos, sin = cos[at], sin[at]
        if pos is not None:  # Qwen3-VL: the learned position embedding, interpolated to the grid
            x = x + pos[rows.to(pos.device)]
        dim = x.shape[-1]
        x = x.view(-1, unit, dim)
        cos, sin = cos.reshape(x.shape[0], unit, -1), sin.reshape(x.shape[0], unit, -1)
        run = TowerRun(pipeline, ctxs, unit_tokens(x, kept, grids, len(self.blocks)))
        x, taps = self.run_blocks(run, x, cos, sin, normed.view(x.shape[0], unit, -1))
        if x.dtype == torch.float16 and self.window is not None:  # as Qwen2.5-VL's forward, before its merger
            from vllm.model_executor.models.utils import cast_overflow_tensors

            x = cast_overflow_tensors(x)
        out = scatter_by_cell(visual.merger(x.flatten(0, 1)), run.tokens, units)
        if taps:
            levels = [scatter_by_cell(tap, at, units) for tap, at in taps]
            out = tuple(torch.cat([main, *(level[v] for level in levels)], dim=1) for v, main in enumerate(out))
        return out, run

    def _positions(self, patch_grids: list[list[int]]) -> tuple[Tensor, Tensor, Tensor | None]:
        """The whole grids' rotary rows (cos, sin [patches, R], in the patch rows' order) and Qwen3-VL's
        interpolated position embeddings [patches, D] (None elsewhere), by the tower's own functions."""
        visual = self.visual
        if self.window is not None:  # Qwen2.5-VL: per video, in the grid's order (its forward reorders by window)
            parts = [visual.rotary_pos_emb_thw(t, h, w) for t, h, w in patch_grids]
            cos = torch.cat([c.flatten(0, 1) for c, _ in parts])
            sin = torch.cat([s.flatten(0, 1) for _, s in parts])
            return cos, sin, None
        cos, sin = visual.rot_pos_emb(patch_grids)
        pos = visual.fast_pos_embed_interpolate(patch_grids) if hasattr(visual, "fast_pos_embed_interpolate") else None
        return cos, sin, pos

    def attend(self, block, x, cos, sin, lengths, bias, keys_wanted):
        attn = block.attn
        h = block.norm1(x).unsqueeze(1)  # [s, b=1, c]: the layout vLLM's Qwen vision attention takes
        n = h.shape[0]
        heads, head_dim = attn.num_attention_heads_per_partition, attn.hidden_size_per_attention_head
        if bias is None:
            captured: list[Tensor] = []
            handle = None
            if keys_wanted:  # a parallel linear returns (output, bias)
                handle = attn.qkv.register_forward_hook(
                    lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out)
                )
            cu = F.pad(torch.tensor(lengths).cumsum(0, dtype=torch.int32), (1, 0))
            try:
                segments = segment_inputs(self.visual, self.family, cu)
                out = attn(h, rotary_pos_emb_cos=cos, rotary_pos_emb_sin=sin, **segments)
            finally:
                if handle is not None:
                    handle.remove()
            # the qkv output is [q heads ; k heads ; v heads] per row (Qwen2-VL's chunk(3), Qwen2.5-VL's "three")
            keys = captured[0].reshape(n, 3, heads, head_dim)[:, 1] if keys_wanted else None
            return out.reshape(n, -1), keys
        qkv, _ = attn.qkv(h)
        q, k, v = qkv.reshape(n, 3, heads, head_dim).unbind(1)
        q_rotated, k_rotated = attn.apply_rotary_emb(torch.stack([q, k]), cos, sin).unbind(0)
        context = segment_attention(q_rotated, k_rotated, v, lengths, attn.attn.scale, bias)
        out, _ = attn.proj(context.reshape(n, 1, heads * head_dim))
        return out.reshape(n, -1), k

    def mlp(self, block, x):
        return block.mlp(block.norm2(x))

    def tap(self, index, x):
        return self.visual.deepstack_merger_list[index](x)


def segment_inputs(visual: torch.nn.Module, family: str, cu: Tensor) -> dict[str, Any]:
    """The attention-segment keywords of a block's attention in vLLM's `family` tower `visual` for the segments `cu`
    (cumulative patch counts from 0, int32 on the CPU), in the form its backend takes: Qwen2-VL's plain offsets and
    `compute_attn_mask_seqlen`; Qwen2.5-VL's and Qwen3-VL's through vLLM's `MMEncoderAttention` helpers (FlashInfer
    offsets, bucketed maxima and `sequence_lengths` where it runs), as their `prepare_encoder_metadata` calls them."""
    from vtc.vllm.encode import attention_segment_metadata

    device = visual.device
    if family == "qwen2_vl":  # as its prepare_encoder_metadata: the maximum from the host offsets
        return {"cu_seqlens": cu.to(device), "max_seqlen": visual.compute_attn_mask_seqlen(cu)}
    cu_seqlens, max_seqlen, lengths = attention_segment_metadata(visual, cu, device)
    return {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "sequence_lengths": lengths}


# --- LLaVA's SigLIP / CLIP --------------------------------------------------------------------------------------


class VllmFrameTower(FrameTower):
    """vLLM's `SiglipVisionModel` (LLaVA-OneVision) or `CLIPVisionModel` (LLaVA-NeXT-Video) block by block: the loop
    is `vtc.core.tower.FrameTower`'s, shared with the HF backend's `LlavaTower`; this class calls vLLM's attention
    modules (`SiglipAttention` / `CLIPAttention`: one `qkv_proj`, vLLM's `MMEncoderAttention` on [frames, n, D], an
    `out_proj`; parallel linears return (output, bias)).

    vLLM builds the LLaVA tower only up to the layer the projector reads (`init_vision_tower_for_llava`:
    `num_hidden_layers_override` from `vision_feature_layer`, no post-layernorm, no SigLIP head), and its forward runs
    every layer it holds: so does this one. The output then goes through the tower's own last step
    (`resolve_visual_encoder_outputs`: SigLIP's `last_hs_proc`, CLIP's `post_layernorm`, both None here, then the
    model's `feature_select_strategy`, "default" dropping CLIP's class token), as the tower's forward returns it."""

    def __init__(self, tower: torch.nn.Module, family: str) -> None:
        model = tower.vision_model
        config = model.config
        super().__init__(model, config.image_size // config.patch_size, hasattr(model.embeddings, "class_embedding"))
        self.family = family
        ranks = max((int(getattr(layer.self_attn, "tp_size", 1)) for layer in self.layers), default=1)
        if ranks > 1:  # checked at start too (check_tower_parallelism); a tower split by heads cannot merge here
            raise RuntimeError(
                f"vtc runs tower methods on an unsplit vision tower; this {family} tower is split across {ranks} "
                "tensor-parallel ranks (vLLM's LLaVA models do not take --mm-encoder-tp-mode data: serve with "
                "--tensor-parallel-size 1)"
            )

    def projections(self, attn, h):
        qkv, _ = attn.qkv_proj(h)
        shape = (*h.shape[:-1], attn.num_heads_per_partition, attn.head_dim)
        return tuple(x.reshape(shape) for x in qkv.chunk(3, dim=-1))  # as the module's forward splits it

    def project_out(self, attn, x):
        out, _ = attn.out_proj(x)
        return out

    def own_attention(self, attn, h, keys_wanted):
        captured: list[Tensor] = []
        handle = None
        if keys_wanted:  # the key part of the module's own qkv projection
            handle = attn.qkv_proj.register_forward_hook(
                lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out)
            )
        try:
            out, _ = attn(hidden_states=h)
        finally:
            if handle is not None:
                handle.remove()
        if not keys_wanted:
            return out, None
        keys = captured[0].chunk(3, dim=-1)[1]
        return out, keys.reshape(*h.shape[:-1], attn.num_heads_per_partition, attn.head_dim)

    def output(self, hidden: Tensor, feature_select_strategy: Any = None) -> Tensor:
        """The tower's forward output from its last layer's output `hidden` [frames, (1 +) side^2, D]."""
        from vllm.model_executor.models.vision import resolve_visual_encoder_outputs

        model = self.model
        siglip = hasattr(model, "last_hs_proc")
        return resolve_visual_encoder_outputs(
            hidden,
            None if siglip else model.post_layernorm,
            select_layers=None,
            max_possible_layers=model.config.num_hidden_layers,
            last_hs_proc=model.last_hs_proc if siglip else None,
            feature_select_strategy=feature_select_strategy,
        )
