"""Uniform frame sampling: N frames evenly spaced over the whole video.

The sampler every video-LLM evaluation uses by default (lmms-eval's `max_num_frames`, LLaVA's `force_sample`,
qwen-vl-utils' `nframes`). The families' reference pipelines place the frames differently, and vtc follows each
family's own rule by default (`vtc.media.video.uniform_indices`):
  Qwen-VL families, qwen-vl-utils: `linspace(0, T - 1, N).round()`, each frame at most once;
  LLaVA families, lmms-eval's wrappers: `np.linspace(0, T - 1, N, dtype=int)`, truncated, duplicates kept.
Stage: sample.
"""

from __future__ import annotations

import vtc
from vtc.media.video import SAMPLING_RULES, sampling_rule, uniform_indices


@vtc.method(
    "uniform",
    paper="Uniform sampling (baseline)",
    summary="N frames evenly spaced over the video (the family's reference rounding)",
)
class Uniform(vtc.FrameSampler):
    """N frames evenly spaced, by the family's own rounding."""

    num_frames: int = vtc.param(16, range="[1, inf)", doc="frames handed to the processor (Qwen pairs them)")
    rule: str | None = vtc.param(None, choices=SAMPLING_RULES, doc="None: the model family's own rule")

    def sample(self, video, ctx):
        count = ctx.num_frames or self.num_frames
        return uniform_indices(video.num_frames, int(count), self.rule or sampling_rule(ctx.family))
