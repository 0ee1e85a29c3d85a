"""StreamingTOM's CTR: hand-built frames with known answers, a loop transcription of the official
`CTR._compress_single_frame` (YIGE24/StreamingTOM `streamingtom/modules/ctr.py`), the plugin's counts through
`vtc.patch`, and the causal state that carries the previous frame across connect calls."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import grid_tokens, model_and_processor, single_inputs
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context
from vtc_plugins.streamingtom import (
    RECEIVED,
    StreamingTOMCTR,
    classify_static,
    ctr_dpc_centers,
    ctr_frame,
    ctr_plan,
    previous_key,
    split_budget,
)

# --- a loop transcription of the official code --------------------------------------------------------------------


def official_ctr_frame(x, previous, importance, retain, threshold, k, beta, generator, delta_to_denser=False):
    """`_classify_tokens` + `_compress_single_frame` for one frame, with plain loops (distances by the official
    `torch.cdist(...) / sqrt(dim)`, the noise drawn from `generator`)."""
    n, dim = x.shape
    if previous is None:
        static = [False] * n
    else:
        static = []
        for i in range(n):
            a = F.normalize(x[i].float(), p=2, dim=-1)
            b = F.normalize(previous[i].float(), p=2, dim=-1)
            static.append(bool((a * b).sum() > threshold))
    n_static = sum(static)
    g_s = int(retain * n_static / n)
    g_d = retain - g_s
    if g_s > n_static:
        g_s, g_d = n_static, retain - n_static
    if g_d > n - n_static:
        g_d = n - n_static
        g_s = retain - g_d
    out = []  # (position, value)
    static_pos = [i for i in range(n) if static[i]]
    if g_s > 0 and static_pos:
        feats = x[static_pos]
        m = len(static_pos)
        clusters = min(g_s, m)
        dist = torch.cdist(feats.float(), feats.float()) / dim**0.5
        if m <= 1:
            centres = list(range(m))
        else:
            kk = min(k, m - 1)
            density = []
            for i in range(m):
                row = sorted(dist[i].tolist())[:kk]
                density.append(math.exp(-sum(d * d for d in row) / kk))
            noise = torch.rand(m, generator=generator, dtype=torch.float32)
            density = (torch.tensor(density, dtype=torch.float32) + noise * 1e-6).tolist()
            dmax = float(dist.max())
            score = []
            for i in range(m):
                if delta_to_denser:
                    cands = [float(dist[i, j]) for j in range(m) if density[j] > density[i]]
                else:
                    cands = [float(dist[i, j]) for j in range(m) if density[i] > density[j]]
                score.append(density[i] * (min(cands) if cands else dmax))
            centres = sorted(sorted(range(m), key=lambda i: -score[i])[:clusters])
        members = {c: [] for c in centres}
        if clusters < m:
            for i in range(m):
                if i in members:
                    continue
                best = min(centres, key=lambda c: (float(dist[i, c]), centres.index(c)))
                members[best].append(i)
        for c in centres:
            value = feats[c]
            if members[c]:
                value = beta * feats[c] + (1 - beta) * feats[members[c]].mean(dim=0)
            out.append((static_pos[c], value))
    dyn_pos = [i for i in range(n) if not static[i]]
    if g_d > 0 and dyn_pos:
        ranked = sorted(dyn_pos, key=lambda i: -float(importance[i]))[: min(g_d, len(dyn_pos))]
        out += [(i, x[i]) for i in ranked]
    out.sort(key=lambda t: t[0])
    return torch.tensor([p for p, _ in out], dtype=torch.long), torch.stack([v for _, v in out])


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --- hand-built frames -------------------------------------------------------------------------------------------


def test_first_frame_is_all_dynamic_top_g_by_importance():
    x = torch.randn(16, 8, generator=gen(1))
    importance = torch.rand(16, generator=gen(2))
    keep, values = ctr_frame(x, None, importance, retain=5)
    assert keep.tolist() == sorted(torch.topk(importance, 5).indices.tolist())
    assert torch.equal(values, x[keep])
    assert not bool(classify_static(x, None).any())


def test_identical_frames_are_all_static_dpc_centres():
    x = torch.randn(16, 8, generator=gen(3))
    importance = torch.rand(16)
    assert bool(classify_static(x, x.clone()).all())
    keep, values = ctr_frame(x, x.clone(), importance, retain=4, generator=gen(0))
    centres, dist = ctr_dpc_centers(x, 4, 7, gen(0))
    assert keep.tolist() == centres.tolist() and keep.tolist() == sorted(keep.tolist())
    # importance plays no part: any other importance gives the same frame
    keep2, values2 = ctr_frame(x, x.clone(), torch.rand(16), retain=4, generator=gen(0))
    assert torch.equal(keep, keep2) and torch.equal(values, values2)
    # every non-centre joins its nearest centre
    others = [i for i in range(16) if i not in set(keep.tolist())]
    labels = dist[others][:, keep].argmin(dim=1)
    for j, c in enumerate(keep.tolist()):
        members = [others[i] for i in range(len(others)) if labels[i] == j]
        expected = 0.6 * x[c] + 0.4 * x[members].mean(dim=0) if members else x[c]
        torch.testing.assert_close(values[j], expected)


def test_centre_values_on_a_case_computed_by_hand():
    """Four static tokens on a line (second coordinate 1): x = 0, 1, 1.5, 4; G = 2, so G_s = 2, G_d = 0.

    k' = min(7, 4 - 1) = 3 smallest distances (self included); dist = |a - b| / sqrt(2):
      density = exp(-mean(d^2)): x=1 0.812 > x=1.5 0.659 > x=0 0.582 > x=4 0.079.
    Official delta (nearest LOWER density, max 4 / sqrt(2) for the least dense), score density * delta * sqrt(2):
      x=0: 0.582 * 4 = 2.33, x=1.5: 0.659 * 1.5 = 0.99, x=1: 0.812 * 0.5 = 0.41, x=4: 0.079 * 4 = 0.31
      -> centres x=0 and x=1.5; x=1 (0.5 from 1.5) and x=4 (2.5 from 1.5) join x=1.5:
      values 0 and 0.6 * 1.5 + 0.4 * (1 + 4) / 2 = 1.9.
    Textbook delta (nearest DENSER point, max for the densest): x=1: 0.812 * 4 = 3.25, x=0: 0.582 * 1 = 0.58,
      x=1.5: 0.659 * 0.5 = 0.33, x=4: 0.079 * 2.5 = 0.20 -> centres x=0 and x=1; x=1.5 and x=4 join x=1:
      values 0 and 0.6 * 1 + 0.4 * (1.5 + 4) / 2 = 1.7."""
    x = torch.tensor([[0.0, 1.0], [1.0, 1.0], [1.5, 1.0], [4.0, 1.0]])
    importance = torch.tensor([9.0, 8.0, 7.0, 6.0])
    assert split_budget(2, 4, 4) == (2, 0)
    keep, values = ctr_frame(x, x.clone(), importance, retain=2, generator=gen(0))
    assert keep.tolist() == [0, 2]
    torch.testing.assert_close(values, torch.tensor([[0.0, 1.0], [1.9, 1.0]]))
    keep, values = ctr_frame(x, x.clone(), importance, retain=2, generator=gen(0), delta_to_denser=True)
    assert keep.tolist() == [0, 1]
    torch.testing.assert_close(values, torch.tensor([[0.0, 1.0], [1.7, 1.0]]))
    # the linear form of the plan gives the same features (what side features follow)
    plan = ctr_plan(x, torch.ones(4, dtype=torch.bool), importance, 2, generator=gen(0))
    linear = plan.keep_weight[:, None] * x[plan.keep]
    linear = linear.index_add(0, plan.dst, plan.src_weight[:, None] * x[plan.src])
    torch.testing.assert_close(linear, plan.values)
    assert plan.keep_weight.tolist() == pytest.approx([1.0, 0.6]) and plan.src.tolist() == [1, 3]


def test_threshold_boundary_equal_is_dynamic():
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor([[9.0, math.sqrt(19.0)], [1.0, 0.05], [0.0, -1.0]])  # cos exactly float32(0.9); ~0.9988; -1
    cos = (F.normalize(a) * F.normalize(b)).sum(-1)
    assert float(cos[0]) == float(torch.tensor(0.9))
    assert classify_static(a, b, 0.9).tolist() == [False, True, False]
    assert classify_static(a, b, 0.899).tolist() == [True, True, False]
    with pytest.raises(ValueError, match="share the token grid"):
        classify_static(a, b[:2])


def test_budget_split():
    assert split_budget(50, 98, 196) == (25, 25)
    assert split_budget(50, 195, 196) == (49, 1)  # int(49.74)
    assert split_budget(50, 190, 196) == (48, 2)  # int(48.47)
    assert split_budget(50, 0, 196) == (0, 50)
    assert split_budget(50, 196, 196) == (50, 0)
    assert split_budget(10, 3, 12) == (2, 8)
    assert split_budget(7, 9, 10) == (6, 1)  # int(6.3)
    # with G <= N the official clamps never fire: G_s <= n_static and G_d <= n_dynamic, always G in total
    for n in range(1, 31):
        for g in range(1, n + 1):
            for n_static in range(n + 1):
                g_s, g_d = split_budget(g, n_static, n)
                assert g_s == int(g * n_static / n) and g_s + g_d == g
                assert 0 <= g_s <= n_static and 0 <= g_d <= n - n_static


@pytest.mark.parametrize("seed", range(8))
def test_count_order_and_the_official_loop_on_random_frames(seed):
    g = gen(seed)
    n, dim = (16, 36)[seed % 2], 12
    x = torch.randn(n, dim, generator=g)
    previous = torch.randn(n, dim, generator=g)
    still = torch.rand(n, generator=g) < (0.2 + 0.1 * seed)
    previous[still] = x[still] + 0.05 * torch.randn(int(still.sum()), dim, generator=g)
    if seed == 7:
        x[3] = x[5]  # duplicate tokens: equal distances
    importance = torch.rand(n, generator=g)
    for retain in (1, 5, n // 2, n - 1, n):
        for delta_to_denser in (False, True):
            keep, values = ctr_frame(
                x, previous, importance, retain, generator=gen(99), delta_to_denser=delta_to_denser
            )
            assert keep.numel() == retain == values.shape[0]
            assert keep.tolist() == sorted(set(keep.tolist()))
            ref_keep, ref_values = official_ctr_frame(
                x, previous, importance, retain, 0.9, 7, 0.6, gen(99), delta_to_denser
            )
            assert keep.tolist() == ref_keep.tolist(), (retain, delta_to_denser)
            torch.testing.assert_close(values, ref_values)
    # G = N keeps the frame as it is
    keep, values = ctr_frame(x, previous, importance, n)
    assert keep.tolist() == list(range(n)) and torch.equal(values, x)
    # G > N is clamped to N
    assert ctr_frame(x, None, importance, n + 5)[0].numel() == n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_dtypes(dtype):
    """Distances and cosines in float32, the merge in the features' dtype (as the official code)."""
    x = torch.randn(20, 8, generator=gen(4)).to(dtype)
    previous = x.clone()
    previous[:6] = torch.randn(6, 8, generator=gen(5)).to(dtype)
    importance = torch.rand(20, generator=gen(6))
    keep, values = ctr_frame(x, previous, importance, 6, generator=gen(0))
    assert values.dtype == dtype and keep.numel() == 6
    ref_keep, ref_values = official_ctr_frame(x, previous, importance, 6, 0.9, 7, 0.6, gen(0))
    assert keep.tolist() == ref_keep.tolist()
    torch.testing.assert_close(values, ref_values)  # bf16: the member mean may differ by one rounding


def test_few_static_tokens():
    """One static token (no clustering, no noise drawn), two (k' = 1: density from the self distance only)."""
    x = torch.randn(6, 4, generator=gen(7))
    previous = -x.clone()
    previous[2] = x[2]
    keep, values = ctr_frame(x, previous, torch.arange(6.0), 6, generator=gen(0))
    assert keep.tolist() == list(range(6))
    keep, values = ctr_frame(x, previous, torch.arange(6.0), 3)  # G_s = int(3 / 6) = 0
    assert keep.tolist() == [3, 4, 5]
    previous[4] = x[4]
    keep, values = ctr_frame(x, previous, torch.arange(6.0), 5, generator=gen(0))  # G_s = int(5 * 2 / 6) = 1
    ref_keep, ref_values = official_ctr_frame(x, previous, torch.arange(6.0), 5, 0.9, 7, 0.6, gen(0))
    assert keep.tolist() == ref_keep.tolist()
    torch.testing.assert_close(values, ref_values)


# --- the plugin ---------------------------------------------------------------------------------------------------


def context(attn, state=None, video_index=0, generator=None):
    return Context(
        family="qwen2_vl",
        geometry=default_geometry("qwen2_vl"),
        vision={RECEIVED: attn},
        generator=generator if generator is not None else gen(0),
        state=state if state is not None else {},
        video_index=video_index,
    )


def streaming_video(t=4, h=3, w=4, dim=8, seed=0):
    g = gen(seed)
    embeds = torch.randn(t, h * w, dim, generator=g)
    for f in range(1, t):  # half of each frame's positions barely move
        embeds[f, : h * w // 2] = embeds[f - 1, : h * w // 2] + 0.01 * torch.randn(h * w // 2, dim, generator=g)
    attn = torch.rand(t, h * w, generator=g)
    return embeds, attn


def test_connect_matches_ctr_frame_per_frame_and_merges_linearly():
    t, h, w = 4, 3, 4
    embeds, attn = streaming_video(t, h, w)
    extra = torch.randn(t * h * w, 3)
    tokens = grid_tokens(embeds.reshape(-1, 8), (t, h, w), mrope=True)
    tokens.extras["side"] = extra
    plugin = StreamingTOMCTR().bind(0.5)
    ctx = context(attn)
    out = plugin.connect(tokens, ctx)
    assert len(out) == plugin.retained_count(len(tokens), (t, h, w), "qwen2_vl") == t * 6
    assert ctx.reports["static"] == [[0, 6, 6, 6]]
    g = gen(0)
    previous = None
    for f in range(t):
        keep, values = ctr_frame(embeds[f], previous, attn[f], 6, generator=g)
        rows = slice(6 * f, 6 * (f + 1))
        assert torch.equal(out.frame[rows], torch.full((6,), f)) and torch.equal(out.patch[rows], keep)
        torch.testing.assert_close(out.embeds[rows], values)
        previous = embeds[f]
    # positions ascend (frames, then spatial order); weights count the merged tokens
    flat = out.frame * h * w + out.patch
    assert flat.tolist() == sorted(flat.tolist())
    # weights: a centre stands for itself and its members, a dynamic token for itself (the others are pruned)
    merged = 3 * (t - 1)  # frames 1..3: 6 static tokens, G_s = int(6 * 6 / 12) = 3 centres + 3 members
    assert float(out.weight.sum()) == len(out) + merged and int(out.weight.max()) <= 1 + 3
    # side features follow the same linear map: an identity-featured side channel reproduces the embeds' map
    tokens2 = grid_tokens(embeds.reshape(-1, 8), (t, h, w), mrope=True)
    tokens2.extras["side"] = embeds.reshape(-1, 8).clone()
    out2 = plugin.connect(tokens2, context(attn))
    torch.testing.assert_close(out2.extras["side"], out2.embeds)
    assert out.extras["side"].shape == (t * 6, 3)


def test_previous_frame_carries_across_calls():
    """Two consecutive chunks of one video with one ctx.state (and one generator) give exactly the one-call result;
    a fresh state makes the chunk's first frame all dynamic; another video's state is kept apart."""
    t, h, w = 4, 3, 4
    embeds, attn = streaming_video(t, h, w, seed=1)
    plugin = StreamingTOMCTR(retain_tokens=5).bind(None)
    whole = plugin.connect(grid_tokens(embeds.reshape(-1, 8), (t, h, w)), context(attn, generator=gen(3)))
    state, g = {}, gen(3)
    outs = []
    for chunk in (slice(0, 2), slice(2, 4)):
        tokens = grid_tokens(embeds[chunk].reshape(-1, 8), (2, h, w))
        ctx = context(attn[chunk], state=state, generator=g)
        outs.append(plugin.connect(tokens, ctx))
        assert torch.equal(state[previous_key(0)], embeds[chunk][-1])  # the original last frame, not its output
    assert torch.equal(torch.cat([o.embeds for o in outs]), whole.embeds)
    assert torch.equal(torch.cat([o.patch for o in outs]), whole.patch)
    # the second chunk alone, with a fresh state: its first frame has no previous frame
    fresh = context(attn[2:], generator=gen(3))
    alone = plugin.connect(grid_tokens(embeds[2:].reshape(-1, 8), (2, h, w)), fresh)
    keep, _ = ctr_frame(embeds[2], None, attn[2], 5)
    assert alone.patch[:5].tolist() == keep.tolist()
    assert fresh.reports["static"] == [[0, 6]] and not torch.equal(alone.embeds, outs[1].embeds)
    # another video of the same prompt (video_index 1) does not see video 0's last frame
    other = context(attn[2:], state=state, video_index=1, generator=gen(3))
    again = plugin.connect(grid_tokens(embeds[2:].reshape(-1, 8), (2, h, w)), other)
    assert torch.equal(again.embeds, alone.embeds) and set(state) == {previous_key(0), previous_key(1)}


def test_identity_and_whole_frames():
    t, h, w = 3, 2, 3
    embeds, attn = streaming_video(t, h, w)
    tokens = grid_tokens(embeds.reshape(-1, 8), (t, h, w))
    full = StreamingTOMCTR().bind(1.0)
    assert full.vision_stats("qwen2_vl") == [] and full.connect(tokens, Context()) is tokens
    big = StreamingTOMCTR(retain_tokens=50).bind(None)  # 50 > 6 tokens per frame: clamped
    assert big.retained_count(18, (t, h, w), "llava_onevision") == 18
    assert big.connect(tokens, context(attn)) is tokens
    plugin = StreamingTOMCTR().bind(0.5)
    assert plugin.vision_stats("llava_onevision") == [RECEIVED]
    with pytest.raises(ValueError, match="streamingtom-ctr needs whole frames"):
        plugin.connect(tokens.select(torch.arange(1, t * h * w)), context(attn))
    with pytest.raises(RuntimeError, match="attention was not captured"):
        plugin.connect(tokens, Context(geometry=default_geometry("qwen2_vl")))


def test_params_and_counts():
    p = StreamingTOMCTR()
    assert (p.retain_tokens, p.similarity_threshold, p.k, p.beta, p.delta_to_denser) == (None, 0.9, 7, 0.6, False)
    assert p.bind(None).retained_count(8 * 196, (8, 14, 14), "llava_onevision") == 8 * 50
    assert p.bind(0.25).retained_count(8 * 196, (8, 14, 14), "llava_onevision") == 8 * 49
    assert p.bind(0.1).retained_count(4 * 25, (4, 5, 5), "qwen2_vl") == 4 * 2  # round(2.5) = 2
    assert p.bind(0.001).retained_count(4 * 25, (4, 5, 5), "qwen2_vl") == 4  # at least one per frame
    explicit = StreamingTOMCTR(retain_tokens=7).bind(0.5)
    assert explicit.retained_count(8 * 196, (8, 14, 14), "qwen2_vl") == 56 and not explicit.identity
    for bad, match in (
        ({"retain_tokens": 0}, "retain_tokens"),
        ({"retain_tokens": 2.5}, "retain_tokens"),
        ({"similarity_threshold": 1.5}, "similarity_threshold"),
        ({"k": 0}, "k must be in \\[1, inf\\)"),
        ({"beta": -0.1}, "beta"),
    ):
        with pytest.raises(ValueError, match=match):
            StreamingTOMCTR(**bad)


def test_method_info():
    cls = vtc.registry()["streamingtom-ctr"]
    info = cls.card
    assert info.stages == ("connect",) and info.fixed_count and info.fixed_count_mode == "always"
    assert info.vision_stats and info.whole_frames and not info.query_aware
    assert info.positions == "compact" and info.url == "https://arxiv.org/abs/2510.18269"
    assert cls.testing.exemptions == {}
    assert info.streams and not info.stream_memory and info.owns == frozenset()
    full = vtc.registry()["streamingtom"].card  # CTR plus OQM, the stream's memory
    assert full.stages == ("connect",) and full.stream_memory and full.stream_only and full.streams
    assert full.owns == frozenset({"stream_memory"}) and full.fixed_count_mode == "always" and full.vision_stats


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_vl"])
def test_patched_model_keeps_g_per_frame(family):
    model, _ = model_and_processor(family)
    with vtc.patch(model, "streamingtom-ctr", retention=0.25) as handle:
        with torch.no_grad():
            model(**single_inputs(family))
        stats = handle.stats()
    (grid,) = stats.grids
    t, h, w = grid
    assert stats.llm_tokens_in == handle.retained_count(grid) == t * round(0.25 * h * w) < stats.visual_tokens_in
    (static,) = stats.reports["streamingtom-ctr"]["static"]
    assert len(static) == t and static[0] == 0  # the first frame has no previous frame
