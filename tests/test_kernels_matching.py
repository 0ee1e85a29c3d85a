"""Bipartite matching (`best_match`) and the merge into matched anchors (`merge_into_anchors`): the references
against the expressions the plugins wrote (bit for bit) and against loops, their properties, the Triton kernels
against the references (tiny sizes: Triton's interpreter runs on CPU), and the plugins that now call them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernel_checks import DEVICE, assert_kernel_matches, both_backends, needs_triton
from vtc_kernels.dispatch import trace
from vtc_kernels.matching import ASSIGNMENT_GAP, best_match
from vtc_kernels.merge import mean_into_anchors, merge_into_anchors


def official_similarity(a, b, variant):
    """The expressions as the plugins wrote them before the op."""
    if variant == "visionzip":  # and FastVID's normalize_rows
        return (a / a.norm(dim=-1, keepdim=True)) @ (b / b.norm(dim=-1, keepdim=True)).T
    if variant == "lifestream":
        return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T
    return (a @ b.T) / (torch.norm(a, dim=-1, keepdim=True) * torch.norm(b, dim=-1, keepdim=True).T)  # holitom


FLAGS = {"visionzip": ("exact", "dot"), "lifestream": ("eps", "dot"), "holitom": ("none", "ratio")}


@pytest.mark.parametrize("variant", sorted(FLAGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_is_the_plugins_expression_per_segment(variant, dtype):
    g = torch.Generator().manual_seed(0)
    src_lengths, dst_lengths = [7, 0, 1, 12], [3, 2, 1, 5]
    src = torch.randn(sum(src_lengths), 16, generator=g).to(dtype)
    dst = torch.randn(sum(dst_lengths), 16, generator=g).to(dtype)
    # an exact tie, whatever order a matmul sums in: a one-hot destination's dot product is one product, so two
    # copies of it score the same to the last bit (random copies need not, e.g. with AVX-512 kernels)
    dst[-2:] = 0
    dst[-2:, 0] = 3.0
    src_offsets = torch.tensor([0, *src_lengths]).cumsum(0)
    dst_offsets = torch.tensor([0, *dst_lengths]).cumsum(0)
    assign, best = best_match(src, dst, *FLAGS[variant], src_offsets, dst_offsets)
    for s in range(4):
        a = src[src_offsets[s] : src_offsets[s + 1]]
        b = dst[dst_offsets[s] : dst_offsets[s + 1]]
        sim = official_similarity(a, b, variant)
        expected = (torch.max(sim, dim=-1).indices if variant == "holitom" else sim.argmax(dim=1)) + dst_offsets[s]
        mine = slice(int(src_offsets[s]), int(src_offsets[s + 1]))
        assert torch.equal(assign[mine], expected)
        assert torch.equal(best[mine], sim.max(dim=1).values if a.shape[0] else best[mine])
        assert int(dst_offsets[-1] - 1) not in assign.tolist()  # the first of the two tied destinations wins
    assert int(dst_offsets[-1] - 2) in assign.tolist()  # ... and it does win somewhere: the tie is exercised
    whole = best_match(src, dst, *FLAGS[variant])
    sim = official_similarity(src, dst, variant)
    assert torch.equal(whole[0], sim.argmax(dim=1)) and torch.equal(whole[1], sim.max(dim=1).values)


def test_best_match_against_a_loop_and_a_known_answer():
    g = torch.Generator().manual_seed(1)
    src, dst = torch.randn(9, 5, generator=g, dtype=torch.float64), torch.randn(4, 5, generator=g, dtype=torch.float64)
    assign, best = best_match(src, dst, "none", "dot")
    for i in range(9):
        dots = [sum(x * y for x, y in zip(src[i].tolist(), dst[j].tolist())) for j in range(4)]
        assert assign[i].item() == max(range(4), key=lambda j: (dots[j], -j))
        assert best[i].item() == pytest.approx(max(dots), rel=1e-12)
    src = torch.tensor([[1.0, 0.1], [0.0, 3.0], [0.0, 0.0]])
    dst = torch.tensor([[0.0, 1.0], [2.0, 0.0], [5.0, 0.0]])  # destinations 1 and 2 point the same way
    assign, best = best_match(src, dst)
    assert assign.tolist() == [1, 0, 0]  # a zero vector has NaN similarity everywhere: the first, as argmax
    assert best[1].item() == pytest.approx(1.0) and best[2].isnan()


def test_bad_arguments_name_the_problem():
    src, dst = torch.rand(4, 3), torch.rand(2, 3)
    with pytest.raises(ValueError, match="normalize must be one of"):
        best_match(src, dst, normalize="l2")
    with pytest.raises(ValueError, match="give both src_offsets and dst_offsets"):
        best_match(src, dst, src_offsets=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="same number of segments"):
        best_match(src, dst, src_offsets=torch.tensor([0, 4]), dst_offsets=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"segments \[1\] have sources but no destination"):
        best_match(src, dst, src_offsets=torch.tensor([0, 2, 4]), dst_offsets=torch.tensor([0, 2, 2]))
    with pytest.raises(ValueError, match="share D, dtype and device"):
        best_match(src, dst.double())
    with pytest.raises(ValueError, match="rule must be one of"):
        merge_into_anchors(dst, src, torch.zeros(4, dtype=torch.long), rule="max")
    with pytest.raises(ValueError, match="must index the 2 anchors"):
        merge_into_anchors(dst, src, torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="needs source_weight"):
        merge_into_anchors(dst, src, torch.zeros(4, dtype=torch.long), rule="weighted_mean")


@settings(max_examples=25, deadline=None)
@given(
    n_src=st.integers(0, 8),
    n_dst=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    normalize=st.sampled_from(["exact", "eps", "none"]),
    formula=st.sampled_from(["dot", "ratio"]),
)
def test_best_match_properties(n_src, n_dst, seed, normalize, formula):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(n_src, 4, generator=g, dtype=torch.float64)
    dst = torch.randn(n_dst, 4, generator=g, dtype=torch.float64)
    assign, best = best_match(src, dst, normalize, formula)
    a, b = src, dst
    if normalize != "none":
        a, b = (
            F.normalize(a, dim=-1, eps=1e-12 if normalize == "eps" else 0.0),
            F.normalize(b, dim=-1, eps=1e-12 if normalize == "eps" else 0.0),
        )
    sim = a @ b.T if formula == "dot" else official_similarity(a, b, "holitom")
    # the best similarity is each row's maximum, attained at the assignment
    assert torch.equal(best, sim.gather(1, assign[:, None]).squeeze(1)) and bool((sim <= best[:, None]).all())
    # permuting the sources permutes the answer; permuting the destinations relabels it
    perm = torch.randperm(n_src, generator=g)
    assert torch.equal(best_match(src[perm], dst, normalize, formula)[0], assign[perm])
    dperm = torch.randperm(n_dst, generator=g)
    moved, moved_best = best_match(src, dst[dperm], normalize, formula)
    assert torch.allclose(moved_best, best, rtol=1e-12, atol=0) and torch.equal(dperm[moved], assign)


# --- merge ------------------------------------------------------------------------------------------------------


def test_merge_rules_are_the_plugins_expressions():
    g = torch.Generator().manual_seed(2)
    anchors = torch.randn(5, 2, 3, generator=g).to(torch.bfloat16)
    members = torch.randn(11, 2, 3, generator=g).to(torch.bfloat16)
    assign = torch.tensor([0, 0, 2, 4, 4, 4, 0, 2, 4, 1, 4])  # anchor 3 takes nobody
    one_hot = torch.zeros(11, 5, dtype=members.dtype)
    one_hot[torch.arange(11), assign] = 1
    counts = one_hot.sum(dim=0).unsqueeze(-1)
    product = one_hot.T @ members.flatten(1)
    visionzip = anchors + (product / counts.clamp(min=1)).reshape(anchors.shape)
    assert torch.equal(merge_into_anchors(anchors, members, assign, "add_mean", summation="one_hot"), visionzip)
    weight = (1 / (counts + 1)).clamp(min=0.6)
    fastvid = weight * anchors.flatten(1) + (1 - weight) * (product / counts.clamp(min=1))
    merged = merge_into_anchors(anchors, members, assign, "blend", beta=0.6, summation="one_hot")
    assert torch.equal(merged, fastvid.reshape(anchors.shape))
    # LifeStream: (sum w x) / (sum w) in float32 over one row set, only the touched rows replaced
    x = torch.cat([anchors, members]).flatten(1)
    w = torch.randint(1, 5, (16,), generator=g)
    target = assign  # sources are rows 5.., anchors rows 0..4
    total = x.float() * w.float()[:, None]
    total.index_add_(0, target, total[torch.arange(5, 16)])  # LifeStream's total[sources]: a copy
    mass = w.float().index_add_(0, target, w[5:].float())
    expected = x[:5].clone()
    touched = torch.unique(target)
    expected[touched] = (total[touched] / mass[touched, None]).to(x.dtype)
    lifestream = merge_into_anchors(x[:5], x[5:], assign, "weighted_mean", source_weight=w[5:], anchor_weight=w[:5])
    assert torch.equal(lifestream, expected)
    # FrameFusion's mean_into_anchors, as it was written: index_add_ into the rows, then one division
    out = x.clone()
    dst, src = assign, torch.arange(5, 16)
    out.index_add_(0, dst, x[src])
    uniq, cnt = torch.unique(dst, return_counts=True)
    out[uniq] /= (cnt + 1).to(out.dtype).view(-1, 1)
    assert torch.equal(mean_into_anchors(x, dst, src), out)


@pytest.mark.parametrize("rule", ["mean", "add_mean", "blend", "weighted_mean"])
def test_merge_against_a_loop(rule):
    g = torch.Generator().manual_seed(3)
    anchors, sources = (
        torch.randn(4, 3, generator=g, dtype=torch.float64),
        torch.randn(9, 3, generator=g, dtype=torch.float64),
    )
    assign = torch.randint(0, 3, (9,), generator=g)  # anchor 3 takes nobody
    sw, aw = (
        torch.rand(9, generator=g, dtype=torch.float64) + 0.5,
        torch.rand(4, generator=g, dtype=torch.float64) + 0.5,
    )
    kw = {"source_weight": sw, "anchor_weight": aw} if rule == "weighted_mean" else {}
    merged = merge_into_anchors(anchors, sources, assign, rule, beta=0.3, **kw)
    for j in range(4):
        mine = [i for i in range(9) if assign[i] == j]
        total = sum((sources[i] for i in mine), torch.zeros(3, dtype=torch.float64))
        c = len(mine)
        if rule == "mean":
            expected = (anchors[j] + total) / (c + 1)
        elif rule == "add_mean":
            expected = anchors[j] + total / max(c, 1)
        elif rule == "blend":
            w = max(1 / (c + 1), 0.3)
            expected = w * anchors[j] + (1 - w) * total / max(c, 1)
        else:
            num = aw[j] * anchors[j] + sum((sw[i] * sources[i] for i in mine), torch.zeros(3, dtype=torch.float64))
            expected = num / (aw[j] + sum(sw[i] for i in mine))
        torch.testing.assert_close(merged[j], expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 10), a=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_merge_properties(m, a, seed):
    g = torch.Generator().manual_seed(seed)
    anchors, sources = (
        torch.randn(a, 3, generator=g, dtype=torch.float64),
        torch.randn(m, 3, generator=g, dtype=torch.float64),
    )
    assign = torch.randint(0, a, (m,), generator=g)
    mean = merge_into_anchors(anchors, sources, assign)
    untouched = torch.bincount(assign, minlength=a) == 0
    for rule in ("add_mean", "blend"):
        assert torch.equal(merge_into_anchors(anchors, sources, assign, rule)[untouched], anchors[untouched])
    # unit weights make the weighted mean the plain mean; the order of the sources does not matter
    ones_m, ones_a = torch.ones(m, dtype=torch.long), torch.ones(a, dtype=torch.long)
    weighted = merge_into_anchors(anchors, sources, assign, "weighted_mean", source_weight=ones_m, anchor_weight=ones_a)
    torch.testing.assert_close(weighted, mean, rtol=1e-12, atol=1e-12)
    perm = torch.randperm(m, generator=g)
    torch.testing.assert_close(merge_into_anchors(anchors, sources[perm], assign[perm]), mean, rtol=1e-12, atol=1e-12)
    # blend with beta = 0 is the plain mean
    torch.testing.assert_close(merge_into_anchors(anchors, sources, assign, "blend"), mean, rtol=1e-12, atol=1e-12)


# --- the Triton kernels (interpreter on CPU: tiny sizes) ------------------------------------------------------


def assert_assignment_within_contract(src, dst, expected, actual, flags):
    """Exact assignment wherever the reference's best beats its second best by more than ASSIGNMENT_GAP; the
    similarity itself is checked by the op's tolerance."""
    sim = best_match.reference  # noqa: F841 (documentation: the gap is measured on the reference similarity)
    full = official_similarity(src.double(), dst.double(), "visionzip" if flags[0] == "exact" else "holitom")
    top2 = full.topk(min(2, dst.shape[0]), dim=1).values
    clear = (
        (top2[:, 0] - top2[:, -1]) > ASSIGNMENT_GAP[src.dtype]
        if dst.shape[0] > 1
        else torch.ones_like(top2[:, 0]).bool()
    )
    assert torch.equal(actual[0].cpu()[clear], expected[0].cpu()[clear])
    rtol, atol = best_match.op.tolerance.bound(src.dtype)
    torch.testing.assert_close(actual[1].cpu().double(), expected[1].cpu().double(), rtol=rtol, atol=atol)


@needs_triton
def test_triton_best_match_every_variant_segmented():
    g = torch.Generator().manual_seed(4)
    # empty, one-source and one-destination segments; D = 40 spans several feature slices of 16... 64
    src_offsets = torch.tensor([0, 0, 1, 9, 9, 40], device=DEVICE)
    dst_offsets = torch.tensor([0, 2, 3, 8, 9, 47], device=DEVICE)
    src = torch.randn(40, 40, generator=g).to(DEVICE)
    dst = torch.randn(47, 40, generator=g).to(DEVICE)
    for normalize, formula in [("exact", "dot"), ("eps", "dot"), ("none", "dot"), ("none", "ratio")]:
        assert_kernel_matches(best_match, src, dst, normalize, formula, src_offsets, dst_offsets)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_best_match_half_precision(dtype):
    g = torch.Generator().manual_seed(5)
    dst = torch.randn(20, 24, generator=g)
    truth = torch.randint(0, 20, (33,), generator=g)
    src = dst[truth] + 0.05 * torch.randn(33, 24, generator=g)  # each source near one destination: clear margins
    src, dst = src.to(dtype).to(DEVICE), dst.to(dtype).to(DEVICE)
    expected, actual = both_backends(best_match, src, dst)
    assert torch.equal(actual[0].cpu(), truth) and actual[1].dtype == dtype
    assert_assignment_within_contract(src.cpu(), dst.cpu(), expected, actual, ("exact", "dot"))


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the zero vector's 0 / 0
def test_triton_best_match_ties_and_zero_vectors():
    """Exactly representable ties go to the first destination in both; a zero source is NaN, matched first."""
    dst = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]] * 8, device=DEVICE)
    src = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 1.0], [0.0, 0.0]], device=DEVICE)
    offsets = (torch.tensor([0, 1, 4], device=DEVICE), torch.tensor([0, 3, 40], device=DEVICE))
    for flags in [("exact", "dot"), ("none", "dot")]:
        expected, actual = assert_kernel_matches(best_match, src, dst, *flags, *offsets)
        assert actual[0].tolist() == [1, 3, 3, 3]  # segment 1's first [0, 1] is row 3; ties and zeros: row 3
    assert actual[1][:3].tolist() == [2.0, 3.0, 1.0]
    expected, actual = both_backends(best_match, src, dst, "exact")
    assert actual[0].tolist() == expected[0].tolist() == [1, 0, 0, 0] and actual[1][3].isnan()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_merge_every_rule(dtype):
    g = torch.Generator().manual_seed(6)
    anchors = torch.randn(6, 2, 5, generator=g).to(dtype).to(DEVICE)
    sources = torch.randn(13, 2, 5, generator=g).to(dtype).to(DEVICE)
    assign = torch.tensor([0, 0, 2, 4, 4, 4, 0, 2, 4, 1, 4, 5, 5], device=DEVICE)  # anchor 3 takes nobody
    weights = {
        "source_weight": torch.randint(1, 5, (13,), generator=g).to(DEVICE),
        "anchor_weight": torch.randint(1, 5, (6,), generator=g).to(DEVICE),
    }
    rules = ["mean", "add_mean", "blend", "weighted_mean"] if dtype == torch.float32 else ["mean", "blend"]
    for rule in rules:
        kw = weights if rule == "weighted_mean" else {}
        summation = "one_hot" if rule in ("add_mean", "blend") else "index_add"
        _, merged = assert_kernel_matches(
            merge_into_anchors, anchors, sources, assign, rule, 0.6, summation=summation, **kw
        )
        if rule == "weighted_mean":
            assert torch.equal(merged[3], anchors[3])  # no source: bit for bit
    empty = merge_into_anchors(anchors, sources[:0], assign[:0])
    assert torch.equal(empty, anchors)


# --- plugins call the shared ops -------------------------------------------------------------------------------


def test_plugins_call_the_matching_ops():
    from vtc_plugins.fastvid import dtm_merge
    from vtc_plugins.holitom import inner_merge
    from vtc_plugins.visionzip import contextual_features, select_frame

    g = torch.Generator().manual_seed(7)
    with trace() as calls:
        plan = select_frame(torch.rand(12, generator=g), torch.randn(12, 4, generator=g), 2, 3)
        contextual_features(
            torch.randn(12, 4, generator=g)[plan.targets], torch.randn(plan.members.numel(), 4), plan.assign
        )
        dtm_merge(torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g), 0.6)
        inner_merge(torch.randn(10, 4, generator=g), torch.rand(10, generator=g), torch.arange(2, 9), 3)
    names = [name for name, _ in calls]
    assert names.count("best_match") == 3 and names.count("merge_into_anchors") == 2
