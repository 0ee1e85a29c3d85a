"""Model-family adapters. `resolve_adapter(model)` picks the one matching the model's class.

Every family names its adapter in its `Family` record (`vtc.core.families`), so this package lists none:
`adapters()` / `ADAPTERS` and `SUPPORTED_FAMILIES` are read from the family registry when asked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vtc.core.families import families, get_family
from vtc.hf.adapters.base import Adapter, CapturedInputs, VideoSpan


def adapters() -> tuple[type[Adapter], ...]:
    """The HF adapter class of every registered family, in registry order."""
    return tuple(family.adapter_class() for family in families())


def __getattr__(name: str):
    # kept names, derived on use: ADAPTERS (adapter classes), SUPPORTED_FAMILIES (their family names)
    if name == "ADAPTERS":
        return adapters()
    if name == "SUPPORTED_FAMILIES":
        return tuple(family.name for family in families())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_adapter(model: torch.nn.Module) -> Adapter:
    class_name = type(model).__name__
    for family in families():
        if class_name in family.model_classes:
            adapter = family.adapter_class()
            if adapter.matches(model):
                return adapter(model)
    supported = ", ".join(f"{f.name} ({'/'.join(f.model_classes)})" for f in families())
    raise TypeError(
        f"vtc does not support {class_name}; supported model families: {supported}. "
        "Load the model with its ...ForConditionalGeneration class."
    )


@dataclasses.dataclass
class _ConfigOnly:
    config: Any


def config_adapter(family: str, config: Any) -> Adapter:
    """The family's adapter over a model config alone (no weights): geometry, token ids and `video_spans` of
    processor outputs, for a backend whose model is not a transformers module (vLLM)."""
    return get_family(family).adapter_class()(_ConfigOnly(config))


__all__ = [
    "ADAPTERS",
    "Adapter",
    "CapturedInputs",
    "SUPPORTED_FAMILIES",
    "VideoSpan",
    "adapters",
    "config_adapter",
    "resolve_adapter",
]
