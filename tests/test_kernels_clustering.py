"""DPC-kNN passes (`knn_density`, `nearest_denser`): the segmented references against plain Python loops and
against one call per segment, their properties, `dpc_knn_scores` composing them, and the Triton kernels
against the references (tiny sizes: Triton's interpreter runs on CPU; ties, empty and one-row segments,
k above the length, several tiles)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernel_checks import DEVICE, assert_kernel_matches, needs_triton
from vtc_kernels.clustering import NO_PARENT, dpc_knn_scores, knn_density, nearest_denser
from vtc_kernels.dispatch import trace, use_backend


def loop_density(dist: torch.Tensor, k: int) -> list[float]:
    n = dist.shape[0]
    k = max(1, min(k, n))
    return [math.exp(-sum(v * v for v in sorted(row)[:k]) / k) for row in dist.double().tolist()]


def loop_denser(dist: torch.Tensor, density: torch.Tensor) -> tuple[list[float], list[int]]:
    d, dens = dist.tolist(), density.tolist()
    n = len(d)
    largest = max((v for row in d for v in row), default=0.0)
    delta, parent = [], []
    for i in range(n):
        higher = [j for j in range(n) if dens[j] > dens[i]]
        if higher:
            best = min(higher, key=lambda j: (d[i][j], j))
            delta.append(d[i][best])
            parent.append(best)
        else:
            delta.append(largest)
            parent.append(NO_PARENT)
    return delta, parent


def padded_distances(g: torch.Generator, lengths: list[int], ties: bool = False) -> torch.Tensor:
    """Euclidean distances [S, n, n] of random points (integer points when `ties`: many equal distances);
    the padding holds NaN, which the ops must never read."""
    size = max(lengths, default=0)
    shape = (len(lengths), size, 3)
    x = torch.randint(-2, 3, shape, generator=g).float() if ties else torch.randn(shape, generator=g)
    dist = torch.cdist(x, x)
    for s, n in enumerate(lengths):
        dist[s, n:, :] = float("nan")
        dist[s, :, n:] = float("nan")
    return dist


LENGTHS = [6, 0, 1, 9, 3]


@pytest.mark.parametrize("ties", [False, True])
def test_references_equal_the_python_loops_and_one_call_per_segment(ties):
    g = torch.Generator().manual_seed(0)
    dist = padded_distances(g, LENGTHS, ties)
    lengths = torch.tensor(LENGTHS)
    for k in (1, 3, 7, 20):
        density = knn_density(dist, k, lengths)
        delta, parent = nearest_denser(dist, density, lengths)
        for s, n in enumerate(LENGTHS):
            block = dist[s, :n, :n]
            alone = knn_density(block, k)
            assert torch.equal(density[s, :n], alone)  # the same bits as a call per segment
            torch.testing.assert_close(alone.double(), torch.tensor(loop_density(block, k)).double())
            expected_delta, expected_parent = loop_denser(block, density[s, :n])
            assert delta[s, :n].tolist() == expected_delta and parent[s, :n].tolist() == expected_parent
            alone_delta, alone_parent = nearest_denser(block, density[s, :n])
            assert torch.equal(alone_delta, delta[s, :n]) and torch.equal(alone_parent, parent[s, :n])
            assert (density[s, n:] == 0).all() and (delta[s, n:] == 0).all() and (parent[s, n:] == NO_PARENT).all()


def test_dpc_knn_scores_composes_the_two_ops():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 5, generator=g)
    with trace() as calls:
        score, dist = dpc_knn_scores(x, 4, torch.Generator().manual_seed(7))
    assert [name for name, _ in calls] == ["knn_density", "nearest_denser"]
    density = knn_density(dist, 4) + torch.rand(12, generator=torch.Generator().manual_seed(7)) * 1e-6
    delta, parent = nearest_denser(dist, density)
    assert torch.equal(score, delta * density)
    assert int((parent == NO_PARENT).sum()) == 1 and density[parent == NO_PARENT] == density.max()


def test_argument_errors():
    dist = torch.rand(2, 4, 4)
    with pytest.raises(ValueError, match="k must be an int"):
        knn_density(dist, 2.5)
    with pytest.raises(ValueError, match=r"density must have dist's shape minus its last dim, \(2, 4\)"):
        nearest_denser(dist, torch.rand(4))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\]"):
        knn_density(dist, 2, torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="square"):
        nearest_denser(torch.rand(3, 4), torch.rand(3))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 10), k=st.integers(1, 12))
def test_properties(seed, n, k):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    dist = torch.cdist(x, x)
    density = knn_density(dist, k)
    delta, parent = nearest_denser(dist, density)
    perm = torch.randperm(n, generator=g)
    # relabelling the rows relabels the outputs (the k nearest are a multiset: the same bits)
    assert torch.equal(knn_density(dist[perm][:, perm], k), density[perm])
    delta_p, parent_p = nearest_denser(dist[perm][:, perm], density[perm])
    assert torch.equal(delta_p, delta[perm])
    has = parent_p != NO_PARENT
    assert torch.equal(perm[parent_p[has]], parent[perm][has]) and torch.equal(has, parent[perm] != NO_PARENT)
    # every parent is denser; rows without one are the densest and get the largest distance
    assert bool((density[parent[parent >= 0]] > density[parent >= 0]).all())
    top = parent == NO_PARENT
    assert bool((density[top] == density.max()).all()) and bool((delta[top] == dist.max()).all())
    assert bool(((0 < density) & (density <= 1)).all())  # exp(-mean of squares), the self-distance included


@needs_triton
def test_triton_matches_random_and_tied_float32():
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor(LENGTHS, device=DEVICE)
    for ties, k in ((False, 20), (True, 1), (True, 4)):  # 20: above every length
        dist = padded_distances(g, LENGTHS, ties).to(DEVICE)
        density, _ = assert_kernel_matches(knn_density, dist, k, lengths)
        assert_kernel_matches(nearest_denser, dist, density, lengths)
    # densities rounded to a few values: many rows tie with their would-be parents
    assert_kernel_matches(nearest_denser, dist, (density * 4).round(), lengths)
    assert_kernel_matches(knn_density, dist[3, :9, :9], 3)  # one matrix
    assert_kernel_matches(nearest_denser, dist[3, :9, :9], density[3, :9])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_in_half_precision(dtype):
    g = torch.Generator().manual_seed(3)
    dist = padded_distances(g, LENGTHS, ties=True).to(dtype).to(DEVICE)
    lengths = torch.tensor(LENGTHS, device=DEVICE)
    density, _ = assert_kernel_matches(knn_density, dist, 3, lengths)
    assert_kernel_matches(nearest_denser, dist, density, lengths)


@needs_triton
def test_triton_over_several_tiles(monkeypatch):
    """Column tiles of 4 and row blocks of 4: the k smallest merge across tiles (repeated values counted
    repeatedly) and the nearest denser row keeps the first index across tiles."""
    import vtc_kernels.triton.clustering as kernel

    monkeypatch.setattr(kernel, "BLOCK_COLS", 4)
    monkeypatch.setattr(kernel, "BLOCK_ROWS", 4)
    g = torch.Generator().manual_seed(4)
    dist = padded_distances(g, [10, 3], ties=True).to(DEVICE)
    lengths = torch.tensor([10, 3], device=DEVICE)
    density, _ = assert_kernel_matches(knn_density, dist, 5, lengths)
    assert_kernel_matches(nearest_denser, dist, (density * 3).round(), lengths)


@needs_triton
def test_triton_declines_what_it_cannot_run():
    dist = torch.rand(3, 3, device=DEVICE)
    with use_backend("triton"), pytest.raises(ValueError, match="at most 64"):
        knn_density(torch.rand(70, 70, device=DEVICE), 65)
    with use_backend("triton"), pytest.raises(ValueError, match="float64"):
        nearest_denser(dist, torch.rand(3, dtype=torch.float64, device=DEVICE))
