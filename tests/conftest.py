"""Shared fixtures: tiny random-weight models of every family (built once per session, offline), generated
videos with moving shapes / scene cuts / static stretches, and processor inputs for them. They live in
`vtc.testing.fixtures`, so third-party plugin packages get the same ones."""

from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("VTC_DISABLE_PLUGIN_AUTOLOAD", "1")
warnings.filterwarnings("ignore", message=".*cap_pixels_per_frame.*")
# under pytest-xdist each worker gets one thread of the cores (two workers on the 2-core CI class)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
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
    single_inputs,
    videos,
)

collect_ignore = ["plugin_example"]  # an installable example package; tests/test_plugin_package.py runs it


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml): at most two workers. More would each build every shared tiny model and vLLM
    engine, and on the 2-core CI class two is what pays (7 min 51 s against 10 min 48 s for one process)."""
    return max(1, min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Every test starts from the same global RNG state, so its random inputs do not depend on test order."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_patch_left_behind(request):
    """A test leaves no model patched and no stream open. The tiny models are cached for the whole session
    (`model_and_processor`), so a patch a test forgets (a failure before its `unpatch`, a handle outside `with`)
    would make every later test on that model fail with "already patched", far from the cause; and a patched
    model is never freed (`PATCHED_MODELS` holds its patch, which holds the model), so a model the test built
    itself leaks too. After each test, whatever it left is undone, so later tests start clean, and the test fails
    (an error at teardown) naming what it left. Patches and streams that existed when the test started belong to
    a wider-scoped fixture (e.g. an lmms-eval model held for a module), which owns their teardown."""
    from vtc.hf.patching import OPEN_STREAMS, PATCHED_MODELS, open_streams

    before_patches = {id(p) for p in PATCHED_MODELS.values()}
    before_streams = {id(s) for model in list(OPEN_STREAMS.keys()) for s in open_streams(model)}
    yield
    if not (PATCHED_MODELS or OPEN_STREAMS):
        return
    if OPEN_STREAMS:
        gc.collect()  # a session the test dropped without close() is gone (held weakly), not open
    patches = [p for p in PATCHED_MODELS.values() if id(p) not in before_patches]
    streams = [
        session
        for model in list(OPEN_STREAMS.keys())
        for session in open_streams(model)
        if id(session) not in before_streams
    ]
    from vtc.testing.fixtures import SHARED_MODELS

    # every leftover is undone; a test fails for what it left on a model other tests share (a model it built
    # itself, or one an lmms-eval model object holds, dies with it)
    left = [
        f"{type(p.adapter.model).__name__} patched by {p.describe()}"
        for p in patches
        if p.adapter.model in SHARED_MODELS
    ]
    left += [f"{type(s.model).__name__} with an open {s!r}" for s in streams if s.model in SHARED_MODELS]
    for patch in patches:
        patch.remove()
    for session in streams:
        session.close()
    for model in [m for m in list(OPEN_STREAMS.keys()) if not open_streams(m)]:
        OPEN_STREAMS.pop(model, None)  # sets emptied by collected sessions: nothing is open
    if left:
        pytest.fail(
            f"{request.node.nodeid} left {'; '.join(left)} (now undone, so later tests start clean): use "
            "`with vtc.patch(...)` / `with vtc.stream(...)`, or unpatch / close in a `finally:` block",
            pytrace=False,
        )


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
