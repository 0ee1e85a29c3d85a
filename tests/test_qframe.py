"""Q-Frame: QFS against a transcription of the paper's formula on random scores, known answers (tau -> 0 is the
similarity top-K, a hand-computed Gumbel ranking at seed 0), the MRA tiers and their 16 : 4 : 1 budgets, temporal
order, the resized frames at their anchor cells, end-to-end runs on Qwen2.5-VL and LLaVA-OneVision with what
`handle.stats().frames` shows, composition, and bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import vtc
from tests.conftest import grid_tokens, model_and_processor
from tests.probes import ColourEncoder, coloured_clip
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context
from vtc.media.encoders import FEATURE_CACHE
from vtc.media.video import VideoSource
from vtc_plugins.qframe import (
    QFrame,
    QFrameQFS,
    candidate_frames,
    frame_cells,
    own_fraction,
    qfs_ranking,
    tier_counts,
    tier_weights,
    tiers_by_rank,
)
from vtc_plugins.quota import resize_frame


def paper_qfs(scores, tau, u):
    """Q-Frame §3.2, transcribed: pi = softmax(I / tau), g = -log(-log eps), p = log pi + g, frames ranked by p."""
    logits = np.asarray(scores, dtype=np.float64) / tau
    pi = np.exp(logits - logits.max())
    pi = pi / pi.sum()
    g = -np.log(-np.log(u))
    return np.argsort(-(np.log(pi) + g), kind="stable").tolist()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("tau", [0.5, 0.8, 1.2])
def test_qfs_is_the_papers_gumbel_max_on_random_scores(seed, tau):
    scores = np.random.default_rng(seed).normal(25, 3, size=128)
    u = torch.rand(128, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).numpy()
    assert qfs_ranking(scores, tau, seed)[0] == paper_qfs(scores, tau, u)


def test_tau_to_zero_is_the_similarity_top_k():
    scores = np.random.default_rng(3).normal(0, 1, size=64)
    for seed in range(4):
        ranking, _ = qfs_ranking(scores, 1e-6, seed)
        assert ranking[:8] == np.argsort(-scores)[:8].tolist()


def test_a_fixed_seed_gives_the_hand_computed_ranking():
    # u from torch.Generator().manual_seed(0): 0.97005, 0.70782, 0.45938, 0.92075; log pi = I - log sum e^I
    # p = (-3.4402 + 3.4932, -2.4402 + 1.0626, -1.4402 + 0.2512, -0.4402 + 2.4941)
    ranking, p = qfs_ranking([1.0, 2.0, 3.0, 4.0], 1.0, 0)
    assert ranking == [3, 0, 2, 1]
    assert p == pytest.approx([0.05297, -1.37762, -1.18900, 2.05393], abs=1e-5)
    assert qfs_ranking([1.0, 2.0, 3.0, 4.0], 1.0, 0) == (ranking, p)  # reproducible
    # a large tau flattens pi: the noise decides, so another seed ranks otherwise
    assert qfs_ranking(list(range(16)), 100.0, 0)[0] != qfs_ranking(list(range(16)), 100.0, 1)[0]


def test_tiers_by_rank_and_their_16_4_1_shares():
    ranking = [5, 1, 7, 0, 3, 2, 6, 4]
    tiers = tiers_by_rank(ranking, 2, 3, 2)
    assert tiers == {5: "high", 1: "high", 7: "medium", 0: "medium", 3: "medium", 2: "low", 6: "low"}
    chosen = sorted(tiers)  # temporal order; 4 (ranked last) is dropped
    assert chosen == [0, 1, 2, 3, 5, 6, 7]
    assert tier_weights([tiers[i] for i in chosen]) == [1 / 4, 1, 1 / 16, 1 / 4, 1, 1 / 16, 1 / 4]
    assert tier_counts(4, 8, 32, None) == tier_counts(4, 8, 32, 44) == (4, 8, 32)
    assert tier_counts(4, 8, 32, 8) == (1, 1, 6)  # a request split in the same proportion
    assert tier_counts(4, 8, 32, 1) == (1, 0, 0)
    # the main setting in high-frame equivalents: K + M/4 + N/16 = 8
    shares = tier_weights(["high"] * 4 + ["medium"] * 8 + ["low"] * 32)
    assert sum(shares) == 8 and own_fraction(shares, 44) == pytest.approx(8 / 44)


def test_budgets_are_16_4_1_of_a_frame_or_of_the_retention():
    sampler = QFrame().bind(None)
    shares = [1, 1 / 4, 1 / 16]
    assert sampler.budgets(shares, 3 * 16, (3, 4, 4)) == [16, 4, 1]  # the tiers' own count
    assert sampler.budgets(shares * 2, 6 * 16, (6, 4, 4)) == [16, 4, 1] * 2
    # Qwen pairs frames: a pair keeps its mean share of one grid frame (the last frame repeated when odd)
    assert sampler.budgets([1, 1, 1 / 4, 1 / 4], 2 * 16, (2, 4, 4)) == [16, 4]
    assert own_fraction([1, 1 / 4, 1 / 16], 2) == pytest.approx((1 + 1 / 4 + 1 / 16 + 1 / 16) / 4)
    counts = QFrame().bind(0.875).budgets(shares, 3 * 16, (3, 4, 4))  # round(0.875 * 48) = 42 = 2 * 21
    assert counts == [32, 8, 2] and sum(counts) == 42
    assert QFrame().bind(0.25).retained_count(48, (3, 4, 4), "llava_onevision") == 12
    assert QFrame().bind(None).retained_count(48, (3, 4, 4), "llava_onevision") is None


def test_frame_cells_keep_a_full_frame_and_resize_the_others():
    grid = torch.arange(4 * 4 * 2, dtype=torch.float32).reshape(4, 4, 2)
    cells, shape = frame_cells(grid, 16, 4, 4)
    assert shape == (4, 4) and torch.equal(cells, grid.reshape(16, 2))  # untouched
    cells, shape = frame_cells(grid, 4, 4, 4)  # a quarter: bilinear 2 x 2 (QuoTA's resize_frame)
    expected = torch.nn.functional.interpolate(grid.permute(2, 0, 1)[None], size=(2, 2), mode="bilinear")
    assert shape == (2, 2) and torch.allclose(cells, expected[0].permute(1, 2, 0).reshape(4, 2))
    assert frame_cells(grid, 1, 4, 4)[0].shape == (1, 2)
    # a pre-pool map (8 x 8) at a full share is resized to the model's 4 x 4 grid
    cells, shape = frame_cells(torch.zeros(8, 8, 3), 16, 4, 4)
    assert shape == (4, 4) and cells.shape == (16, 3)


def test_connect_keeps_high_frames_and_resizes_the_others_onto_their_anchor_cells():
    """LLaVA-OV grid (one grid frame per frame): a high frame keeps its cells and positions; a medium frame (4 of
    16) is a bilinear 2 x 2 whose cells sit at (and take the positions of) the nearest grid cells; a low one is 1."""
    g = torch.Generator().manual_seed(0)
    tokens = grid_tokens(torch.randn(48, 5, generator=g), (3, 4, 4))
    tokens.extras["side"] = tokens.embeds.clone()
    ctx = Context(
        family="llava_onevision",
        geometry=default_geometry("llava_onevision"),
        prepared={"weights": [1 / 4, 1, 1 / 16]},
    )
    out = QFrame().bind(None).connect(tokens, ctx)
    assert ctx.reports == {"budgets": [[4, 16, 1]]} and len(out) == 21
    anchors = [1 * 4 + 1, 1 * 4 + 3, 3 * 4 + 1, 3 * 4 + 3] + list(range(16, 32)) + [32 + 2 * 4 + 2]
    assert (out.frame * 16 + out.patch).tolist() == anchors
    assert torch.equal(out.positions, tokens.positions[..., anchors])
    maps = tokens.embeds.reshape(3, 4, 4, 5)
    expected = torch.cat([resize_frame(maps[0], 4, True)[0], maps[1].reshape(16, 5), resize_frame(maps[2], 1, True)[0]])
    torch.testing.assert_close(out.embeds, expected)
    assert torch.equal(out.embeds[4:20], tokens.embeds[16:32])  # the high frame untouched
    torch.testing.assert_close(out.extras["side"], out.embeds)  # side features resized alike
    with pytest.raises(ValueError, match="q-frame resizes whole frames"):
        QFrame().bind(None).connect(tokens.select(torch.arange(1, 48)), ctx)


def test_short_clips_give_each_frame_once_as_a_candidate():
    assert candidate_frames(1000) == np.linspace(0, 999, 128, dtype=int).tolist()
    assert candidate_frames(10) == list(range(10))


def _sampler(cls=QFrame, **params):
    return cls(encoder=ColourEncoder(), encoder_pretrained=None, **params).bind(None)


def test_sample_ranks_red_frames_high_in_temporal_order():
    video = VideoSource.open(coloured_clip(), fps=4.0)  # 80 frames, red 48..55
    ctx = Context(question="red")
    choice = _sampler().sample(video, ctx)
    assert choice.indices == sorted(choice.indices) and len(choice.indices) == 44
    assert choice.candidates == list(range(80)) and len(choice.scores) == 80
    tiers = dict(zip(choice.indices, ctx.state["tiers"]))
    high = [i for i, t in tiers.items() if t == "high"]
    assert len(high) == 4 and set(high) <= set(range(48, 56))
    assert all(tiers[i] in ("high", "medium") for i in range(48, 56))  # the eight red frames fill the top 12
    assert ctx.state["weights"] == tier_weights(ctx.state["tiers"])
    # q-frame-qfs: the best K only, at full resolution
    qfs = _sampler(QFrameQFS, num_frames=4).sample(video, Context(question="red"))
    assert len(qfs.indices) == 4 and set(qfs.indices) <= set(range(48, 56)) and qfs.indices == sorted(qfs.indices)
    assert qfs.indices == sorted(high)  # the same scores and seed: the same top four


def test_raw_cosine_is_almost_uniform_sampling():
    """Spec 11.3: with raw cosines and tau = 0.8 pi is nearly flat; the logit scale makes the question matter."""
    video = VideoSource.open(coloured_clip(), fps=4.0)
    scaled = _sampler(QFrameQFS, num_frames=8).sample(video, Context(question="red"))
    raw = _sampler(QFrameQFS, num_frames=8, logit_scale=False).sample(video, Context(question="red"))
    assert set(scaled.indices) == set(range(48, 56))
    assert len(set(raw.indices) & set(range(48, 56))) < 8
    assert max(raw.scores) <= 1.0 and max(scaled.scores) > 50


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_end_to_end_the_model_sees_the_tiers_and_stats_show_the_frames(family):
    model, processor = model_and_processor(family)
    FEATURE_CACHE.clear()
    with vtc.patch(model, "q-frame", encoder=ColourEncoder(), high=2, medium=2, low=4) as handle:
        inputs = handle.prepare(processor, coloured_clip(), "where is the red ball?", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        chosen = stats.frames[0]
        assert chosen.method == "q-frame" and len(chosen.indices) == 8 and chosen.indices == sorted(chosen.indices)
        assert chosen.candidates == list(range(80))
        assert chosen.scores == [chosen.candidate_scores[chosen.candidates.index(i)] for i in chosen.indices]
        assert set(chosen.indices) == set(range(48, 56))  # the eight red frames outrank every grey one
        tiers = chosen.reports["tiers"][0]
        assert sorted(tiers) == sorted(["high"] * 2 + ["medium"] * 2 + ["low"] * 4)
        t, h, w = stats.grids[0]
        assert stats.visual_tokens_in == t * h * w
        # the tiers' own count: 2 + 2/4 + 4/16 = 2.75 full frames of 8 (Qwen: 1.375 of 4 grid frames)
        expected = round(t * h * w * 2.75 / 8)
        budgets = stats.reports["q-frame"]["budgets"][0]
        assert stats.llm_tokens_in == sum(budgets) == expected
        if family == "llava_onevision":  # one grid frame per frame: 16 : 4 : 1 of h * w (largest remainder)
            full = {"high": h * w, "medium": h * w / 4, "low": h * w / 16}
            assert all(abs(b - full[tier]) < 1 for b, tier in zip(budgets, tiers))
        else:  # Qwen pairs frames: each grid frame keeps the mean share of its pair
            pairs = [tier_weights(tiers[i : i + 2]) for i in range(0, 8, 2)]
            assert all(abs(b - h * w * sum(p) / 2) < 1 for b, p in zip(budgets, pairs))


def test_retention_is_what_the_llm_sees():
    model, processor = model_and_processor("qwen2_5_vl")
    with vtc.patch(model, "q-frame", retention=0.25, encoder=ColourEncoder(), high=2, medium=2, low=4) as handle:
        inputs = handle.prepare(processor, coloured_clip(), "red", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        assert stats.llm_tokens_in == round(stats.visual_tokens_in * 0.25)


def test_the_sampler_composes_with_a_connect_method_and_q_frame_resizes_first():
    model, processor = model_and_processor("qwen2_5_vl")
    with vtc.patch(model, "q-frame-qfs+vidcom2", retention=0.5, encoder=ColourEncoder(), num_frames=4) as handle:
        inputs = handle.prepare(processor, coloured_clip(), "the red ball", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        assert stats.frames[0].method == "q-frame-qfs" and len(stats.frames[0].indices) == 4
        assert set(stats.frames[0].indices) <= set(range(48, 56))
        assert stats.llm_tokens_in == round(stats.visual_tokens_in * 0.5)
    assert vtc.registry()["q-frame"].card.reduces_tokens and not vtc.registry()["q-frame-qfs"].card.reduces_tokens
    with pytest.raises(ValueError, match="both decide frame selection"):
        vtc.patch(model, "q-frame+uniform")


def test_bad_inputs_name_the_problem():
    model, processor = model_and_processor("qwen2_vl")
    with vtc.patch(model, "q-frame", encoder=ColourEncoder()) as handle:
        with pytest.raises(ValueError, match="question"):
            handle.prepare(processor, coloured_clip(), "", fps=4)
    with pytest.raises(ValueError, match="tau"):
        qfs_ranking([1.0, 2.0], 0.0, 0)
    with pytest.raises(ValueError, match="no candidate"):
        qfs_ranking([], 0.8, 0)
    with pytest.raises((ValueError, TypeError)):
        QFrame(tau=-1.0)
    # the connect stage alone (cached inputs, no handle.prepare) has no tiers to size frames by
    from tests.conftest import single_inputs

    with vtc.patch(model, "q-frame", encoder=ColourEncoder()):
        with pytest.raises(ValueError, match="handle.prepare"):
            with torch.no_grad():
                model(**single_inputs("qwen2_vl"))
    assert math.isclose(sum(tier_weights(["high", "medium", "low"])), 21 / 16)
