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

from vtc.api import PatchHandle, patch, prepare_inputs
from vtc.core.bases import (
    DenseMerge,
    FrameChoice,
    FrameSampler,
    LayerPruner,
    Merge,
    PatchSelector,
    StreamMemoryMethod,
    TokenMerger,
    TokenSelector,
    TowerMerger,
)
from vtc.core.method import DType, Method, MethodCard, as_dtype, method, param
from vtc.core.patches import VideoPatches
from vtc.core.registry import register, registry
from vtc.core.tokens import Context, VideoTokens
from vtc.core.tower import TowerTokens
from vtc.core.vision_stats import VisionStat
from vtc.streaming import StreamSession, stream

__version__ = "0.1.0"


def methods() -> list[MethodCard]:
    """The card of every installed method (built-in and from the `vtc` entry-point group)."""
    return registry().cards()


__all__ = [
    "Context",
    "DType",
    "DenseMerge",
    "FrameChoice",
    "FrameSampler",
    "LayerPruner",
    "Merge",
    "Method",
    "MethodCard",
    "PatchHandle",
    "PatchSelector",
    "StreamMemoryMethod",
    "StreamSession",
    "TokenMerger",
    "TokenSelector",
    "TowerMerger",
    "TowerTokens",
    "VideoPatches",
    "VideoTokens",
    "VisionStat",
    "as_dtype",
    "method",
    "methods",
    "param",
    "patch",
    "prepare_inputs",
    "register",
    "registry",
    "stream",
]
