"""Qwen3-VL: each temporal patch of a video is its own `<t seconds><|vision_start|>...<|vision_end|>`
segment, so a video's tokens are not contiguous; DeepStack features for the visual positions are fed into
the first LLM layers and must follow the tokens (`visual_pos_masks`, `deepstack_visual_embeds`)."""

from __future__ import annotations

import torch

from vtc.core.families import Family
from vtc.core.geometry import FamilyGeometry
from vtc.hf.adapters.base import CapturedInputs, VideoSpan, runs
from vtc.hf.adapters.qwen2_vl import (
    QWEN_MEDIA_KWARGS,
    QWEN_VISION_STATS,
    Qwen2VLAdapter,
    qwen_grids,
    video_runs,
    video_token_counts,
)

FAMILY = Family(
    name="qwen3_vl",
    summary="Qwen3-VL: one <t seconds><|vision_start|>...<|vision_end|> segment per temporal patch, DeepStack",
    geometry=FamilyGeometry("qwen3_vl", mrope=True),
    model_classes=("Qwen3VLForConditionalGeneration",),
    processor_classes=("Qwen3VLProcessor",),
    adapter="vtc.hf.adapters.qwen3_vl:Qwen3VLAdapter",
    frame_rule="round",
    media_kwargs=QWEN_MEDIA_KWARGS,
    vision_stats=QWEN_VISION_STATS,
    features=frozenset(
        {"tower_blocks", "mrope", "merge_units", "encode_units", "deepstack", "timestamps", "frame_text", "streaming"}
    ),
    tiny="vtc.testing.tiny:build_qwen3_vl",
)


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Same vision tower layout as Qwen2-VL (`visual.blocks`, 2x2 merger); different token layout."""

    family = FAMILY.name
    class_names = FAMILY.model_classes
    deepstack = True

    video_processor_class = "Qwen3VLVideoProcessor"

    def survivor_tower_inputs(self, grid_thw, kept, rows) -> dict:
        """As Qwen2-VL's, plus the survivors' rows of the learned position embedding's interpolation (its DeepStack
        taps then run on the survivors too)."""
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        visual = self.vision_tower
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=visual.num_grid_per_side,
            mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners,
            spatial_merge_size=visual.config.spatial_merge_size,
        )
        at = rows.to(indices.device)
        extra = {"interp_indices": indices[at], "interp_weights": weights[at]}
        return {**super().survivor_tower_inputs(grid_thw, kept, rows), **extra}

    def _segments_per_video(self, captured: CapturedInputs) -> list[list[tuple[int, int, int]]] | None:
        """Group the per-frame segments into videos using each video's token count (generate path)."""
        counts = video_token_counts(captured)
        if counts is None:
            return None
        segments = video_runs(captured.input_ids, self.video_token_id)
        grouped, i = [], 0
        for count in counts:
            group, total = [], 0
            while total < count and i < len(segments):
                b, s, e = segments[i]
                group.append((b, s, e))
                total += e - s
                i += 1
            grouped.append(group)
        return grouped

    def video_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        merge = int(self.model.config.vision_config.spatial_merge_size)
        grids = qwen_grids(captured, merge, self._segments_per_video(captured))
        spans: list[VideoSpan] = []
        video = 0
        for b in range(captured.input_ids.shape[0]):
            segments = runs(captured.input_ids[b] == self.video_token_id)
            while segments:
                if video >= len(grids):
                    raise ValueError("qwen3_vl: the prompt has more video segments than the videos passed produce")
                t, h, w = grids[video]
                frames, segments = segments[:t], segments[t:]
                if len(frames) != t or any(end - start != h * w for start, end in frames):
                    raise ValueError(
                        f"qwen3_vl: video {video} should be {t} segments of {h * w} tokens, "
                        f"found {[end - start for start, end in frames]}"
                    )
                device = captured.input_ids.device
                seq_index = torch.cat([torch.arange(s, e, device=device) for s, e in frames])
                frame_slot = torch.tensor([s for s, _ in frames], device=device)
                spans.append(VideoSpan(b, video, seq_index, (t, h, w), frame_slot))
                video += 1
        if video != len(grids):
            raise ValueError(f"qwen3_vl: {len(grids)} videos were passed but {video} were found in the prompt")
        return spans
