"""The sample stage from user code: frame indices, video metadata, decoders giving the same frames."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vtc
from tests.conftest import model_and_processor, videos
from vtc.media.video import VideoSource, available_backends, synthetic_video, uniform_indices, write_video


def test_uniform_indices():
    assert uniform_indices(100, 5) == [0, 25, 50, 74, 99]
    assert uniform_indices(3, 8) == [0, 1, 2]
    with pytest.raises(ValueError, match="must be positive"):
        uniform_indices(10, 0)


def test_synthetic_video_has_cuts_static_stretch_and_motion():
    clip = synthetic_video(30, 64, 64)
    assert clip.shape == (30, 64, 64, 3) and clip.dtype == np.uint8
    assert np.array_equal(clip[12], clip[15])  # static stretch (second scene)
    assert not np.array_equal(clip[0], clip[5])  # the square moves
    assert np.abs(clip[9].astype(int) - clip[10].astype(int)).mean() > 50  # scene cut


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    return write_video(path, synthetic_video(40, 96, 128), fps=10)


def test_decoders_give_the_same_frames(clip_path):
    backends = available_backends()
    assert "pyav" in backends
    sources = {b: VideoSource.open(clip_path, backend=b) for b in backends}
    reference = sources["pyav"]
    assert (reference.num_frames, reference.fps, reference.width, reference.height) == (40, 10.0, 128, 96)
    idx = [0, 9, 21, 39]
    for backend, source in sources.items():
        assert (source.num_frames, source.fps) == (40, 10.0), backend
        np.testing.assert_array_equal(source.read(idx), reference.read(idx), err_msg=backend)
    with pytest.raises(IndexError, match="outside"):
        reference.read([40])


def test_missing_file_and_bad_array():
    with pytest.raises(FileNotFoundError, match="video not found"):
        VideoSource.open("/nonexistent/clip.mp4")
    with pytest.raises(ValueError, match=r"\[T, H, W, 3\]"):
        VideoSource.open(np.zeros((4, 8, 8)))
    with pytest.raises(ValueError, match="unknown video backend"):
        VideoSource.open(__file__, backend="opencv")


def test_prepare_samples_uniformly_with_metadata(clip_path):
    _, processor = model_and_processor("qwen3_vl")
    inputs = vtc.prepare_inputs(processor, clip_path, "What happens?", "uniform", num_frames=8)
    t, h, w = inputs["video_grid_thw"][0].tolist()
    assert t == 4  # 8 frames, temporal patches of 2
    text = processor.batch_decode(inputs["input_ids"])[0]
    # Qwen3-VL writes each temporal patch's time: frames 0,6,11,17 / 22,28,33,39 at 10 fps
    times = [(a + b) / 2 / 10 for a, b in zip(uniform_indices(40, 8)[::2], uniform_indices(40, 8)[1::2])]
    for seconds in times:
        assert f"<{seconds:.1f} seconds>" in text


def test_handle_prepare_uses_the_pipeline_sampler(clip_path):
    model, processor = model_and_processor("qwen2_5_vl")
    with vtc.patch(model, "uniform+random", retention=0.5, num_frames=4) as handle:
        inputs = handle.prepare(processor, clip_path, "What happens?")
        assert inputs["video_grid_thw"][0, 0].item() == 2  # 4 frames
        # second_per_grid_ts from the sampled frame rate: 4 frames over 40 at 10 fps -> 1 fps, 2 s per patch
        assert inputs["second_per_grid_ts"][0].item() == pytest.approx(2.0)
        more = handle.prepare(processor, clip_path, "What happens?", num_frames=8)
        assert more["video_grid_thw"][0, 0].item() == 4  # the call's num_frames wins
        with torch.no_grad():
            model(**inputs)
        assert handle.stats().grids[0][0] == 2


def test_prepare_batch_pads_left_and_checks_lengths():
    _, processor = model_and_processor("llava_onevision")
    clips = list(videos())
    inputs = vtc.prepare_inputs(
        processor, clips, ["short", "a much longer question about the clip"], num_frames=4, fps=8
    )
    assert inputs["pixel_values_videos"].shape[:2] == (2, 4)
    assert inputs["attention_mask"][0, 0] == 0 and inputs["attention_mask"][:, -1].all()
    with pytest.raises(ValueError, match="one question per video"):
        vtc.prepare_inputs(processor, clips, ["only one"] * 3)


def test_question_reaches_query_aware_plugins():
    """The connect/prefill context carries the question text after the video."""
    model, processor = model_and_processor("qwen2_vl")
    seen = {}

    from vtc.core.hookspecs import hookimpl

    class Spy:
        @hookimpl
        def vtc_connect(self, tokens, ctx):
            seen["question"] = ctx.question
            seen["ids"] = ctx.question_ids
            return tokens

    with vtc.patch(model, "random", retention=1.0) as handle:
        handle.pipeline.entries[0].plugin.vtc_connect = Spy().vtc_connect
        inputs = handle.prepare(processor, videos()[0], "Which shape moves?", num_frames=4, fps=8)
        with torch.no_grad():
            model(**inputs)
    assert seen["question"] == "Which shape moves?"
    assert "Which shape moves?" in processor.tokenizer.decode(seen["ids"])
