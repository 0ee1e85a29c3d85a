"""VidCom²: per-frame budgets and token choices on hand-built videos whose answer is known, the pure function
against a loop re-derivation of the official `vidcom2_compression`, the fixed-count mode, and the patched
model end to end (the LLM receives exactly the tokens the pure function picks)."""

from __future__ import annotations

import math

import pytest
import torch

import vtc
from tests.conftest import batch_inputs, model_and_processor, single_inputs
from tests.probes import llm_inputs
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context, VideoTokens, frame_groups
from vtc_plugins.vidcom2 import (
    ALPHAS,
    VidCom2,
    fixed_target,
    frame_budgets,
    frame_scales,
    low_variance_channels,
    vidcom2_plan,
)


def make_tokens(embeds: torch.Tensor, frame: torch.Tensor, grid) -> VideoTokens:
    n = embeds.shape[0]
    zeros = torch.zeros(n, dtype=torch.long)
    return VideoTokens(
        embeds=embeds,
        positions=torch.arange(n),
        frame=frame,
        row=zeros,
        col=zeros,
        weight=torch.ones(n),
        grid=grid,
    )


def official_reference(x: torch.Tensor, tpf: int, base: float) -> tuple[list[int], list[int]]:
    """A loop re-derivation of the official `vidcom2_compression` (linear mapper, equal frames of `tpf` tokens):
    returns (global kept indices, per-frame budgets)."""
    n, d = x.shape
    var = [((x[:, c] - x[:, c].mean()) ** 2).mean() for c in range(d)]
    channels = sorted(range(d), key=lambda c: float(var[c]))[: int(d * 0.5)]
    frames = torch.nn.functional.normalize(x[:, channels].view(-1, tpf, len(channels)), dim=-1)
    num_frames = frames.shape[0]
    video_centre = frames.reshape(-1, len(channels)).sum(0) / n
    v = torch.zeros(num_frames, tpf, dtype=x.dtype)
    fm = torch.zeros(num_frames, tpf, dtype=x.dtype)
    for f in range(num_frames):
        frame_centre = frames[f].sum(0) / tpf
        for i in range(tpf):
            dv = float(((frames[f, i] - video_centre) ** 2).sum())
            df = float(((frames[f, i] - frame_centre) ** 2).sum())
            v[f, i] = sum(math.exp(-dv / (2 * a)) for a in [2**k for k in range(-3, 2)])
            fm[f, i] = sum(math.exp(-df / (2 * a)) for a in [2**k for k in range(-3, 2)])
    u = [-float(v[f].mean()) for f in range(num_frames)]
    exps = [math.exp((uf - max(u)) / 0.01) for uf in u]
    probs = [e / sum(exps) for e in exps]
    mean_p = sum(probs) / num_frames
    budgets = [max(1, round(min(1.0, base * (1 + p - mean_p)) * tpf)) for p in probs]
    keep = []
    for f, k in enumerate(budgets):
        score = (v[f] + fm[f]).tolist()
        local = sorted(sorted(range(tpf), key=lambda i: score[i])[:k])
        keep += [f * tpf + i for i in local]
    return keep, budgets


def outlier_video(frames: int = 8, tokens: int = 20, odd: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Channels 0-1: large, irrelevant token noise (high variance, dropped by the channel selection);
    channels 2-3: every frame points along (1, 0), frame `odd` along (0, 1)."""
    g = torch.Generator().manual_seed(0)
    n = frames * tokens
    x = torch.zeros(n, 4, dtype=torch.float64)
    x[:, :2] = 10 * torch.randn(n, 2, generator=g, dtype=torch.float64)
    frame = torch.arange(n) // tokens
    x[:, 2] = torch.where(frame == odd, 0.0, 1.0)
    x[:, 3] = torch.where(frame == odd, 1.0, 0.0)
    x[:, 2:] += 0.01 * torch.randn(n, 2, generator=g, dtype=torch.float64)
    return x, frame


def test_defaults_match_the_official_code():
    p = VidCom2()
    assert p.ratio is None and p.channel_ratio == 0.5 and p.temperature == 0.01
    assert p.alphas == ALPHAS == tuple(2.0**k for k in range(-3, 2))
    assert p.fixed_count is False and p.compute_dtype is None
    cls = vtc.registry()["vidcom2"]
    card = cls.card
    assert card.stages == ("connect",) and card.positions == "compact" and card.fixed_count
    assert card.fixed_count_mode == "optional" and not card.query_aware
    # post-projector features only: no tower statistics, no pre-pool features, works on thinned frames
    assert not card.vision_stats and not card.prepool and not card.whole_frames
    assert card.retention_reference == "llm_input"
    assert cls().bind(None).fraction() == 0.25  # R_RATIO default


def test_retention_maps_to_r_and_explicit_ratio_wins():
    assert VidCom2().bind(0.15).fraction() == 0.15
    assert VidCom2(ratio=0.4).bind(0.15).fraction() == 0.4
    with pytest.raises(ValueError, match="ratio must be in"):
        VidCom2(ratio=0.0)
    with pytest.raises(ValueError, match="compute_dtype"):
        VidCom2(compute_dtype="int8")


def test_frame_groups_keep_each_frames_current_order():
    """VidCom² groups tokens by `tokens.frame` with `vtc.core.tokens.frame_groups` (its own copy moved there):
    frames ascending, indices within a frame in the tokens' current order (ascending) when no patch is given."""
    frame = torch.tensor([2, 0, 2, 0, 1, 2])
    assert [g.tolist() for g in frame_groups(frame)] == [[1, 3], [4], [0, 2, 5]]
    patch = torch.tensor([0, 3, 1, 0, 0, 2])  # spatial order within a frame, with tokens_per_frame = H * W = 4
    assert [g.tolist() for g in frame_groups(frame, patch, 4)] == [[3, 1], [4], [0, 2, 5]]
    assert [g.tolist() for g in vidcom2_plan(torch.randn(6, 4), frame, ratio=0.5).frames] == [[1, 3], [4], [0, 2, 5]]


def test_low_variance_half_of_the_channels():
    x = torch.tensor([[0.0, 5.0, 1.0, -3.0], [0.1, -5.0, 1.0, 3.0], [0.2, 5.0, 1.0, -3.0]])
    assert sorted(low_variance_channels(x).tolist()) == [0, 2]


def test_outlier_frame_gets_the_largest_budget():
    x, frame = outlier_video()
    plan = vidcom2_plan(x, frame, ratio=0.25)
    # p = one-hot on frame 5 (temperature 0.01), mean p = 1/8: s = 0.25 * 7/8 -> round(4.375) = 4 tokens,
    # frame 5: 0.25 * 15/8 -> round(9.375) = 9 tokens
    assert plan.budgets == [4, 4, 4, 4, 4, 9, 4, 4]
    assert plan.keep.numel() == sum(plan.budgets) == 37


def test_frame_scales_and_budgets():
    scales = frame_scales(torch.tensor([0.0, -1.0, -1.0, -1.0]), 0.5)
    assert torch.allclose(scales, torch.tensor([0.875, 0.375, 0.375, 0.375]))
    assert frame_scales(torch.tensor([0.0, -1.0]), 0.9).tolist()[0] == 1.0  # clamped at 1
    # round half to even, at least one token, t_f per frame
    assert frame_budgets(torch.tensor([0.125, 0.375, 0.01]), [20, 20, 20]).tolist() == [2, 8, 1]
    assert frame_budgets(torch.tensor([0.5, 0.5]), [7, 10]).tolist() == [4, 5]
    # bf16: 1.0 * 731 rounds to 732; never more than the frame holds
    assert frame_budgets(torch.tensor([1.0, 0.5], dtype=torch.bfloat16), [731, 731]).tolist() == [731, 366]


def test_keeps_the_tokens_least_like_both_centres():
    # one frame of 8 tokens: 6 alike, tokens 3 and 6 point elsewhere; one frame -> s = R -> k = round(8 R) = 2
    x = torch.zeros(8, 4)
    x[:, 0] = torch.tensor([5.0, -5.0] * 4)
    x[:, 1] = torch.tensor([-5.0, 5.0] * 4)
    x[:, 2] = 1.0
    x[3, 2:] = torch.tensor([0.0, 1.0])
    x[6, 2:] = torch.tensor([0.6, -0.8])
    plan = vidcom2_plan(x, torch.zeros(8, dtype=torch.long), ratio=0.25)
    assert plan.budgets == [2]
    assert plan.keep.tolist() == [3, 6]
    assert bool((plan.scores[[3, 6]].max() < plan.scores[[0, 1, 2, 4, 5, 7]].min()))


@pytest.mark.parametrize("seed,ratio,frames,tpf", [(0, 0.25, 6, 12), (1, 0.15, 4, 25), (2, 0.5, 3, 16)])
def test_matches_a_loop_rederivation_of_the_official_code(seed, ratio, frames, tpf):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(frames * tpf, 10, generator=g, dtype=torch.float64)
    x[: 2 * tpf] += 1.5  # two frames unlike the rest
    keep, budgets = official_reference(x, tpf, ratio)
    plan = vidcom2_plan(x, torch.arange(frames * tpf) // tpf, ratio=ratio)
    assert plan.budgets == budgets
    assert plan.keep.tolist() == keep


def test_total_is_close_to_r_n_and_kept_tokens_are_the_lowest_scores_per_frame():
    g = torch.Generator().manual_seed(3)
    frames, tpf, ratio = 8, 49, 0.25
    x = torch.randn(frames * tpf, 16, generator=g)
    frame = torch.arange(frames * tpf) // tpf
    plan = vidcom2_plan(x, frame, ratio=ratio)
    assert abs(plan.keep.numel() - ratio * frames * tpf) <= frames / 2  # mean s_f = R; rounding only
    kept = torch.zeros(frames * tpf, dtype=torch.bool)
    kept[plan.keep] = True
    for f in range(frames):
        idx = torch.nonzero(frame == f).flatten()
        assert int(kept[idx].sum()) == plan.budgets[f]
        assert plan.scores[idx][kept[idx]].max() <= plan.scores[idx][~kept[idx]].min()
    assert bool((plan.keep[1:] > plan.keep[:-1]).all())


def test_thinned_video_groups_by_frame_and_uses_each_frames_count():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 8, generator=g, dtype=torch.float64)
    x[:30] += 2.0  # frames 0 and 1 point the same way, the last frame present (random directions) is unlike them
    frame = torch.tensor([0] * 10 + [1] * 20 + [3] * 10)  # frame 2 already removed by an earlier plugin
    plan = vidcom2_plan(x, frame, ratio=0.5)
    assert [idx.tolist() for idx in plan.frames] == [list(range(10)), list(range(10, 30)), list(range(30, 40))]
    # re-derive: video centre over all 40 tokens, uniqueness = -mean video score of each frame's own tokens
    xn = torch.nn.functional.normalize(x[:, low_variance_channels(x)], dim=-1)
    centre = xn.mean(0)
    v = sum(torch.exp(-((xn - centre) ** 2).sum(-1) / (2 * a)) for a in ALPHAS)
    u = torch.stack([-v[:10].mean(), -v[10:30].mean(), -v[30:].mean()])
    p = torch.softmax((u - u.max()) / 0.01, 0)
    s = (0.5 * (1 + p - p.mean())).clamp(max=1.0)
    assert plan.budgets == [max(1, round(float(s[i]) * t)) for i, t in enumerate([10, 20, 10])]
    assert plan.budgets[2] == 8  # p ~ one-hot: round(0.5 * (2 - 1/3) * 10)
    assert sum(plan.budgets) == plan.keep.numel()


def test_fixed_count_mode_is_exact_and_reconciles_by_score():
    g = torch.Generator().manual_seed(5)
    frames, tpf = 8, 30
    n = frames * tpf
    x = torch.randn(n, 12, generator=g)
    x[:tpf] *= 3.0
    frame = torch.arange(n) // tpf
    for ratio in (0.25, 0.15, 0.33, 0.01):
        target = fixed_target(n, frames, ratio)
        assert target == max(frames, min(int(n * ratio), n))
        free = vidcom2_plan(x, frame, ratio=ratio)
        fixed = vidcom2_plan(x, frame, ratio=ratio, target=target)
        assert fixed.keep.numel() == target
        a, b = set(free.keep.tolist()), set(fixed.keep.tolist())
        if len(a) >= len(b):  # the highest-scored of the adaptive choice are dropped
            assert b <= a and all(free.scores[i] >= free.scores[list(b)].max() for i in a - b)
        else:  # the lowest-scored of the rest are added
            assert a <= b and all(free.scores[i] <= free.scores[list(set(range(n)) - b)].min() for i in b - a)
    plugin = VidCom2(fixed_count=True).bind(0.25)
    assert plugin.retained_count(1568, (8, 14, 14), "llava_onevision") == 392
    assert plugin.retained_count(1568, (8, 14, 14), "qwen2_vl") == 392  # the same on every family
    assert plugin.retained_count(100, (8, 5, 5), "llava_next_video") == 25
    one_per_frame = VidCom2(fixed_count=True).bind(0.01)
    assert one_per_frame.retained_count(200, (8, 5, 5), "llava_next_video") == 8
    assert VidCom2().bind(0.25).retained_count(1568, (8, 14, 14), "llava_onevision") is None  # adaptive
    assert VidCom2().bind(1.0).retained_count(1568, (8, 14, 14), "llava_onevision") == 1568


def _ctx(retention=None):
    family = "llava_next_video"
    return Context(retention=retention, family=family, geometry=default_geometry(family))


def test_plugin_identity_budgets_and_dtype():
    x, frame = outlier_video()
    tokens = make_tokens(x.float(), frame, (8, 4, 5))
    ctx = _ctx(1.0)
    assert VidCom2().bind(1.0).connect(tokens, ctx) is tokens
    assert ctx.reports == {"budgets": [[20] * 8]}  # ratio 1: every frame keeps its token count, no plan
    plugin = VidCom2().bind(0.25)
    ctx = _ctx()
    out = plugin.connect(tokens, ctx)
    (plan,) = ctx.reports["plan"]
    assert len(out) == 37 == plan.keep.numel() and ctx.reports["budgets"] == [[4, 4, 4, 4, 4, 9, 4, 4]]
    assert plan.budgets == ctx.reports["budgets"][0]
    assert torch.equal(out.embeds, x.float()[plan.keep])
    fixed = VidCom2(fixed_count=True).bind(0.25)
    ctx = _ctx()
    assert len(fixed.connect(tokens, ctx)) == fixed.retained_count(160, (8, 4, 5), ctx.family) == 40
    assert ctx.reports["budgets"] == [[4, 4, 4, 4, 4, 9, 4, 4]]  # k_f before the reconciliation to 40
    assert ctx.reports["plan"][0].keep.numel() == 40
    half = make_tokens(x.bfloat16(), frame, (8, 4, 5))
    ctx = _ctx()
    plugin.connect(half, ctx)
    assert ctx.reports["plan"][0].scores.dtype == torch.bfloat16  # the official code scores in the model dtype
    up = VidCom2(compute_dtype="float32").bind(0.25)
    ctx = _ctx()
    up.connect(half, ctx)
    assert ctx.reports["plan"][0].scores.dtype == torch.float32


def test_patched_llava_next_video_sees_the_chosen_tokens_renumbered():
    model, _ = model_and_processor("llava_next_video")
    inputs = single_inputs("llava_next_video")
    full, _, _ = llm_inputs(model, inputs)
    video = inputs["input_ids"][0] == vtc.api.resolve_adapter(model).video_token_id
    slots = torch.nonzero(video).flatten()
    assert slots.numel() == 8 * 12 * 12
    plan = vidcom2_plan(full[slots], torch.arange(slots.numel()) // 144, ratio=0.25)
    keep = torch.sort(torch.cat([torch.nonzero(~video).flatten(), slots[plan.keep]])).values
    out, positions, handle = llm_inputs(model, inputs, "vidcom2", retention=0.25)
    stats = handle.stats()
    assert stats.visual_tokens_out == plan.keep.numel() == sum(plan.budgets)
    assert abs(stats.visual_tokens_out - 0.25 * 1152) <= 4
    assert torch.equal(out, full[keep])
    assert torch.equal(positions.flatten(), torch.arange(keep.numel()))  # LLaVA: contiguous, as the official code


def test_patched_qwen2_vl_fixed_count():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with vtc.patch(model, "vidcom2", retention=0.25, fixed_count=True) as handle:
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        assert stats.grids == [(4, 12, 12)]
        assert stats.visual_tokens_out == handle.retained_count((4, 12, 12)) == 144


def test_reports_cover_every_video_of_the_last_forward():
    """One budgets list (and plan) per video, in video order, for the last forward only; in the adaptive mode each
    video keeps exactly sum(k_f), over as many frames as its grid has."""
    model, _ = model_and_processor("qwen2_5_vl")
    with vtc.patch(model, "vidcom2", retention=0.3) as handle:
        for inputs, videos in ((batch_inputs("qwen2_5_vl"), 2), (single_inputs("qwen2_5_vl"), 1)):
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
            budgets = stats.reports["vidcom2"]["budgets"]
            plans = stats.reports["vidcom2"]["plan"]
            connect = [s for s in stats.stages if s.stage == "connect"]
            assert len(budgets) == len(plans) == len(connect) == stats.videos == videos
            assert [len(b) for b in budgets] == [t for t, _, _ in stats.grids]
            assert [s.tokens_in for s in connect] == [t * h * w for t, h, w in stats.grids]
            assert [s.tokens_out for s in connect] == [sum(b) for b in budgets] == [p.keep.numel() for p in plans]
            assert sum(map(sum, budgets)) == stats.llm_tokens_in == stats.visual_tokens_out < stats.visual_tokens_in
    with vtc.patch(model, "vidcom2", retention=1.0) as handle:  # ratio 1: the per-frame token counts, no plan
        with torch.no_grad():
            model(**single_inputs("qwen2_5_vl"))
        stats = handle.stats()
        assert stats.reports["vidcom2"] == {"budgets": [[h * w] * t for t, h, w in stats.grids]}
        assert stats.visual_tokens_out == stats.visual_tokens_in
