"""Qwen2.5-VL: as Qwen2-VL, plus `second_per_grid_ts` (seconds per temporal patch) scaling M-RoPE time.

The vision merger's output is window-permuted inside `visual`; vtc reads features after the model has
scattered them into the prompt, i.e. after the reorder, so nothing here depends on the permutation.
"""

from __future__ import annotations

import torch

from vtc.core.families import Family
from vtc.core.geometry import FamilyGeometry
from vtc.hf.adapters.base import CapturedInputs, VideoSpan
from vtc.hf.adapters.qwen2_vl import QWEN_MEDIA_KWARGS, QWEN_VISION_STATS, Qwen2VLAdapter, qwen_vision_stats

FAMILY = Family(
    name="qwen2_5_vl",
    summary="Qwen2.5-VL: as Qwen2-VL, with seconds per temporal patch scaling M-RoPE time; windowed tower",
    geometry=FamilyGeometry("qwen2_5_vl", mrope=True),
    model_classes=("Qwen2_5_VLForConditionalGeneration",),
    processor_classes=("Qwen2_5_VLProcessor",),
    adapter="vtc.hf.adapters.qwen2_5_vl:Qwen2_5_VLAdapter",
    frame_rule="round",
    media_kwargs=QWEN_MEDIA_KWARGS,
    vision_stats=QWEN_VISION_STATS,
    features=frozenset({"tower_blocks", "mrope", "merge_units", "encode_units", "timestamps", "streaming"}),
    tiny="vtc.testing.tiny:build_qwen2_5_vl",
)


class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    family = FAMILY.name
    class_names = FAMILY.model_classes

    def vision_stats_per_video(self, calls, spans, layer_of) -> list[dict]:
        from transformers.vision_utils import get_vision_window_index

        vision = self.model.config.vision_config

        def window_index(grid_thw):
            merge, window, patch = vision.spatial_merge_size, vision.window_size, vision.patch_size
            return get_vision_window_index(grid_thw, merge, window, patch)[0]

        return qwen_vision_stats(self, calls, spans, layer_of, window_index)

    def survivor_tower_inputs(self, grid_thw, kept, rows) -> dict:
        """As Qwen2-VL's, plus the window attention restricted to the survivors."""
        from vtc.hf.encode import window_kwargs

        return {
            **super().survivor_tower_inputs(grid_thw, kept, rows),
            **window_kwargs(grid_thw, kept, self.model.config.vision_config),
        }

    def _add_timestamps(self, spans: list[VideoSpan], captured: CapturedInputs) -> None:
        """Seconds of each temporal patch: `second_per_grid_ts` (one float per video, fractional above 2 fps) when
        the forward got it, else read back from the M-RoPE time positions (t = tokens_per_second * seconds,
        truncated, so only whole steps)."""
        seconds = captured.kwargs.get("second_per_grid_ts")
        if seconds is not None and len(seconds) == len(spans):
            for span, step in zip(spans, torch.as_tensor(seconds).tolist()):
                span.timestamps = torch.arange(span.grid[0], dtype=torch.float32) * float(step)
            return
        positions = captured.kwargs.get("llm_position_ids")
        rate = float(self.model.config.vision_config.tokens_per_second)
        if positions is None or not rate:
            return
        for span in spans:
            t, h, w = span.grid
            first_of_frame = span.seq_index[:: h * w].to(positions.device)
            times = positions[0, span.batch, first_of_frame].float()
            span.timestamps = (times - times[0]) / rate
