"""Max-Min diverse selection (`max_min_select`, DivPrune's greedy): the segmented reference against a plain
Python loop and against one call per segment, its properties, the Triton kernel against the reference (tiny
sizes: Triton's interpreter runs on CPU; ties, empty and one-token segments, several tiles), and DivPrune
calling the shared op."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernel_checks import DEVICE, assert_kernel_matches, needs_triton
from vtc_kernels.dispatch import trace, use_backend
from vtc_kernels.diverse import cosine_distance_matrix, max_min_select


def loop_max_min(dist: torch.Tensor, count: int) -> list[int]:
    """The greedy written out on Python floats: second-smallest per column first, then farthest from the picks."""
    n = dist.shape[0]
    d = dist.double().tolist()
    count = max(0, min(count, n))
    if count == 0:
        return []
    if n == 1:
        return [0]
    second = [sorted(d[i][j] for i in range(n))[1] for j in range(n)]
    picks = [max(range(n), key=lambda j: (second[j], -j))]
    while len(picks) < count:
        rest = [j for j in range(n) if j not in picks]
        picks.append(max(rest, key=lambda j: (min(d[s][j] for s in picks), -j)))
    return picks


def tied_points(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Small-integer vectors, never zero (a zero row has no cosine): many equal distances."""
    x = torch.randint(-2, 3, shape, generator=g).float()
    x[..., 0] = x[..., 0].abs() + 1
    return x


def padded_batch(g: torch.Generator, lengths: list[int], dim: int = 4, ties: bool = False) -> torch.Tensor:
    """cosine distances [S, L, L] of random points; the padding holds garbage the op must ignore."""
    size = max(lengths, default=0)
    x = tied_points(g, len(lengths), size, dim) if ties else torch.randn(len(lengths), size, dim, generator=g)
    dist = cosine_distance_matrix(x)
    for s, n in enumerate(lengths):
        dist[s, n:, :] = -5.0
        dist[s, :, n:] = 7.0
    return dist


def test_reference_equals_the_python_loop():
    g = torch.Generator().manual_seed(0)
    for case in range(30):
        n = int(torch.randint(1, 14, (1,), generator=g))
        x = tied_points(g, n, 3) if case % 2 else torch.randn(n, 5, generator=g)
        dist = cosine_distance_matrix(x)
        count = int(torch.randint(-1, n + 3, (1,), generator=g))
        assert max_min_select(dist, count).tolist() == loop_max_min(dist, count), case


@pytest.mark.parametrize("ties", [False, True])
def test_segmented_equals_one_call_per_segment(ties):
    g = torch.Generator().manual_seed(1)
    lengths = [9, 0, 1, 5, 9, 2]
    dist = padded_batch(g, lengths, ties=ties)
    lens = torch.tensor(lengths)
    for count in (3, 20, 0, torch.tensor([4, 2, 3, 5, 9, 1]), torch.tensor(2)):
        picks = max_min_select(dist, count, lens)
        per = count if isinstance(count, torch.Tensor) and count.dim() else torch.full((6,), int(count))
        expected_width = max(min(max(int(c), 0), n) for c, n in zip(per, lengths))
        assert picks.shape == (6, expected_width) and picks.dtype == torch.long
        for s, n in enumerate(lengths):
            alone = max_min_select(dist[s, :n, :n], int(per[s])).tolist()
            assert picks[s, : len(alone)].tolist() == alone == loop_max_min(dist[s, :n, :n], int(per[s]))
            assert (picks[s, len(alone) :] == -1).all()


def test_argument_errors():
    dist = torch.rand(2, 4, 4)
    with pytest.raises(ValueError, match="square"):
        max_min_select(torch.rand(3, 4), 2)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\]"):
        max_min_select(dist, 2, torch.tensor([5, 1]))
    with pytest.raises(ValueError, match="integer tensor"):
        max_min_select(dist, 2, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="single matrix"):
        max_min_select(dist[0], 2, torch.tensor([4]))
    with pytest.raises(ValueError, match="count must be an int"):
        max_min_select(dist, torch.tensor([1.5, 2.0]))
    with pytest.raises(ValueError, match="3 entries for 2 segments"):
        max_min_select(dist, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"\[L, D\] or \[S, L, D\]"):
        cosine_distance_matrix(torch.rand(4))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 12), count=st.integers(0, 14))
def test_properties(seed, n, count):
    g = torch.Generator().manual_seed(seed)
    # any matrix works (the op does not assume symmetry); distinct entries leave no tie to break, where a
    # symmetric one ties the first pick between two mutual nearest neighbours
    dist = torch.rand(n, n, generator=g, dtype=torch.float64).fill_diagonal_(0.0)
    picks = max_min_select(dist, count)
    full = max_min_select(dist, n)
    # the count is clamped, picks are distinct, and a larger budget only extends the greedy sequence
    assert picks.numel() == min(count, n) and picks.unique().numel() == picks.numel()
    assert torch.equal(picks, full[: picks.numel()])
    # at full budget every token is picked once: selecting again from the kept set changes nothing
    assert sorted(full.tolist()) == list(range(n))
    assert torch.equal(full[max_min_select(dist[full][:, full], n)], full)
    # relabelling the tokens relabels the picks
    perm = torch.randperm(n, generator=g)
    assert torch.equal(perm[max_min_select(dist[perm][:, perm], count)], picks)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_random_and_tied(dtype):
    g = torch.Generator().manual_seed(2)
    lengths = [7, 0, 1, 12, 2]
    counts = torch.tensor([3, 2, 1, 12, 5], device=DEVICE)
    for ties in (False, True) if dtype == torch.float32 else (True,):
        dist = padded_batch(g, lengths, ties=ties).to(dtype).to(DEVICE)
        assert_kernel_matches(max_min_select, dist, counts, torch.tensor(lengths, device=DEVICE))
    if dtype == torch.float32:
        assert_kernel_matches(max_min_select, dist[3], 6)  # one matrix, int count
        assert_kernel_matches(max_min_select, dist[2:3, :1, :1], 3)  # one token
        assert_kernel_matches(max_min_select, dist, 0, torch.tensor(lengths, device=DEVICE))  # no picks


@needs_triton
def test_triton_over_several_tiles(monkeypatch):
    """Tiles of 4 columns x 2 rows: the two-smallest merge across row tiles and the argmax across column
    tiles (first index on ties) both run."""
    import vtc_kernels.triton.diverse as kernel

    monkeypatch.setattr(kernel, "BLOCK_COLS", 4)
    monkeypatch.setattr(kernel, "BLOCK_ROWS", 2)
    g = torch.Generator().manual_seed(3)
    dist = padded_batch(g, [11, 6, 3], ties=True).to(DEVICE)
    lengths = torch.tensor([11, 6, 3], device=DEVICE)
    assert_kernel_matches(max_min_select, dist, torch.tensor([8, 6, 2], device=DEVICE), lengths)
    duplicates = cosine_distance_matrix(torch.tensor([[1.0, 0.0]] * 5 + [[0.0, 1.0]] * 5)).to(DEVICE)
    expected, _ = assert_kernel_matches(max_min_select, duplicates, 10)
    assert sorted(expected.tolist()) == list(range(10))  # never a token twice, even when all are duplicates


@needs_triton
def test_triton_declines_float64():
    with use_backend("triton"), pytest.raises(ValueError, match="float64"):
        max_min_select(torch.rand(3, 3, dtype=torch.float64, device=DEVICE), 2)


def test_divprune_calls_the_shared_op():
    from vtc_plugins.divprune import divprune_keep

    with trace() as calls:
        keep = divprune_keep(torch.randn(20, 6), 5)
    assert [name for name, _ in calls] == ["cosine_distance_matrix", "max_min_select"]
    assert keep.numel() == 5 and bool((keep[1:] > keep[:-1]).all())
