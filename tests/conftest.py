"""Shared fixtures: tiny random-weight models of every family (built once per session, offline), generated
videos with moving shapes / scene cuts / static stretches, and processor inputs for them. They live in
`vtc.testing.fixtures`, so third-party plugin packages get the same ones."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("VTC_DISABLE_PLUGIN_AUTOLOAD", "1")
warnings.filterwarnings("ignore", message=".*cap_pixels_per_frame.*")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be switched on before Triton is
# first imported (it decorates its own library functions at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import vtc  # noqa: E402
from vtc.testing.fixtures import (  # noqa: E402,F401  (re-exported for the test modules)
    FAMILIES,
    NUM_FRAMES,
    QUESTIONS,
    batch_inputs,
    model_and_processor,
    register_tiny_clip,
    single_inputs,
    videos,
)

register_tiny_clip()  # quota-clip tests use the tiny random CLIP architecture
collect_ignore = ["plugin_example"]  # an installable example package; tests/test_plugin_package.py runs it


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Every test starts from the same global RNG state, so its random inputs do not depend on test order."""
    torch.manual_seed(0)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def grid_tokens(embeds: torch.Tensor, grid: tuple[int, int, int], mrope: bool = False) -> vtc.VideoTokens:
    """One video's tokens on a full (T, H, W) grid in raster order, as the adapters hand them to connect plugins."""
    return vtc.VideoTokens.from_grid(embeds, grid, mrope=mrope)


def reducing_methods() -> list[str]:
    """Every installed method that changes visual tokens in `vtc.patch` (the conformance matrix runs on all of them;
    stream-only methods are tested through `vtc.stream`)."""
    return [info.name for info in vtc.methods() if info.reduces_tokens and not info.stream_only]
