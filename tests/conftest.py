"""Shared fixtures: tiny random-weight models of every family (built once per session, offline), generated
videos with moving shapes / scene cuts / static stretches, and processor inputs for them."""

from __future__ import annotations

import functools
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("VTC_DISABLE_PLUGIN_AUTOLOAD", "1")
warnings.filterwarnings("ignore", message=".*cap_pixels_per_frame.*")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import vtc  # noqa: E402
from vtc.testing import tiny  # noqa: E402

try:  # a tiny CLIP architecture (random weights) for quota-clip tests
    import open_clip

    open_clip.add_model_config(os.path.join(os.path.dirname(__file__), "assets"))
except ImportError:  # pragma: no cover - open_clip is a dev dependency
    open_clip = None
from vtc.media.video import synthetic_video  # noqa: E402

FAMILIES = tiny.FAMILIES
QUESTIONS = ("What happens in this video?", "How many objects are visible in the whole clip, and which one moves?")
NUM_FRAMES = 8


@functools.lru_cache(maxsize=None)
def model_and_processor(family: str, dtype: torch.dtype = torch.float32):
    return tiny.build(family, dtype=dtype)


@functools.lru_cache(maxsize=None)
def videos():
    """Two clips of different sizes (so a batch needs padding)."""
    return synthetic_video(32, 224, 224, seed=0), synthetic_video(24, 160, 200, seed=1)


@functools.lru_cache(maxsize=None)
def single_inputs(family: str, which: int = 0):
    _, processor = model_and_processor(family)
    return vtc.prepare_inputs(processor, videos()[which], QUESTIONS[which], num_frames=NUM_FRAMES, fps=8)


@functools.lru_cache(maxsize=None)
def batch_inputs(family: str):
    _, processor = model_and_processor(family)
    return vtc.prepare_inputs(processor, list(videos()), list(QUESTIONS), num_frames=NUM_FRAMES, fps=8)


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Every test starts from the same global RNG state, so its random inputs do not depend on test order."""
    torch.manual_seed(0)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def grid_tokens(embeds: torch.Tensor, grid: tuple[int, int, int], mrope: bool = False) -> vtc.VideoTokens:
    """One video's tokens on a full (T, H, W) grid in raster order, as the adapters hand them to connect plugins
    (positions: the flat index, or (t, h, w) rows with `mrope`)."""
    t, h, w = grid
    flat = torch.arange(t * h * w)
    frame, row, col = flat // (h * w), (flat // w) % h, flat % w
    return vtc.VideoTokens(
        embeds=embeds,
        positions=torch.stack([frame, row, col]) if mrope else flat.clone(),
        frame=frame,
        row=row,
        col=col,
        weight=torch.ones(t * h * w),
        grid=grid,
    )


def reducing_methods() -> list[str]:
    """Every installed method that changes visual tokens (the invariant matrix runs on all of them)."""
    return [info.name for info in vtc.methods() if info.reduces_tokens]
