"""Model-family adapters. `resolve_adapter(model)` picks the one matching the model's class."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vtc.hf.adapters.base import Adapter, CapturedInputs, VideoSpan
from vtc.hf.adapters.llava_next_video import LlavaNextVideoAdapter
from vtc.hf.adapters.llava_onevision import LlavaOnevisionAdapter
from vtc.hf.adapters.qwen2_5_vl import Qwen2_5_VLAdapter
from vtc.hf.adapters.qwen2_vl import Qwen2VLAdapter
from vtc.hf.adapters.qwen3_vl import Qwen3VLAdapter

ADAPTERS: tuple[type[Adapter], ...] = (
    Qwen2VLAdapter,
    Qwen2_5_VLAdapter,
    Qwen3VLAdapter,
    LlavaOnevisionAdapter,
    LlavaNextVideoAdapter,
)
SUPPORTED_FAMILIES = tuple(a.family for a in ADAPTERS)


def resolve_adapter(model: torch.nn.Module) -> Adapter:
    for adapter in ADAPTERS:
        if adapter.matches(model):
            return adapter(model)
    supported = ", ".join(f"{a.family} ({'/'.join(a.class_names)})" for a in ADAPTERS)
    raise TypeError(
        f"vtc does not support {type(model).__name__}; supported model families: {supported}. "
        "Load the model with its ...ForConditionalGeneration class."
    )


@dataclasses.dataclass
class _ConfigOnly:
    config: Any


def config_adapter(family: str, config: Any) -> Adapter:
    """The family's adapter over a model config alone (no weights): geometry, token ids and `video_spans` of
    processor outputs, for a backend whose model is not a transformers module (vLLM)."""
    for adapter in ADAPTERS:
        if adapter.family == family:
            return adapter(_ConfigOnly(config))
    raise ValueError(f"unknown family {family!r}; vtc supports {', '.join(SUPPORTED_FAMILIES)}")


__all__ = [
    "ADAPTERS",
    "Adapter",
    "CapturedInputs",
    "SUPPORTED_FAMILIES",
    "VideoSpan",
    "config_adapter",
    "resolve_adapter",
]
