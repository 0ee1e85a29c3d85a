"""Getting a model, a processor and a video for the CLI: real checkpoints by name or path, or the bundled
offline demo (a random-weight model built from a config, and a generated clip). Real checkpoints load with
`vtc.hf.loading.load_model`."""

from __future__ import annotations

import os
import tempfile

import torch

from vtc.hf.loading import resolve_dtype
from vtc.media.video import synthetic_video, write_video
from vtc.testing import tiny

DEMO_FAMILY = "qwen2_5_vl"


def build_random_model(family: str, size: str, dtype: str = "float32"):
    """A random-weight model of `family` at `size` (see `vtc.testing.tiny.SIZES`), built offline."""
    resolved = resolve_dtype(dtype)
    return tiny.build(family, size=size, dtype=torch.float32 if resolved == "auto" else resolved)


def demo_clip(num_frames: int = 96, size: int = 336, fps: float = 8.0) -> str:
    """Write the generated demo clip (moving shapes, scene cuts, a static stretch) to a temp mp4."""
    path = os.path.join(tempfile.gettempdir(), f"vtc-demo-{num_frames}x{size}.mp4")
    if not os.path.exists(path):
        write_video(path, synthetic_video(num_frames, size, size), fps=fps)
    return path
