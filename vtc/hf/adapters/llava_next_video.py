"""LLaVA-NeXT-Video: CLIP features per frame, 2x2 average pooling (12 x 12 = 144 tokens per 336-px frame),
projector; one contiguous run of `<video>` tokens per video, no newline, 1-D RoPE."""

from __future__ import annotations

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
    name="llava_next_video",
    summary="LLaVA-NeXT-Video: CLIP 24x24 patches + CLS, 2x2 pooling to 12x12 before the projector",
    geometry=FamilyGeometry(
        "llava_next_video",
        mrope=False,
        patch_grid=(24, 24),
        cls_tokens=1,
        pooling="average",
        pool_before_projector=True,
    ),
    model_classes=("LlavaNextVideoForConditionalGeneration",),
    processor_classes=("LlavaNextVideoProcessor",),
    adapter="vtc.hf.adapters.llava_next_video:LlavaNextVideoAdapter",
    frame_rule="floor",
    media_kwargs=("pixel_values_videos", "mm_encoder_outputs", "pixel_values", "image_sizes", "batch_num_images"),
    vision_stats=frozenset({"received", "cls", "keys", "features"}),
    features=frozenset({"tower_blocks", "patch_grid", "prepool", "cls_token", "streaming"}),
    tiny="vtc.testing.tiny:build_llava_next_video",
)


class LlavaNextVideoAdapter(LlavaAdapter):
    family = FAMILY.name
    class_names = FAMILY.model_classes

    @property
    def geometry(self) -> FamilyGeometry:
        """CLIP patches + CLS per frame, pooled by the model's `spatial_pool_mode`. A learned "conv" pooler has no
        counterpart for attention maps; they are averaged over its 2x2 windows then."""
        side = self.patch_side
        mode = getattr(self.model.config, "spatial_pool_mode", "average")
        pooling = mode if mode in ("average", "max") else "average"
        return FamilyGeometry(
            self.family, mrope=False, patch_grid=(side, side), cls_tokens=1, pooling=pooling, pool_before_projector=True
        )

    def prepool_capture(self) -> PrepoolCapture:
        """CLIP features entering the 2x2 pooler (CLS already removed); `pool` = pooler then projector."""
        config = self.model.config
        side = config.vision_config.image_size // config.vision_config.patch_size
        pooler = self.outer.vision_resampler

        def pool(grid: torch.Tensor) -> torch.Tensor:  # [F, h, w, D_vision] through the model's pooler
            return pooler.pool(grid.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)

        return PrepoolCapture(pooler, (side, side), pool, capture="input", project=self.outer.multi_modal_projector)

    def frame_grid(self) -> tuple[int, int]:
        config = self.model.config
        side = config.vision_config.image_size // config.vision_config.patch_size // config.spatial_pool_stride
        return side, side

    def video_spans(self, captured: CapturedInputs) -> list[VideoSpan]:
        h, w = self.frame_grid()
        grids = [(f, h, w) for f in frames_per_video(captured, h * w)]
        counts = [t * h * w for t, h, w in grids]
        return contiguous_spans(captured.input_ids, self.video_token_id, counts, grids, self.family)
