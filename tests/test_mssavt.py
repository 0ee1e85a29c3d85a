"""StreamingAssistant / MSSAVT: known answers on hand-built frames (the most redundant pair, the temporal step on a
repeated frame, the isolated fallback), the masked-pruning invariants (candidates of a round are mutually
non-adjacent, checkerboard rounds alternate parity), the vectorised frame function against a plain loop written
from the spec, the fixed count, the plugin end to end, and the previous frame carried across calls (streaming)."""

from __future__ import annotations

import math

import pytest
import torch

import vtc
from tests.conftest import batch_inputs, model_and_processor, single_inputs
from tests.probes import llm_inputs
from vtc.core.geometry import default_geometry
from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context, VideoTokens
from vtc_plugins.mssavt import (
    MSSAVT,
    keep_per_frame,
    masked_prune,
    mssavt_frame,
    mssavt_scores,
    prune_rounds,
    temporal_prune,
)


# --- a loop reference, written straight from specs/from-abstracts.md §4 (and the [OPEN] choices of the plugin) ----
def reference_frame(x, previous, h, w, keep, tau, mask="local_max"):
    n = h * w
    if keep >= n:
        return list(range(n))

    def cos(a, b):
        return float((a * b).sum() / (a.norm() * b.norm()))

    pair = {}

    def sim(i, j):  # cos(x_i, x_j), memoised (the features never change)
        if (i, j) not in pair:
            pair[i, j] = pair[j, i] = cos(x[i], x[j])
        return pair[i, j]

    def neighbours(i):
        r, c = divmod(i, w)
        for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
            if 0 <= r + dr < h and 0 <= c + dc < w:
                yield (r + dr) * w + c + dc

    alive = [True] * n
    if previous is not None:  # step 1: most similar first, lower index first on ties, at most n - keep
        over = [(cos(x[i], previous[i]), i) for i in range(n)]
        over = sorted([(s, i) for s, i in over if s > tau], key=lambda t: (-t[0], t[1]))
        for _, i in over[: n - keep]:
            alive[i] = False
    rnd = 0
    while sum(alive) > keep:
        r = []  # step 2: max cosine to an alive 4-neighbour, -inf when none (and for pruned tokens)
        for i in range(n):
            sims = [sim(i, j) for j in neighbours(i) if alive[j]]
            r.append(max(sims) if alive[i] and sims else -math.inf)
        live = [i for i in range(n) if alive[i] and r[i] > -math.inf]
        if mask == "local_max":  # strict local maximum, the lower index winning an exact tie
            cand = [i for i in live if all((r[i], -i) > (r[j], -j) for j in neighbours(i) if alive[j])]
        else:
            cand = [i for i in live if sum(divmod(i, w)) % 2 == rnd % 2]
        if cand:
            for i in sorted(cand, key=lambda i: (-r[i], i))[: sum(alive) - keep]:
                alive[i] = False
        else:  # every alive token isolated: the highest cosine to any other alive token, one per round
            idx = [i for i in range(n) if alive[i]]
            best = max(idx, key=lambda i: (max(sim(i, j) for j in idx if j != i), -i))
            alive[best] = False
        rnd += 1
    return [i for i in range(n) if alive[i]]


def adjacent(i, j, w):
    (ri, ci), (rj, cj) = divmod(int(i), w), divmod(int(j), w)
    return abs(ri - rj) + abs(ci - cj) == 1


def signs(n, d, seed):
    """±1 vectors: the cosine of a vector with itself is exactly 1 (exact ties for the tie-break tests)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n, d), generator=g).float() * 2 - 1


def llava_ctx(state=None, video_index=0):
    family = "llava_next_video"
    return Context(
        family=family, geometry=default_geometry(family), video_index=video_index, state={} if state is None else state
    )


# --- parameters and registration -----------------------------------------------------------------------------------
def test_defaults_validation_and_registration():
    p = MSSAVT()
    assert p.rho is None and p.tau_t == 0.9 and p.mask == "local_max"
    assert p.bind(None).fraction() == 0.25 and p.bind(0.4).fraction() == 0.4
    assert MSSAVT(rho=0.1).bind(0.4).fraction() == 0.1
    with pytest.raises(ValueError, match=r"rho must be in \(0, 1\]"):
        MSSAVT(rho=0.0)
    with pytest.raises(ValueError, match=r"tau_t must be in \[-1, 1\]"):
        MSSAVT(tau_t=1.5)
    with pytest.raises(ValueError, match="mask must be one of 'local_max', 'checkerboard'"):
        MSSAVT(mask="chess")
    card = vtc.registry()["mssavt"].card
    assert card.stages == ("connect",) and card.fixed_count_mode == "always" and card.whole_frames
    assert card.positions == "keep" and not card.query_aware and not card.vision_stats
    assert card.streams and card.capabilities()["streams"]
    with pytest.raises(ValueError, match="needs whole frames"):
        Pipeline("random+mssavt", 0.25)
    Pipeline("mssavt+random", 0.25)


def test_keep_per_frame_and_retained_count():
    assert keep_per_frame(16, 0.25) == 4 and keep_per_frame(49, 0.25) == 12 and keep_per_frame(25, 0.01) == 1
    assert keep_per_frame(36, 1.0) == 36 and keep_per_frame(10, 0.25) == 2  # round half to even (2.5 -> 2)
    plugin = MSSAVT().bind(0.25)
    assert plugin.retained_count(8 * 196, (8, 14, 14), "llava_onevision") == 8 * 49
    assert plugin.retained_count(4 * 144, (4, 12, 12), "qwen2_vl") == 4 * 36
    assert MSSAVT().bind(1.0).retained_count(3 * 25, (3, 5, 5), "qwen2_vl") == 75


# --- known answers -------------------------------------------------------------------------------------------------
def test_a_token_equal_to_its_right_neighbour_is_the_most_redundant():
    x = torch.eye(16)
    x[6] = x[5]  # (1, 1) == (1, 2); every other pair orthogonal
    alive = torch.ones(16, dtype=torch.bool)
    r = mssavt_scores(x, alive, (4, 4))
    assert r[5] == r[6] == 1.0 and bool((r[[i for i in range(16) if i not in (5, 6)]] == 0).all())
    # one token to prune: exactly one of the pair, the lower index (it wins the exact tie of the local-max test)
    assert prune_rounds(x, alive, (4, 4), 15) == [torch.tensor([5])]
    assert torch.nonzero(~masked_prune(x, alive, (4, 4), 15)).flatten().tolist() == [5]
    # its partner lost its only similar neighbour: R drops to 0
    assert mssavt_scores(x, masked_prune(x, alive, (4, 4), 15), (4, 4))[6] == 0.0
    # two to prune: 5 first, then the best other candidate (R = 0, lowest index); 6 is adjacent to 5, never both
    assert prune_rounds(x, alive, (4, 4), 14)[0].tolist() == [0, 5]
    # pruned tokens and tokens without an alive neighbour get -inf, never NaN
    alive = torch.zeros(16, dtype=torch.bool)
    alive[[0, 5]] = True
    r = mssavt_scores(x, alive, (4, 4))
    assert bool(torch.isneginf(r).all()) and not bool(torch.isnan(r).any())


def test_pruned_tokens_of_a_round_are_mutually_non_adjacent():
    g = torch.Generator().manual_seed(1)
    for h, w, keep in ((7, 7, 5), (5, 6, 3), (4, 4, 1), (1, 9, 2)):
        x = torch.randn(h * w, 8, generator=g)
        x[: w * (h // 2)] += 2.0  # a smooth half with high similarities
        alive = torch.ones(h * w, dtype=torch.bool)
        rounds = prune_rounds(x, alive, (h, w), keep)
        assert sum(p.numel() for p in rounds) == h * w - keep
        for pruned in rounds:
            assert bool(alive[pruned].all())
            assert not any(adjacent(i, j, w) for a, i in enumerate(pruned) for j in pruned[a + 1 :])
            alive[pruned] = False
        assert int(alive.sum()) == keep


def test_first_frame_skips_the_temporal_step_and_a_repeated_frame_keeps_its_last_positions():
    x = signs(16, 16, seed=0)
    assert bool((temporal_prune(x, None, 4, 0.9)).all())
    assert mssavt_frame(x, None, (4, 4), 4).tolist() == reference_frame(x.double(), None, 4, 4, 4, 0.9)
    # identical to the previous frame: every cosine is exactly 1 > tau, the step prunes N - k = 12 of them, ties
    # broken by the lower index first, so the last k positions survive and no spatial round is left
    alive = temporal_prune(x, x.clone(), 4, 0.9)
    assert torch.nonzero(alive).flatten().tolist() == [12, 13, 14, 15]
    assert mssavt_frame(x, x.clone(), (4, 4), 4).tolist() == [12, 13, 14, 15]
    # 13 above tau: with k = 2 (budget 14) exactly those go, with k = 4 (budget 12) the last of them survives
    prev = x.clone()
    prev[[2, 9]] *= -1
    prev[3] = 0.0  # a zero vector: cosine 0, not NaN
    assert torch.nonzero(temporal_prune(x, prev, 2, 0.9)).flatten().tolist() == [2, 3, 9]
    assert torch.nonzero(temporal_prune(x, prev, 4, 0.9)).flatten().tolist() == [2, 3, 9, 15]
    assert bool(temporal_prune(x, x.clone(), 4, 1.0).all())


def test_isolated_fallback_keeps_the_count():
    """The temporal step leaves a checkerboard of isolated tokens: every R is -inf, yet 8 > k = 4 are alive. The
    [OPEN] fallback prunes one at a time the token most similar to any other alive token (lower index on ties)."""
    x = torch.eye(16)
    x[12] = x[3]  # two alive odd-parity tokens are identical
    even = torch.tensor([(r + c) % 2 == 0 for r in range(4) for c in range(4)])
    prev = torch.where(even[:, None], x, -x)  # even cells repeat the previous frame, odd cells do not
    alive = temporal_prune(x, prev, 4, 0.9)
    assert torch.equal(alive, ~even)
    assert bool(torch.isneginf(mssavt_scores(x, alive, (4, 4))).all())
    assert prune_rounds(x, alive, (4, 4), 4) == [torch.tensor([i]) for i in (3, 1, 4, 6)]
    assert mssavt_frame(x, prev, (4, 4), 4).tolist() == [9, 11, 12, 14]
    assert mssavt_frame(x, prev, (4, 4), 4).tolist() == reference_frame(x.double(), prev.double(), 4, 4, 4, 0.9)


def test_checkerboard_rounds():
    """Round 0 prunes the cells with (row + col) even, the highest R first. On a full grid it either meets the
    budget or prunes every even cell with an alive neighbour, which isolates every odd cell: the rest goes through
    the fallback. (The same holds after any temporal step, so the alternation to odd cells never finds a candidate:
    the spec's checkerboard reading degenerates to one round plus the fallback.)"""
    g = torch.Generator().manual_seed(2)
    h, w = 7, 7
    x = torch.randn(h * w, 6, generator=g)
    alive = torch.ones(h * w, dtype=torch.bool)
    even = torch.tensor([sum(divmod(i, w)) % 2 == 0 for i in range(h * w)])
    r0 = mssavt_scores(x, alive, (h, w))
    (first,) = prune_rounds(x, alive, (h, w), 40, "checkerboard")  # budget 9 < 25 even cells: one round
    assert bool(even[first].all()) and first.numel() == 9
    assert float(r0[first].min()) >= float(r0[even & ~torch.isin(torch.arange(h * w), first)].max())
    rounds = prune_rounds(x, alive, (h, w), 20, "checkerboard")  # budget 29 > 25 even cells
    assert torch.equal(rounds[0], torch.nonzero(even).flatten())
    assert [p.numel() for p in rounds[1:]] == [1, 1, 1, 1] and not bool(even[torch.cat(rounds[1:])].any())
    with pytest.raises(ValueError, match="mask must be one of"):
        prune_rounds(x, alive, (h, w), 40, "stripes")


@pytest.mark.parametrize("mask", ["local_max", "checkerboard"])
def test_matches_the_loop_reference(mask):
    g = torch.Generator().manual_seed(3)
    for h, w, keep, tau in (
        (4, 4, 4, 0.9),
        (5, 7, 9, 0.5),
        (7, 7, 12, 0.8),
        (1, 6, 2, 0.9),
        (6, 1, 1, 0.0),
        (6, 6, 30, 0.7),
        (4, 5, 5, -1.0),
    ):
        for _ in range(2):
            x = torch.randn(h * w, 5, generator=g, dtype=torch.float64)
            prev = x + torch.randn(h * w, 5, generator=g, dtype=torch.float64) * torch.rand(h * w, 1, generator=g)
            for previous in (None, prev):
                got = mssavt_frame(x, previous, (h, w), keep, tau, mask).tolist()
                assert got == reference_frame(x, previous, h, w, keep, tau, mask), (h, w, keep, tau, previous is None)
                assert len(got) == keep


# --- the plugin ----------------------------------------------------------------------------------------------------
def test_plugin_keeps_k_per_frame_in_order_and_is_the_identity_at_full_retention():
    g = torch.Generator().manual_seed(4)
    t, h, w = 5, 6, 6
    x = torch.randn(t * h * w, 8, generator=g)
    x[h * w : 2 * h * w] = x[: h * w] + 0.01 * torch.randn(h * w, 8, generator=g)  # frame 1 ~ frame 0
    tokens = VideoTokens.from_grid(x, (t, h, w))
    plugin = MSSAVT().bind(0.25)
    ctx = llava_ctx()
    out = plugin.connect(tokens, ctx)
    k = keep_per_frame(h * w, 0.25)
    assert len(out) == plugin.retained_count(len(tokens), tokens.grid, ctx.family) == t * k
    assert torch.bincount(out.frame, minlength=t).tolist() == [k] * t
    assert bool((out.positions[1:] > out.positions[:-1]).all())
    (temporal,) = ctx.reports["temporal_pruned"]
    assert temporal[0] == 0 and temporal[1] == h * w - k  # the near-copy frame: the temporal step does it all
    previous = None
    for f in range(t):  # the pure function, frame by frame, with each frame's original embeddings as `previous`
        frame = x[f * h * w : (f + 1) * h * w]
        expected = mssavt_frame(frame, previous, (h, w), k) + f * h * w
        assert out.positions[out.frame == f].tolist() == expected.tolist()
        previous = frame
    full = MSSAVT().bind(1.0)
    assert full.connect(tokens, llava_ctx()) is tokens
    scores = mssavt_scores(x[: h * w].bfloat16(), torch.ones(h * w, dtype=torch.bool), (h, w))
    assert scores.dtype == torch.float32  # scored in float32 whatever the model dtype


def test_previous_frame_is_carried_across_calls_with_the_same_state():
    """Streaming: the first frame of a chunk compares to the last frame of the previous chunk of the same video
    (same ctx.state, same video_index); a fresh state, or another video, starts without a previous frame."""
    h, w = 4, 4
    frames = [signs(h * w, 16, seed=s) for s in (10, 11, 12)]
    chunk1 = VideoTokens.from_grid(torch.cat(frames[:2]), (2, h, w))
    chunk2 = VideoTokens.from_grid(torch.cat([frames[1], frames[2]]), (2, h, w))  # starts with chunk 1's last frame
    plugin = MSSAVT().bind(0.25)
    ctx = llava_ctx()
    plugin.connect(chunk1, ctx)
    assert torch.equal(ctx.state[("previous", 0)], frames[1])  # the original (unpruned) last frame
    streamed = plugin.connect(chunk2, llava_ctx(state=ctx.state))
    assert streamed.positions[streamed.frame == 0].tolist() == [12, 13, 14, 15]  # a repeat of the previous frame
    assert ctx.state[("previous", 0)] is not None and torch.equal(ctx.state[("previous", 0)], frames[2])
    fresh = plugin.connect(chunk2, llava_ctx())
    assert fresh.positions[fresh.frame == 0].tolist() == mssavt_frame(frames[1], None, (h, w), 4).tolist()
    other = llava_ctx(state=ctx.state, video_index=1)  # another video of the same prompt never sees video 0's frame
    assert torch.equal(plugin.connect(chunk2, other).embeds, fresh.embeds)
    # a video in two chunks with one state = the whole video in one call
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4 * h * w, 8, generator=g)
    x[2 * h * w : 3 * h * w] = x[h * w : 2 * h * w] + 0.05 * torch.randn(h * w, 8, generator=g)
    whole = plugin.connect(VideoTokens.from_grid(x, (4, h, w)), llava_ctx())
    store: dict = {}
    parts = [
        plugin.connect(VideoTokens.from_grid(x[i * 2 * h * w : (i + 1) * 2 * h * w], (2, h, w)), llava_ctx(state=store))
        for i in range(2)
    ]
    assert torch.equal(whole.embeds, torch.cat([p.embeds for p in parts]))
    # a stored frame of another grid size is ignored (no previous frame)
    store[("previous", 0)] = torch.randn(9, 8)
    again = plugin.connect(VideoTokens.from_grid(x[: 2 * h * w], (2, h, w)), llava_ctx(state=store))
    assert torch.equal(again.embeds, parts[0].embeds)


def test_patched_llava_next_video_sees_the_chosen_tokens_at_their_positions():
    model, _ = model_and_processor("llava_next_video")
    inputs = single_inputs("llava_next_video")
    full, _, _ = llm_inputs(model, inputs)
    video = inputs["input_ids"][0] == vtc.api.resolve_adapter(model).video_token_id
    slots = torch.nonzero(video).flatten()
    t, hw = 8, 144
    assert slots.numel() == t * hw
    k = keep_per_frame(hw, 0.25)
    kept, previous = [], None
    for f in range(t):
        x = full[slots[f * hw : (f + 1) * hw]]
        kept.append(slots[f * hw + mssavt_frame(x, previous, (12, 12), k)])
        previous = x
    keep = torch.sort(torch.cat([torch.nonzero(~video).flatten(), *kept])).values
    out, positions, handle = llm_inputs(model, inputs, "mssavt", retention=0.25)
    stats = handle.stats()
    assert stats.visual_tokens_out == handle.retained_count((t, 12, 12)) == t * k
    assert torch.equal(out, full[keep])
    assert torch.equal(positions.flatten(), keep)  # positions "keep": the original ones


def test_patched_qwen_batch_keeps_the_retained_count():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "mssavt", retention=0.3) as handle:
        with torch.no_grad():
            model(**batch_inputs("qwen2_vl"))
        stats = handle.stats()
        assert stats.videos == 2
        assert stats.visual_tokens_out == sum(handle.retained_count(g) for g in stats.grids) < stats.visual_tokens_in
        assert [len(r) for r in stats.reports["mssavt"]["temporal_pruned"]] == [t for t, _, _ in stats.grids]
