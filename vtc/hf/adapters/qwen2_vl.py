"""Qwen2-VL: one contiguous run of `<|video_pad|>` per video, 3-D M-RoPE, 2x2 spatial merge."""

from __future__ import annotations

import torch

from vtc.core.families import Family
from vtc.core.geometry import FamilyGeometry
from vtc.hf.adapters.base import Adapter, CapturedInputs, VideoSpan, contiguous_spans, runs

# media arguments of the Qwen-VL forwards (videos, then images)
QWEN_MEDIA_KWARGS = (
    "video_grid_thw",
    "second_per_grid_ts",
    "pixel_values_videos",
    "mm_encoder_outputs",
    "image_grid_thw",
    "pixel_values",
)
QWEN_VISION_STATS = frozenset({"received", "keys", "mean_query"})

FAMILY = Family(
    name="qwen2_vl",
    summary="Qwen2-VL: one <|video_pad|> run per video, 3-D M-RoPE, 2x2 merge inside the vision tower",
    geometry=FamilyGeometry("qwen2_vl", mrope=True),
    model_classes=("Qwen2VLForConditionalGeneration",),
    processor_classes=("Qwen2VLProcessor",),
    adapter="vtc.hf.adapters.qwen2_vl:Qwen2VLAdapter",
    frame_rule="round",
    media_kwargs=QWEN_MEDIA_KWARGS,
    vision_stats=QWEN_VISION_STATS,
    features=frozenset({"tower_blocks", "mrope", "merge_units", "encode_units", "streaming"}),
    tiny="vtc.testing.tiny:build_qwen2_vl",
)


def qwen_grids(
    captured: CapturedInputs,
    merge: int,
    segments: list[list[tuple[int, int, int]]] | None = None,
    kind: str = "video",
) -> list[tuple[int, int, int]]:
    """Token grid (T, H, W) of every video (or image: `kind`).

    From `video_grid_thw` (`image_grid_thw`) when the forward got it; `generate` (transformers >= 5.18) encodes the
    media before the prefill and passes only `mm_encoder_outputs`, so the grid is then read back from the M-RoPE
    (h, w) positions of each item's first token segment and the item's token count.
    `segments[k]` = (batch row, start, end) runs of item k's tokens, in order."""
    grid_thw = captured.kwargs.get(f"{kind}_grid_thw")
    if grid_thw is not None:
        return [(int(t), int(h) // merge, int(w) // merge) for t, h, w in grid_thw.tolist()]
    positions = captured.kwargs.get("llm_position_ids")
    counts = video_token_counts(captured, kind)
    if positions is None or counts is None or segments is None:
        raise ValueError(
            f"the prompt has {kind} tokens but the model got neither {kind}_grid_thw nor (mm_encoder_outputs and "
            "M-RoPE position_ids); pass the processor's outputs unchanged"
        )
    grids = []
    for k, count in enumerate(counts):
        b, start, end = segments[k][0]
        h = positions[1, b, start:end]
        w = positions[2, b, start:end]
        height = int(h.max() - h.min()) + 1
        width = int(w.max() - w.min()) + 1
        grids.append((count // (height * width), height, width))
    return grids


def video_token_counts(captured: CapturedInputs, kind: str = "video") -> list[int] | None:
    """Tokens per video (or image: `kind`) from pre-encoded `mm_encoder_outputs` (what generate passes), if
    present."""
    encoded = (captured.kwargs.get("mm_encoder_outputs") or {}).get(kind)
    if encoded is None:
        return None
    return [int(x.shape[0]) for x in encoded.pooler_output]


def video_runs(input_ids: torch.Tensor, video_token_id: int) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of every run of video tokens, in order of appearance."""
    return [(b, s, e) for b in range(input_ids.shape[0]) for s, e in runs(input_ids[b] == video_token_id)]


def qwen_vision_stats(adapter, calls, spans, layer_of, window_index_fn=None) -> list[dict]:
    """Statistics on the LLM token grid for the videos of `spans` (see `qwen_stats_on_grid`)."""
    merge = int(adapter.model.config.vision_config.spatial_merge_size)
    return qwen_stats_on_grid(merge, calls, [span.grid for span in spans], layer_of, window_index_fn)


def qwen_stats_on_grid(merge: int, calls, grids, layer_of, window_index_fn=None) -> list[dict]:
    """Statistics on the LLM token grid: find the tower call that encoded videos of token grids `grids`,
    concatenate its attention chunks (one per temporal patch, or per window), undo Qwen2.5-VL's window
    permutation, average each merge unit, and split per video into [T, H*W(, d)]. Shared by the HF and vLLM
    backends (`calls`: [{"grid_thw": [videos, 3] in patches, "chunks": {layer: [stats of each chunk]}}])."""
    wanted = [tuple(int(v) for v in grid) for grid in grids]
    call = None
    for candidate in reversed(calls):
        grid_thw = candidate["grid_thw"]
        if grid_thw is None:
            continue
        if [(int(t), int(h) // merge, int(w) // merge) for t, h, w in grid_thw.tolist()] == wanted:
            call = candidate
            break
    if call is None:
        raise RuntimeError("no vision-tower call for these videos was captured (was the vision tower bypassed?)")
    unit = merge * merge
    out: list[dict] = [{} for _ in wanted]
    for stat, layer in layer_of.items():
        values = torch.cat([chunk[stat.kind] for chunk in call["chunks"].get(layer, [])], dim=1)[0]
        units = values.reshape(values.shape[0] // unit, unit, *values.shape[1:])
        if window_index_fn is not None:
            window_index = window_index_fn(call["grid_thw"]).to(units.device)
            restored = torch.empty_like(units)
            restored[window_index] = units
            units = restored
        per_token = units.mean(dim=1)
        start = 0
        for k, (t, h, w) in enumerate(wanted):
            out[k][stat] = per_token[start : start + t * h * w].reshape(t, h * w, *per_token.shape[1:])
            start += t * h * w
    return out


class Qwen2VLAdapter(Adapter):
    family = FAMILY.name
    class_names = FAMILY.model_classes
    mrope = True

    @property
    def vision_tower(self) -> torch.nn.Module:
        return self.outer.visual

    def vision_attention_modules(self) -> list[torch.nn.Module]:
        return [block.attn for block in self.outer.visual.blocks]

    def vision_feature_layer(self) -> int:
        return len(self.outer.visual.blocks) - 1

    def vision_stats_per_video(self, calls, spans, layer_of) -> list[dict]:
        return qwen_vision_stats(self, calls, spans, layer_of)

    @property
    def spatial_merge(self) -> int:
        return int(self.model.config.vision_config.spatial_merge_size)

    video_processor_class = "Qwen2VLVideoProcessor"  # whose image_mean / image_std normalised the pixels

    def survivor_tower_inputs(self, grid_thw: torch.Tensor, kept: list[torch.Tensor], rows: torch.Tensor) -> dict:
        """The tower inputs transformers lets a caller precompute, for the surviving units' patch `rows` only: their
        2-D rotary rows and one attention segment per temporal patch (`vtc.hf.encode`)."""
        from transformers.vision_utils import get_vision_position_ids

        from vtc.hf.encode import frame_seqlens

        positions = get_vision_position_ids(grid_thw, self.spatial_merge)
        return {
            "position_ids": positions[rows.to(positions.device)],
            "cu_seqlens": frame_seqlens(grid_thw, kept, self.spatial_merge),
        }

    def video_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        spans = self._run_spans(captured, self.video_token_id, "video")
        self._add_timestamps(spans, captured)
        return spans

    def image_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        # Qwen3-VL too: an image is one segment, T = 1
        return self._run_spans(captured, self.image_token_id, "image")

    def _run_spans(self, captured: CapturedInputs, token_id: int, kind: str) -> list[VideoSpan]:
        """One item per contiguous run of `token_id` (contiguous_spans checks the counts against the grids)."""
        segments = [[r] for r in video_runs(captured.input_ids, token_id)]
        grids = qwen_grids(captured, self.spatial_merge, segments, kind=kind)
        counts = [t * h * w for t, h, w in grids]
        return contiguous_spans(captured.input_ids, token_id, counts, grids, self.family, kind=kind)

    def _add_timestamps(self, spans: list[VideoSpan], captured: CapturedInputs) -> None:
        """Qwen2-VL inputs carry no timing; Qwen2.5-VL overrides this."""
