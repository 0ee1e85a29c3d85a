"""QuoTA: decoupling parse, scoring prompts, the (100 p)^2 weights, per-frame budgets and shapes (token_compress
v1), the bilinear resize, Qwen's frame pairing, the official truncating frame sampling, the connect hook's
resized frames at their anchor cells, and end-to-end runs with the model itself and with CLIP as scorer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import vtc
from tests.conftest import grid_tokens, model_and_processor, videos
from vtc.core.geometry import default_geometry
from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context
from vtc.media.video import VideoSource
from vtc_plugins.quota import (
    Quota,
    QuotaClip,
    anchor_cells,
    frame_shape,
    frame_weights,
    grid_frame_weights,
    parse_objects,
    relevance_prompt,
    resize_frame,
    token_budgets,
)


def test_parse_objects_follows_the_official_regexes():
    answer = 'Step 1: Yes\nStep 2: ["red square", "video"]\nStep 3: ["red square", "blue circle"]'
    assert parse_objects(answer) == ["red square", "blue circle"]
    assert parse_objects("Step 1: no") == []
    assert parse_objects("Step 1: yes\nStep 3: null") == []
    assert parse_objects("Step 1: yes\nStep 3: [__import__('os')]") == []  # never evaluated as code


def test_relevance_prompts():
    assert relevance_prompt("q?", ["cat", "dog"]).startswith("Does the image contain any object of cat, dog? A. yes")
    assert relevance_prompt("Who wins?", []).startswith("Who wins?\nDoes the image contain sufficient information")


def test_weights_are_the_squared_scaled_scores():
    w = frame_weights([0.1, 0.3, 0.0], 100, 2)
    assert w == pytest.approx([100 / 1000, 900 / 1000, 0.0])
    assert frame_weights([0.0, 0.0], 100, 2) == [0.5, 0.5]


def test_budgets_and_frame_shapes():
    # official: int(B w_i), frames at 0 dropped, h = w = int(sqrt n), one more row when it fits
    assert token_budgets([0.5, 0.3, 0.2, 0.0], 196, exact=False) == [98, 58, 39, 0]
    exact = token_budgets([0.5, 0.3, 0.2, 0.0], 197, exact=True)
    assert sum(exact) == 197 and exact[-1] == 0
    assert frame_shape(98) == (10, 9)  # 9*9 = 81 < 98 and 10*9 = 90 <= 98
    assert frame_shape(100) == (10, 10)
    assert frame_shape(1) == (1, 1)
    assert frame_shape(2000) == (45, 44)  # no cap: a dominant frame is upsampled beyond its grid


def test_the_most_relevant_frame_gets_the_most_tokens():
    scores = [0.05, 0.9, 0.1, 0.05]
    counts = token_budgets(frame_weights(scores, 100, 2), 4 * 196, exact=False)
    assert counts.index(max(counts)) == 1
    assert counts[1] > 3 * 196  # (100 * 0.9)^2 dominates


def test_resize_is_bilinear_and_exact_mode_cuts_raster_order():
    grid = torch.arange(2 * 2 * 1, dtype=torch.float32).reshape(2, 2, 1)
    cells, shape = resize_frame(grid, 16, exact=False)
    expected = torch.nn.functional.interpolate(grid.permute(2, 0, 1)[None], size=(4, 4), mode="bilinear")
    assert shape == (4, 4)
    torch.testing.assert_close(cells, expected[0].permute(1, 2, 0).reshape(16, 1))
    cells, shape = resize_frame(grid, 7, exact=True)  # w = 3, h = 3, first 7 cells
    assert shape == (3, 3) and cells.shape == (7, 1)
    assert anchor_cells(4, 4, 2, 2).tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]


def test_qwen_pairs_frames_into_temporal_patches():
    assert grid_frame_weights([0.1, 0.3, 0.2, 0.4], 2) == pytest.approx([0.4, 0.6])
    assert grid_frame_weights([0.2, 0.2, 0.6], 2) == pytest.approx([0.2 / 0.8, 0.6 / 0.8])  # last frame repeated
    assert grid_frame_weights([0.5, 0.5], 2) == [0.5, 0.5]


def test_defaults_follow_the_official_pipeline():
    p = Quota()
    assert (p.max_frames_num, p.additional_frames, p.enhance_total, tuple(p.weight_scale)) == (96, 64, 64, (100, 2))
    assert p.scorer is None and p.decouple and p.decouple_max_new_tokens == 4096
    with pytest.raises(ValueError, match="weight_scale"):
        Quota(weight_scale=(1, 2, 3))


def test_method_info_declares_what_the_plugin_needs():
    for name in ("quota", "quota-clip"):
        cls = vtc.registry()[name]
        info = cls.card
        assert info.stages == ("sample", "connect") and info.owns == frozenset({"frame_selection"})
        assert info.query_aware and info.fixed_count_mode == "optional" and info.positions == "compact"
        # the pre-pool feature maps are resized (the `needs_prepool` attribute of the first contract), and every
        # cell of every frame is needed
        assert info.prepool and info.whole_frames and not info.vision_stats and info.reduces_tokens
        assert info.retention_reference == "llm_input" and info.retention_note
        assert {"original_positions", "ordered_positions"} <= set(cls.testing.exemptions)
        assert cls.testing.params["decouple_max_new_tokens"] == 4
    clip = vtc.registry()["quota-clip"].testing.params
    assert clip["clip_model"] == "vtc-tiny-clip" and clip["clip_pretrained"] is None  # no download
    assert not hasattr(Quota(), "needs_prepool")
    # its sample stage runs first, so a connect method named before it still sees whole frames
    assert Pipeline("divprune+quota").names() == ["quota", "divprune"]


def _clip_sampler(**params):
    return QuotaClip(**{**vtc.registry()["quota-clip"].testing.params, "decouple": False, **params}).bind(0.25)


def test_sampling_truncates_like_the_official_pipeline():
    """quota_pipeline.py samples `np.linspace(0, T - 1, N, dtype=int)`: truncated, duplicates kept on short clips
    (qwen-vl-utils' rounding would give [0, 3, 7, 10]); the request comes from `ctx.num_frames`, the question's
    scores land in `ctx.state` (what its connect stage reads as `ctx.prepared`)."""
    frames = np.random.default_rng(0).integers(0, 256, size=(11, 32, 32, 3), dtype=np.uint8)
    source = VideoSource.open(frames, fps=1.0)
    ctx = Context(question="Which shape moves?", num_frames=4)
    assert _clip_sampler().sample(source, ctx) == [0, 3, 6, 10]
    info = ctx.state
    assert info["objects"] == [] and len(info["scores"]) == len(info["weights"]) == 4
    assert sum(info["weights"]) == pytest.approx(1.0)
    ctx = Context(question="Which shape moves?", num_frames=5)
    assert _clip_sampler().sample(VideoSource.open(frames[:3], fps=1.0), ctx) == [0, 0, 1, 1, 2]
    # no request: max_frames_num + additional_frames per hour (11 s: 96 + 0), duplicates kept
    ctx = Context(question="Which shape moves?")
    indices = _clip_sampler().sample(source, ctx)
    assert indices == np.linspace(0, 10, 96, dtype=int).tolist() and len(indices) == 96
    assert len(ctx.state["scores"]) == 96


def test_sampler_needs_the_processor_for_decoupling():
    frames = np.zeros((4, 32, 32, 3), dtype=np.uint8)
    model, processor = model_and_processor("qwen2_vl")
    ctx = Context(question="Which shape moves?", num_frames=2, model=model, processor=None)
    with pytest.raises(ValueError, match="query decoupling runs the model"):
        Quota().sample(VideoSource.open(frames), ctx)
    with pytest.raises(ValueError, match="pass it to handle.prepare"):
        Quota().sample(VideoSource.open(frames), Context(processor=processor))


def _connect_ctx(weights, family="qwen2_vl"):
    return Context(family=family, geometry=default_geometry(family), prepared={"weights": weights})


def test_connect_resizes_frames_onto_their_anchor_cells():
    """Frame budgets int(B w_f) become h x w bilinear resizes of the frame's map; each resized cell sits at (and
    takes the original position of) its nearest grid cell, so an upsampled frame repeats anchors."""
    g = torch.Generator().manual_seed(0)
    tokens = grid_tokens(torch.randn(18, 5, generator=g), (2, 3, 3), mrope=True)
    tokens.extras["deepstack"] = tokens.embeds.clone()
    ctx = _connect_ctx([0.8, 0.2])
    out = Quota().bind(1.0).connect(tokens, ctx)
    # B = 18: int(14.4) = 14 -> a 4 x 3 grid (12 cells), int(3.6) = 3 -> 2 x 1 (2 cells)
    assert ctx.reports == {"budgets": [[14, 3]]}
    assert len(out) == 14 and out.grid == (2, 3, 3)
    anchors = [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8] + [9 + 1, 9 + 7]  # rows [0, 1, 1, 2] of frame 0; (0, 1), (2, 1)
    assert (out.frame * 9 + out.patch).tolist() == anchors
    assert torch.equal(out.positions, tokens.positions[:, anchors])
    maps = tokens.embeds.reshape(2, 3, 3, 5)
    expected = torch.cat([resize_frame(maps[0], 14, False)[0], resize_frame(maps[1], 3, False)[0]])
    torch.testing.assert_close(out.embeds, expected)
    torch.testing.assert_close(out.extras["deepstack"], out.embeds)  # side features resized alike
    with pytest.raises(ValueError, match="two tokens sit on the same grid cell"):
        out.grid_index()  # repeated anchors: no one token per cell


def test_connect_fixed_count_and_whole_frames():
    tokens = grid_tokens(torch.randn(32, 4), (2, 4, 4))
    ctx = _connect_ctx([0.5, 0.5], "llava_onevision")
    fixed = Quota(fixed_count=True).bind(0.3)
    out = fixed.connect(tokens, ctx)
    assert len(out) == fixed.retained_count(32, (2, 4, 4), "llava_onevision") == round(32 * 0.3) == 10
    assert ctx.reports == {"budgets": [[5, 5]]}  # B = 10 shared equally, exactly
    assert Quota().bind(0.3).retained_count(32, (2, 4, 4), "llava_onevision") is None  # adaptive
    thinned = tokens.select(torch.arange(1, 32))
    with pytest.raises(ValueError, match="quota resizes whole frames"):
        fixed.connect(thinned, _connect_ctx([0.5, 0.5], "llava_onevision"))
    with pytest.raises(ValueError, match="build the inputs with handle.prepare"):
        fixed.connect(tokens, Context(family="qwen2_vl", geometry=default_geometry("qwen2_vl")))


def run_quota(family, method="quota", retention=0.25, **params):
    """(stats of the forward, what the sample stage prepared for the prompt) of one prepared clip."""
    model, processor = model_and_processor(family)
    params = {**vtc.registry()[method].testing.params, **params}
    with vtc.patch(model, method, retention=retention, **params) as handle:
        inputs = handle.prepare(processor, videos()[0], "Which shape moves?", num_frames=8, fps=8)
        (prompt,) = handle._patch.prepared.values()
        info = prompt["methods"][method]  # what the method's sample stage left in its ctx.state
        with torch.no_grad():
            model(**inputs)
        return handle.stats(), info


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_5_vl", "llava_next_video"])
def test_end_to_end_counts_follow_the_budgets(family):
    stats, info = run_quota(family)
    assert len(info["scores"]) == 8 and sum(info["weights"]) == pytest.approx(1.0)  # num_frames=8 honoured
    budget = round(stats.visual_tokens_in * 0.25)
    (counts,) = stats.reports["quota"]["budgets"]  # one video: one budget list, one entry per grid frame
    assert len(counts) == stats.grids[0][0] and sum(counts) <= budget
    expected = sum(math.prod(frame_shape(c)) for c in counts if c > 0)
    (connect,) = [s for s in stats.stages if s.stage == "connect"]
    assert (connect.plugin, connect.tokens_in) == ("quota", stats.visual_tokens_in)
    assert stats.visual_tokens_out == expected == connect.tokens_out == stats.llm_tokens_in


def test_fixed_count_hits_the_budget_exactly():
    stats, _ = run_quota("qwen2_vl", retention=0.3, fixed_count=True)
    assert stats.visual_tokens_out == round(stats.visual_tokens_in * 0.3) == sum(stats.reports["quota"]["budgets"][0])


def test_clip_scorer_end_to_end():
    stats, info = run_quota("qwen2_vl", method="quota-clip")
    assert len(info["scores"]) == 8 and all(0 < s < 1 for s in info["scores"])
    assert 0 < stats.visual_tokens_out <= round(stats.visual_tokens_in * 0.25)


def test_inputs_without_prepare_are_refused():
    from tests.conftest import single_inputs

    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "quota", retention=0.25):
        with pytest.raises(ValueError, match="build the inputs with handle.prepare"):
            model(**single_inputs("qwen2_vl"))
    with pytest.raises(ValueError, match="both decide frame selection"):
        vtc.patch(model, "uniform+quota")
