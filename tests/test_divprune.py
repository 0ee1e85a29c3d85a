"""DivPrune: the greedy Max-Min selection against a loop re-derivation of the official `DivPrune` function and
a brute-force check of every greedy step, hand-built clusters, the count, and the patched model end to end
(the LLM receives exactly the tokens the pure function picks)."""

from __future__ import annotations

import pytest
import torch

import vtc
from tests.conftest import grid_tokens, model_and_processor, single_inputs
from tests.probes import llm_inputs
from vtc.core.bases import fraction_count as kept_count
from vtc.core.geometry import default_geometry
from vtc.core.tokens import Context, VideoTokens
from vtc_kernels.diverse import cosine_distance_matrix, max_min_select
from vtc_plugins.divprune import DivPrune, divprune_keep


def official_reference(x: torch.Tensor, ratio: float) -> list[int]:
    """The official `DivPrune(visual_feature_vectors, image_feature_length, threshold_ratio)` re-derived with
    loops: picks in order (the caller sorts them, as `keep_indexs.sort()` does)."""
    n = x.shape[0]
    unit = [x[i] / x[i].norm() for i in range(n)]
    dist = [[1.0 - float((unit[i] * unit[j]).sum()) for j in range(n)] for i in range(n)]
    picks: list[int] = []
    for step in range(int(round(ratio * n))):
        if step == 0:
            scores = [sorted(dist[i][j] for i in range(n))[1] for j in range(n)]  # second-smallest per column
        else:
            scores = [min(dist[s][j] for s in picks) for j in range(n)]
        best = max(range(n), key=lambda j: (scores[j], -j))  # argmax, first index on ties
        picks.append(best)
    return picks


def make_tokens(embeds: torch.Tensor) -> VideoTokens:
    """Frames of 2 x 2 tokens (n a multiple of 4), positions = flat index."""
    return grid_tokens(embeds, (embeds.shape[0] // 4, 2, 2))


def test_defaults_and_retention_mapping():
    assert DivPrune().ratio is None and DivPrune().compute_dtype is None
    info = vtc.registry()["divprune"].card
    assert info.stages == ("connect",) and info.positions == "compact" and info.fixed_count
    assert info.fixed_count_mode == "always" and not info.query_aware  # no fixed_count switch: always exact
    assert not info.vision_stats and not info.prepool and not info.whole_frames
    assert info.retention_reference == "llm_input"
    assert DivPrune().bind(None).fraction() == 0.098  # SUBSET_RATIO of run_Divprune.sh
    assert DivPrune().bind(0.25).fraction() == 0.25
    assert DivPrune(ratio=0.1).bind(0.25).fraction() == 0.1  # explicit wins
    with pytest.raises(ValueError, match=r"divprune: ratio must be in \(0, 1\], got 1.5"):
        DivPrune(ratio=1.5)


def test_count_is_round_ratio_times_l():
    assert kept_count(576, 0.098) == 56  # the paper's LLaVA-1.5 setting
    assert kept_count(1568, 0.25) == 392
    assert kept_count(25, 0.1) == 2  # round(2.5): half to even, as Python's round in the official code
    assert kept_count(35, 0.1) == 4  # round(3.5)
    assert kept_count(3, 0.098) == 1  # never zero
    assert DivPrune().bind(0.3).retained_count(1152, (8, 12, 12), "llava_next_video") == 346
    assert DivPrune().bind(0.3).retained_count(1152, (8, 12, 12), "qwen2_vl") == 346  # any family
    assert DivPrune().bind(0.3).retained_count(0, (8, 12, 12), "qwen2_vl") == 0  # nothing left


def test_distance_matrix():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0]])
    assert torch.allclose(cosine_distance_matrix(x), torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0], [2.0, 1.0, 0.0]]))


@pytest.mark.parametrize("seed,n,ratio", [(0, 12, 0.5), (1, 30, 0.098), (2, 40, 0.25), (3, 9, 1.0)])
def test_matches_a_loop_rederivation_of_the_official_function(seed, n, ratio):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    picks = official_reference(x, ratio)
    assert max_min_select(cosine_distance_matrix(x), len(picks)).tolist() == picks
    assert divprune_keep(x, len(picks)).tolist() == sorted(picks)


def test_every_greedy_step_is_the_brute_force_max_min_choice():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(10, 4, generator=g, dtype=torch.float64)
    dist = cosine_distance_matrix(x)
    picks = max_min_select(dist, 5).tolist()
    # first: the token whose nearest neighbour is farthest
    nearest = [min(float(dist[i, j]) for i in range(10) if i != j) for j in range(10)]
    assert picks[0] == max(range(10), key=lambda j: nearest[j])
    # then: among all tokens not picked, the one whose closest picked token is farthest
    for step in range(1, 5):
        rest = [j for j in range(10) if j not in picks[:step]]
        assert picks[step] == max(rest, key=lambda j: min(float(dist[s, j]) for s in picks[:step]))


def test_one_token_per_far_apart_cluster_first():
    g = torch.Generator().manual_seed(8)
    directions = torch.eye(4, dtype=torch.float64)
    clusters = [0] * 6 + [1] * 5 + [2] * 4 + [3] * 1  # cluster 3 is a single token, far from everything
    x = directions[clusters] + 0.02 * torch.randn(len(clusters), 4, generator=g, dtype=torch.float64)
    picks = max_min_select(cosine_distance_matrix(x), 4).tolist()
    assert picks[0] == 15  # its nearest neighbour is farthest
    assert sorted(clusters[i] for i in picks) == [0, 1, 2, 3]
    keep = divprune_keep(x, 4)
    assert bool((keep[1:] > keep[:-1]).all()) and sorted(clusters[i] for i in keep.tolist()) == [0, 1, 2, 3]


def test_duplicates_never_picked_twice():
    # two distinct directions, each repeated: after two picks every remaining token duplicates a kept one
    x = torch.tensor([[1.0, 0.0]] * 5 + [[0.0, 1.0]] * 5)
    picks = max_min_select(cosine_distance_matrix(x), 6)
    assert picks.unique().numel() == 6
    assert sorted(set(int(x[i, 1]) for i in picks[:2])) == [0, 1]


def test_plugin_identity_count_and_dtype():
    g = torch.Generator().manual_seed(9)
    tokens = make_tokens(torch.randn(40, 8, generator=g))
    ctx = Context(family="llava_next_video", geometry=default_geometry("llava_next_video"))
    assert DivPrune().bind(1.0).connect(tokens, ctx) is tokens
    out = DivPrune().bind(0.25).connect(tokens, ctx)
    keep = divprune_keep(tokens.embeds, 10)
    assert len(out) == 10 and torch.equal(out.embeds, tokens.embeds[keep]) and torch.equal(out.positions, keep)
    assert torch.equal(out.frame, keep // 4) and torch.equal(out.patch, keep % 4)  # grid cells follow the tokens
    assert ctx.reports == {}  # DivPrune reports nothing: its count is len(out)
    half = make_tokens(tokens.embeds.bfloat16())
    assert len(DivPrune().bind(0.25).connect(half, ctx)) == 10
    up = DivPrune(compute_dtype="float32").bind(0.25).connect(half, ctx)
    assert torch.equal(up.positions, divprune_keep(half.embeds.float(), 10))


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_5_vl"])
def test_patched_model_sees_the_chosen_tokens(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    full, full_positions, _ = llm_inputs(model, inputs)
    adapter = vtc.api.resolve_adapter(model)
    video = inputs["input_ids"][0] == adapter.video_token_id
    slots = torch.nonzero(video).flatten()
    if family == "llava_onevision":
        assert slots.numel() == 8 * 196 + 1
        slots = slots[:-1]  # the newline token after the frames is not a frame token: never pruned
        video = torch.zeros_like(video)
        video[slots] = True
    keep_visual = divprune_keep(full[slots], kept_count(slots.numel(), 0.25))
    keep = torch.sort(torch.cat([torch.nonzero(~video).flatten(), slots[keep_visual]])).values
    out, positions, handle = llm_inputs(model, inputs, "divprune", retention=0.25)
    stats = handle.stats()
    assert stats.visual_tokens_out == keep_visual.numel() == round(0.25 * slots.numel())
    assert [(s.stage, s.plugin, s.tokens_in, s.tokens_out) for s in stats.stages] == [
        ("connect", "divprune", slots.numel(), keep_visual.numel())
    ]
    assert "divprune" not in stats.reports
    assert torch.equal(out, full[keep])
    if adapter.mrope:  # Qwen: original (t, h, w) positions of the survivors
        assert torch.equal(positions[-3:, 0], full_positions[-3:, 0][:, keep])
    else:  # LLaVA: renumbered 0..n-1 like the official code
        assert torch.equal(positions.flatten(), torch.arange(keep.numel()))
