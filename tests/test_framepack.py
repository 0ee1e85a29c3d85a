"""FramePack-U (abstract only; vtc's reading, specs/from-abstracts.md §2): the MMR ranking's known answer, the
spec's worked example of the resolution ladder, the s_min stop, the leftover rule, frames dropped after the last
packed one, temporal order on the token grid, end-to-end runs on Qwen2.5-VL and LLaVA-OneVision with the exact
token count and what `handle.stats().frames` shows, retention, and bad inputs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import vtc
from tests.conftest import grid_tokens, model_and_processor
from tests.probes import ColourEncoder, coloured_clip
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context
from vtc.media.encoders import FEATURE_CACHE
from vtc.media.video import VideoSource
from vtc_plugins.framepack import FramePackU, grid_ranks, ladder_pack, minmax, mmr_ranking, tier_shape


def test_mmr_ranks_a_diverse_frame_before_a_duplicate_of_the_top_frame():
    # frame 1 is a copy of frame 0 (almost as relevant), frame 2 is orthogonal and the least relevant
    relevance, embeddings = [1.0, 0.9, 0.0], [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    # step 2: frame 1 scores 0.5 * 0.9 - 0.5 * 1 = -0.05, frame 2 scores 0.5 * 0 - 0.5 * 0 = 0
    assert mmr_ranking(relevance, embeddings, 0.5) == [0, 2, 1]
    assert mmr_ranking(relevance, embeddings, 1.0) == [0, 1, 2]  # relevance only
    # min-max: an affine map of the relevance (CLIP's logit scale and bias) gives the same ranking
    assert mmr_ranking([100 * r + 3 for r in relevance], embeddings, 0.5) == [0, 2, 1]
    assert minmax([2.0, 2.0]).tolist() == [0.0, 0.0] and minmax([1.0, 3.0, 2.0]).tolist() == [0.0, 1.0, 0.5]


def test_the_specs_worked_example_packs_all_128_frames_in_5984_tokens():
    """LLaVA-OV: n_0 = 196, s_0 = 14, B = 6272, F = 128: c_0 = 16; 16 x 196 + 32 x 49 + 64 x 16 = 5728, tier 3
    (s = 2) is below s_min, the leftover 544 takes the last 16 frames at s = 4: 16 x 196 + 32 x 49 + 80 x 16."""
    order = torch.randperm(128, generator=torch.Generator().manual_seed(0)).tolist()
    packed = ladder_pack(order, (14, 14), 6272)
    assert Counter(packed.values()) == {(14, 14): 16, (7, 7): 32, (4, 4): 80}
    assert sum(h * w for h, w in packed.values()) == 5984 and len(packed) == 128
    assert all(packed[i] == (14, 14) for i in order[:16]) and all(packed[i] == (7, 7) for i in order[16:48])
    assert [tier_shape(14, 14, t) for t in range(4)] == [(14, 14), (7, 7), (4, 4), (2, 2)]
    assert tier_shape(12, 20, 2) == (3, 5)  # non-square: both sides halved per tier, rounded up


def test_s_min_stops_the_ladder_and_the_leftover_goes_to_the_lowest_tier_used():
    # s_min = 8: tier 1 (s = 7) is below it; the leftover 3136 buys 16 more frames at tier 0 (the baseline's 32)
    packed = ladder_pack(list(range(128)), (14, 14), 6272, s_min=8)
    assert sorted(packed) == list(range(32)) and set(packed.values()) == {(14, 14)}
    # s_min = 1: tier 3 (s = 2) is used, tier 4 is 1 x 1: all frames fit, no leftover rule needed
    assert Counter(ladder_pack(list(range(128)), (14, 14), 6272, s_min=1).values()) == {
        (14, 14): 16,
        (7, 7): 32,
        (4, 4): 64,
        (2, 2): 16,
    }


def test_a_small_budget_drops_every_frame_after_the_last_packed_one():
    # B = 1000: c_0 = 2: 2 x 196 + 4 x 49 + 8 x 16 = 716; the leftover 284 takes 17 frames at 4 x 4 (988)
    order = list(range(99, -1, -1))
    packed = ladder_pack(order, (14, 14), 1000)
    assert set(packed) == set(order[:31])  # a prefix of the ranking; the other 69 frames are dropped
    assert Counter(packed.values()) == {(14, 14): 2, (7, 7): 4, (4, 4): 25}
    assert sum(h * w for h, w in packed.values()) == 988 <= 1000
    # a budget below one full frame skips tier 0 (vtc's reading): 2 frames at 7 x 7
    assert ladder_pack(list(range(10)), (14, 14), 100) == {0: (7, 7), 1: (7, 7)}


def test_grid_ranks_take_the_better_frame_of_a_qwen_pair():
    assert grid_ranks([3, 0, 1, 2], 2) == [0, 1]
    assert grid_ranks([2, 0, 1], 2) == [0, 1]  # odd: the last frame repeated, as the processor pads it
    assert grid_ranks([2, 0, 1], 3) == [2, 0, 1]


def test_connect_resizes_each_frame_to_its_tier_in_temporal_order():
    """A 4 x 4 grid of 6 frames, B = 2 frames = 32 tokens, c_0 = 1, s_min = 2: the best-ranked frame (2) keeps its
    grid, the next two (0, 3) are 2 x 2 (24), tier 2 (1 x 1) is below s_min, the leftover 8 takes frames 1 and 4
    at 2 x 2, and frame 5 (ranked last) is dropped; the output stays in temporal order on the anchor cells."""
    g = torch.Generator().manual_seed(0)
    tokens = grid_tokens(torch.randn(96, 5, generator=g), (6, 4, 4))
    tokens.extras["side"] = tokens.embeds.clone()
    ranks = [1, 3, 0, 2, 4, 5]
    ctx = Context(family="llava_onevision", geometry=default_geometry("llava_onevision"), prepared={"ranks": ranks})
    out = FramePackU(budget_frames=2, s_min=2).bind(None).connect(tokens, ctx)
    assert ctx.reports["budgets"] == [[4, 4, 16, 4, 4, 0]] and len(out) == 32
    assert ctx.reports["sides"] == [[[2, 2], [2, 2], [4, 4], [2, 2], [2, 2], None]]
    assert out.frame.tolist() == sorted(out.frame.tolist()) and set(out.frame.tolist()) == {0, 1, 2, 3, 4}
    maps = tokens.embeds.reshape(6, 4, 4, 5)
    half = torch.nn.functional.interpolate(maps[0].permute(2, 0, 1)[None], size=(2, 2), mode="bilinear")
    torch.testing.assert_close(out.embeds[:4], half[0].permute(1, 2, 0).reshape(4, 5))
    assert torch.equal(out.embeds[8:24], tokens.embeds[32:48])  # the top frame untouched
    assert (out.frame[:4] * 16 + out.patch[:4]).tolist() == [5, 7, 13, 15]  # nearest grid cells of a 2 x 2
    torch.testing.assert_close(out.extras["side"], out.embeds)  # side features resized alike
    with pytest.raises(ValueError, match="framepack-u resizes whole frames"):
        FramePackU().bind(None).connect(tokens.select(torch.arange(1, 96)), ctx)


def _sampler(**params):
    return FramePackU(encoder=ColourEncoder(), encoder_pretrained=None, **params).bind(None)


def test_sample_hands_every_candidate_over_with_its_rank():
    video = VideoSource.open(coloured_clip(), fps=4.0)  # 80 frames, red 48..55
    ctx = Context(question="red")
    choice = _sampler().sample(video, ctx)
    assert choice.indices == choice.candidates == list(range(80))  # temporal order; packing is on the grid
    ranking = ctx.reports["ranking"][0]
    assert set(ranking[:8]) == set(range(48, 56)) and sorted(ctx.state["ranks"]) == list(range(80))
    assert max(choice.scores) == 1.0 and min(choice.scores) == 0.0  # min-max normalised relevance
    fewer = _sampler(candidates=16).sample(video, Context(question="red"))
    assert len(fewer.indices) == 16 and fewer.indices == sorted(fewer.indices) and fewer.indices[-1] == 79


CLIP = dict(seconds=8, red=(5,), blue=(2,))  # 32 frames at 4 fps, red 20..23


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_end_to_end_the_llm_sees_the_ladders_tokens(family):
    model, processor = model_and_processor(family)
    FEATURE_CACHE.clear()
    params = {"budget_frames": 8} if family == "qwen2_5_vl" else {}
    with vtc.patch(model, "framepack-u", encoder=ColourEncoder(), **params) as handle:
        inputs = handle.prepare(processor, coloured_clip(**CLIP), "where is the red ball?", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        chosen = stats.frames[0]
        assert chosen.method == "framepack-u" and chosen.indices == chosen.candidates == list(range(32))
        assert set(chosen.reports["ranking"][0][:4]) == set(range(20, 24))
        budgets = stats.reports["framepack-u"]["budgets"][0]
        if family == "llava_onevision":
            # B = 32 x 196 = 6272, c_0 = 16: 16 frames x 196 + the other 16 x 49 (tier 1) = 3920
            assert stats.grids[0] == (32, 14, 14)
            assert stats.llm_tokens_in == sum(budgets) == 16 * 196 + 16 * 49 == 3920
            assert all(budgets[i] == 196 for i in range(20, 24))  # the red frames are at full resolution
        else:
            # 16 grid frames of 12 x 12 (pairs), B = 8 x 144 = 1152, c_0 = 4: 4 x 144 + 8 x 36 = 864; tier 2
            # (3 x 3) is below s_min, the leftover 288 takes the last 4 grid frames at 6 x 6: 1008
            assert stats.grids[0] == (16, 12, 12)
            assert stats.llm_tokens_in == sum(budgets) == 4 * 144 + 12 * 36 == 1008
            assert budgets[10] == budgets[11] == 144  # the grid frames of the red frames 20..23
        assert stats.visual_tokens_in == 32 * 196 if family == "llava_onevision" else 16 * 144


def test_retention_is_exactly_what_the_llm_sees():
    model, processor = model_and_processor("llava_onevision")
    with vtc.patch(model, "framepack-u", retention=0.1, encoder=ColourEncoder()) as handle:
        inputs = handle.prepare(processor, coloured_clip(**CLIP), "red", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        # B = round(0.1 * 6272) = 627: c_0 = 1: 1 x 196 + 2 x 49 + 4 x 16 = 358; leftover 269 -> 16 x 16 (614);
        # the 23 packed frames share 627 tokens in those proportions
        budgets = stats.reports["framepack-u"]["budgets"][0]
        assert stats.llm_tokens_in == sum(budgets) == round(0.1 * stats.visual_tokens_in) == 627
        assert sum(b > 0 for b in budgets) == 23


def test_bad_inputs_name_the_problem():
    model, processor = model_and_processor("qwen2_5_vl")
    with vtc.patch(model, "framepack-u", encoder=ColourEncoder()) as handle:
        with pytest.raises(ValueError, match="question"):
            handle.prepare(processor, coloured_clip(**CLIP), "", fps=4)
    with pytest.raises(ValueError, match="lambda_mmr"):
        mmr_ranking([1.0, 2.0], [[1.0], [1.0]], 1.5)
    with pytest.raises(ValueError, match="no candidate"):
        mmr_ranking([], torch.zeros(0, 2), 0.5)
    with pytest.raises(ValueError, match="budget"):
        ladder_pack([0, 1], (4, 4), 0)
    with pytest.raises((ValueError, TypeError)):
        FramePackU(lambda_mmr=2.0)
    with pytest.raises(ValueError, match="handle.prepare"):
        FramePackU().bind(None).connect(grid_tokens(torch.zeros(16, 2), (1, 4, 4)), Context())
