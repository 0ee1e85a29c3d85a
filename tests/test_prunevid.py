"""PruneVid: stage-1 pieces (DPC-kNN, refine_clusters, the static test, the whole merge) against loop
re-derivations written in the official structure (Visual-AI/PruneVid `modeling_pllava.py`), stage 2 against
`VTPWindowCache.process_attention`, and the patched model against a layer-by-layer reference (prune of the
hidden states and of the KV cache of layers 0..selected_layer, prefill and a decode step)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import batch_inputs, model_and_processor, single_inputs
from tests.reference import CAPTURED, ManualLLM, last_rows_attention
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context, VideoTokens
from vtc_plugins.prunevid import (
    DEFAULT_ALPHA,
    README_RETAINED,
    TAG_BUDGET,
    TAG_FRAME,
    TAG_STATIC,
    TAG_WINDOW,
    PruneVid,
    cluster_means,
    dpc_knn_cluster,
    prunevid_stage1,
    refine_clusters,
    segment_lengths,
    stage2_keep,
    static_scores,
    temporal_windows,
)

# --- loop re-derivations of the official code -------------------------------------------------------------------


def official_dpc(x: torch.Tensor, num: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """`cluster_dpc_knn` (B = 1) with explicit loops for the density-peak parts."""
    n, c = x.shape
    dist = torch.cdist(x.float()[None], x.float()[None])[0] / c**0.5
    k = min(k, n)
    density = torch.empty(n)
    for i in range(n):
        nearest = torch.sort(dist[i]).values[:k]
        density[i] = torch.exp(-(nearest**2).mean())
    density = density + torch.rand(n, generator=generator) * 1e-6
    delta = torch.empty(n)
    for i in range(n):
        denser = [dist[i, j] for j in range(n) if density[j] > density[i]]
        delta[i] = min(denser) if denser else dist.max()
    centres = torch.topk(delta * density, num).indices
    labels = torch.empty(n, dtype=torch.long)
    for j in range(n):  # index_points(dist, centres) then argmin over the centre axis: rows of the centres
        labels[j] = int(torch.argmin(torch.stack([dist[c_, j] for c_ in centres])))
    labels[centres] = torch.arange(num)
    return labels


def official_refine(labels: list[int]) -> list[int]:
    """`refine_clusters` for one video, step by step as the official code does it."""
    n = len(labels)
    refined = list(labels)
    segments = {}
    for lab in sorted(set(labels)):
        idx = [i for i in range(n) if labels[i] == lab]
        segs, start, prev = [], idx[0], idx[0]
        for i in idx[1:]:
            if i == prev + 1:
                prev = i
            else:
                segs.append((start, prev))
                start = prev = i
        segs.append((start, prev))
        segments[lab] = segs
    for segs in segments.values():
        longest = max(e - s + 1 for s, e in segs)
        for s, e in segs:
            if longest == 1 or e - s + 1 != longest:
                for i in range(s, e + 1):
                    refined[i] = -1
    idx = 0
    while idx < n:
        if refined[idx] != -1:
            idx += 1
            continue
        start = idx
        while idx < n and refined[idx] == -1:
            idx += 1
        end = idx - 1
        left_label, left_length = None, 0
        if start > 0:
            left_label = refined[start - 1]
            j = start - 1
            while j >= 0 and refined[j] == left_label:
                j -= 1
            left_length = start - j - 1
        right_label, right_length = None, 0
        if end < n - 1:
            right_label = refined[end + 1]
            j = end + 1
            while j < n and refined[j] == right_label:
                j += 1
            right_length = j - end - 1
        if left_length > right_length:
            new = left_label
        elif right_length > left_length:
            new = right_label
        else:
            new = left_label if left_label is not None else right_label
        if new is None:
            new = 0
        for i in range(start, end + 1):
            refined[i] = new
    return refined


def official_static_scores(frames: torch.Tensor) -> torch.Tensor:
    """Mean cosine over the ordered pairs of distinct frames, per position (loops)."""
    w, length, _ = frames.shape
    out = torch.empty(length)
    for pos in range(length):
        sims = [
            F.cosine_similarity(frames[a, pos], frames[b, pos], dim=0) for a in range(w) for b in range(w) if a != b
        ]
        out[pos] = torch.stack(sims).mean() if sims else float("nan")
    return out


def official_stage1(frames: torch.Tensor, tau, segment_ratio, cluster_ratio, k, generator):
    """`merge_frames_dynamic` on a dense [T, L, C] video (B = 1) -> (features [M, C], windows, static, dynamic)."""
    t, length, _ = frames.shape

    def merge(feat):
        if feat.shape[0] <= 14:
            return feat
        m = int(feat.shape[0] * cluster_ratio)
        labels = official_dpc(feat, m, 7, generator)
        return torch.stack([feat[labels == c].mean(0) for c in range(m)])

    labels = official_dpc(frames.mean(dim=1), int(t * segment_ratio), k, generator)
    refined = official_refine(labels.tolist())
    windows = [len(list(g)) for _, g in __import__("itertools").groupby(refined)]
    out, static_sizes, dynamic_sizes, start = [], [], [], 0
    for w in windows:
        current = frames[start : start + w]
        static = official_static_scores(current) > tau
        static_feat = merge(current[:, static].mean(dim=0))
        out.append(static_feat)
        static_sizes.append(static_feat.shape[0])
        dyn = [merge(current[i, ~static]) for i in range(w)]
        out.extend(dyn)
        dynamic_sizes.append(sum(d.shape[0] for d in dyn))
        start += w
    return torch.cat(out), windows, static_sizes, dynamic_sizes


def official_process_attention(scores, static_sizes, dynamic_sizes, window_sizes, alpha):
    """`VTPWindowCache.process_attention` on a flat score vector -> sorted kept indices."""
    kept, start = [], 0
    for s, d, w in zip(static_sizes, dynamic_sizes, window_sizes):
        window = scores[start : start + s + d]
        kept.append(torch.topk(window[:s], int(s * alpha)).indices + start)
        dyn = window[s:].view(w, -1)
        top = torch.topk(dyn, int(dyn.shape[-1] * alpha), dim=-1).indices
        for i in range(w):
            kept.append(top[i] + start + s + dyn.shape[-1] * i)
        start += s + d
    return torch.sort(torch.cat(kept)).values


def scene_video(t=8, length=20, dim=8, static=16, seed=0, scenes=2):
    """Dense [T, L, C] features: `scenes` scenes; per scene the first `static` positions barely move, the
    rest are new every frame."""
    g = torch.Generator().manual_seed(seed)
    frames = torch.randn(t, length, dim, generator=g)
    per_scene = t // scenes
    for s in range(scenes):
        base = torch.randn(length, dim, generator=g) * 3
        for f in range(s * per_scene, (s + 1) * per_scene):
            frames[f, :static] = base[:static] + 0.05 * torch.randn(static, dim, generator=g)
    return frames


def flat(frames):
    t, length, _ = frames.shape
    frame = torch.arange(t).repeat_interleave(length)
    patch = torch.arange(length).repeat(t)
    return frames.reshape(t * length, -1), frame, patch


# --- parameters -------------------------------------------------------------------------------------------------


def test_defaults_follow_the_official_scripts():
    p = PruneVid()
    assert (p.selected_layer, p.alpha, p.tau, p.temporal_segment_ratio, p.cluster_ratio, p.k) == (
        10,
        None,
        0.8,
        0.25,
        0.5,
        7,
    )
    assert p.fixed_count is False
    cls = vtc.registry()["prunevid"]
    info = cls.card
    assert cls is PruneVid and issubclass(PruneVid, vtc.LayerPruner)  # stage 2 is FastV's schedule
    assert info.stages == ("connect", "prefill")
    assert info.query_aware and info.owns == frozenset({"llm_token_schedule"})
    assert info.positions == "compact" and info.fixed_count and info.fixed_count_mode == "optional"
    # the count retention sets is the one after the layer-M prune; stage 1 has no vision statistics
    assert info.retention_reference == "last_layer" and "layer-M prune" in info.retention_note
    assert not (info.vision_stats or info.prepool or info.whole_frames or info.during_decode)
    assert set(cls.testing.exemptions) == {"ordered_positions"}
    assert cls.testing.params == {"selected_layer": 2}
    plugin = cls().bind(None)
    assert plugin.group_alpha() == DEFAULT_ALPHA == 0.4
    assert plugin.retained_count(1000, (10, 10, 10), "qwen2_vl") is None  # adaptive by default
    # the method object holds only its parameters (per-prompt state lives in ctx.state)
    assert not any(hasattr(plugin, a) for a in ("last_kept", "last_plans", "_pending", "entry_layout", "_scores"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"selected_layer": -1}, "selected_layer"),
        ({"alpha": 0.0}, r"alpha must be in \(0, 1\]"),
        ({"alpha": 1.5}, "alpha"),
        ({"temporal_segment_ratio": 0.0}, "temporal_segment_ratio"),
        ({"cluster_ratio": 1.2}, "cluster_ratio"),
        ({"k": 0}, "k must be"),
    ],
)
def test_invalid_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PruneVid(**kwargs)


def test_retention_mapping_and_fixed_counts():
    cls = vtc.registry()["prunevid"]
    grid = (4, 12, 12)
    plugin = cls().bind(0.3)
    assert plugin.group_alpha() is None and plugin.target() == 0.3  # alpha = round(0.3 N) / (tokens after stage 1)
    assert plugin.retained_count(576, grid, "qwen2_vl") is None
    fixed = cls(fixed_count=True).bind(0.3)
    for family in ("qwen2_vl", "llava_onevision"):  # the count depends on the tokens only
        assert fixed.retained_count(576, grid, family) == round(0.3 * 576) == 173
    assert fixed.retained_count(300, grid, "qwen2_vl") == round(0.3 * 300)  # of what reaches it
    # defaults: the README's 16.2 % at alpha = 0.4; an explicit alpha scales it and wins over the retention
    default = cls(fixed_count=True).bind(None)
    assert default.retained_count(1000, grid, "qwen2_vl") == round(README_RETAINED * 1000)
    explicit = cls(alpha=0.2, fixed_count=True).bind(0.9)
    assert explicit.group_alpha() == 0.2
    assert explicit.retained_count(1000, grid, "qwen2_vl") == round(0.2 * README_RETAINED / 0.4 * 1000)
    # retention 1.0 keeps everything (both stages off)
    full = cls().bind(1.0)
    assert full.identity() and full.retained_count(576, grid, "qwen2_vl") == 576
    tokens = _video_tokens(torch.randn(2, 4, 4))
    ctx = Context()
    assert full.connect(tokens, ctx) is tokens
    assert ctx.reports == {}  # no stage 1: no plan


# --- stage 1 pieces ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "labels, expected",
    [
        ([0, 0, 1, 1, 1, 0, 0, 0, 2], [1, 1, 1, 1, 1, 0, 0, 0, 0]),  # short runs and singleton clusters move
        ([0, 1, 2, 2, 3, 3], [2, 2, 2, 2, 3, 3]),  # no left neighbour: the right one
        ([0, 0, 1, 2, 2], [0, 0, 0, 2, 2]),  # equal neighbours: the left one
        ([0, 0, 1, 2, 3, 3, 3], [0, 0, 3, 3, 3, 3, 3]),  # the longer neighbour
        ([0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0, 0]),  # all longest runs of a cluster stay
        ([0, 1, 2], [0, 0, 0]),  # nothing left to join: cluster 0
        ([3], [0]),
        ([1, 1, 1, 1], [1, 1, 1, 1]),
    ],
)
def test_refine_clusters_hand_built(labels, expected):
    assert refine_clusters(labels) == expected
    assert official_refine(labels) == expected


def test_refine_clusters_matches_the_official_loops_on_random_labels():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 20, (1,), generator=g))
        labels = torch.randint(0, int(torch.randint(1, 6, (1,), generator=g)), (n,), generator=g).tolist()
        assert refine_clusters(labels) == official_refine(labels), labels
    assert segment_lengths([1, 1, 1, 1, 1, 0, 0, 0, 0]) == [5, 4]
    assert segment_lengths([0, 0, 1, 1, 1, 0, 0]) == [2, 3, 2]


def test_dpc_knn_matches_the_official_loops():
    for seed in range(5):
        x = torch.randn(23, 6, generator=torch.Generator().manual_seed(seed))
        labels, centres = dpc_knn_cluster(x, 5, 7, torch.Generator().manual_seed(seed))
        expected = official_dpc(x, 5, 7, torch.Generator().manual_seed(seed))
        assert torch.equal(labels, expected)
        assert torch.equal(labels[centres], torch.arange(5))  # centres own their cluster
    # exact duplicates: the generator's noise decides, repeatably
    x = torch.cat([torch.ones(4, 3), torch.zeros(4, 3)])
    a, _ = dpc_knn_cluster(x, 2, 3, torch.Generator().manual_seed(1))
    b, _ = dpc_knn_cluster(x, 2, 3, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a[:4].unique().numel() == 1 and a[4:].unique().numel() == 1


def test_cluster_means_are_member_means_and_empty_clusters_are_zero():
    x = torch.arange(12.0).view(6, 2)
    labels = torch.tensor([0, 2, 0, 2, 2, 0])
    means = cluster_means(x, labels, 4)
    assert torch.allclose(means[0], x[[0, 2, 5]].mean(0))
    assert torch.allclose(means[2], x[[1, 3, 4]].mean(0))
    assert torch.equal(means[1], torch.zeros(2)) and torch.equal(means[3], torch.zeros(2))


def test_static_scores_on_constructed_frames():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 8, generator=g)
    frames = torch.randn(3, 5, 8, generator=g)
    frames[:, 0] = base[0]  # identical over the window
    frames[:, 1] = base[1] * torch.tensor([1.0, 2.0, 0.5])[:, None]  # same direction, different scale
    frames[:, 2] = torch.stack([base[2], -base[2], base[2]])  # flips: pairs +1, -1, -1, ...
    scores = static_scores(frames)
    assert torch.allclose(scores, official_static_scores(frames), atol=1e-6)
    assert scores[0] == pytest.approx(1.0, abs=1e-6) and scores[1] == pytest.approx(1.0, abs=1e-6)
    assert scores[2] == pytest.approx(-1 / 3, abs=1e-6)  # (1*2 - 1*4) / 6
    static = scores > 0.8
    assert static.tolist()[:3] == [True, True, False]
    assert torch.isnan(static_scores(frames[:1])).all()  # one frame: 0 / 0, never static
    assert not (static_scores(frames[:1]) > 0.8).any()


def test_temporal_windows_follow_scenes():
    frames = scene_video(t=8, scenes=2)
    assert temporal_windows(frames.mean(dim=1), 0.25, 7, torch.Generator().manual_seed(0)) == [4, 4]
    # fewer frames than k and fewer than 1 / ratio: one cluster, one window (the official code needs T >= 7)
    assert temporal_windows(frames[:3].mean(dim=1), 0.25, 7, torch.Generator().manual_seed(0)) == [3]


@pytest.mark.parametrize(
    "shape, static, seed",
    [((8, 20, 8, 16), 16, 0), ((8, 40, 8, 10), 10, 1), ((12, 18, 6, 3), 3, 2), ((4, 16, 4, 16), 16, 3)],
)
def test_stage1_matches_the_official_merge(shape, static, seed):
    t, length, dim, _ = shape
    frames = scene_video(t, length, dim, static, seed)
    expected, windows, static_sizes, dynamic_sizes = official_stage1(
        frames, 0.8, 0.25, 0.5, 7, torch.Generator().manual_seed(seed)
    )
    embeds, frame, patch = flat(frames)
    plan = prunevid_stage1(embeds, frame, patch, generator=torch.Generator().manual_seed(seed))
    assert plan.window_sizes == windows
    assert plan.static_sizes == static_sizes and plan.dynamic_sizes == dynamic_sizes
    assert torch.allclose(plan.values, expected, atol=1e-5)
    assert plan.count == sum(static_sizes) + sum(dynamic_sizes)
    # tags: windows in order, static tokens first in each window, then dynamic tokens frame by frame
    starts = [sum(windows[:i]) for i in range(len(windows))]
    order = []
    for w, (s, d) in enumerate(zip(static_sizes, dynamic_sizes)):
        order += [(w, 1, -1)] * s
        per_frame = d // windows[w]
        for f in range(windows[w]):
            order += [(w, 0, starts[w] + f)] * per_frame
    assert list(zip(plan.window.tolist(), plan.static.tolist(), plan.frame.tolist())) == order
    # static anchors sit in the first frame of their window, dynamic anchors in their own frame
    first_frame = torch.tensor(starts)[plan.window]
    assert torch.equal(frame[plan.anchors][plan.static == 1], first_frame[plan.static == 1])
    assert torch.equal(frame[plan.anchors][plan.static == 0], plan.frame[plan.static == 0])


def _video_tokens(frames: torch.Tensor) -> VideoTokens:
    t, length, _ = frames.shape
    embeds, frame, patch = flat(frames)
    side = int(math.isqrt(length))
    assert side * side == length
    return VideoTokens(
        embeds=embeds,
        positions=torch.arange(t * length),
        frame=frame,
        row=patch // side,
        col=patch % side,
        weight=torch.ones(t * length),
        grid=(t, side, side),
        extras={"side": embeds.double() * 2},
        seq_index=torch.arange(t * length),
    )


def _context(seed: int = 0, family: str = "qwen2_vl") -> Context:
    return Context(family=family, geometry=default_geometry(family), generator=torch.Generator().manual_seed(seed))


def test_connect_merges_linearly_and_tags_the_tokens():
    frames = scene_video(t=8, length=16, dim=8, static=12, seed=4)
    tokens = _video_tokens(frames)
    plugin = vtc.registry()["prunevid"]().bind(None)
    ctx = _context(seed=0)
    out = plugin.connect(tokens, ctx)
    (plan,) = ctx.reports["plan"]  # one report for the one video
    assert list(ctx.reports) == ["plan"] and len(out) == plan.count
    # the reported plan is the official stage 1 with the same generator
    again = prunevid_stage1(tokens.embeds, tokens.frame, tokens.patch, generator=torch.Generator().manual_seed(0))
    assert torch.equal(plan.anchors, again.anchors) and torch.equal(plan.values, again.values)
    assert torch.equal(out.embeds, plan.values)
    # the weighted-merge map (used for side features) gives the same means
    torch.testing.assert_close(out.extras["side"], plan.values.double() * 2, atol=1e-5, rtol=1e-5)
    assert out.weight.sum() == len(tokens)  # every input token is in exactly one output token
    assert torch.equal(out.positions, tokens.positions[plan.anchors])
    assert torch.equal(out.tags[TAG_WINDOW], plan.window) and torch.equal(out.tags[TAG_STATIC], plan.static)
    assert torch.equal(out.tags[TAG_FRAME], plan.frame) and TAG_BUDGET not in out.tags
    # without merges at all (tau > 1, no clustering) the tokens come back in their original order
    nothing = prunevid_stage1(tokens.embeds, tokens.frame, tokens.patch, tau=2.0, cluster=False)
    assert torch.equal(nothing.anchors, torch.arange(len(tokens)))


def test_relaxed_stage1_leaves_at_least_the_budget():
    frames = scene_video(t=8, length=16, dim=8, static=16, seed=5)  # everything static: stage 1 keeps little
    tokens = _video_tokens(frames)
    for fixed in (False, True):
        plugin = vtc.registry()["prunevid"](fixed_count=fixed).bind(0.5)
        ctx = _context(seed=0)
        out = plugin.connect(tokens, ctx)
        budget = round(0.5 * len(tokens))
        assert len(out) >= budget and bool((out.tags[TAG_BUDGET] == budget).all())
        (plan,) = ctx.reports["plan"]  # the relaxed plan is the one reported
        assert plan.count == len(out)
    official = prunevid_stage1(tokens.embeds, tokens.frame, tokens.patch, generator=torch.Generator().manual_seed(0))
    assert official.count < budget


def test_stage1_handles_partial_frames():
    """After an earlier plugin, frames may hold different patches: only patches present in every frame of a
    window can be static; the others are dynamic tokens of their frame."""
    frames = scene_video(t=4, length=16, dim=8, static=16, seed=6, scenes=1)
    embeds, frame, patch = flat(frames)
    keep = ~((frame == 2) & (patch < 3))
    plan = prunevid_stage1(embeds[keep], frame[keep], patch[keep], cluster=False)
    assert plan.window_sizes == [4]
    assert plan.static_sizes == [13] and plan.dynamic_sizes == [3 * 3]


# --- stage 2 ----------------------------------------------------------------------------------------------------


def test_stage2_matches_process_attention():
    g = torch.Generator().manual_seed(0)
    static_sizes, dynamic_sizes, window_sizes = [5, 0, 12], [8, 18, 10], [2, 3, 5]
    n = sum(static_sizes) + sum(dynamic_sizes)
    scores = torch.rand(n, generator=g)
    window, static, frame = [], [], []
    for w, (s, d, size) in enumerate(zip(static_sizes, dynamic_sizes, window_sizes)):
        window += [w] * (s + d)
        static += [1] * s + [0] * d
        frame += [-1] * s + [f for f in range(10 * w, 10 * w + size) for _ in range(d // size)]
    # the video sits in slots 3.. of a longer row
    pad = 3
    full = torch.cat([torch.rand(pad, generator=g), scores, torch.rand(2, generator=g)])
    slots = torch.arange(pad, pad + n)
    tags = [torch.tensor([-1] * pad + t + [-1] * 2) for t in (window, static, frame)]
    for alpha in (0.4, 0.5, 0.75):
        keep = stage2_keep(full, slots, *tags, alpha=alpha)
        expected = official_process_attention(scores, static_sizes, dynamic_sizes, window_sizes, alpha)
        assert torch.equal(torch.nonzero(keep).flatten(), expected)
    # alpha from a budget: size * budget // total per group, then reconciled to exactly the budget when fixed
    keep = stage2_keep(full, slots, *tags, alpha=None, budget=20)
    assert int(keep.sum()) == sum(s * 20 // n for s in [5, 4, 4, 6, 6, 6, 12, 2, 2, 2, 2, 2])
    fixed = stage2_keep(full, slots, *tags, alpha=None, budget=20, fixed=True)
    assert int(fixed.sum()) == 20 and bool((keep <= fixed).all())
    fixed = stage2_keep(full, slots, *tags, alpha=0.75, budget=20, fixed=True)
    assert int(fixed.sum()) == 20


# --- the patched model against a layer-by-layer reference -------------------------------------------------------


def _capture_llm_inputs(model):
    """Record the kwargs every forward of the language model receives (after vtc's own pre-hook)."""
    text = vtc.api.resolve_adapter(model).text_model
    calls = []

    def hook(module, args, kwargs):
        calls.append({k: v for k, v in kwargs.items()})

    return calls, text.register_forward_pre_hook(hook, with_kwargs=True)


def _layout_probe(plugin):
    """Wrap the plugin's prefill hook to record the layout (slots, tags) of the sequence entering the LLM, at
    layer 0 of every prefill (vtc keeps no per-forward state on the plugin object)."""
    layouts = []
    original = plugin.prefill

    def wrapped(llm, ctx):
        if llm.phase == "prefill" and llm.layer == 0 and llm.point == "layer_start":
            layouts.append(llm.layout)
        return original(llm, ctx)

    plugin.prefill = wrapped
    return layouts


def _three_rows(pos):
    return pos[1:] if pos.dim() == 3 and pos.shape[0] == 4 else pos


def position_free_scores(layer, hidden: torch.Tensor, first_row: int) -> torch.Tensor:
    """The official score: the eager LLaMA attention of PruneVid returns softmax(q k^T / sqrt(d)) of the
    projections *before* RoPE and without any mask; max over heads, then over the rows after the video."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    q = attn.q_proj(x).view(1, x.shape[1], -1, attn.head_dim)
    k = attn.k_proj(x).view(1, x.shape[1], -1, attn.head_dim)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    weights = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(attn.head_dim), dim=-1, dtype=torch.float32)
    weights = weights.to(q.dtype)
    return weights[0, :, first_row:].max(dim=0).values.max(dim=0).values


def prunevid_reference(model, prefill, decode, layout, selected_layer, alpha, causal_scores=False):
    """Run the language model layer by layer on the stage-1 sequence (batch 1): layers 0..s on everything; the
    attention map of layer s (official: position-free, unmasked; or the layer's real causal one) of every
    token after the video, max over heads and queries, ranks the video tokens; per window keep the top
    int(size * alpha) static tokens and per frame the top int(count * alpha) dynamic tokens (alpha = budget /
    tokens when alpha is None); layers > s run on the survivors. A decode token (if given) sees only the
    survivors, at every layer. Returns (last-row logits, kept prompt slots)."""
    ref = ManualLLM(model)
    hidden = prefill["inputs_embeds"]
    n = hidden.shape[1]
    positions = prefill.get("position_ids")
    positions = torch.arange(n)[None] if positions is None else _three_rows(positions)
    new_tokens = 0
    if decode is not None:
        new_tokens = decode["inputs_embeds"].shape[1]
        hidden = torch.cat([hidden, decode["inputs_embeds"]], dim=1)
        positions = torch.cat([positions, _three_rows(decode["position_ids"]).to(positions.dtype)], dim=-1)
    cos, sin = ref.rope(hidden, positions)
    length = hidden.shape[1]
    ds_mask = prefill.get("visual_pos_masks")
    ds_embeds = prefill.get("deepstack_visual_embeds")
    if ds_mask is not None:
        ds_mask = torch.cat([ds_mask[0], torch.zeros(new_tokens, dtype=torch.bool)])
    visual = layout.visual[0]
    tags = {name: t[0] for name, t in layout.tags.items()}
    first_row = int(torch.nonzero(visual).max()) + 1
    with ref.capturing(), torch.no_grad():
        h = hidden[:, :n]
        for i in range(selected_layer + 1):
            if i == selected_layer and not causal_scores:
                scores = position_free_scores(ref.layers[i], h, first_row)
            h = ref.mlp_block(i, ref.attention_block(i, h, cos[:, :n], sin[:, :n]))
            h = ref.deepstack(i, h, None if ds_mask is None else ds_mask[:n], ds_embeds)
        if causal_scores:
            query, key = CAPTURED[selected_layer]
            probs = last_rows_attention(query, key, n - first_row, upcast=True)
            scores = probs[0].max(dim=0).values.max(dim=0).values
        slots = torch.nonzero(visual).flatten()
        budget = int(tags[TAG_BUDGET][slots[0]]) if TAG_BUDGET in tags else None
        chosen = []
        for w in sorted(set(tags[TAG_WINDOW][slots].tolist())):
            groups = [slots[(tags[TAG_WINDOW][slots] == w) & (tags[TAG_STATIC][slots] == 1)]]
            dyn = slots[(tags[TAG_WINDOW][slots] == w) & (tags[TAG_STATIC][slots] == 0)]
            groups += [dyn[tags[TAG_FRAME][dyn] == f] for f in sorted(set(tags[TAG_FRAME][dyn].tolist()))]
            for group in groups:
                quota = int(group.numel() * alpha) if alpha is not None else group.numel() * budget // slots.numel()
                chosen.append(group[torch.topk(scores[group], quota).indices])
        kept = torch.sort(torch.cat([torch.nonzero(~visual).flatten()] + chosen)).values
        if new_tokens:
            # prompt rows are unchanged; a decode row must not see the dropped slots in layers 0..s either
            dropped = torch.ones(length, dtype=torch.bool)
            dropped[kept] = False
            dropped[n:] = False
            mask = torch.ones(length, length, dtype=torch.bool).tril()
            mask[n:, dropped] = False
            h = hidden
            for i in range(selected_layer + 1):
                h = ref.mlp_block(i, ref.attention_block(i, h, cos, sin, mask))
                h = ref.deepstack(i, h, ds_mask, ds_embeds)
        rows = torch.cat([kept, torch.arange(n, length)])
        h, cos, sin = h[:, rows], cos[:, rows], sin[:, rows]
        for i in range(selected_layer + 1, len(ref.layers)):
            h = ref.mlp_block(i, ref.attention_block(i, h, cos, sin))
            if ds_embeds is not None and i < len(ds_embeds):
                raise AssertionError("DeepStack after the prune is not covered by this reference")
        logits = ref.logits(h)
    return logits[:, -1], kept


@pytest.mark.parametrize(
    "family, retention, alpha, causal",
    [
        ("qwen2_vl", None, None, False),
        ("qwen2_5_vl", 0.3, None, False),
        ("qwen3_vl", None, 0.5, False),
        ("llava_onevision", 0.25, None, False),
        ("llava_next_video", None, None, False),
        ("qwen2_vl", 0.3, None, True),
        ("llava_onevision", None, None, True),
    ],
)
def test_matches_reference_prefill_and_decode(family, retention, alpha, causal):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    params = {"selected_layer": 2, "causal_scores": causal} | ({"alpha": alpha} if alpha is not None else {})
    with vtc.patch(model, "prunevid", retention=retention, **params) as handle:
        layouts = _layout_probe(handle.pipeline.entries[-1].method)
        calls, hook = _capture_llm_inputs(model)
        try:
            gen = model.generate(
                **inputs, max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        finally:
            hook.remove()
        stats = handle.stats()
    (layout,) = layouts  # one prefill; decode steps do not call the hook (prunevid does not act during decode)
    prefill, decode = calls[0], calls[1]
    # stage 1 is what the LLM received: the plan's features, in the plan's order (one contiguous video)
    (plan,) = stats.reports["prunevid"]["plan"]
    visual_slots = torch.nonzero(layout.visual[0]).flatten()
    assert visual_slots.numel() == plan.count == stats.llm_tokens_in
    if family != "qwen3_vl":  # Qwen3-VL interleaves timestamps; tokens go to their frame's segment
        torch.testing.assert_close(prefill["inputs_embeds"][0, visual_slots], plan.values)
        # the connect output's tags reach the LLM on the video's slots, in the plan's order
        assert torch.equal(layout.tags[TAG_WINDOW][0, visual_slots], plan.window)
        assert torch.equal(layout.tags[TAG_STATIC][0, visual_slots], plan.static)
        assert torch.equal(layout.tags[TAG_FRAME][0, visual_slots], plan.frame)
    else:  # reordered into frame segments: the same multiset of tags
        pairs = sorted(
            zip(layout.tags[TAG_WINDOW][0, visual_slots].tolist(), layout.tags[TAG_FRAME][0, visual_slots].tolist())
        )
        assert pairs == sorted(zip(plan.window.tolist(), plan.frame.tolist()))
    assert bool((layout.tags[TAG_WINDOW][0][~layout.visual[0]] == -1).all())  # -1 outside the video
    assert (TAG_BUDGET in layout.tags) == (retention is not None and alpha is None)
    effective_alpha = alpha if alpha is not None else (None if retention is not None else 0.4)
    ref_prefill, kept = prunevid_reference(model, prefill, None, layout, 2, effective_alpha, causal)
    ref_decode, kept_again = prunevid_reference(model, prefill, decode, layout, 2, effective_alpha, causal)
    assert torch.equal(kept, kept_again)
    kept_visual = int(layout.visual[0][kept].sum())
    assert stats.reports["prunevid"]["kept"] == [kept_visual]  # one batch row
    assert stats.layer_visual_tokens[-1] == kept_visual
    assert stats.layer_visual_tokens[:3] == [plan.count] * 3  # layers 0..2 see every stage-1 token
    torch.testing.assert_close(gen.logits[0], ref_prefill, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(gen.logits[1], ref_decode, atol=2e-5, rtol=1e-4)


def test_end_to_end_stats_and_fixed_count():
    model, _ = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    with vtc.patch(model, "prunevid", retention=0.25, selected_layer=2) as handle, torch.no_grad():
        model(**inputs)
        stats = handle.stats()
    n = stats.visual_tokens_in
    assert n == 8 * 14 * 14
    counts = stats.layer_visual_tokens
    (plan,) = stats.reports["prunevid"]["plan"]
    assert counts[0] == counts[2] == stats.llm_tokens_in == plan.count < n  # stage 1 merged before the LLM
    (kept,) = stats.reports["prunevid"]["kept"]
    assert counts[3] == counts[-1] == stats.visual_tokens_out == kept
    (record,) = [r for r in stats.stages if r.stage == "connect" and r.plugin == "prunevid"]
    assert (record.tokens_in, record.tokens_out) == (n, plan.count)
    assert stats.visual_tokens_out <= round(0.25 * n)  # per-group floors of alpha = budget / tokens
    assert stats.visual_tokens_out > 0.2 * n
    with vtc.patch(model, "prunevid", retention=0.25, selected_layer=2, fixed_count=True) as handle:
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        assert stats.visual_tokens_out == handle.retained_count((8, 14, 14)) == round(0.25 * n)
        assert stats.reports["prunevid"]["kept"] == [round(0.25 * n)]


def test_reports_follow_videos_and_batch_rows():
    """A padded batch of two prompts: one stage-1 plan per video (video order), one kept count per batch row;
    the next forward's reports hold that forward's values only."""
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "prunevid", retention=0.3, selected_layer=2, fixed_count=True) as handle:
        for inputs, rows in ((batch_inputs("qwen2_vl"), 2), (single_inputs("qwen2_vl"), 1)):
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
            plans = stats.reports["prunevid"]["plan"]
            assert len(plans) == stats.videos == rows
            records = [r for r in stats.stages if r.stage == "connect" and r.plugin == "prunevid"]
            assert [r.tokens_out for r in records] == [p.count for p in plans]
            assert sum(p.count for p in plans) == stats.llm_tokens_in
            kept = stats.reports["prunevid"]["kept"]
            assert kept == [handle.retained_count(grid) for grid in stats.grids]  # one video per row here
            assert sum(kept) == stats.visual_tokens_out


def test_selected_layer_beyond_the_model_is_a_clear_error():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "prunevid", selected_layer=3):
        with pytest.raises(ValueError, match=r"prunevid: selected_layer=3 needs a language model with more than 4"):
            with torch.no_grad():
                model(**single_inputs("qwen2_vl"))
