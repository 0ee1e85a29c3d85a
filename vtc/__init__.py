"""vtc: training-free visual-token compression for video-LLMs, as composable plugins.

import vtc
handle = vtc.patch(model, "uniform+fastv", retention=0.3)
inputs = handle.prepare(processor, "clip.mp4", "What happens?")
out = model.generate(**inputs)
handle.stats(); handle.unpatch()
"""

from vtc.api import PatchHandle, patch, prepare_inputs
from vtc.hookspecs import hookimpl
from vtc.registry import MethodInfo, registry
from vtc.tokens import Context, VideoTokens

__version__ = "0.1.0"


def methods() -> list[MethodInfo]:
    """Every installed method (built-in and from the `vtc` entry-point group)."""
    return registry().infos()


__all__ = [
    "Context",
    "MethodInfo",
    "PatchHandle",
    "VideoTokens",
    "hookimpl",
    "methods",
    "patch",
    "prepare_inputs",
    "registry",
]
