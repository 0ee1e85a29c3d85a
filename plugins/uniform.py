"""Uniform frame sampling: N frames evenly spaced over the whole video.

The sampler every video-LLM evaluation uses by default (lmms-eval's `max_num_frames`, LLaVA's `force_sample`,
qwen-vl-utils' `nframes`). The families' reference pipelines place the frames differently, and vtc follows each
family's own rule by default (`vtc.media.video.uniform_indices`):
  Qwen-VL families, qwen-vl-utils: `linspace(0, T - 1, N).round()`, each frame at most once;
  LLaVA families, lmms-eval's wrappers: `np.linspace(0, T - 1, N, dtype=int)`, truncated, duplicates kept.
Stage: sample.
"""

from __future__ import annotations

import dataclasses

from vtc.core.hookspecs import hookimpl
from vtc.core.registry import MethodInfo
from vtc.media.video import SAMPLING_RULES, sampling_rule, uniform_indices


@dataclasses.dataclass
class UniformParams:
    num_frames: int = 16  # frames handed to the processor (Qwen groups them in temporal pairs)
    rule: str | None = None  # "round" (qwen-vl-utils) or "floor" (LLaVA / QuoTA); None = the model family's own

    def __post_init__(self):
        if isinstance(self.num_frames, bool) or int(self.num_frames) != self.num_frames or int(self.num_frames) < 1:
            raise ValueError(f"uniform: num_frames must be a positive integer, got {self.num_frames!r}")
        if self.rule is not None and self.rule not in SAMPLING_RULES:
            raise ValueError(f"uniform: rule must be one of {', '.join(SAMPLING_RULES)} (or None), got {self.rule!r}")


class Uniform:
    def __init__(self, params: UniformParams, retention: float | None = None) -> None:
        self.params = params

    @hookimpl
    def vtc_sample(self, video, ctx):
        count = ctx.num_frames or self.params.num_frames
        return uniform_indices(video.num_frames, int(count), self.params.rule or sampling_rule(ctx.family))


@hookimpl
def vtc_register_methods(registry):
    registry.add(
        MethodInfo(
            name="uniform",
            factory=Uniform,
            params=UniformParams,
            stages=("sample",),
            paper="Uniform sampling (baseline)",
            summary="N frames evenly spaced over the video (the family's reference rounding)",
            owns=frozenset({"frame_selection"}),
            reduces_tokens=False,
        )
    )
