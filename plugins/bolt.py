"""BOLT: "Boost Large Vision-Language Model Without Training for Long-form Video Understanding" (Liu et al.,
CVPR 2025, arXiv 2503.21483). Official code: sming256/BOLT (`extract_feature.py`, `select_frames.py`, and its
qwen-vl-utils fork's `frame_indices`).

Score every frame at 1 fps by CLIP similarity to the question (`logit_scale * cos`), then draw N frames by inverse
transform sampling of `minmax(score) ** alpha`: the quantiles `1/N .. 1 - 1/N` of the scores' cumulative
distribution. Frames go to the model sorted, duplicates kept, as the official loader does. Stage: sample.

Where the official code runs differently:
- CLIP comes through open_clip (`ViT-L-14` with the `openai` weights are the checkpoint the paper uses,
  `openai/clip-vit-large-patch14`); its preprocessing is CLIP's own (224 px, bicubic, centre crop).
- The official selection runs offline and stores times rounded to 0.01 s; vtc keeps that rounding.
- Scores that are all equal give uniform sampling (the official code divides by zero there).

Positions: the frames are passed with their real indices. On Qwen2.5-VL transformers then assumes uniform spacing
at `N / T * fps` (qwen-vl-utils' `sample_fps` in the official fork); Qwen3-VL's timestamps are the real times, as
with the fork's decord reader.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import vtc
from vtc.media.encoders import clip_encoder, frame_features, similarity_logits
from vtc.media.frame_selection import fps_candidates, inverse_transform_sampling


def bolt_frames(scores: list[float], candidate_fps: float, video_fps: float, total: int, n: int, power: float):
    """The official pipeline from scores to frame numbers: inverse transform sampling over the candidates, their
    times `k / fps` rounded to 0.01 s (`select_frames.py`), then `round(t * video_fps)` sorted and clipped (the
    fork's `sample_frames`)."""
    positions = np.asarray(inverse_transform_sampling(scores, n, power))
    seconds = np.round(positions / candidate_fps, 2)
    return np.clip(np.sort(np.round(seconds * video_fps).astype(int)), 0, total - 1).tolist()


@vtc.method(
    "bolt",
    paper="BOLT (CVPR 2025)",
    url="https://arxiv.org/abs/2503.21483",
    summary="frames drawn by inverse transform sampling of CLIP question-frame similarity at 1 fps",
    test_params={"encoder": "vtc-tiny-clip", "encoder_pretrained": None},
)
class Bolt(vtc.FrameSampler):
    """N frames where the question's CLIP similarity is high: inverse transform sampling with power alpha."""

    num_frames: int = vtc.param(16, range="[1, inf)", doc="N, frames handed to the processor (the paper: 8, 16, 32)")
    alpha: float = vtc.param(3.0, doc="--power: 3 for VideoMME and MLVU, 2.5 for LongVideoBench; -1 = none")
    fps: float = vtc.param(1.0, range="(0, inf)", doc="rate of the scored candidate frames")
    encoder: Any = vtc.param("ViT-L-14", doc="open_clip architecture, or an encoder object (vtc.media.encoders)")
    encoder_pretrained: str | None = vtc.param("openai", doc="open_clip weights tag or a local checkpoint file")

    query_aware = True

    def sample(self, video, ctx):
        if not ctx.question:
            raise ValueError("bolt scores frames against the question: pass one to handle.prepare(...)")
        count = int(ctx.num_frames or self.num_frames)
        clip = clip_encoder(self.encoder, self.encoder_pretrained, param="bolt.encoder")
        candidates = fps_candidates(video.num_frames, video.fps, self.fps)
        scores = similarity_logits(clip, clip.encode_text([ctx.question])[0], frame_features(clip, video, candidates))
        scores = scores.tolist()
        indices = bolt_frames(scores, self.fps, video.fps, video.num_frames, count, self.alpha)
        return vtc.FrameChoice(indices, candidates=candidates, scores=scores)
