"""LLaVA-OneVision (and LLaVA-Video checkpoints in the same HF class): SigLIP features, projector, bilinear
2x2 pooling to ceil(27/2)^2 = 196 tokens per frame, then one `image_newline` token after all frames.

The newline is not a frame token: it stays in place like text and is never pruned."""

from __future__ import annotations

import math

import torch

from vtc.core.families import Family
from vtc.core.geometry import FamilyGeometry
from vtc.hf.adapters.base import (
    CapturedInputs,
    LlavaAdapter,
    VideoSpan,
    contiguous_spans,
    frames_per_video,
)
from vtc.hf.prepool import PrepoolCapture

FAMILY = Family(
    name="llava_onevision",
    summary="LLaVA-OneVision / LLaVA-Video: SigLIP 27x27 patches, projector, bilinear pooling to 14x14, one newline",
    geometry=FamilyGeometry("llava_onevision", mrope=False, patch_grid=(27, 27), pooling="bilinear"),
    model_classes=("LlavaOnevisionForConditionalGeneration",),
    processor_classes=("LlavaOnevisionProcessor",),
    adapter="vtc.hf.adapters.llava_onevision:LlavaOnevisionAdapter",
    frame_rule="floor",
    media_kwargs=("pixel_values_videos", "mm_encoder_outputs", "pixel_values", "image_sizes", "batch_num_images"),
    vision_stats=frozenset({"received", "keys", "features"}),
    features=frozenset({"tower_blocks", "patch_grid", "prepool", "streaming"}),
    tiny="vtc.testing.tiny:build_llava_onevision",
)


class LlavaOnevisionAdapter(LlavaAdapter):
    family = FAMILY.name
    class_names = FAMILY.model_classes

    @property
    def geometry(self) -> FamilyGeometry:
        side = self.patch_side
        return FamilyGeometry(self.family, mrope=False, patch_grid=(side, side), pooling="bilinear")

    @property
    def max_views(self) -> int:
        """anyres_max_N (`vision_aspect_ratio`): the packed crop grid is resized to about N views' tokens."""
        return int(str(getattr(self.model.config, "vision_aspect_ratio", "anyres_max_9")).removeprefix("anyres_max_"))

    def prepool_capture(self) -> PrepoolCapture:
        """Projected SigLIP features before `apply_pooling` (bilinear to ceil(side / 2))."""
        vision = self.model.config.vision_config
        side = vision.image_size // vision.patch_size

        def pool(grid: torch.Tensor) -> torch.Tensor:  # [F, h, w, D] -> [F, ceil(h/2), ceil(w/2), D]
            x = grid.permute(0, 3, 1, 2)
            size = [math.ceil(x.shape[2] / 2), math.ceil(x.shape[3] / 2)]
            return torch.nn.functional.interpolate(x, size=size, mode="bilinear").permute(0, 2, 3, 1)

        return PrepoolCapture(self.outer.multi_modal_projector, (side, side), pool, capture="output")

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
