"""QuoTA: decoupling parse, scoring prompts, the (100 p)^2 weights, per-frame budgets and shapes (token_compress
v1), the bilinear resize, Qwen's frame pairing, and end-to-end runs with the model itself and with CLIP as scorer."""

from __future__ import annotations

import math

import pytest
import torch

import vtc
from tests.conftest import model_and_processor, videos
from vtc_plugins.quota import (
    QuotaParams,
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
    p = QuotaParams()
    assert (p.max_frames_num, p.additional_frames, p.enhance_total, tuple(p.weight_scale)) == (96, 64, 64, (100, 2))
    assert p.scorer is None and p.decouple and p.decouple_max_new_tokens == 4096
    with pytest.raises(ValueError, match="weight_scale"):
        QuotaParams(weight_scale=(1, 2, 3))


def run_quota(family, method="quota", retention=0.25, **params):
    model, processor = model_and_processor(family)
    params = {"decouple_max_new_tokens": 4, **params}
    if method == "quota-clip":
        params.update(clip_model="vtc-tiny-clip", clip_pretrained=None)
    with vtc.patch(model, method, retention=retention, **params) as handle:
        inputs = handle.prepare(processor, videos()[0], "Which shape moves?", num_frames=8, fps=8)
        info = handle._patch.prepared[next(iter(handle._patch.prepared))]["quota"]
        with torch.no_grad():
            model(**inputs)
        plugin = handle.pipeline.entries[0].plugin
        return handle.stats(), info, plugin


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_5_vl", "llava_next_video"])
def test_end_to_end_counts_follow_the_budgets(family):
    stats, info, plugin = run_quota(family)
    assert len(info["scores"]) == 8 and sum(info["weights"]) == pytest.approx(1.0)
    budget = round(stats.visual_tokens_in * 0.25)
    counts = plugin.last_budgets[-1]
    assert sum(counts) <= budget
    expected = sum(math.prod(frame_shape(c)) for c in counts if c > 0)
    assert stats.visual_tokens_out == expected == plugin.last_kept[-1]


def test_fixed_count_hits_the_budget_exactly():
    stats, _, plugin = run_quota("qwen2_vl", retention=0.3, fixed_count=True)
    assert stats.visual_tokens_out == round(stats.visual_tokens_in * 0.3)


def test_clip_scorer_end_to_end():
    stats, info, _ = run_quota("qwen2_vl", method="quota-clip")
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
