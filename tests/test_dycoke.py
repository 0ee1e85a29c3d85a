"""DyCoke: TTM on hand-built frames whose answer is known (least-similar tokens in ascending-similarity order,
each pair ranked by its own similarity (latest official commit) or by the previous pair's (first commit,
`shifted_pairs=True`), the group-of-4 pass and its loop bound, the odd last frame), TTM against a re-derivation
of the official `dycole_ttm` in its own structure (both commits), the retention -> per-frame count mapping
(and its floor), the decode-time KV pruning rule, and the patched model end to end: the LLM receives exactly
the TTM selection (renumbered on LLaVA), its count is the promised `retained_count`, and decode steps match a
layer-by-layer reference in which layers >= L of each step see the pruned cache (or the full one when the
attention is stable, the official quirk)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import FAMILIES, batch_inputs, grid_tokens, model_and_processor, single_inputs
from tests.probes import llm_inputs
from tests.reference import CAPTURED, ManualLLM, compressible_video_mask, start
from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context, TokenLayout, VideoTokens
from vtc_plugins.dycoke import (
    DecodeStep,
    DyCoke,
    DyCokeTTM,
    image_span,
    kv_prune,
    merging_ratio_for,
    ttm_frame_counts,
    ttm_keep,
    ttm_roles,
    ttm_select,
)


def rotated(angles) -> torch.Tensor:
    """Unit 2-D tokens at the given angles: cos(a_j - 0) is their similarity with a frame of (1, 0) tokens."""
    a = torch.tensor(angles, dtype=torch.float64)
    return torch.stack([torch.cos(a), torch.sin(a)], dim=-1)


def reference_frame(n: int) -> torch.Tensor:
    return rotated([0.0] * n)


# --- TTM on hand-built frames ---------------------------------------------------------------------------------


def test_pair_keeps_the_least_similar_tokens_in_ascending_similarity_order():
    # frame 1's token j has similarity cos(angle_j) with frame 0: order of similarity 3 < 0 < 4 < 1 < 5 < 2
    angles = [1.0, 0.4, 0.1, 1.3, 0.7, 0.2]
    x = torch.stack([reference_frame(6), rotated(angles)])
    kept = ttm_keep(x, k=0.5)  # keep int(0.5 * 6) = 3 of frame 1
    assert kept[0].tolist() == [0, 1, 2, 3, 4, 5]  # frame 0 in full, spatial order
    assert kept[1].tolist() == [3, 0, 4]  # least similar first: NOT spatial order (official quirk)


def test_identical_pairs_keep_n_tokens_and_count_uses_int():
    x = torch.randn(2, 10, 4, dtype=torch.float64)
    x[1] = x[0] * 2.0  # identical directions: every similarity is 1
    kept = ttm_keep(x, k=0.7)
    assert kept[1].numel() == int((1 - 0.7) * 10) == 3  # the official arithmetic: int((1 - k) * N)
    assert ttm_frame_counts(2, 196, 0.7) == [196, 58]  # int(0.3 * 196) = int(58.8)


def two_pairs_with_opposite_profiles() -> torch.Tensor:
    """4 frames: pair (0, 1)'s own similarity ranks token 3 then 2 least similar, pair (2, 3)'s token 0 then 1."""
    a_angles = [0.1, 0.2, 0.3, 1.4]  # pair (0,1): least similar = token 3, then 2
    b_angles = [1.4, 0.3, 0.2, 0.1]  # pair (2,3): least similar = token 0, then 1
    return torch.stack([reference_frame(4), rotated(a_angles), reference_frame(4), rotated(b_angles)])


def test_each_pair_is_ranked_by_its_own_similarity_by_default():
    # latest official commit (35cc532 "Update ttm code"): `similarities[i // 2]`, pair p by its own similarity
    assert DyCoke().shifted_pairs is False
    x = two_pairs_with_opposite_profiles()
    own = ttm_keep(x, k=0.5)
    assert own[1].tolist() == [3, 2]  # ranked by pair (0, 1)
    assert own[3].tolist() == [0, 1]  # ranked by pair (2, 3)
    assert torch.equal(torch.cat(ttm_keep(x, k=0.5, shifted_pairs=False)), torch.cat(own))
    assert own[0].tolist() == own[2].tolist() == [0, 1, 2, 3]  # the first frame of each pair stays whole


def test_shifted_pairs_reproduces_the_first_commit():
    # first commit (26dc6f4): `similarities[(i - 2) // 2]` ranks frame 1 by pair (2, 3)'s similarity (Python's
    # index -1, the last pair) and frame 3 by pair (0, 1)'s
    x = two_pairs_with_opposite_profiles()
    shifted = ttm_keep(x, k=0.5, shifted_pairs=True)
    assert shifted[1].tolist() == [0, 1]  # ranked by pair (2, 3)
    assert shifted[3].tolist() == [3, 2]  # ranked by pair (0, 1)
    # three pairs: pair p by pair p - 1 (pair 0 by the last one)
    angles = ([0.1, 0.2, 0.3, 1.4], [1.4, 0.3, 0.2, 0.1], [0.2, 1.4, 0.1, 0.3])  # least similar: 3, 0, 1
    frames = []
    for a in angles:
        frames += [reference_frame(4), rotated(a)]
    x = torch.stack(frames)
    assert [t[0] for t in map(torch.Tensor.tolist, ttm_keep(x, k=0.75)[1::2])] == [3, 0, 1]
    assert [t[0] for t in map(torch.Tensor.tolist, ttm_keep(x, k=0.75, shifted_pairs=True)[1::2])] == [1, 3, 0]


def test_shifted_pairs_through_the_connect_hook():
    """The parameter reaches the plugin: one 4-frame video on a 2 x 2 grid, k = 0.5 (2 of 4 tokens kept)."""
    x = two_pairs_with_opposite_profiles().float()
    tokens = grid_tokens(x.reshape(-1, 2), (4, 2, 2))
    own = DyCoke(k=0.5).bind(None).connect(tokens, Context())
    shifted = DyCoke(k=0.5, shifted_pairs=True).bind(None).connect(tokens, Context())
    assert own.patch.tolist() == [0, 1, 2, 3, 3, 2, 0, 1, 2, 3, 0, 1]
    assert shifted.patch.tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 3, 2]


def test_group_of_four_pass_and_its_loop_bound():
    n = 6
    counts = {f: ttm_frame_counts(f, n, 0.5) for f in (4, 5, 8, 9, 12, 32)}
    assert counts[4] == [6, 3, 6, 3]  # range(0, 0, 4): no second pass
    assert counts[5] == [6, 3, 3, 3, 0]  # i = 0 only; the unpaired last frame is left out
    assert counts[8] == [6, 3, 3, 3, 6, 3, 6, 3]  # i = 0 only: the last group (4..7) is left alone
    assert counts[9] == [6, 3, 3, 3, 6, 3, 3, 3, 0]  # i = 0, 4
    assert counts[12] == [6, 3, 3, 3, 6, 3, 3, 3, 6, 3, 6, 3]
    full = [f for f, c in enumerate(counts[32]) if c == n]
    assert full == [0, 4, 8, 12, 16, 20, 24, 28, 30]  # the spec's 32-frame example
    assert sum(ttm_frame_counts(32, 196, 0.7)) == 9 * 196 + 23 * 58 == 3098
    assert ttm_frame_counts(9, 6, 0.5, drop_unpaired_frame=False)[-1] == 6

    # frame i+2 is re-selected against frame i, not kept from the first pass
    angles = [0.9, 0.1, 0.5, 0.3, 1.2, 0.2]  # order of similarity to frame 0: 4, 0, 2, 3, 5, 1
    x = torch.stack([reference_frame(n)] * 8)
    x[2] = rotated(angles)
    kept = ttm_keep(x, k=0.5, shifted_pairs=False)
    assert kept[2].tolist() == [4, 0, 2]
    assert kept[6].tolist() == list(range(n))  # outside the loop bound: frame 6 stays whole


def test_fewer_than_two_frames_or_k_zero_keep_everything():
    x = torch.randn(1, 5, 3)
    assert [t.tolist() for t in ttm_keep(x, k=0.7)] == [[0, 1, 2, 3, 4]]
    x = torch.randn(3, 5, 3)
    assert [t.tolist() for t in ttm_keep(x, k=0.0)] == [list(range(5))] * 3
    assert ttm_frame_counts(1, 196, 0.7) == [196]
    assert ttm_frame_counts(7, 196, 0.0) == [196] * 7


def official_ttm(feature: torch.Tensor, tokens_per_frame: int, k: float, first_commit: bool = False) -> torch.Tensor:
    """A re-derivation of the official `dycole_ttm` in its own structure: list of frames, pair similarity
    list indexed i // 2 (latest commit 35cc532; (i - 2) // 2 at the first commit 26dc6f4), second pass
    rewriting list entries i and i + 2, concatenation. (The official code crashes with fewer than 5 frames,
    when a similarity list is empty; this one skips the empty pass.)"""
    num_frames = feature.shape[0] // tokens_per_frame
    keep_ratio = 1 - k
    n = tokens_per_frame

    def frame(i):
        return feature[i * n : (i + 1) * n]

    sims = []
    for i in range(0, num_frames - 1, 2):
        sims.append(F.cosine_similarity(F.normalize(frame(i), p=2, dim=1), F.normalize(frame(i + 1), p=2, dim=1)))
    out = []
    for i in range(0, num_frames - 1, 2):
        idx = sims[(i - 2) // 2 if first_commit else i // 2].topk(int(keep_ratio * n), largest=False).indices
        out.append(frame(i))
        out.append(frame(i + 1)[idx])
    for i in range(0, num_frames - 4, 4):
        sim = F.cosine_similarity(frame(i), frame(i + 2), dim=1)
        out[i] = frame(i)
        out[i + 2] = frame(i + 2)[sim.topk(int(keep_ratio * n), largest=False).indices]
    return torch.cat(out)


@pytest.mark.parametrize("first_commit", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("frames", [2, 3, 5, 8, 9, 12, 13])
@pytest.mark.parametrize("k", [0.7, 0.3, 0.75])
def test_matches_the_official_structure(first_commit, seed, frames, k):
    g = torch.Generator().manual_seed(seed)
    n, d = 16, 8
    x = torch.randn(frames * n, d, generator=g)
    frame = torch.arange(frames).repeat_interleave(n)
    patch = torch.arange(n).repeat(frames)
    keep = ttm_select(x, frame, patch, n, k, shifted_pairs=first_commit)
    assert torch.equal(x[keep], official_ttm(x, n, k, first_commit))
    assert keep.numel() == sum(ttm_frame_counts(frames, n, k))
    if frames >= 4:  # with two pairs or more the two commits rank differently (so each check has teeth)
        other = ttm_select(x, frame, patch, n, k, shifted_pairs=not first_commit)
        assert not torch.equal(keep, other)


def test_thinned_frames_are_aligned_by_patch():
    # frame 0 lacks patch 2 (frame 1's patch 2 is new: least similar); frame 1 lacks patch 3 (never kept)
    n = 5
    f0 = reference_frame(n)
    f1 = rotated([0.1, 0.2, 0.0, 0.0, 0.9])
    embeds = torch.cat([f0[[0, 1, 3, 4]], f1[[0, 1, 2, 4]]])
    frame = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    patch = torch.tensor([0, 1, 3, 4, 0, 1, 2, 4])
    keep = ttm_select(embeds, frame, patch, n, k=0.5)  # frame 1: int(0.5 * 4) = 2 of its 4 tokens
    assert keep.tolist() == [0, 1, 2, 3, 6, 7]  # frame 0 whole; frame 1: patch 2 (new), then patch 4
    with pytest.raises(ValueError, match="share a spatial patch"):
        ttm_select(embeds, torch.zeros(8, dtype=torch.long), patch, n, k=0.5)


# --- decode-time KV pruning rule --------------------------------------------------------------------------------


def test_kv_prune_first_step_stable_step_and_changed_step():
    a = torch.tensor([0.10, 0.40, 0.05, 0.30, 0.15])
    kept, sim = kv_prune(a, None, p=0.6)  # first step: similarity 0 -> prune, keep int(5 * 0.4) = 2
    assert sim == 0.0 and sorted(kept.tolist()) == [1, 3]
    kept, sim = kv_prune(a * 1.01, a, p=0.6)  # stable (cosine 1 >= 0.9): the full cache, nothing reused
    assert kept is None and sim == pytest.approx(1.0)
    b = torch.tensor([0.40, 0.01, 0.30, 0.02, 0.27])
    kept, sim = kv_prune(b, a, p=0.6)
    assert sim == pytest.approx(float(F.cosine_similarity(b, a, dim=0))) and sim < 0.9
    assert sorted(kept.tolist()) == [0, 2]
    assert kv_prune(b, a, p=0.6, threshold=-1.0)[0] is None
    assert kv_prune(a, a[:3], p=0.6)[1] == 0.0  # a span of another length: treated as the first step


def test_image_span_leaves_out_the_last_token_of_each_video():
    visual = torch.tensor([[False, True, True, True, False, True, True, False]])
    video = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1]])
    layout = TokenLayout(
        index=torch.arange(8)[None],
        valid=torch.ones(1, 8, dtype=torch.bool),
        visual=visual,
        frame=torch.zeros(1, 8, dtype=torch.long),
        patch=torch.zeros(1, 8, dtype=torch.long),
        video=video,
    )
    assert image_span(layout).tolist() == [[False, True, True, False, False, True, False, False]]
    assert torch.equal(image_span(layout, exclude_last_token=False), visual)


# --- parameters and retention -------------------------------------------------------------------------------------


def test_defaults_and_retention_mapping():
    params = DyCoke()
    assert (params.k, params.layer, params.p, params.threshold) == (None, 3, None, 0.9)
    assert not params.shifted_pairs and params.drop_unpaired_frame and params.exclude_last_token
    plugin = vtc.registry()["dycoke"]().bind(None)
    assert (plugin.ttm_k(), plugin.decode_p()) == (0.7, 0.8)  # lmms-eval defaults
    assert plugin.merging_ratio(32, 196) == 0.7
    plugin = params.bind(0.5)
    assert plugin.ttm_k() is None and plugin.decode_p() == 0.8  # k chosen per video from the retention; P official
    k, reachable = merging_ratio_for(0.5, 32, 196)
    assert reachable and plugin.merging_ratio(32, 196) == k
    plugin = params.bind(1.0)
    assert (plugin.ttm_k(), plugin.decode_p()) == (0.0, 0.0)  # retention 1: both stages off
    plugin = DyCoke(k=0.5, p=0.7).bind(0.25)
    assert (plugin.ttm_k(), plugin.decode_p()) == (0.5, 0.7)  # explicit parameters win
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit k is never "below the floor"
        assert plugin.merging_ratio(32, 196) == 0.5
        assert plugin.retained_count(32 * 196, (32, 14, 14), "qwen2_vl") == 9 * 196 + 23 * 98
    # r = 0.5 of 32 x 196: 3136 tokens; 9 full frames (1764) leave 1372 for 23 reduced frames: 60 each (59.65)
    assert params.bind(0.5).retained_count(32 * 196, (32, 14, 14), "llava_onevision") == 9 * 196 + 23 * 60
    assert params.bind(1.0).retained_count(1000, (32, 14, 14), "qwen2_vl") == 1000
    assert params.bind(0.5).retained_count(100, (32, 14, 14), "qwen2_vl") is None  # thinned by another method
    card = vtc.registry()["dycoke"].card
    assert card.stages == ("connect", "prefill") and card.fixed_count and card.query_aware
    assert card.positions == "compact" and card.during_decode
    assert not hasattr(params.bind(0.5), "acts_during_decode")  # a class attribute (`during_decode`) now
    # the connect part alone (vLLM): the same parameters and TTM, no LLM stage, not query-aware
    ttm = vtc.registry()["dycoke-ttm"]
    assert ttm is DyCokeTTM and issubclass(ttm, DyCoke) and ttm.card.fixed_count_mode == "always"
    assert ttm.card.stages == ("connect",) and not ttm.card.query_aware and not ttm.card.during_decode
    assert ttm.card.positions == "compact" and set(ttm.testing.exemptions) == {"ordered_positions"}
    assert ttm().bind(0.5).retained_count(32 * 196, (32, 14, 14), "qwen2_vl") == 9 * 196 + 23 * 60


def test_ttm_roles():
    assert ttm_roles(1) == ["full"]
    assert ttm_roles(4) == ["full", "reduced", "full", "reduced"]
    assert ttm_roles(5) == ["full", "reduced", "reduced", "reduced", "dropped"]
    assert ttm_roles(5, drop_unpaired_frame=False)[-1] == "full"
    roles = ttm_roles(32)
    assert [f for f, r in enumerate(roles) if r == "full"] == [0, 4, 8, 12, 16, 20, 24, 28, 30]
    for frames in (2, 4, 5, 8, 9, 16, 32):  # roles agree with the counts TTM keeps
        size = {"full": 6, "reduced": 3, "dropped": 0}
        assert ttm_frame_counts(frames, 6, 0.5) == [size[r] for r in ttm_roles(frames)]


@pytest.mark.parametrize("tokens_per_frame", [196, 144, 9])
@pytest.mark.parametrize("frames", [4, 8, 16, 32])
@pytest.mark.parametrize("retention", [0.5, 0.35, 0.25])
def test_retention_sets_the_ttm_count(frames, tokens_per_frame, retention):
    """TTM keeps round(r T n) of a full T x n grid within one token per reduced frame; below the share of the
    frames it never reduces, it keeps that floor (all reduced frames emptied) and says so."""
    n = tokens_per_frame
    reduced = ttm_roles(frames).count("reduced")
    floor = sum(ttm_frame_counts(frames, n, 1.0))
    assert floor == ttm_roles(frames).count("full") * n
    target = round(retention * frames * n)
    k, reachable = merging_ratio_for(retention, frames, n)
    count = sum(ttm_frame_counts(frames, n, k))
    assert 0.0 <= k <= 1.0
    if reachable:
        assert abs(count - target) <= reduced, (count, target)
    else:
        assert target < floor and count == floor
    plugin = DyCoke().bind(retention)
    side = {196: 14, 144: 12, 9: 3}[n]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plugin.retained_count(frames * n, (frames, side, side), "qwen2_vl") == count
        plugin.retained_count(frames * n, (frames, side, side), "qwen2_vl")  # same frame count: no second warning
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if reachable:
        assert messages == []
    else:
        assert len(messages) == 1
        assert f"retention {retention:.3g} is below what TTM can keep of a {frames}-frame video" in messages[0]
        assert f"keeping {floor} of {frames * n} tokens" in messages[0]


def test_retention_hits_known_counts():
    # 16 frames of 196: 5 full frames (980) and 11 reduced; r = 0.35 -> 1098 -> 118 / 11 = 10.7 -> 11 per frame
    k, reachable = merging_ratio_for(0.35, 16, 196)
    assert reachable and int((1 - k) * 196) == 11
    assert sum(ttm_frame_counts(16, 196, k)) == 980 + 11 * 11 == 1101
    # 4 frames: frames 0 and 2 are never reduced, so 1/2 is the lowest retention; it empties frames 1 and 3
    k, reachable = merging_ratio_for(0.5, 4, 9)
    assert reachable and ttm_frame_counts(4, 9, k) == [9, 0, 9, 0]
    assert merging_ratio_for(0.4, 4, 9)[1] is False
    # no reduced frame (a single frame): nothing to choose
    assert merging_ratio_for(0.5, 1, 9) == (0.0, False)
    assert merging_ratio_for(1.0, 1, 9) == (0.0, True)
    # a retention TTM meets without touching a frame
    assert merging_ratio_for(0.999, 4, 9) == (0.0, True)


def test_below_the_floor_warns_once_per_frame_count():
    plugin = DyCoke().bind(0.25)
    with pytest.warns(RuntimeWarning, match=r"dycoke: retention 0.25 is below .* 8-frame video") as caught:
        assert plugin.merging_ratio(8, 9) == merging_ratio_for(0.25, 8, 9)[0]
        plugin.merging_ratio(8, 9)
        plugin.merging_ratio(8, 16)  # same frame count, other frame size: still once
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    with pytest.warns(RuntimeWarning, match=r"4-frame video .*keeping 18 of 36 tokens \(50.0%\)"):
        plugin.merging_ratio(4, 9)
    with pytest.warns(RuntimeWarning, match="8-frame video"):  # another plugin object warns again
        DyCoke().bind(0.25).merging_ratio(8, 9)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k": 1.5}, "k"),
        ({"p": -0.1}, "p"),
        ({"layer": 0}, "layer"),
        ({"layer": 2.5}, "layer"),
        ({"threshold": 2.0}, "threshold"),
    ],
)
def test_invalid_parameters(kwargs, match):
    with pytest.raises(ValueError, match=f"dycoke: {match}"):
        DyCoke(**kwargs)


def make_tokens(x: torch.Tensor) -> VideoTokens:
    """Frames x [T, n, D] with n = side^2 patches as one video's tokens."""
    t, n, d = x.shape
    side = int(math.isqrt(n))
    return grid_tokens(x.reshape(-1, d), (t, side, side))


def test_connect_hook_identity_selection_and_reports():
    x = torch.randn(4, 9, 6)
    tokens = make_tokens(x)
    ctx = Context()
    assert DyCoke().bind(1.0).connect(tokens, ctx) is tokens
    assert ctx.reports == {"merging_ratio": [0.0]}  # retention 1: TTM off (k = 0), reported like any k
    # r = 0.75 of 4 x 9: 27 tokens; frames 0 and 2 stay whole (18), frames 1 and 3 keep round(4.5) = 4 each
    plugin = DyCoke().bind(0.75)
    ctx = Context()
    k = merging_ratio_for(0.75, 4, 9)[0]
    assert int((1 - k) * 9) == 4
    state = {name: (set(v) if isinstance(v, set) else v) for name, v in vars(plugin).items()}
    out = plugin.connect(tokens, ctx)
    expected = ttm_select(tokens.embeds, tokens.frame, tokens.patch, 9, k)
    assert torch.equal(out.embeds, tokens.embeds[expected])
    assert torch.equal(out.positions, tokens.positions[expected])
    assert len(out) == plugin.retained_count(36, (4, 3, 3), "qwen2_vl") == 9 + 4 + 9 + 4
    assert ctx.reports == {"merging_ratio": [k]}
    plugin.connect(tokens, ctx)  # a second video of the same forward
    assert ctx.reports == {"merging_ratio": [k, k]}
    assert vars(plugin) == state  # the plugin object keeps no per-forward state
    explicit = DyCoke(k=0.5).bind(0.3)
    ctx = Context()
    assert len(explicit.connect(tokens, ctx)) == 26 and ctx.reports == {"merging_ratio": [0.5]}


# --- the patched model ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_patched_model_sees_the_ttm_selection(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    full, full_positions, _ = llm_inputs(model, inputs)
    video = compressible_video_mask(model, inputs["input_ids"])
    slots = torch.nonzero(video).flatten()
    out, positions, handle = llm_inputs(model, inputs, "dycoke", retention=0.6)
    stats = handle.stats()
    (grid,) = stats.grids
    t, h, w = grid
    assert slots.numel() == t * h * w
    k, reachable = merging_ratio_for(0.6, t, h * w)
    assert reachable and stats.reports["dycoke"]["merging_ratio"] == [k]
    keep = ttm_select(full[slots], torch.arange(t).repeat_interleave(h * w), torch.arange(h * w).repeat(t), h * w, k)
    assert stats.visual_tokens_out == keep.numel() == sum(ttm_frame_counts(t, h * w, k))
    assert stats.visual_tokens_out == handle.retained_count(grid)
    assert abs(keep.numel() - round(0.6 * t * h * w)) <= ttm_roles(t).count("reduced")
    first, last = int(slots[0]), int(slots[-1])
    expected = torch.cat([full[:first], full[slots][keep], full[last + 1 :]])
    assert torch.equal(out, expected)
    if family == "llava_onevision":  # the official LLaVA code renumbers the shortened sequence
        assert torch.equal(positions.flatten(), torch.arange(expected.shape[0]))
    else:  # Qwen: original M-RoPE positions of the chosen tokens
        sel = torch.cat([torch.arange(first), slots[keep], torch.arange(last + 1, full.shape[0])])
        assert torch.equal(positions[..., 0, :], full_positions[..., 0, sel])


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
@pytest.mark.parametrize("retention", [0.7, 0.35, 0.25])
def test_patched_model_keeps_the_promised_count(family, retention):
    """retained_count (before any model runs) = what the patched model keeps: round(r N) within one token per
    reduced frame, or the floor of the never-reduced frames below it, with one warning for the patch."""
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with vtc.patch(model, "dycoke", retention=retention) as handle:
            for _ in range(2):  # a second prompt of the same frame count does not warn again
                with torch.no_grad():
                    model(**inputs)
            stats = handle.stats()
            (grid,) = stats.grids
            promised = handle.retained_count(grid)
    dycoke_warnings = [str(w.message) for w in caught if "dycoke" in str(w.message)]
    t, h, w = grid
    n = h * w
    k, reachable = merging_ratio_for(retention, t, n)
    floor = sum(ttm_frame_counts(t, n, 1.0))
    assert stats.visual_tokens_out == stats.llm_tokens_in == promised == sum(ttm_frame_counts(t, n, k))
    assert stats.reports["dycoke"]["merging_ratio"] == [k]
    assert Pipeline("dycoke", retention, family=family).retained_count(grid) == promised
    if reachable:
        assert abs(promised - round(retention * t * n)) <= ttm_roles(t).count("reduced")
        assert dycoke_warnings == []
    else:
        assert promised == floor and len(dycoke_warnings) == 1
        assert f"{t}-frame video" in dycoke_warnings[0] and f"keeping {floor} of {t * n} tokens" in dycoke_warnings[0]


def test_retention_one_turns_both_stages_off():
    family = "qwen2_vl"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    kwargs = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    plain = model.generate(**inputs, **kwargs)
    with vtc.patch(model, "dycoke", retention=1.0) as handle:
        gen = model.generate(**inputs, **kwargs)
        stats = handle.stats()
        (grid,) = stats.grids
        assert handle.retained_count(grid) == stats.visual_tokens_in == stats.visual_tokens_out
    assert torch.equal(gen.sequences, plain.sequences)
    for step in range(3):
        torch.testing.assert_close(gen.logits[step], plain.logits[step], atol=1e-6, rtol=1e-6)
    assert all(s.kept == [None] for s in stats.reports.get("dycoke", {}).get("decode_steps", []))


def decode_steps(handle) -> list[DecodeStep]:
    """What the decode stage reported for the last generate call, one `DecodeStep` per decode step."""
    steps = handle.stats().reports["dycoke"]["decode_steps"]
    assert all(isinstance(s, DecodeStep) for s in steps)
    return steps


def dycoke_decode_reference(model, inputs, new, layer=3, p=0.8, threshold=0.9, reuse=False):
    """The official decode-time pruning, batch 1, on the uncompressed prompt (TTM off): see `decode_reference`."""
    ref, _, x, hidden, cos, sin, visual = start(model, inputs, new)
    deepstack = (x.get("visual_pos_masks", [None])[0], x.get("deepstack_visual_embeds"))
    n_prompt = inputs["input_ids"].shape[1]
    return decode_reference(ref, hidden, cos, sin, visual, n_prompt, layer, p, threshold, reuse, deepstack)


def decode_reference(ref, hidden, cos, sin, visual, n_prompt, layer, p, threshold, reuse=False, deepstack=(None,) * 2):
    """Layer by layer: the decisions come from layer L-1's attention of each decode token (model-dtype softmax,
    head mean, image span = the prompt's video tokens minus the last one); layers >= L of that token's row then
    see only the kept video tokens, or the whole cache when the cosine with the previous step's attention is
    >= threshold (with `reuse`, the previous step's pruned set instead: NOT the official behaviour, to show the
    test tells them apart). `hidden` [1, prompt + new, D] holds the prompt and the decode tokens."""
    length = hidden.shape[1]
    span = torch.nonzero(visual[:n_prompt]).flatten()[:-1]
    with ref.capturing(), torch.no_grad():
        h = hidden
        for i in range(layer):
            h = ref.deepstack(i, ref.mlp_block(i, ref.attention_block(i, h, cos, sin)), *deepstack)
        query, key = CAPTURED[layer - 1]
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    previous, hidden_prev, decisions = None, None, []
    for row in range(n_prompt, length):  # decode step row - n_prompt + 1 runs the token at `row`
        logits = query[0, :, row : row + 1] @ key[0, :, : row + 1].transpose(-1, -2) * query.shape[-1] ** -0.5
        attention = torch.softmax(logits[:, 0], dim=-1).mean(0)[span]
        sim = 0.0 if previous is None else float(F.cosine_similarity(attention, previous, dim=0))
        previous = attention
        if sim < threshold:
            top = torch.topk(attention, int(span.numel() * (1 - p))).indices
            dropped = torch.ones(span.numel(), dtype=torch.bool)
            dropped[top] = False
            mask[row, span[dropped]] = False
            hidden_prev = span[dropped]
            decisions.append(int(top.numel()))
        else:
            if reuse and hidden_prev is not None:
                mask[row, hidden_prev] = False
            decisions.append(None)
    with torch.no_grad():
        h = hidden
        for i in range(len(ref.layers)):
            block = ref.attention_block(i, h, cos, sin, mask if i >= layer else None)
            h = ref.deepstack(i, ref.mlp_block(i, block), *deepstack)
        return ref.logits(h)[0], decisions


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_match_the_layer_by_layer_reference(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    n_prompt = inputs["input_ids"].shape[1]
    with vtc.patch(model, "dycoke", k=0.0) as handle:  # TTM off: the decode stage alone, official P = 0.8
        gen = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        steps = decode_steps(handle)
    assert len(steps) == 3  # one per decode step (4 new tokens: a prefill and 3 decode forwards)
    new = gen.sequences[:, n_prompt:]
    ref_logits, decisions = dycoke_decode_reference(model, inputs, new[:, :3])
    assert [s.kept[0] for s in steps] == decisions
    assert decisions[0] is not None and steps[0].similarity == [0.0]  # the first step always prunes
    for step in (1, 2, 3):
        torch.testing.assert_close(gen.logits[step][0], ref_logits[n_prompt + step - 1], atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        plain = model(**inputs).logits[:, -1]
    torch.testing.assert_close(gen.logits[0], plain, atol=1e-6, rtol=1e-6)  # the prefill is never pruned


def test_stable_steps_use_the_full_cache_and_always_pruning_matches_too():
    family = "qwen2_vl"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    n_prompt = inputs["input_ids"].shape[1]
    for threshold in (0.9, 1.0):
        with vtc.patch(model, "dycoke", k=0.0, threshold=threshold) as handle:
            gen = model.generate(
                **inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
            steps = decode_steps(handle)
        new = gen.sequences[:, n_prompt:]
        ref_logits, decisions = dycoke_decode_reference(model, inputs, new[:, :3], threshold=threshold)
        assert [s.kept[0] for s in steps] == decisions
        for step in (1, 2, 3):
            torch.testing.assert_close(gen.logits[step][0], ref_logits[n_prompt + step - 1], atol=2e-5, rtol=1e-4)
        if threshold == 0.9:
            assert decisions[1] is None  # stable attention on the tiny model: the whole cache
            reused, _ = dycoke_decode_reference(model, inputs, new[:, :3], reuse=True)
            assert not torch.allclose(gen.logits[2][0], reused[n_prompt + 1], atol=1e-4, rtol=1e-3)
        else:
            assert all(d is not None for d in decisions)


def test_padded_batch_decodes_like_single_prompts():
    family = "qwen2_vl"
    model, _ = model_and_processor(family)
    kwargs = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with vtc.patch(model, "dycoke", retention=0.6) as handle:
        batch = model.generate(**batch_inputs(family), **kwargs)
        batch_steps = decode_steps(handle)
        batch_ratios = handle.stats().reports["dycoke"]["merging_ratio"]
        singles = []
        for which in (0, 1):
            single = model.generate(**single_inputs(family, which), **kwargs)
            singles.append((single, decode_steps(handle), handle.stats().reports["dycoke"]["merging_ratio"]))
    assert len(batch_steps) == 2 and all(len(s.kept) == len(s.similarity) == 2 for s in batch_steps)
    assert batch_ratios == [ratios[0] for _, _, ratios in singles]  # one per video, in batch order
    for row, (single, steps, _) in enumerate(singles):
        assert [s.kept[row] for s in batch_steps] == [s.kept[0] for s in steps]
        assert [s.similarity[row] for s in batch_steps] == pytest.approx([s.similarity[0] for s in steps], abs=1e-5)
        for step in range(3):
            torch.testing.assert_close(batch.logits[step][row], single.logits[step][0], atol=2e-5, rtol=1e-4)


def test_llava_onevision_ttm_then_decode_pruning_on_the_renumbered_prompt():
    """Both stages on LLaVA-OneVision: the prompt is the TTM selection with contiguous positions (official
    LLaVA), the image span is the TTM output minus its last token, the newline after it is text."""
    family = "llava_onevision"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    full, _, _ = llm_inputs(model, inputs)
    video = compressible_video_mask(model, inputs["input_ids"])
    slots = torch.nonzero(video).flatten()
    t, n = 8, 196
    keep = ttm_select(full[slots], torch.arange(t).repeat_interleave(n), torch.arange(n).repeat(t), n, 0.7)
    first, last = int(slots[0]), int(slots[-1])
    prompt = torch.cat([full[:first], full[slots][keep], full[last + 1 :]])
    with vtc.patch(model, "dycoke", k=0.7) as handle:  # the paper's knob (official lmms-eval value)
        gen = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        assert handle.stats().visual_tokens_out == keep.numel() == handle.retained_count((t, 14, 14))
        steps = decode_steps(handle)
    new = gen.sequences[:, inputs["input_ids"].shape[1] :]
    ref = ManualLLM(model)
    with torch.no_grad():
        hidden = torch.cat([prompt, model.get_input_embeddings()(new[0, :3])])[None]
    cos, sin = ref.rope(hidden, torch.arange(hidden.shape[1])[None])
    visual = torch.zeros(hidden.shape[1], dtype=torch.bool)
    visual[first : first + keep.numel()] = True
    n_prompt = prompt.shape[0]
    ref_logits, decisions = decode_reference(ref, hidden, cos, sin, visual, n_prompt, layer=3, p=0.8, threshold=0.9)
    assert [s.kept[0] for s in steps] == decisions
    assert decisions[0] == int((keep.numel() - 1) * (1 - 0.8))
    torch.testing.assert_close(gen.logits[0][0], ref.logits(ref_prefill(ref, prompt, cos, sin))[0, -1], **TOL)
    for step in (1, 2, 3):
        torch.testing.assert_close(gen.logits[step][0], ref_logits[n_prompt + step - 1], **TOL)


TOL = dict(atol=2e-5, rtol=1e-4)


def ref_prefill(ref, prompt, cos, sin):
    with torch.no_grad():
        h = prompt[None]
        for i in range(len(ref.layers)):
            h = ref.mlp_block(i, ref.attention_block(i, h, cos[:, : h.shape[1]], sin[:, : h.shape[1]]))
        return h


def test_layer_beyond_the_model_is_a_clear_error():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "dycoke", retention=0.6, layer=4):
        with pytest.raises(ValueError, match=r"dycoke: layer=4 but the language model has only 4 layers"):
            model.generate(**single_inputs("qwen2_vl"), max_new_tokens=2, do_sample=False)
