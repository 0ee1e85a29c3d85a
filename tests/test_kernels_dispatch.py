"""The dispatch layer of vtc_kernels: which implementation runs under each backend, the errors when a kernel
cannot run, the trace, the tolerance contract, and the rule that every public op has a caller."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import vtc_kernels
from vtc_kernels import dispatch
from vtc_kernels.dispatch import OPS, Tolerance, kernel_op, trace, use_backend

ROOT = Path(__file__).resolve().parents[1]


def fake_kernel(x: torch.Tensor) -> torch.Tensor:
    """Stands in for a Triton kernel: the dispatch logic does not care what the function is."""
    return x * 3


def _needs_small(x: torch.Tensor) -> str | None:
    return None if x.numel() <= 4 else f"at most 4 elements, got {x.numel()}"


fake_kernel.supports = _needs_small  # type: ignore[attr-defined]


@dataclasses.dataclass
class Boxed:
    value: torch.Tensor


@pytest.fixture
def toy_op():
    name = "toy_triple"
    op = kernel_op(name, tolerance=Tolerance.exact(), triton=f"{__name__}:fake_kernel")(lambda x: x + x + x)
    yield op
    del OPS[name]


def test_backends_pick_the_implementation(toy_op, monkeypatch):
    x = torch.arange(3.0)
    with trace() as calls:
        toy_op(x)  # auto on a CPU tensor: the reference
        with use_backend("torch"):
            toy_op(x)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with use_backend("triton"):
            assert torch.equal(toy_op(x), x * 3)
    assert calls == [("toy_triple", "torch"), ("toy_triple", "torch"), ("toy_triple", "triton")]
    assert toy_op.reference(x).tolist() == [0.0, 3.0, 6.0] and toy_op.op.name == "toy_triple"


def test_forced_triton_says_why_it_cannot_run(toy_op, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"), pytest.raises(RuntimeError, match="need CUDA tensors, or TRITON_INTERPRET=1"):
        toy_op(torch.ones(2))
    with use_backend("triton"), pytest.raises(RuntimeError, match="got a tensor on cpu"):
        toy_op(Boxed(torch.ones(2)))  # the device is found inside dataclasses (QuantizedGroups) too
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with use_backend("triton"), pytest.raises(ValueError, match="does not support these arguments: at most 4"):
        toy_op(torch.ones(9))
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with use_backend("triton"), pytest.raises(RuntimeError, match="Triton does not import here"):
        toy_op(torch.ones(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="auto picks Triton on CUDA tensors only")
def test_auto_picks_the_kernel_on_cuda_when_it_supports_the_arguments(toy_op):
    with trace() as calls:
        toy_op(torch.ones(2, device="cuda"))
        toy_op(torch.ones(9, device="cuda"))  # unsupported size: the reference
    assert [backend for _, backend in calls] == ["triton", "torch"]


def test_backend_names_are_checked(toy_op, monkeypatch):
    with pytest.raises(ValueError, match=r"one of \('auto', 'torch', 'triton'\), got 'cuda'"):
        with use_backend("cuda"):
            pass
    monkeypatch.setenv(dispatch.ENV_BACKEND, "fast")
    with pytest.raises(ValueError, match="got 'fast'"):
        toy_op(torch.ones(2))
    monkeypatch.setenv(dispatch.ENV_BACKEND, "torch")
    with trace() as calls:
        toy_op(torch.ones(2))
    assert calls == [("toy_triple", "torch")]


def test_an_op_without_a_kernel_runs_its_reference_under_every_backend(monkeypatch):
    name = "toy_plain"
    op = kernel_op(name, tolerance=Tolerance.exact())(lambda x: x + 1)
    try:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with use_backend("triton"), trace() as calls:
            assert op(torch.zeros(1)).item() == 1.0
        assert calls == [(name, "torch")] and name not in dispatch.kernel_ops()
        with pytest.raises(ValueError, match="declared twice"):
            kernel_op(name, tolerance=Tolerance.exact())(lambda x: x)
    finally:
        del OPS[name]


def test_tolerance_contract_checks():
    exact = Tolerance.exact()
    exact.check(torch.tensor([1, 2]), torch.tensor([1, 2]))
    with pytest.raises(AssertionError, match=r"not equal to the reference at \[\[1\]\]"):
        exact.check(torch.tensor([1, 3]), torch.tensor([1, 2]))
    with pytest.raises(AssertionError, match="shape"):
        exact.check(torch.tensor([1]), torch.tensor([1, 2]))
    close = Tolerance.allclose({torch.float32: (0.0, 1e-3)})
    close.check(torch.tensor([1.0005, float("nan")]), torch.tensor([1.0, float("nan")]))  # NaN where NaN: fine
    with pytest.raises(AssertionError, match="worst at flat index 1"):
        close.check(torch.tensor([1.0, 2.01]), torch.tensor([1.0, 2.0]))
    with pytest.raises(AssertionError, match="beyond"):
        close.check(torch.tensor([float("nan")]), torch.tensor([1.0]))
    with pytest.raises(KeyError, match="no tolerance stated for torch.bfloat16"):
        close.check(torch.ones(1, dtype=torch.bfloat16), torch.ones(1, dtype=torch.bfloat16))


def test_every_op_states_its_tolerance_and_its_kernel_imports():
    assert OPS, "no op is declared"
    for name, op in OPS.items():
        assert op.tolerance.kind in ("exact", "allclose"), name
        if op.tolerance.kind == "allclose":  # float outputs: bounds stated at least for float32
            assert op.tolerance.bound(torch.float32), name
        assert op.reference.__doc__, f"{name}: the reference documents the op's semantics"
        if op.triton is not None and dispatch.triton_available() and dispatch.interpreting():
            assert callable(op.triton_impl()), name


def test_every_public_op_has_a_caller():
    """An op nobody calls is dead weight: each public name is used by a plugin, by vtc's runtime or by the
    kernel benchmark (`benchmarks/`, which times ops such as `topk_gather` against the official codes)."""
    folders = ("plugins", "vtc", "benchmarks")
    sources = [p.read_text() for folder in folders for p in (ROOT / folder).rglob("*.py")]
    text = "\n".join(sources)
    tools = {"Tolerance", "kernel_ops", "trace", "use_backend"}  # the dispatch layer's own API, not ops
    unused = [n for n in vtc_kernels.__all__ if n not in tools and not re.search(rf"\b{n}\b", text)]
    assert not unused, f"vtc_kernels ops with no caller in plugins/, vtc/ or benchmarks/: {unused}"


def test_plugins_reach_the_shared_ops():
    """The hot loops the plugins used to run themselves now go through the dispatched ops (the cosine ops'
    callers are checked in test_kernels_similarity.py)."""
    from vtc_plugins.aot import intra_ot_merge
    from vtc_plugins.divprune import divprune_keep
    from vtc_plugins.fastv import fastv_keep
    from vtc_plugins.vidcom2 import vidcom2_plan
    from vtc_plugins.visionzip import contextual_features, select_frame

    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(12, 8, generator=g)
    with trace() as calls:
        divprune_keep(embeds, 4)
        fastv_keep(
            torch.rand(2, 6, generator=g), torch.ones(2, 6, dtype=torch.bool), torch.ones(2, 6, dtype=torch.bool), 0.5
        )
        vidcom2_plan(embeds, torch.arange(12) // 4, 0.5)
        plan = select_frame(torch.rand(12, generator=g), embeds, 2, 3)
        contextual_features(embeds[plan.targets], embeds[plan.members], plan.assign)
        mask = torch.zeros(2, 4, dtype=torch.bool)
        mask[:, :2] = True
        intra_ot_merge(torch.randn(2, 4, 8, generator=g), mask, torch.rand(4, 2, generator=g))
    names = {name for name, _ in calls}
    expected = {"cosine_distance_matrix", "max_min_select", "segmented_topk", "best_match", "merge_into_anchors"}
    assert expected | {"sinkhorn"} <= names, f"missing: {expected | {'sinkhorn'} - names}"
    assert [n for n, _ in calls].count("segmented_topk") == 2  # FastV's two rows in one call, VidCom2's frames in one
