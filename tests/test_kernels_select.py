"""Segmented top-k (`segmented_topk`, `topk_gather`): the reference against the per-segment `topk_indices` loop
the plugins ran (also under ties, NaN and infinities), its properties, the Triton kernel against the reference
(tiny sizes: Triton's interpreter runs on CPU), and the plugins that now call it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernel_checks import DEVICE, assert_kernel_matches, both_backends, needs_triton
from vtc_kernels.dispatch import trace
from vtc_kernels.select import segmented_topk, topk_gather, topk_indices


def loop_topk(scores, offsets, k, largest=True, sort_indices=True):
    """What plugins did before: one `topk_indices` per segment."""
    bounds = offsets.tolist()
    out = []
    for s in range(len(bounds) - 1):
        start, end = bounds[s], bounds[s + 1]
        budget = k if isinstance(k, int) else int(k[s])
        out.append(start + topk_indices(scores[start:end], budget, largest, sort_indices))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def random_segments(g, count, longest, device="cpu"):
    lengths = torch.randint(0, longest + 1, (count,), generator=g)
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device)


def random_scores(g, n, kind):
    if kind == "distinct":
        return torch.randn(n, generator=g)
    if kind == "ties":
        return torch.randint(0, 4, (n,), generator=g).float()
    if kind == "special":  # NaN, infinities and signed zeros, all tied among themselves
        x = torch.randint(0, 5, (n,), generator=g).float()
        return x.masked_fill(x == 2, float("nan")).masked_fill(x == 3, float("-inf")).masked_fill(x == 4, -0.0)
    return torch.randint(-3, 3, (n,), generator=g)  # integers


@pytest.mark.parametrize("kind", ["distinct", "ties", "special", "int"])
def test_reference_equals_the_per_segment_loop(kind):
    """Index for index, in both orders and directions, with an int k and with per-segment k (clamped both
    ways), including ties that padding would otherwise resolve differently."""
    g = torch.Generator().manual_seed(1)
    for case in range(24):
        offsets = random_segments(g, int(torch.randint(0, 7, (1,), generator=g)), 40)
        scores = random_scores(g, int(offsets[-1]), kind)
        segments = offsets.numel() - 1
        k = torch.randint(-1, 45, (segments,), generator=g) if case % 2 else int(torch.randint(0, 9, (1,), generator=g))
        for largest in (True, False):
            for sort_indices in (True, False):
                expected = loop_topk(scores, offsets, k, largest, sort_indices)
                assert torch.equal(segmented_topk(scores, offsets, k, largest, sort_indices), expected), (case, kind)


def test_known_answer_and_the_gather():
    scores = torch.tensor([0.5, 0.9, 0.1, 0.7, 0.3, 0.2, 0.8])
    offsets = torch.tensor([0, 4, 4, 7])  # segments [0.5, 0.9, 0.1, 0.7], [], [0.3, 0.2, 0.8]
    assert segmented_topk(scores, offsets, 2).tolist() == [1, 3, 4, 6]
    assert segmented_topk(scores, offsets, 2, sort_indices=False).tolist() == [1, 3, 6, 4]
    assert segmented_topk(scores, offsets, torch.tensor([1, 5, 9]), largest=False).tolist() == [2, 4, 5, 6]
    rows = (torch.arange(14.0).view(7, 2), torch.tensor([True, False, True, False, True, False, True]))
    index, (emb, mask) = topk_gather(scores, offsets, 1, rows)
    assert index.tolist() == [1, 6] and emb.tolist() == [[2.0, 3.0], [12.0, 13.0]] and mask.tolist() == [False, True]


def test_bad_arguments_name_the_problem():
    scores = torch.rand(5)
    with pytest.raises(ValueError, match="end at 5"):
        segmented_topk(scores, torch.tensor([0, 3]), 1)
    with pytest.raises(ValueError, match="never decrease"):
        segmented_topk(scores, torch.tensor([0, 4, 2, 5]), 1)
    with pytest.raises(ValueError, match="offsets must hold integers"):
        segmented_topk(scores, torch.tensor([0.0, 5.0]), 1)
    with pytest.raises(ValueError, match="k must be an int or an integer tensor"):
        segmented_topk(scores, torch.tensor([0, 5]), 1.5)
    with pytest.raises(ValueError, match=r"integer tensor \[S\] = \[1\]"):
        segmented_topk(scores, torch.tensor([0, 5]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="scores must be a 1-D tensor"):
        segmented_topk(scores.view(1, 5), torch.tensor([0, 5]), 1)
    with pytest.raises(ValueError, match=r"rows\[1\] must be a tensor \[N, ...\] with N = 5"):
        topk_gather(scores, torch.tensor([0, 5]), 1, (torch.rand(5, 2), torch.rand(4)))


segment_lists = st.lists(st.lists(st.integers(-20, 20), max_size=12), max_size=5)


def _flat(segments):
    scores = torch.tensor([v for seg in segments for v in seg], dtype=torch.float32)
    offsets = torch.tensor([0] + [len(seg) for seg in segments]).cumsum(0)
    return scores, offsets


@settings(max_examples=25, deadline=None)
@given(segments=segment_lists, k=st.integers(0, 14), data=st.data())
def test_properties_of_the_reference(segments, k, data):
    scores, offsets = _flat(segments)
    index = segmented_topk(scores, offsets, k)
    lengths = offsets.diff()
    # counts, segment membership and ascending order within each segment
    seg_of = torch.bucketize(index, offsets[1:], right=True)
    assert torch.equal(torch.bincount(seg_of, minlength=len(segments)), lengths.clamp(max=k))
    for s in range(len(segments)):
        mine = index[seg_of == s]
        assert torch.equal(mine, mine.sort().values)
        others = torch.ones(int(lengths[s]), dtype=torch.bool)
        others[mine - offsets[s]] = False
        if mine.numel() and others.any():  # every kept score is at least every dropped one of its segment
            assert scores[mine].min() >= scores[offsets[s] : offsets[s + 1]][others].max()
    # the full budget keeps everything; selecting again from the kept scores keeps them all (idempotent)
    assert torch.equal(segmented_topk(scores, offsets, 99), torch.arange(scores.numel()))
    kept_offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.clamp(max=k).cumsum(0)])
    assert torch.equal(segmented_topk(scores[index], kept_offsets, k), torch.arange(index.numel()))
    # segments are independent: reordering them reorders the output blocks and nothing else
    perm = data.draw(st.permutations(range(len(segments))))
    shuffled, shuffled_offsets = _flat([segments[p] for p in perm])
    blocks = [index[seg_of == p] - offsets[p] for p in perm]
    moved = [b + shuffled_offsets[i] for i, b in enumerate(blocks)]
    expected = torch.cat(moved) if moved else torch.zeros(0, dtype=torch.long)
    assert torch.equal(segmented_topk(shuffled, shuffled_offsets, k), expected)


@settings(max_examples=25, deadline=None)
@given(segments=segment_lists, k=st.integers(0, 14))
def test_score_order_is_a_permutation_of_index_order(segments, k):
    scores, offsets = _flat(segments)
    by_index = segmented_topk(scores, offsets, k)
    by_score = segmented_topk(scores, offsets, k, sort_indices=False)
    # the same multiset of kept scores per segment, best first in score order
    seg_of = torch.bucketize(by_score, offsets[1:], right=True)
    assert torch.equal(torch.sort(scores[by_index]).values, torch.sort(scores[by_score]).values)
    for s in range(len(segments)):
        values = scores[by_score[seg_of == s]]
        assert torch.equal(values, values.sort(descending=True).values)


# --- the Triton kernel (interpreter on CPU: tiny sizes) --------------------------------------------------------


def _stable_topk(scores, offsets, k, largest=True):
    """The kernel's rule under ties: best scores first, lower index first among equal ones; index order out."""
    out = []
    bounds = offsets.tolist()
    for s in range(len(bounds) - 1):
        seg = scores[bounds[s] : bounds[s + 1]].float()
        key = torch.where(seg.isnan(), torch.full_like(seg, float("inf")), seg)
        key = torch.where(seg == 0, torch.zeros_like(seg), key)  # -0.0 ties with 0.0
        order = torch.sort(key, descending=largest, stable=True).indices
        if not largest:  # NaN ranks last when the smallest are kept
            order = torch.cat([order[~seg[order].isnan()], order[seg[order].isnan()]])
        budget = min(max(int(k[s]), 0), seg.numel())
        out.append(bounds[s] + order[:budget].sort().values)
    return torch.cat(out)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_on_distinct_scores(dtype):
    g = torch.Generator().manual_seed(2)
    # empty, one-token and uneven segments; distinct values (exactly representable in every dtype)
    offsets = torch.tensor([0, 0, 1, 9, 9, 26, 40], device=DEVICE)
    scores = (torch.randperm(40, generator=g).float() - 20).to(dtype).to(DEVICE)
    k = torch.tensor([3, 1, 4, 2, 30, 6], device=DEVICE)
    orders = [(True, True), (False, False)] if dtype == torch.float32 else [(dtype == torch.float16, True)]
    for largest, sort_indices in orders:
        assert_kernel_matches(segmented_topk, scores, offsets, k, largest, sort_indices)


@needs_triton
def test_triton_under_ties_keeps_the_lower_index_and_the_same_scores():
    g = torch.Generator().manual_seed(3)
    offsets = torch.tensor([0, 7, 8, 8, 30], device=DEVICE)
    scores = random_scores(g, 30, "special").to(DEVICE)
    k = torch.tensor([3, 1, 2, 9], device=DEVICE)
    for largest in (True, False):
        expected, actual = both_backends(segmented_topk, scores, offsets, k, largest)
        assert torch.equal(actual.cpu(), _stable_topk(scores.cpu(), offsets.cpu(), k.cpu(), largest))
        for s in range(4):  # the contract: the same multiset of kept scores per segment
            lo, hi = int(offsets[s]), int(offsets[s + 1])
            mine, ref = actual[(actual >= lo) & (actual < hi)], expected[(expected >= lo) & (expected < hi)]
            a, b = scores[mine].nan_to_num(7.0).sort().values, scores[ref].nan_to_num(7.0).sort().values
            assert torch.equal(a, b)


@needs_triton
def test_triton_long_segment_bisects():
    """Above 256 scores a segment in index order takes the bisection path (ties included)."""
    g = torch.Generator().manual_seed(4)
    scores = torch.cat([torch.randn(300, generator=g), torch.randint(0, 3, (20,), generator=g).float()])
    offsets = torch.tensor([0, 300, 320], device=DEVICE)
    scores = scores.to(DEVICE)
    assert_kernel_matches(segmented_topk, scores[:300], offsets[:2], 37)
    _, actual = both_backends(segmented_topk, scores, offsets, torch.tensor([120, 5], device=DEVICE))
    assert torch.equal(actual.cpu(), _stable_topk(scores.cpu(), offsets.cpu(), [120, 5]))


@needs_triton
def test_triton_gathers_every_row_exactly():
    g = torch.Generator().manual_seed(5)
    offsets = torch.tensor([0, 5, 5, 6, 18], device=DEVICE)
    scores = torch.randn(18, generator=g).to(DEVICE)
    rows = [
        torch.randn(18, 3, 5, generator=g).to(DEVICE),  # embeddings with extra dims
        torch.randn(18, 7, generator=g).to(torch.bfloat16).to(DEVICE),
        torch.arange(18, device=DEVICE),  # positions
        torch.rand(18, generator=g).to(DEVICE) > 0.5,  # masks
        torch.randint(0, 9, (18, 3), generator=g, dtype=torch.int32).to(DEVICE),  # fifth tensor: a second launch
        torch.zeros(18, 0, device=DEVICE),  # nothing to copy
    ]
    for sort_indices in (True, False):
        assert_kernel_matches(
            topk_gather, scores, offsets, torch.tensor([2, 0, 1, 20], device=DEVICE), rows, sort_indices=sort_indices
        )
    index, gathered = topk_gather(scores, offsets, 0, rows)
    assert index.numel() == 0 and [t.shape[0] for t in gathered] == [0] * len(rows)


# --- plugins call the shared op --------------------------------------------------------------------------------


def test_plugins_call_the_segmented_op():
    from vtc_plugins.fastv import fastv_keep
    from vtc_plugins.prunevid import stage2_keep
    from vtc_plugins.vidcom2 import vidcom2_plan

    g = torch.Generator().manual_seed(6)
    with trace() as calls:
        fastv_keep(
            torch.rand(2, 9, generator=g), torch.rand(2, 9, generator=g) > 0.3, torch.ones(2, 9, dtype=torch.bool), 0.5
        )
        tags = [torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([1, 0, 0, 1, 0, 0]), torch.tensor([-1, 0, 1, -1, 2, 2])]
        stage2_keep(torch.rand(6, generator=g), torch.arange(6), *tags, alpha=0.5)
        vidcom2_plan(torch.randn(12, 8, generator=g), torch.arange(12) // 4, ratio=0.5)
    assert [name for name, _ in calls].count("segmented_topk") == 3
