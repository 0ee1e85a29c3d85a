"""Getting a model, a processor and a video for the CLI: real checkpoints by name or path, or the bundled
offline demo (a random-weight model built from a config, and a generated clip)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from vtc.media.video import synthetic_video, write_video
from vtc.testing import tiny

DEMO_FAMILY = "qwen2_5_vl"


def load_model(name_or_path: str, dtype: str = "auto", device: str = "auto") -> tuple[Any, Any]:
    """`AutoModelForImageTextToText` + `AutoProcessor` as users load them (device_map="auto" on GPU)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    kwargs: dict[str, Any] = {"dtype": _dtype(dtype)}
    if device == "auto":
        if torch.cuda.is_available():
            kwargs["device_map"] = "auto"
    else:
        kwargs["device_map"] = device
    model = AutoModelForImageTextToText.from_pretrained(name_or_path, **kwargs).eval()
    processor = AutoProcessor.from_pretrained(name_or_path)
    return model, processor


def _dtype(name: str):
    if name == "auto":
        return "auto"
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return table[name]


def build_random_model(family: str, size: str, dtype: str = "float32"):
    """A random-weight model of `family` at `size` (see `vtc.testing.tiny.SIZES`), built offline."""
    resolved = _dtype(dtype)
    return tiny.build(family, size=size, dtype=torch.float32 if resolved == "auto" else resolved)


def demo_clip(num_frames: int = 96, size: int = 336, fps: float = 8.0) -> str:
    """Write the generated demo clip (moving shapes, scene cuts, a static stretch) to a temp mp4."""
    path = os.path.join(tempfile.gettempdir(), f"vtc-demo-{num_frames}x{size}.mp4")
    if not os.path.exists(path):
        write_video(path, synthetic_video(num_frames, size, size), fps=fps)
    return path
