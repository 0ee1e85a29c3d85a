"""The encode stage on a vLLM server (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a pipeline's `PatchSelector` methods choose
each video's surviving merge units in the prompt processor, and the worker runs vLLM's own vision tower on those
units alone.

vLLM sizes a prompt when it processes it, before any pixel is encoded. An encode method decides from the pixels
only (never the question), and the pixels are there once the HF processor ran, so the decision runs there:

  prompt processor (API server, CPU): `choose_units` builds each video's `VideoPatches` from the processor's
      `pixel_values_videos` and runs `Pipeline.run_encode`, the call the HF backend makes (`vtc.hf.encode`), with a
      generator seeded afresh per video. The kept unit indices travel with the video as a multimodal field
      (`KEPT_FIELD`), and the video's placeholders are sized from them (`Pipeline.retained_count(grid,
      encoded=...)`: connect methods after the encode stage count from its survivors). The official PixelPrune
      vLLM patch does the same (keep indices in the multimodal processor, `len(keep) / 4` placeholders).
  worker: `encode_survivors` runs the tower on the survivors' patch rows with precomputed inputs
      (`encoder_metadata`, which vLLM's Qwen towers take in `forward`): the full grid's inputs computed by vLLM's
      own functions, then restricted to the survivors (rotary rows, Qwen3-VL's interpolated position embeddings),
      one attention segment per temporal patch holding its survivors (an emptied one dropped), Qwen2.5-VL's window
      order and window lengths restricted to the survivors. The output (DeepStack features included) is scattered
      back onto each video's grid; `vtc.core.engine.connect_video(..., survivors=kept)` then hands the survivors to
      the connect methods, each at its original (t, h, w).

Methods acting between the tower's blocks (`TowerMerger`, ToMe) run in the worker alone, inside vLLM's tower
(`vtc.vllm.tower`): their count is fixed by the grid, so the prompt processor sizes the prompt without them running.

vLLM keys its processor and encoder caches on the media and the request's processor kwargs (the request's vtc
settings among them): everything the kept set depends on besides the server's config, which a server cannot change
without a restart.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vtc.core.patches import VideoPatches
from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context
from vtc.hf.encode import frame_seqlens, pixel_normalization, scatter_units, survivor_rows

Tensor = torch.Tensor
KEPT_FIELD = "vtc_kept"  # per-video multimodal field: the merge units the encode stage kept, ascending (long)


# --- prompt processor --------------------------------------------------------------------------------------------


def normalized_rows(rows: Tensor, video_processor: Any) -> Tensor:
    """A video's `pixel_values_videos` rows as transformers' video processor normalises them. vLLM leaves the
    normalisation of Qwen pixels to the model (`mm_device_do_normalize`, on by default): its processor then emits
    raw uint8 rows, which the video processor's own `rescale_and_normalize` turns into the values the HF backend's
    encode methods see, bit for bit (the arithmetic is per element, so the patch layout does not matter)."""
    if rows.is_floating_point():
        return rows  # normalised by the HF processor already
    vp = video_processor
    channels = len(vp.image_mean)
    x = rows.reshape(rows.shape[0], channels, -1, 1)  # (C, tp, P, P) per row: channels first
    mean, std = tuple(float(m) for m in vp.image_mean), tuple(float(s) for s in vp.image_std)
    if hasattr(vp, "rescale_and_normalize"):
        x = vp.rescale_and_normalize(x, vp.do_rescale, vp.rescale_factor, vp.do_normalize, mean, std)
    else:  # a processor without torchvision's fused path: its formula
        x = x.float() * (vp.rescale_factor if vp.do_rescale else 1.0)
        if vp.do_normalize:
            x = (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
    return x.reshape(rows.shape).float()


def choose_units(
    pipelines: list[Pipeline],
    seeds: list[int],
    pixels: Tensor,
    grid_thw: Tensor,
    *,
    vision_config: Any,
    video_processor: Any,
    family: str,
    geometry: Any,
) -> list[Tensor]:
    """The merge units each video keeps (ascending indices on its token grid), video k through the encode methods
    of `pipelines[k]` with a generator seeded with `seeds[k]`. `pixels` / `grid_thw`: the processor's
    `pixel_values_videos` and `video_grid_thw` of these videos. `ctx.video_index` is the video's place among the
    videos processed here (a cached video is not processed again), so a method must not decide from it."""
    merge = int(vision_config.spatial_merge_size)
    patch = int(vision_config.patch_size)
    patch_shape = (int(vision_config.in_channels), int(vision_config.temporal_patch_size), patch, patch)
    mean, std = pixel_normalization(None, types.SimpleNamespace(video_processor=video_processor))
    kept = []
    sizes = grid_thw.prod(-1).tolist()
    for k, (rows, thw) in enumerate(zip(torch.split(pixels, sizes), grid_thw.tolist())):
        pipeline = pipelines[k]
        patches = VideoPatches.from_rows(normalized_rows(rows, video_processor), thw, merge, patch_shape, mean, std)
        ctx = Context(retention=pipeline.retention, family=family, geometry=geometry, video_index=k)
        generator = torch.Generator(device="cpu").manual_seed(seeds[k])  # afresh per video, as on the HF backend
        pipeline.begin_prompt()  # the decision is the video's alone: no state from another video or request
        out, _ = pipeline.run_encode(patches, ctx.replace(generator=generator))
        kept.append(out.kept.to(torch.long).cpu())
    return kept


def encoded_count(pipeline: Pipeline, kept: Tensor | None, grid: tuple[int, int, int]) -> int | None:
    """What the pre-tower methods left of a video for `Pipeline.retained_count(grid, encoded=...)`: its kept units;
    every unit when the processor chose none (vLLM's profiling inputs, where the worker then encodes everything too);
    None without a pre-tower method (a tower method alone keeps every unit before the tower and counts itself)."""
    if kept is not None:
        return int(kept.numel())
    return grid[0] * grid[1] * grid[2] if pipeline.pre_tower_entries() else None


# --- worker ------------------------------------------------------------------------------------------------------


def encode_survivors(visual: torch.nn.Module, family: str, pixels: Tensor, grid_thw: Tensor, kept: list[Tensor]):
    """vLLM's Qwen vision tower on the surviving units' patch rows of `pixels` alone -> per video [units, D] on its
    whole token grid: the survivors' outputs (DeepStack features included) at their units, zeros elsewhere."""
    grids = [[int(v) for v in size] for size in grid_thw.tolist()]
    merge = int(visual.spatial_merge_size)
    units = [t * (h // merge) * (w // merge) for t, h, w in grids]
    kept = [k.to(torch.long).cpu() for k in kept]
    rows = survivor_rows(kept, units, merge * merge)
    metadata = survivor_metadata(visual, family, grids, kept, rows)
    out = visual(pixels[rows.to(pixels.device)], grids, encoder_metadata=metadata)
    return scatter_units(out, kept, units)


def survivor_metadata(
    visual: torch.nn.Module, family: str, grids: list[list[int]], kept: list[Tensor], rows: Tensor
) -> dict[str, Any]:
    """The `encoder_metadata` of vLLM's tower for the survivors' patch `rows` (ascending, over all videos): the
    full grid's inputs from the tower's own `prepare_encoder_metadata` (Qwen2.5-VL: `get_rope_by_thw`, per video),
    restricted to the survivors, and one attention segment per temporal patch holding its survivors."""
    merge = int(visual.spatial_merge_size)
    frames = frame_seqlens(torch.tensor(grids), kept, merge).cpu()
    if family == "qwen2_5_vl":
        return _windowed_metadata(visual, grids, kept, frames)
    full = visual.prepare_encoder_metadata(grids)
    device = full["rotary_pos_emb_cos"].device
    at = rows.to(device)
    out = dict(full)
    out["rotary_pos_emb_cos"] = full["rotary_pos_emb_cos"][at]
    out["rotary_pos_emb_sin"] = full["rotary_pos_emb_sin"][at]
    if "pos_embeds" in full:  # Qwen3-VL's learned position embeddings, interpolated for the whole grid
        out["pos_embeds"] = full["pos_embeds"][rows.to(full["pos_embeds"].device)]
    if family == "qwen2_vl":  # its tower's own form: plain offsets, `compute_attn_mask_seqlen`
        out["cu_seqlens"] = frames.to(device)
        out["max_seqlen"] = visual.compute_attn_mask_seqlen(frames)
        return out
    out["cu_seqlens"], out["max_seqlen"], out["sequence_lengths"] = attention_segment_metadata(visual, frames, device)
    return out


def attention_segment_metadata(
    visual: torch.nn.Module, cu: Tensor, device: torch.device
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(cu_seqlens, max_seqlen, sequence_lengths) of the attention segments `cu` (cumulative patch counts from 0),
    in the form the tower's attention backend takes: vLLM's `MMEncoderAttention` helpers, as the Qwen2.5-VL and
    Qwen3-VL towers' `prepare_encoder_metadata` call them (FlashInfer offsets and bucketed maxima, where it runs)."""
    from vllm.model_executor.layers.attention import MMEncoderAttention

    backend = visual.attn_backend
    cu_np = cu.numpy().astype(np.int32)
    lengths = MMEncoderAttention.maybe_compute_seq_lens(backend, cu_np, device)
    max_seqlen = torch.tensor(MMEncoderAttention.compute_max_seqlen(backend, cu_np), dtype=torch.int32)
    cu_seqlens = MMEncoderAttention.maybe_recompute_cu_seqlens(
        backend,
        cu_np,
        visual.hidden_size,
        visual.tp_size,
        device,
        fp8_padded_hidden_size=visual.fp8_padded_hidden_size,
    )
    return cu_seqlens, max_seqlen, lengths


def _windowed_metadata(
    visual: torch.nn.Module, grids: list[list[int]], kept: list[Tensor], frames: Tensor
) -> dict[str, Any]:
    """Qwen2.5-VL: the tower reorders a video's units into windows (`window_index`), attends within windows in most
    blocks (`cu_window_seqlens`) and per temporal patch in the others (`cu_seqlens`), and takes its rotary rows in
    window order. Per video, vLLM's own window order, window lengths and window-ordered rotary rows
    (`get_rope_by_thw`) are restricted to the surviving units, which are numbered among the survivors; a window
    with no survivor has no segment."""
    unit = int(visual.spatial_merge_unit)
    cos, sin, order, windows = [], [], [], []
    offset = 0
    for (t, h, w), k in zip(grids, kept):
        cos_v, sin_v, index, cu_window, _ = visual.get_rope_by_thw(t, h, w)
        index = index.cpu().long()
        slots = index.numel()
        rank = torch.full((slots,), -1, dtype=torch.long)
        rank[k] = torch.arange(k.numel()) + offset
        alive = rank[index] >= 0  # window-order slots whose unit survives
        order.append(rank[index][alive])
        at = alive.to(cos_v.device)
        cos.append(cos_v.reshape(slots, unit, -1)[at].flatten(0, 1))
        sin.append(sin_v.reshape(slots, unit, -1)[at].flatten(0, 1))
        bounds = cu_window.cpu().long() // unit  # each window's end, in slots
        window = torch.bucketize(torch.arange(slots), bounds, right=True)
        per_window = torch.bincount(window[alive], minlength=bounds.numel() + 1) * unit
        windows.append(per_window[per_window > 0])
        offset += k.numel()
    device = visual.device
    window_index = torch.cat(order)
    cu_windows = F.pad(torch.cat(windows).cumsum(0, dtype=torch.int32), (1, 0))
    out: dict[str, Any] = {
        "rotary_pos_emb_cos": torch.cat(cos).to(device),
        "rotary_pos_emb_sin": torch.cat(sin).to(device),
        "window_index": window_index.to(device),
        "reverse_indices": visual.invert_permutation(window_index).to(device),
    }
    out["cu_seqlens"], out["max_seqlen_full"], out["sequence_lengths_full"] = attention_segment_metadata(
        visual, frames, device
    )
    out["cu_window_seqlens"], out["max_seqlen_window"], out["sequence_lengths_window"] = attention_segment_metadata(
        visual, cu_windows, device
    )
    return out
