"""VisionZip: counts and the retention mapping, the per-frame selection against a loop re-derivation of the
port's `visionzip(...)` (HoliTom `visionzip/llava_arch.py`), hand-built frames whose answer is known, the
attention maps per family, the token order per family, and the patched models end to end."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import grid_tokens, model_and_processor, single_inputs
from tests.probes import connect_inputs, llm_inputs
from vtc.core.geometry import FamilyGeometry, default_geometry
from vtc.core.tokens import Context
from vtc.core.vision_stats import VisionStat
from vtc_plugins.visionzip import (
    VisionZip,
    contextual_features,
    frame_tokens,
    select_frame,
    split_counts,
    token_grid_maps,
    vision_stats_for,
)


def port_reference(hidden, attention, metric, dominant_num, contextual_num):
    """Loop re-derivation of the port's per-frame `visionzip` (one_token models): hidden [S, D], attention [S],
    metric [S, d] -> tokens [dominant (spatial order); contextual (target order)]."""
    seq_len = hidden.shape[0]
    top = set(torch.topk(attention, dominant_num).indices.tolist())
    dominant = [i for i in range(seq_len) if i in top]
    rest = [i for i in range(seq_len) if i not in top]
    normalized = [metric[i] / metric[i].norm() for i in rest]
    step = max(1, len(rest) // contextual_num)
    targets = list(range(0, len(rest), step))[:contextual_num]
    sums = [torch.zeros_like(hidden[0]) for _ in targets]
    counts = [0 for _ in targets]
    for j in range(len(rest)):
        if j in targets:
            continue
        sims = [float(normalized[j] @ normalized[t]) for t in targets]
        best = max(range(len(targets)), key=lambda k: (sims[k], -k))  # argmax: first maximum
        sums[best] = sums[best] + hidden[rest[j]]
        counts[best] += 1
    contextual = [hidden[rest[t]] + sums[k] / max(counts[k], 1) for k, t in enumerate(targets)]
    return torch.stack([hidden[i] for i in dominant] + contextual), dominant, [rest[t] for t in targets]


# --- counts -------------------------------------------------------------------------------------------------------


def test_retention_maps_to_the_ports_spatial_tokens():
    # the port's SPATIAL_TOKENS for 10/15/20 % of 196 tokens; 25 % gives 49 (the port ran 50)
    assert [frame_tokens(196, r) for r in (0.10, 0.15, 0.20, 0.25)] == [20, 30, 40, 49]
    assert frame_tokens(196, None) == 50  # the port's default SPATIAL_TOKENS
    assert frame_tokens(196, 1.0) == 196 and frame_tokens(144, 0.001) == 1
    assert frame_tokens(200, 0.35) == 70  # no float ceil artefact (0.35 * 200 = 70.00000000000001)


def test_split_counts_use_the_54_64_dominant_ratio():
    assert [split_counts(s) for s in (20, 30, 40, 50)] == [(16, 4), (25, 5), (33, 7), (42, 8)]
    assert split_counts(64) == (54, 10)  # the README's LLaVA-1.5 setting
    assert split_counts(1) == (0, 1)


def test_params_defaults_and_validation():
    p = VisionZip()
    assert p.tokens_per_frame is None and p.dominant_ratio == 54 / 64 and p.merge_before_projector
    with pytest.raises(ValueError, match="both"):
        VisionZip(dominant=10)
    with pytest.raises(ValueError, match="not both"):
        VisionZip(tokens_per_frame=10, dominant=5, contextual=5)
    with pytest.raises(ValueError, match="dominant_ratio"):
        VisionZip(dominant_ratio=1.5)
    with pytest.raises(ValueError, match="tokens_per_frame"):
        VisionZip(tokens_per_frame=0)


def test_retained_count_is_fixed_per_frame():
    plugin = VisionZip().bind(0.10)
    assert plugin.retained_count(32 * 196, (32, 14, 14), "llava_onevision") == 32 * 20
    assert plugin.retained_count(32 * 196, (32, 14, 14), "qwen2_vl") == 32 * 20  # the grid decides, not the family
    fixed = VisionZip(tokens_per_frame=50).bind(0.10)
    assert fixed.retained_count(8 * 196, (8, 14, 14), "llava_onevision") == 400
    explicit = VisionZip(dominant=54, contextual=10).bind(None)
    assert explicit.retained_count(4 * 144, (4, 12, 12), "llava_next_video") == 256
    assert VisionZip().bind(1.0).retained_count(4 * 144, (4, 12, 12), "llava_next_video") == 4 * 144
    assert plugin.retained_count(100, (32, 14, 14), "llava_onevision") is None  # thinned by an earlier plugin
    cls = vtc.registry()["visionzip"]
    card = cls.card
    assert card.stages == ("connect",) and card.fixed_count and card.positions == "compact"
    assert card.fixed_count_mode == "always"
    assert not card.query_aware
    # reads tower attention and keys; LLaVA-NeXT-Video merges CLIP features before the projector (pre-pool)
    assert card.vision_stats and card.prepool and not card.whole_frames
    assert card.retention_reference == "llm_input" and card.retention_note
    assert set(cls.testing.exemptions) == {"ordered_positions"}  # the port's per-frame order on LLaVA


# --- the per-frame selection --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dominant,contextual", [(42, 8), (16, 4), (0, 7), (30, 1), (50, 0)])
def test_select_frame_matches_the_port(seed, dominant, contextual):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(196, 12, generator=g, dtype=torch.float64)
    attention = torch.rand(196, generator=g, dtype=torch.float64)
    metric = torch.randn(196, 6, generator=g, dtype=torch.float64)
    plan = select_frame(attention, metric, dominant, contextual)
    merged = contextual_features(hidden[plan.targets], hidden[plan.members], plan.assign)
    ours = torch.cat([hidden[plan.dominant], merged])
    if contextual == 0:  # the port divides by zero here; vtc keeps the dominant tokens only
        assert plan.targets.numel() == 0 and plan.dominant.tolist() == sorted(plan.dominant.tolist())
        return
    ref, ref_dominant, ref_targets = port_reference(hidden, attention, metric, dominant, contextual)
    assert plan.dominant.tolist() == ref_dominant and plan.targets.tolist() == ref_targets
    assert sorted(plan.members.tolist()) == sorted(set(range(196)) - set(ref_dominant) - set(ref_targets))
    torch.testing.assert_close(ours, ref)


def test_select_frame_known_answer():
    # 8 tokens; tokens 2 and 5 draw the most attention; the 6 others alternate between two key directions
    attention = torch.tensor([0.1, 0.2, 0.9, 0.1, 0.1, 0.8, 0.1, 0.1])
    metric = torch.tensor([[1.0, 0], [0, 1], [5, 5], [1, 0.1], [0.1, 1], [5, 5], [1, 0], [0, 1]])
    plan = select_frame(attention, metric, 2, 2)
    assert plan.dominant.tolist() == [2, 5]
    # remaining [0, 1, 3, 4, 6, 7]; step 6 // 2 = 3 -> targets at remaining positions 0 and 3 = tokens 0 and 4
    assert plan.targets.tolist() == [0, 4]
    assert dict(zip(plan.members.tolist(), plan.assign.tolist())) == {1: 1, 3: 0, 6: 0, 7: 1}
    hidden = torch.arange(8.0).unsqueeze(-1)
    merged = contextual_features(hidden[plan.targets], hidden[plan.members], plan.assign)
    assert merged.flatten().tolist() == [0 + (3 + 6) / 2, 4 + (1 + 7) / 2]  # h_t + mean(members), not a mean


def test_empty_cluster_adds_nothing():
    targets = torch.tensor([[1.0], [2.0]])
    out = contextual_features(targets, torch.tensor([[4.0], [6.0]]), torch.tensor([0, 0]))
    assert out.flatten().tolist() == [6.0, 2.0]


# --- attention maps -----------------------------------------------------------------------------------------------


def test_geometry_pooling_matches_the_models_pooling():
    """The geometry maps tower values onto the token grid exactly as the port resized them (pool_map before)."""
    onevision, next_video = default_geometry("llava_onevision"), default_geometry("llava_next_video")
    x = torch.randn(3, 729, 5)
    grid = x.reshape(3, 27, 27, 5).permute(0, 3, 1, 2)
    ref = F.interpolate(grid, size=[14, 14], mode="bilinear").permute(0, 2, 3, 1).reshape(3, 196, 5)
    torch.testing.assert_close(onevision.pool_grid(x.reshape(3, 27, 27, 5), (14, 14)), ref)
    torch.testing.assert_close(onevision.to_token_grid(x, (14, 14)), ref)
    scalar = torch.rand(3, 729)  # [F, L] maps come back [F, H*W]
    ref = F.interpolate(scalar.reshape(3, 1, 27, 27), size=[14, 14], mode="bilinear").reshape(3, 196)
    torch.testing.assert_close(onevision.to_token_grid(scalar, (14, 14)), ref)
    y = torch.randn(2, 576, 3)
    ref = F.avg_pool2d(y.reshape(2, 24, 24, 3).permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1).reshape(2, 144, 3)
    torch.testing.assert_close(next_video.pool_grid(y.reshape(2, 24, 24, 3), (12, 12)), ref)
    with_cls = torch.cat([torch.randn(2, 1, 3), y], dim=1)  # CLIP: the CLS column is dropped first
    torch.testing.assert_close(next_video.to_token_grid(with_cls, (12, 12)), ref)
    with pytest.raises(ValueError, match="1 \\+ 24x24"):
        next_video.to_token_grid(y, (12, 12))  # no CLS column where the tower has one
    assert default_geometry("qwen2_vl").to_token_grid(y, (24, 24)) is y  # Qwen: already on the token grid
    assert torch.equal(onevision.to_token_grid(x[:, :196], (14, 14)), x[:, :196])  # already on the token grid


def test_vision_stats_follow_the_towers_cls_token():
    cls_form = [VisionStat("cls", -1), VisionStat("keys", -1)]
    received_form = [VisionStat("received", -1), VisionStat("keys", -1)]
    assert vision_stats_for(default_geometry("llava_next_video")) == cls_form  # CLIP: the official CLS row
    for family in ("llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert vision_stats_for(default_geometry(family)) == received_form
        assert VisionZip().bind(None).vision_stats(family) == received_form
    assert VisionZip().bind(None).vision_stats("llava_next_video") == cls_form
    # the geometry decides, not the family name: a CLS tower on a LLaVA-OneVision-like grid asks for the CLS row
    clip_like = FamilyGeometry("llava_onevision", mrope=False, patch_grid=(24, 24), cls_tokens=1, pooling="average")
    assert vision_stats_for(clip_like) == cls_form


def test_token_grid_maps_per_family():
    g = torch.Generator().manual_seed(0)
    cls = torch.rand(2, 4, 577, generator=g)
    keys = torch.randn(2, 577, 3, generator=g)
    vision = {VisionStat("cls", -1): cls, VisionStat("keys", -1): keys}
    attention, metric = token_grid_maps(vision, default_geometry("llava_next_video"), (12, 12))
    summed = cls[:, :, 1:].sum(dim=1)  # official: attn[:, :, 0, 1:].sum(dim=1)
    torch.testing.assert_close(attention, F.avg_pool2d(summed.reshape(2, 1, 24, 24), 2).reshape(2, 144))
    pooled_keys = F.avg_pool2d(keys[:, 1:].reshape(2, 24, 24, 3).permute(0, 3, 1, 2), 2)
    torch.testing.assert_close(metric, pooled_keys.permute(0, 2, 3, 1).reshape(2, 144, 3))
    received = torch.rand(2, 729, generator=g) * 729
    onevision_keys = torch.randn(2, 729, 3, generator=g)
    vision = {VisionStat("received", -1): received, VisionStat("keys", -1): onevision_keys}
    attention, metric = token_grid_maps(vision, default_geometry("llava_onevision"), (14, 14))
    mean_received = (received / 729).reshape(2, 1, 27, 27)  # attentions[-1].mean(heads).mean(queries)
    torch.testing.assert_close(attention, F.interpolate(mean_received, size=[14, 14], mode="bilinear").flatten(1))
    resized = F.interpolate(onevision_keys.reshape(2, 27, 27, 3).permute(0, 3, 1, 2), size=[14, 14], mode="bilinear")
    torch.testing.assert_close(metric, resized.permute(0, 2, 3, 1).reshape(2, 196, 3))
    vision = {VisionStat("received", -1): received[:, :144], VisionStat("keys", -1): keys[:, :144]}
    attention, metric = token_grid_maps(vision, default_geometry("qwen2_vl"), (12, 12))
    torch.testing.assert_close(attention, received[:, :144] / 144)
    assert torch.equal(metric, keys[:, :144])


# --- the plugin on hand-built tokens ------------------------------------------------------------------------------


def _qwen_context(grid, seed=0):
    t, h, w = grid
    g = torch.Generator().manual_seed(seed)
    vision = {
        VisionStat("received", -1): torch.rand(t, h * w, generator=g),
        VisionStat("keys", -1): torch.randn(t, h * w, 4, generator=g),
    }
    return Context(family="qwen2_vl", geometry=default_geometry("qwen2_vl"), vision=vision), vision


@pytest.mark.parametrize("mrope", [False, True])
def test_connect_per_frame_order_and_features(mrope):
    grid = (3, 4, 4)
    embeds = torch.randn(48, 8, generator=torch.Generator().manual_seed(1))
    tokens = grid_tokens(embeds, grid, mrope)
    ctx, vision = _qwen_context(grid)
    out = VisionZip(tokens_per_frame=6).bind(None).connect(tokens, ctx)
    dominant, contextual = split_counts(6)
    expected, kept = [], []
    for f in range(3):
        rows = slice(16 * f, 16 * (f + 1))
        attention = vision[VisionStat("received", -1)][f] / 16
        ref, dom, targets = port_reference(
            embeds[rows], attention, vision[VisionStat("keys", -1)][f], dominant, contextual
        )
        expected.append(ref)
        kept += [16 * f + i for i in dom + targets]
    expected = torch.cat(expected)
    kept = torch.tensor(kept)
    if mrope:  # Qwen: original order (positions are kept)
        order = torch.argsort(kept)
        expected, kept = expected[order], kept[order]
        assert torch.equal(out.positions, tokens.positions[:, kept])
    else:  # LLaVA: the port's order, per frame [dominant; contextual]
        assert torch.equal(out.positions, kept)
    torch.testing.assert_close(out.embeds, expected)
    assert len(out) == 18 and out.weight.sum() == 48


def test_connect_keeps_everything_at_full_budget():
    grid = (2, 3, 3)
    tokens = grid_tokens(torch.randn(18, 4), grid)
    ctx, _ = _qwen_context(grid)
    plugin = VisionZip().bind(1.0)
    assert plugin.connect(tokens, ctx) is tokens
    assert VisionZip(tokens_per_frame=9).bind(None).connect(tokens, ctx) is tokens


def test_connect_on_frames_an_earlier_plugin_thinned():
    grid = (2, 4, 4)
    tokens = grid_tokens(torch.randn(32, 4), grid)
    thinned = tokens.select(torch.tensor(list(range(0, 16, 4)) + list(range(16, 32))))  # frame 0: 4 tokens
    ctx, _ = _qwen_context(grid)
    out = VisionZip(tokens_per_frame=6).bind(None).connect(thinned, ctx)
    assert int((out.frame == 0).sum()) == 4 and int((out.frame == 1).sum()) == 6


def visionzip_stats(family):
    return VisionZip().bind(None).vision_stats(family)


# --- the patched models -------------------------------------------------------------------------------------------


def test_patched_llava_onevision_matches_the_port_on_the_models_statistics():
    family = "llava_onevision"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    tokens, ctx = connect_inputs(model, inputs, visionzip_stats(family), prepool=True)
    t, h, w = tokens.grid
    attention, metric = token_grid_maps(ctx.vision, ctx.geometry, (h, w))
    dominant, contextual = split_counts(frame_tokens(h * w, 0.25))
    expected = torch.cat(
        [
            port_reference(tokens.embeds[f * h * w : (f + 1) * h * w], attention[f], metric[f], dominant, contextual)[0]
            for f in range(t)
        ]
    )
    out, positions, handle = llm_inputs(model, inputs, "visionzip", retention=0.25)
    stats = handle.stats()
    video = inputs["input_ids"][0] == vtc.api.resolve_adapter(model).video_token_id
    start = int(torch.nonzero(video)[0])
    assert stats.visual_tokens_out == t * 49 == len(expected)
    torch.testing.assert_close(out[start : start + len(expected)], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(positions.flatten(), torch.arange(out.shape[0]))  # renumbered, as LLaVA does


def test_patched_llava_next_video_merges_clip_features_before_the_projector():
    family = "llava_next_video"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    tokens, ctx = connect_inputs(model, inputs, visionzip_stats(family), prepool=True)
    t, h, w = tokens.grid
    attention, metric = token_grid_maps(ctx.vision, ctx.geometry, (h, w))
    pooled = F.avg_pool2d(ctx.prepool.permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1).reshape(t, h * w, -1)
    projector = model.model.multi_modal_projector
    dominant, contextual = split_counts(frame_tokens(h * w, 0.2))
    expected = []
    for f in range(t):
        ref, dom, targets = port_reference(pooled[f], attention[f], metric[f], dominant, contextual)
        with torch.no_grad():
            expected.append(projector(ref))
        # the dominant tokens are the model's own tokens
        torch.testing.assert_close(expected[-1][:dominant], tokens.embeds[f * h * w + torch.tensor(dom)])
    expected = torch.cat(expected)
    out, positions, handle = llm_inputs(model, inputs, "visionzip", retention=0.2)
    stats = handle.stats()
    video = inputs["input_ids"][0] == vtc.api.resolve_adapter(model).video_token_id
    start = int(torch.nonzero(video)[0])
    assert stats.visual_tokens_out == t * math.ceil(0.2 * 144) == len(expected)
    torch.testing.assert_close(out[start : start + len(expected)], expected, atol=1e-5, rtol=1e-5)
    # merging after the projector instead gives other features (the projector is not linear)
    post, _, _ = llm_inputs(model, inputs, "visionzip", retention=0.2, merge_before_projector=False)
    assert not torch.allclose(post, out)


def test_pre_projector_merge_follows_the_geometry():
    """The pre-projector merge is chosen by `ctx.geometry.pool_before_projector`, not the family name: with the
    same pre-pool features, a geometry whose pooler follows the projector merges the LLM tokens instead."""
    family = "llava_next_video"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    tokens, ctx = connect_inputs(model, inputs, visionzip_stats(family), prepool=True)
    assert ctx.geometry.pool_before_projector and ctx.prepool is not None and ctx.pool is not None
    t, h, w = tokens.grid
    plugin = VisionZip().bind(0.2)
    with torch.no_grad():
        before = plugin.connect(tokens, ctx)
        after_geometry = dataclasses.replace(ctx.geometry, pool_before_projector=False)
        after = plugin.connect(tokens, dataclasses.replace(ctx, geometry=after_geometry))
        post = VisionZip(merge_before_projector=False).bind(0.2).connect(tokens, ctx)
    assert len(before) == len(after) == len(post) == t * math.ceil(0.2 * h * w)
    assert torch.equal(after.positions, before.positions)  # the same plan, only the merged features differ
    torch.testing.assert_close(after.embeds, post.embeds, rtol=0, atol=0)
    assert not torch.allclose(before.embeds, after.embeds)


def test_patched_qwen2_5_vl_keeps_positions_and_order():
    family = "qwen2_5_vl"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    out, positions, handle = llm_inputs(model, inputs, "visionzip", retention=0.25)
    stats = handle.stats()
    assert stats.grids == [(4, 12, 12)] and stats.visual_tokens_out == 4 * 36
    t_pos = positions[0, 0]
    assert bool((t_pos[1:] >= t_pos[:-1]).all())  # temporal positions never go back
