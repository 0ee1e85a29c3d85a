"""Helpers for the Triton-kernel tests: run an op on both backends and hold the kernel to the op's
tolerance contract (`vtc_kernels.dispatch.Tolerance`)."""

from __future__ import annotations

import pytest
import torch

from vtc_kernels.dispatch import triton_available, use_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (see conftest)

needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton does not import here")


def _flat(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _flat(item)]
    if hasattr(out, "__dataclass_fields__"):
        return [t for name in out.__dataclass_fields__ for t in _flat(getattr(out, name))]
    return []


def both_backends(op, *args, **kwargs):
    """(reference output, Triton output) of `op` on the same arguments."""
    with use_backend("torch"):
        expected = op(*args, **kwargs)
    with use_backend("triton"):
        actual = op(*args, **kwargs)
    return expected, actual


def assert_kernel_matches(op, *args, **kwargs):
    """Run `op` on both backends and check every tensor output against the op's tolerance contract."""
    expected, actual = both_backends(op, *args, **kwargs)
    exp, act = _flat(expected), _flat(actual)
    assert len(exp) == len(act), f"{op.op.name}: {len(act)} outputs, reference has {len(exp)}"
    for i, (e, a) in enumerate(zip(exp, act)):
        assert a.dtype == e.dtype, f"{op.op.name} output {i}: dtype {a.dtype} != reference {e.dtype}"
        op.op.tolerance.check(a, e, f"{op.op.name} output {i}")
    return expected, actual
