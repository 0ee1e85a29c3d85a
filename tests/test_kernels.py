"""vtc_kernels reference ops against straightforward Python loops on random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from vtc_kernels import (
    adjacent_frame_similarity,
    chain_anchors,
    chain_order,
    chain_similarity,
    cosine,
    frame_cosine,
    mean_into_anchors,
    topk_indices,
    topk_mask,
)
from vtc_kernels.similarity import NO_PREDECESSOR


def loop_cosine(a, b):
    dot = sum(x * y for x, y in zip(a.tolist(), b.tolist()))
    return dot / (math.sqrt(sum(x * x for x in a.tolist())) * math.sqrt(sum(y * y for y in b.tolist())))


def test_cosine_and_adjacent_frames():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 16, generator=g, dtype=torch.float64)
    sim = adjacent_frame_similarity(x)
    assert sim.shape == (4, 7)
    for t in range(4):
        for p in range(7):
            assert sim[t, p].item() == pytest.approx(loop_cosine(x[t, p], x[t + 1, p]), rel=1e-12)
    a, b = x[0], x[1]
    assert torch.allclose(cosine(a, b), torch.nn.functional.cosine_similarity(a, b, dim=-1))


def test_frame_cosine_variants_are_the_official_formulas():
    """Each flag combination is bit-identical to the expression an official code writes."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 5, 16, generator=g).to(torch.bfloat16)
    a, b = x[:-1], x[1:]
    holitom = F.cosine_similarity(F.normalize(a, p=2, dim=-1), F.normalize(b, p=2, dim=-1), dim=-1)
    assert torch.equal(adjacent_frame_similarity(x, normalize="eps", formula="torch"), holitom)
    assert torch.equal(frame_cosine(a, b, formula="torch"), F.cosine_similarity(a, b, dim=-1))  # DyCoke pass 2
    feats = x.mean(1)
    unit = feats / feats.norm(dim=-1, keepdim=True)
    fastvid = (unit[:-1] * unit[1:]).sum(dim=1)
    assert torch.equal(adjacent_frame_similarity(feats, normalize="exact", formula="dot"), fastvid)
    assert torch.equal(frame_cosine(a, b), cosine(a, b))  # FrameFusion's ratio
    assert adjacent_frame_similarity(x, step=2).shape == (4, 5)
    with pytest.raises(ValueError, match="normalize must be one of"):
        frame_cosine(a, b, normalize="l1")


def test_chain_order_and_similarity_match_loops():
    g = torch.Generator().manual_seed(1)
    n = 40
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    key = torch.randint(0, 5, (n,), generator=g)
    slots = torch.sort(torch.randperm(n, generator=g)[:30]).values
    order, keys = chain_order(key, slots)
    expected = sorted(slots.tolist(), key=lambda s: (int(key[s]), s))
    assert order.tolist() == expected
    sim = chain_similarity(x, order, keys)
    for i, slot in enumerate(expected):
        if i == 0 or key[expected[i - 1]] != key[slot]:
            assert sim[i].item() == NO_PREDECESSOR
        else:
            assert sim[i].item() == pytest.approx(loop_cosine(x[expected[i - 1]], x[slot]), rel=1e-12)


def loop_chain_merge(x, order, merge):
    out = x.clone()
    keep = [True] * x.shape[0]
    i = 0
    m = len(order)
    while i < m:
        if merge[i]:
            anchor = i - 1
            run = []
            while i < m and merge[i]:
                run.append(order[i])
                i += 1
            a = order[anchor]
            out[a] = (x[a] + sum(x[j] for j in run)) / (len(run) + 1)
            for j in run:
                keep[j] = False
        else:
            i += 1
    return out, torch.tensor(keep)


def chain_merge_mean(x, order, merge):
    """FrameFusion's merge of chain runs: each run folds into the element before it (the anchor)."""
    anchors = order[chain_anchors(merge)]
    keep = torch.ones(x.shape[0], dtype=torch.bool)
    keep[order[merge]] = False
    return mean_into_anchors(x, anchors, order[merge]), keep


@pytest.mark.parametrize("seed", range(5))
def test_chain_merge_mean_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n = 30
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    order = torch.randperm(n, generator=g)
    merge = torch.rand(n, generator=g) < 0.5
    merge[0] = False
    out, keep = chain_merge_mean(x, order, merge)
    ref_out, ref_keep = loop_chain_merge(x, order.tolist(), merge.tolist())
    assert torch.equal(keep, ref_keep)
    torch.testing.assert_close(out[keep], ref_out[keep])


def test_chain_anchors_runs_fold_into_predecessor():
    merge = torch.tensor([False, True, True, False, False, True, False, True])
    assert chain_anchors(merge).tolist() == [0, 0, 4, 6]
    with pytest.raises(ValueError, match="first chain position cannot be merged"):
        chain_anchors(torch.tensor([True, False]))


def test_identical_frames_merge_into_first():
    """Two identical frames: every token of the second frame has similarity 1 and merges into the first."""
    frame = torch.randn(4, 8)
    x = torch.cat([frame, frame])
    patch = torch.arange(8) % 4
    order, keys = chain_order(patch, torch.arange(8))
    sim = chain_similarity(x, order, keys)
    merge = sim >= 0.99
    assert int(merge.sum()) == 4
    out, keep = chain_merge_mean(x, order, merge)
    assert keep.tolist() == [True] * 4 + [False] * 4
    torch.testing.assert_close(out[:4], frame)


def test_topk_selection():
    scores = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.5])
    assert topk_indices(scores, 2).tolist() == [1, 3]
    assert topk_indices(scores, 2, sort_indices=False).tolist() == [1, 3]
    assert topk_indices(scores, 2, largest=False).tolist() == [0, 2]
    assert topk_indices(scores, 99).tolist() == [0, 1, 2, 3, 4]
    cand = torch.tensor([True, False, True, True, False])
    assert topk_mask(scores, 2, cand).tolist() == [False, False, True, True, False]


def test_dpc_knn_matches_loops():
    from vtc_kernels import assign_to_centers, dpc_knn_centers, dpc_knn_scores

    g = torch.Generator().manual_seed(4)
    x = torch.randn(15, 6, generator=g, dtype=torch.float64)
    score, dist = dpc_knn_scores(x, k=3, generator=torch.Generator().manual_seed(0))
    noise = torch.rand(15, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 1e-6
    n = x.shape[0]
    d = [[math.dist(x[i].tolist(), x[j].tolist()) / math.sqrt(6) for j in range(n)] for i in range(n)]
    density = []
    for i in range(n):
        nearest = sorted(d[i])[:3]  # itself (0) included, as in the official code
        density.append(math.exp(-sum(v * v for v in nearest) / 3) + noise[i].item())
    dmax = max(max(row) for row in d)
    for i in range(n):
        higher = [d[i][j] for j in range(n) if density[j] > density[i]]
        delta = min(higher) if higher else dmax
        assert score[i].item() == pytest.approx(delta * density[i], rel=1e-5)
    centers, _ = dpc_knn_centers(x, 4, k=3, generator=torch.Generator().manual_seed(0))
    assert centers.tolist() == torch.topk(score, 4).indices.tolist()
    labels = assign_to_centers(dist, centers)
    for i in range(n):
        expected = min(range(4), key=lambda c: d[i][centers[c]])
        assert labels[i].item() == expected
    assert [labels[c].item() for c in centers] == [0, 1, 2, 3]


def test_sinkhorn_matches_loop_and_marginals():
    from vtc_kernels import sinkhorn

    g = torch.Generator().manual_seed(5)
    cost = torch.rand(7, 4, generator=g, dtype=torch.float64)
    plan = sinkhorn(cost, epsilon=0.1, max_iter=100, tol=1e-2)
    K = [[math.exp(-cost[i, j].item() / 0.1) for j in range(4)] for i in range(7)]
    r, c = [1.0] * 7, [1.0] * 4
    for _ in range(100):
        r0 = r
        r = [(1 / 7) / sum(K[i][j] * c[j] for j in range(4)) for i in range(7)]
        c = [(1 / 4) / sum(K[i][j] * r[i] for i in range(7)) for j in range(4)]
        if sum(abs(a - b) for a, b in zip(r, r0)) / 7 < 1e-2:
            break
    for i in range(7):
        for j in range(4):
            assert plan[i, j].item() == pytest.approx(r[i] * K[i][j] * c[j], rel=1e-9)
    # columns match the target mass exactly after the last c-update; rows approximately (loop stopped on r)
    torch.testing.assert_close(plan.sum(0), torch.full((4,), 0.25, dtype=torch.float64))
    assert plan.sum() == pytest.approx(1.0)


def test_reconcile_count():
    from vtc_kernels import reconcile_count

    scores = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7])
    keep = torch.tensor([True, True, True, False, False])
    assert reconcile_count(keep, scores, 2).tolist() == [True, False, True, False, False]
    assert reconcile_count(keep, scores, 4).tolist() == [True, True, True, False, True]
    assert reconcile_count(keep, scores, 3).tolist() == keep.tolist()
