"""Uniform frame sampling: N frames evenly spaced over the whole video.

The sampler every video-LLM evaluation uses by default (lmms-eval's `max_num_frames`, LLaVA's
`force_sample`): indices `np.linspace(0, total - 1, N)` rounded. Stage: sample.
"""

from __future__ import annotations

import dataclasses

from vtc.core.hookspecs import hookimpl
from vtc.core.registry import MethodInfo
from vtc.media.video import uniform_indices


@dataclasses.dataclass
class UniformParams:
    num_frames: int = 16  # frames handed to the processor (Qwen groups them in temporal pairs)

    def __post_init__(self):
        if int(self.num_frames) < 1:
            raise ValueError(f"uniform: num_frames must be >= 1, got {self.num_frames}")


class Uniform:
    def __init__(self, params: UniformParams, retention: float | None = None) -> None:
        self.params = params

    @hookimpl
    def vtc_sample(self, video, ctx):
        count = ctx.extra.get("num_frames") or self.params.num_frames
        return uniform_indices(video.num_frames, int(count))


@hookimpl
def vtc_register_methods(registry):
    registry.add(
        MethodInfo(
            name="uniform",
            factory=Uniform,
            params=UniformParams,
            stages=("sample",),
            paper="Uniform sampling (baseline)",
            summary="N frames evenly spaced over the video",
            fixed_count=True,
            owns=frozenset({"frame_selection"}),
            reduces_tokens=False,
        )
    )
