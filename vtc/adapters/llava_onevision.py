"""LLaVA-OneVision (and LLaVA-Video checkpoints in the same HF class): SigLIP features, projector, bilinear
2x2 pooling to ceil(27/2)^2 = 196 tokens per frame, then one `image_newline` token after all frames.

The newline is not a frame token: it stays in place like text and is never pruned."""

from __future__ import annotations

import math

import torch

from vtc.adapters.base import Adapter, CapturedInputs, VideoSpan, contiguous_spans, frames_per_video


class LlavaOnevisionAdapter(Adapter):
    family = "llava_onevision"
    class_names = ("LlavaOnevisionForConditionalGeneration",)

    @property
    def vision_tower(self) -> torch.nn.Module:
        return self.outer.vision_tower

    def frame_grid(self) -> tuple[int, int]:
        vision = self.model.config.vision_config
        side = math.ceil(vision.image_size // vision.patch_size / 2)
        return side, side

    def video_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        h, w = self.frame_grid()
        frames = frames_per_video(captured, h * w, trailing_specials=1)
        grids = [(f, h, w) for f in frames]
        counts = [t * h * w + 1 for t, h, w in grids]
        return contiguous_spans(
            captured.input_ids, self.video_token_id, counts, grids, self.family, trailing_specials=1
        )
