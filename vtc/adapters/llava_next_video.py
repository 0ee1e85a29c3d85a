"""LLaVA-NeXT-Video: CLIP features per frame, 2x2 average pooling (12 x 12 = 144 tokens per 336-px frame),
projector; one contiguous run of `<video>` tokens per video, no newline, 1-D RoPE."""

from __future__ import annotations

import torch

from vtc.adapters.base import Adapter, CapturedInputs, VideoSpan, contiguous_spans, frames_per_video


class LlavaNextVideoAdapter(Adapter):
    family = "llava_next_video"
    class_names = ("LlavaNextVideoForConditionalGeneration",)

    @property
    def vision_tower(self) -> torch.nn.Module:
        return self.outer.vision_tower

    def frame_grid(self) -> tuple[int, int]:
        config = self.model.config
        side = config.vision_config.image_size // config.vision_config.patch_size // config.spatial_pool_stride
        return side, side

    def video_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        h, w = self.frame_grid()
        grids = [(f, h, w) for f in frames_per_video(captured, h * w)]
        counts = [t * h * w for t, h, w in grids]
        return contiguous_spans(captured.input_ids, self.video_token_id, counts, grids, self.family)
