"""Sinkhorn (`sinkhorn`, AOT's Sinkhorn_v1): the reference's whole-batch stop and iteration count against a
plain loop, its properties, and the Triton kernel (the whole loop in one launch) against the reference: the
same iteration count and a plan within the tolerance (tiny sizes: Triton's interpreter runs on CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernel_checks import DEVICE, assert_kernel_matches, needs_triton
from vtc_kernels.dispatch import use_backend
from vtc_kernels.transport import sinkhorn


def loop_sinkhorn(cost: torch.Tensor, epsilon: float, max_iter: int, tol: float) -> tuple[list, int]:
    """The batched iteration on Python floats: one stop test on the mean change of r over every item."""
    batch, m, n = cost.shape
    K = [[[math.exp(-v / epsilon) for v in row] for row in item] for item in cost.tolist()]
    r = [[1.0] * m for _ in range(batch)]
    c = [[1.0] * n for _ in range(batch)]
    done = 0
    for _ in range(max_iter):
        previous = r
        r = [[(1 / m) / sum(K[b][i][j] * c[b][j] for j in range(n)) for i in range(m)] for b in range(batch)]
        c = [[(1 / n) / sum(K[b][i][j] * r[b][i] for i in range(m)) for j in range(n)] for b in range(batch)]
        done += 1
        change = sum(abs(a - p) for rb, pb in zip(r, previous) for a, p in zip(rb, pb)) / (batch * m)
        if change < tol:
            break
    plan = [[[r[b][i] * K[b][i][j] * c[b][j] for j in range(n)] for i in range(m)] for b in range(batch)]
    return plan, done


def test_reference_stops_on_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    # one easy item and one slow one: a per-item stop would end the easy item earlier
    cost = torch.stack(
        [torch.full((4, 3), 0.5, dtype=torch.float64), torch.rand(4, 3, generator=g, dtype=torch.float64)]
    )
    for tol in (1e-2, 1e-5):
        plan, iterations = sinkhorn(cost, epsilon=0.1, max_iter=100, tol=tol, return_iterations=True)
        expected, count = loop_sinkhorn(cost, 0.1, 100, tol)
        assert iterations.dtype == torch.long and iterations.dim() == 0 and int(iterations) == count > 2
        torch.testing.assert_close(plan, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=0)
        assert torch.equal(sinkhorn(cost, epsilon=0.1, max_iter=100, tol=tol), plan)


def test_no_iteration_leaves_the_gibbs_kernel():
    cost = torch.rand(2, 3, 4)
    plan, iterations = sinkhorn(cost, max_iter=0, return_iterations=True)
    assert int(iterations) == 0 and torch.equal(plan, torch.exp(-cost / 0.1))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    m=st.integers(1, 6),
    n=st.integers(1, 6),
    max_iter=st.integers(1, 40),
)
def test_properties(seed, batch, m, n, max_iter):
    g = torch.Generator().manual_seed(seed)
    cost = torch.rand(batch, m, n, generator=g, dtype=torch.float64)
    plan, iterations = sinkhorn(cost, max_iter=max_iter, tol=1e-3, return_iterations=True)
    assert 1 <= int(iterations) <= max_iter and bool((plan >= 0).all()) and bool(plan.isfinite().all())
    # c is updated last: every column carries exactly its target mass
    torch.testing.assert_close(plan.sum(dim=1), torch.full((batch, n), 1.0 / n, dtype=torch.float64))
    # the items' order does not matter, nor does the rows' order within an item
    order, rows = torch.randperm(batch, generator=g), torch.randperm(m, generator=g)
    swapped = sinkhorn(cost[order][:, rows], max_iter=max_iter, tol=1e-3)
    torch.testing.assert_close(swapped, plan[order][:, rows], rtol=1e-9, atol=1e-12)


@needs_triton
@pytest.mark.parametrize(
    "dtype,shape", [(torch.float32, (2, 3, 4)), (torch.bfloat16, (1, 3, 4)), (torch.float16, (5, 3))]
)
def test_triton_matches_with_the_same_iteration_count(dtype, shape):
    g = torch.Generator().manual_seed(1)
    cost = torch.rand(shape, generator=g).to(dtype).to(DEVICE)
    (_, iterations), _ = assert_kernel_matches(sinkhorn, cost, 0.1, 100, 1e-2, return_iterations=True)
    assert int(iterations) > 2  # the loop ran and stopped on the tolerance, not on max_iter


@needs_triton
def test_triton_over_several_tiles_with_given_masses(monkeypatch):
    import vtc_kernels.triton.transport as kernel

    monkeypatch.setattr(kernel, "BLOCK_M", 2)
    monkeypatch.setattr(kernel, "BLOCK_N", 4)
    g = torch.Generator().manual_seed(2)
    cost = torch.rand(2, 3, 5, generator=g).to(DEVICE)
    u = torch.rand(2, 3, generator=g).softmax(-1).to(DEVICE)
    v = torch.rand(2, 5, generator=g).softmax(-1).to(DEVICE)
    assert_kernel_matches(sinkhorn, cost, 0.2, 100, 1e-2, u, v, return_iterations=True)
    for max_iter in (0, 1):
        assert_kernel_matches(sinkhorn, cost, 0.2, max_iter, 1e-2, return_iterations=True)


@needs_triton
def test_triton_declines_what_it_cannot_run(monkeypatch):
    import vtc_kernels.triton.transport as kernel

    with use_backend("triton"):
        with pytest.raises(ValueError, match="float64"):
            sinkhorn(torch.rand(3, 4, dtype=torch.float64, device=DEVICE))
        with pytest.raises(ValueError, match=r"source_mass must be a torch.float32 tensor \(3,\)"):
            sinkhorn(torch.rand(3, 4, device=DEVICE), source_mass=torch.rand(1, 3, device=DEVICE))
        monkeypatch.setattr(kernel, "MAX_ELEMENTS", 8)
        with pytest.raises(ValueError, match="one program runs the batch, up to 8"):
            sinkhorn(torch.rand(3, 4, device=DEVICE))
