"""OmniDelta's intra-modal allocation (spec: from-abstracts §6), known answers: the budget split (uniform when the
scores are equal, exact total, caps and floors, overflow redistributed), a static frame gets fewer tokens than a
busy one, an image (one frame) keeps its whole budget through VidCom²'s token score, and the method's count on a
real tiny model."""

from __future__ import annotations

import pytest
import torch

import vtc
from tests.probes import llm_inputs
from vtc.testing.fixtures import model_and_processor, single_inputs
from vtc_plugins.omnidelta import allocate_budgets, frame_scores, item_budget, omnidelta_keep
from vtc_plugins.vidcom2 import gaussian_scores, low_variance_channels


def test_budgets_are_uniform_for_equal_scores_and_exact_otherwise():
    assert allocate_budgets([10, 10, 10, 10], torch.ones(4), 20) == [5, 5, 5, 5]
    assert allocate_budgets([10, 10, 10], torch.ones(3), 10) == [4, 3, 3]  # largest remainder, ties: the earlier
    assert allocate_budgets([10, 10], torch.tensor([3.0, 1.0]), 8) == [6, 2]


def test_budgets_respect_caps_and_floors_and_redistribute_the_overflow():
    # the first frame would get 9 * 0.9 / 1.0 ~ 8.1 of 9 but has 4 tokens: capped, the rest shared by the others
    assert allocate_budgets([4, 10, 10], torch.tensor([0.9, 0.05, 0.05]), 9) == [4, 3, 2]
    assert allocate_budgets([5, 5, 5], torch.tensor([1.0, 0.0, 0.0]), 6) == [4, 1, 1]  # floors of one
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        counts = torch.randint(1, 30, (7,), generator=g).tolist()
        total = int(torch.randint(7, sum(counts) + 1, (1,), generator=g))
        budgets = allocate_budgets(counts, torch.rand(7, generator=g), total)
        assert sum(budgets) == total and all(1 <= b <= c for b, c in zip(budgets, counts))
    with pytest.raises(ValueError, match="cannot give 3 frames"):
        allocate_budgets([2, 2, 2], torch.ones(3), 2)


def test_a_static_frame_gets_fewer_tokens_than_a_busy_one():
    """Frame 1 repeats frame 0 (redundancy 1): its score is the floor, so nearly all of the budget goes to the
    busy frames; a flat frame (every token the same: complexity 0) gets the floor too."""
    g = torch.Generator().manual_seed(0)
    busy = torch.randn(16, 32, generator=g)
    flat = torch.randn(32, generator=g).expand(16, 32)
    embeds = torch.cat([busy, busy, flat, torch.randn(16, 32, generator=g)])
    frame = torch.arange(4).repeat_interleave(16)
    scores = frame_scores(embeds, [torch.arange(f * 16, (f + 1) * 16) for f in range(4)])
    assert scores[1] == pytest.approx(1e-3, abs=1e-5) and scores[2] == pytest.approx(1e-3, abs=1e-5)
    keep, budgets = omnidelta_keep(embeds, frame, rho=0.25)
    assert sum(budgets) == keep.numel() == 16 and budgets[1] == budgets[2] == 1 and min(budgets[0], budgets[3]) >= 6


def test_an_image_keeps_its_budget_by_vidcom2s_token_score():
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(20, 16, generator=g)
    keep, budgets = omnidelta_keep(embeds, torch.zeros(20, dtype=torch.long), rho=0.25)
    x = embeds[:, low_variance_channels(embeds, 0.5)]
    video, frame = gaussian_scores(x, [torch.arange(20)])
    assert budgets == [5] and keep.tolist() == sorted(torch.topk(video + frame, 5, largest=False).indices.tolist())
    assert item_budget(20, 1, 0.25) == 5 and item_budget(20, 8, 0.1) == 8 and item_budget(20, 1, 1.0) == 20


def test_on_a_model_each_item_keeps_its_count_and_retention_one_is_stock():
    model, _ = model_and_processor("qwen2_5_vl")
    inputs = single_inputs("qwen2_5_vl")
    stock, _, _ = llm_inputs(model, inputs)
    same, _, _ = llm_inputs(model, inputs, "omnidelta", retention=1.0)
    assert torch.equal(same, stock)
    _, _, handle = llm_inputs(model, inputs, "omnidelta", retention=0.25)
    stats = handle.stats()
    (grid,) = stats.grids
    assert stats.llm_tokens_in == handle.retained_count(grid) == round(0.25 * grid[0] * grid[1] * grid[2])
    assert sum(stats.reports["omnidelta"]["budgets"][0]) == stats.llm_tokens_in
    with pytest.raises(ValueError, match="rho"):
        vtc.patch(model, "omnidelta", rho=1.5)
