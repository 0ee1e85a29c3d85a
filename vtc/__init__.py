"""vtc: training-free visual-token compression for video-LLMs, as composable plugins.

import vtc
handle = vtc.patch(model, "uniform+fastv", retention=0.3)
inputs = handle.prepare(processor, "clip.mp4", "What happens?")
out = model.generate(**inputs)
handle.stats(); handle.unpatch()

Layout: `vtc.core` (backend-neutral types, registry, pipeline), `vtc.hf` (the HuggingFace backend),
`vtc.media` (video reading and frame sampling), `vtc.streaming` (`vtc.stream` sessions), `vtc.tools` (CLI),
`vtc.testing` (tiny offline models).
"""

from vtc import _moved
from vtc.api import PatchHandle, patch, prepare_inputs
from vtc.core.hookspecs import hookimpl
from vtc.core.registry import MethodInfo, registry
from vtc.core.tokens import Context, VideoTokens
from vtc.core.vision_stats import VisionStat
from vtc.streaming import StreamSession, stream

__version__ = "0.1.0"

_moved.install()


def methods() -> list[MethodInfo]:
    """Every installed method (built-in and from the `vtc` entry-point group)."""
    return registry().infos()


__all__ = [
    "Context",
    "MethodInfo",
    "PatchHandle",
    "StreamSession",
    "VideoTokens",
    "VisionStat",
    "hookimpl",
    "methods",
    "patch",
    "prepare_inputs",
    "registry",
    "stream",
]
