"""Pretrained weights a method needs besides the model it compresses (QuoTA's separate scorer VLM, FastVID's
SigLIP pooling head). A method asks here by kind; the backend that can load them registers the loader, so no
method imports a backend (`tests/test_layout.py`). The HuggingFace backend (`vtc.hf.loading`, imported by
`import vtc`) registers "vlm" and "siglip_vision"."""

from __future__ import annotations

from typing import Any, Callable

LOADERS: dict[str, Callable[..., Any]] = {}


def register_loader(kind: str, loader: Callable[..., Any]) -> None:
    """Make `load_pretrained(kind, name, **kwargs)` call `loader(name, **kwargs)`."""
    LOADERS[kind] = loader


def load_pretrained(kind: str, name: str, **kwargs: Any) -> Any:
    """Load the checkpoint `name` (hub id or local path) as `kind`:
    "vlm" -> (model, processor) of a video-LLM; "siglip_vision" -> (SigLIP vision model, loading info)."""
    if kind not in LOADERS:
        known = ", ".join(sorted(LOADERS)) or "none"
        raise ValueError(f"no backend can load a {kind!r} checkpoint ({name!r}); loaders registered: {known}")
    return LOADERS[kind](name, **kwargs)
