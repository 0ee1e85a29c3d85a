"""BOLT: inverse transform sampling against the official function (transcribed), known answers on hand-made scores,
the 1-fps candidates, the seconds round trip, a colour encoder that makes the question's frames the right answer,
what `handle.stats().frames` shows, the feature cache across questions, composition, and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vtc
from tests.conftest import model_and_processor
from tests.probes import ColourEncoder, coloured_clip
from vtc.media.encoders import FEATURE_CACHE, EncoderLoadError, clip_encoder
from vtc.media.frame_selection import fps_candidates, inverse_transform_sampling
from vtc_plugins.bolt import bolt_frames


def official_inverse_transform_sampling(score, n, power=-1):
    """sming256/BOLT select_frames.py::inverse_transform_sampling (8a9ba45), transcribed."""
    score = score - np.min(score)
    score = score / np.max(score)
    if power != -1:
        score = score**power
    probabilities = score / np.sum(score)
    cdf = np.cumsum(probabilities)
    uniform_sampling = np.linspace(1 / n, 1 - 1 / n, n)
    return np.searchsorted(cdf, uniform_sampling)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n,power", [(8, 3.0), (16, 2.5), (32, -1), (5, 1.0)])
def test_inverse_transform_sampling_is_the_official_one_on_random_scores(seed, n, power):
    scores = np.random.default_rng(seed).normal(20, 3, size=120)
    expected = official_inverse_transform_sampling(scores, n, power).tolist()
    assert inverse_transform_sampling(scores, n, power) == expected


def test_a_peak_gets_the_draws_and_they_repeat():
    scores = [0.0] * 10 + [10.0] + [0.0] * 9  # one frame matches the question
    assert inverse_transform_sampling(scores, 4, 3) == [10, 10, 10, 10]
    # a flat stretch with a mild peak: power sharpens it
    ramp = [1, 2, 3, 4, 5, 4, 3, 2, 1]
    assert inverse_transform_sampling(ramp, 5, 1) == [3, 3, 4, 5, 5]
    assert inverse_transform_sampling(ramp, 5, 3) == [3, 4, 4, 4, 5]
    # equal scores (the official code divides by zero): uniform
    assert inverse_transform_sampling([2.0] * 8, 4) == [1, 3, 4, 5]


def test_candidates_are_one_per_second_as_extract_feature_py():
    assert fps_candidates(100, 25.0, 1) == [0, 25, 50, 75]  # int(100 / 25 * 1) = 4 samples
    assert fps_candidates(90, 30.0, 2) == [0, 15, 30, 45, 60, 75]
    assert fps_candidates(10, 30.0, 1) == [0]  # shorter than a second
    assert fps_candidates(61, 29.97, 1) == [0, 30]


def test_times_are_rounded_to_hundredths_then_mapped_to_frames_sorted_with_repeats():
    scores = [0.0, 0.0, 9.0, 0.0]
    # every draw lands on the third candidate (2 s at 1 fps); at 29.97 fps that is round(59.94) = 60
    assert bolt_frames(scores, 1.0, 29.97, 200, 3, 3) == [60, 60, 60]
    # 2 fps candidates: position 3 is 1.5 s
    assert bolt_frames([0, 0, 0, 5.0], 2.0, 10.0, 40, 2, -1) == [15, 15]


def test_bolt_picks_the_frames_the_question_is_about_and_stats_show_them():
    model, processor = model_and_processor("qwen2_vl")
    encoder = ColourEncoder()
    FEATURE_CACHE.clear()
    clip = coloured_clip(blue=())  # grey frames score lowest (0 after min-max): every draw is on a red frame
    with vtc.patch(model, "bolt", encoder=encoder, num_frames=4) as handle:
        inputs = handle.prepare(processor, clip, "where is the red ball?", fps=4)
        with torch.no_grad():
            model(**inputs)
        chosen = handle.stats().frames[0]
        assert chosen.method == "bolt"
        # the red seconds are 12 and 13: frames 48 and 52 at 4 fps; all four draws land there
        assert set(chosen.indices) <= {48, 52} and len(chosen.indices) == 4
        assert chosen.timestamps == [i / 4 for i in chosen.indices]
        assert chosen.candidates == list(range(0, 80, 4))  # 1 fps over 20 s
        assert chosen.scores == [chosen.candidate_scores[chosen.candidates.index(i)] for i in chosen.indices]
        assert max(chosen.candidate_scores) == chosen.scores[0]
        assert encoder.images_encoded == 20
        assert inputs["video_grid_thw"][0, 0].item() == 2  # four frames, paired by Qwen2-VL

        # another question about the same video: its own frames, no second encoding (the feature cache)
        handle.prepare(processor, clip, "and the blue one?", fps=4)
        assert encoder.images_encoded == 20 and FEATURE_CACHE.hits >= 1


def test_bolt_composes_with_a_connect_method_and_refuses_a_second_sampler():
    model, processor = model_and_processor("qwen2_5_vl")
    with vtc.patch(model, "bolt+vidcom2", retention=0.5, encoder=ColourEncoder(), num_frames=4) as handle:
        inputs = handle.prepare(processor, coloured_clip(), "the red ball", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        assert stats.frames[0].method == "bolt" and len(stats.frames[0].indices) == 4
        assert stats.llm_tokens_in == round(stats.visual_tokens_in * 0.5)
    with pytest.raises(ValueError, match="'bolt' and 'uniform' both decide frame selection"):
        vtc.patch(model, "bolt+uniform")


def test_bad_inputs_name_the_problem():
    model, processor = model_and_processor("qwen2_vl")
    with vtc.patch(model, "bolt", encoder=ColourEncoder()) as handle:
        with pytest.raises(ValueError, match="question"):
            handle.prepare(processor, coloured_clip(), "", fps=4)
    with pytest.raises(ValueError, match="unknown CLIP encoder 'ViT-Nope'.*bolt.encoder"):
        clip_encoder("ViT-Nope", None, param="bolt.encoder")
    # a known architecture whose weights are not on disk (offline): the message names the parameter for a local file
    with pytest.raises(EncoderLoadError, match="bolt.encoder_pretrained"):
        clip_encoder("ViT-B-32", "laion2b_s34b_b79k", param="bolt.encoder")
    with pytest.raises(TypeError, match="encode_text"):
        clip_encoder(object(), param="bolt.encoder")


@pytest.mark.parametrize(
    "spec, params, refusal",
    [
        ("bolt+vidcom2", {}, None),
        ("infoshot", {}, None),
        ("ktv-keyframes+vidcom2", {}, None),
        ("q-frame-qfs", {}, None),
        ("ktv", {}, "serve its frame choice alone as 'ktv-keyframes'"),
        ("q-frame", {}, "serve its frame choice alone as 'q-frame-qfs'"),
        ("framepack-u", {}, "sizes each frame's tokens from that choice"),
        ("quota", {}, "sizes each frame's tokens from that choice"),
        ("dig", {}, r"give dig.classifier and dig.judge .*dig.query_type='global'"),
        ("dig", {"dig.query_type": "global"}, None),
        ("q-gate", {}, r"q-gate.weights=\(vg, gm, ca\)"),
        ("q-gate", {"q-gate.weights": [0.5, 0.5, 0.0]}, None),
    ],
)
def test_which_samplers_a_vllm_server_runs(spec, params, refusal):
    """A server chooses frames in its prompt processor (vtc.vllm.sampling): a sampler that then sizes each frame's
    tokens from its choice, or that asks the served model itself, is refused before the server starts, with what
    to serve instead; the others build a serving pipeline."""
    from vtc.vllm.config import ServeConfig, servable_samplers

    config = ServeConfig(methods=spec, retention=0.5, params=params)
    if refusal is None:
        config.check_methods()
        assert config.pipeline("qwen2_5_vl").has_stage("sample")
        assert spec.split("+")[0] in servable_samplers()
        return
    with pytest.raises(ValueError, match=refusal):
        config.check_methods()
        config.pipeline("qwen2_5_vl")
