"""The sample stage from user code: frame indices (each family's reference rule), video metadata, decoders
giving the same frames, the family inferred from the processor or the patched model, bad inputs refused with
what is wrong (one rule for frame arrays: uint8, grey expanded), more frames asked than the video has (warned),
and the typed context a sampler sees."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import vtc
from tests.conftest import FAMILIES, model_and_processor, videos
from vtc.core.families import get_family
from vtc.core.pipeline import Pipeline
from vtc.core.registry import registry
from vtc.media.inputs import processor_family, sample_frames
from vtc.media.video import (
    VideoSource,
    available_backends,
    encode_video,
    sampling_rule,
    synthetic_video,
    uniform_indices,
    write_video,
)
from vtc_plugins.uniform import Uniform


def test_uniform_indices():
    assert uniform_indices(100, 5) == [0, 25, 50, 74, 99]
    assert uniform_indices(3, 8) == [0, 1, 2]
    with pytest.raises(ValueError, match="number of frames must be a positive integer, got 0"):
        uniform_indices(10, 0)
    with pytest.raises(ValueError, match="positive integer"):
        uniform_indices(10, 2.5)
    with pytest.raises(ValueError, match=r"the video has no frames \(total=0\)"):
        uniform_indices(0, 4)
    with pytest.raises(ValueError, match="frame sampling rule must be one of round, floor, middle, got 'ceil'"):
        uniform_indices(10, 4, rule="ceil")


def test_uniform_indices_round_and_floor_rules():
    # "round": qwen-vl-utils, linspace rounded; "floor": np.linspace(0, T - 1, N, dtype=int) (LLaVA, QuoTA)
    assert uniform_indices(11, 4, rule="round") == [0, 3, 7, 10]
    assert uniform_indices(11, 4, rule="floor") == [0, 3, 6, 10]
    assert uniform_indices(11, 4) == [0, 3, 7, 10]  # round is the default
    # a clip shorter than the request: round gives each frame once, floor keeps duplicates
    assert uniform_indices(3, 5, rule="round") == [0, 1, 2]
    assert uniform_indices(3, 5, rule="floor") == [0, 0, 1, 1, 2]
    for total, count in ((40, 8), (100, 16), (7, 7), (1, 3), (64, 5)):
        assert uniform_indices(total, count, "floor") == np.linspace(0, total - 1, count, dtype=int).tolist()
        expected = (
            np.linspace(0, total - 1, count).round().astype(int).tolist() if count < total else list(range(total))
        )
        assert uniform_indices(total, count, "round") == expected


def test_sampling_rule_and_processor_family():
    # each family declares its rule (`Family.frame_rule`); the reference pipelines' rules
    assert {f: sampling_rule(f) for f in FAMILIES} == {f: get_family(f).frame_rule for f in FAMILIES}
    expected = {"qwen2_vl": "round", "qwen2_5_vl": "round", "qwen3_vl": "round", "llava_onevision": "floor"}
    expected.update(llava_next_video="floor", internvl="middle")
    assert {f: sampling_rule(f) for f in expected} == expected
    assert sampling_rule(None) == sampling_rule("unknown") == "round"
    # InternVL's get_index: the middle of equal segments of T - 1 frames
    assert uniform_indices(11, 4, "middle") == [1, 3, 6, 9] and uniform_indices(3, 5, "middle") == [0, 0, 1, 1, 2]
    for family in FAMILIES:
        _, processor = model_and_processor(family)
        assert processor_family(processor) == family
    assert processor_family(object()) is None


def read_spy(monkeypatch) -> list[list[int]]:
    """Record the frame indices every VideoSource.read call decodes."""
    calls = []
    original = VideoSource.read

    def read(self, indices):
        calls.append([int(i) for i in indices])
        return original(self, indices)

    monkeypatch.setattr(VideoSource, "read", read)
    return calls


def renamed(processor):
    """The same processor under a class name vtc does not know (so no family can be read from it)."""
    other = copy.copy(processor)
    other.__class__ = type("CustomProcessor", (type(processor),), {})
    assert processor_family(other) is None
    return other


@pytest.mark.parametrize("family, expected", [("qwen2_vl", [0, 3, 7, 10]), ("llava_onevision", [0, 3, 6, 10])])
def test_prepare_inputs_uses_the_processor_familys_rule(family, expected, monkeypatch):
    model, processor = model_and_processor(family)
    clip = synthetic_video(11, 64, 64)
    calls = read_spy(monkeypatch)
    vtc.prepare_inputs(processor, clip, "What happens?", num_frames=4)
    assert calls == [expected]
    # an explicit rule of the uniform method wins over the family's
    other = "floor" if family.startswith("qwen") else "round"
    vtc.prepare_inputs(processor, clip, "What happens?", num_frames=4, rule=other)
    assert calls[-1] == uniform_indices(11, 4, other)
    # with a model, its family decides (here: the same); without a model and an unknown processor: round
    vtc.prepare_inputs(renamed(processor), clip, "What happens?", num_frames=4, model=model)
    assert calls[-1] == expected
    vtc.prepare_inputs(renamed(processor), clip, "What happens?", num_frames=4)
    assert calls[-1] == [0, 3, 7, 10]


def test_handle_prepare_uses_the_patched_models_family(monkeypatch):
    model, processor = model_and_processor("llava_onevision")
    clip = synthetic_video(11, 64, 64)
    calls = read_spy(monkeypatch)
    with vtc.patch(model, "uniform", num_frames=4) as handle:
        handle.prepare(renamed(processor), clip, "What happens?")
    assert calls == [[0, 3, 6, 10]]  # floor: the model is LLaVA, whatever the processor's class
    with vtc.patch(model, "random", retention=0.5) as handle:  # no sample stage: uniform by the family's rule
        handle.prepare(renamed(processor), clip, "What happens?", num_frames=5)
    assert calls[-1] == uniform_indices(11, 5, "floor") == [0, 2, 5, 7, 10]
    # duplicates of the floor rule reach the processor as repeated frames (and are warned about)
    with pytest.warns(UserWarning, match="asks for 5 frames but the video has only 3 frames"):
        inputs = vtc.prepare_inputs(processor, synthetic_video(3, 64, 64), "What happens?", num_frames=5)
    assert calls[-1] == [0, 0, 1, 1, 2] and inputs["pixel_values_videos"].shape[1] == 5


def test_uniform_rule_parameter():
    assert Uniform().rule is None
    with pytest.raises(ValueError, match="uniform: rule must be one of 'round', 'floor', 'middle', got 'nearest'"):
        Uniform(rule="nearest")
    source = VideoSource.open(synthetic_video(11, 16, 16))
    for family, rule, expected in (
        ("qwen2_vl", None, [0, 3, 7, 10]),
        ("llava_next_video", None, [0, 3, 6, 10]),
        ("qwen2_vl", "floor", [0, 3, 6, 10]),
        ("llava_next_video", "round", [0, 3, 7, 10]),
    ):
        pipeline = Pipeline("uniform", params={"num_frames": 4, "rule": rule}, family=family)
        ctx = vtc.Context(family=family)
        assert pipeline.run_sample(source, ctx) == (expected, {}), (family, rule)  # nothing prepared
        assert sample_frames(source, "q", pipeline, family=family).indices == expected


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
    with pytest.raises(ValueError, match=r"must be \[T, H, W, 3\] RGB \(or \[T, H, W\] grey\) uint8"):
        VideoSource.open(np.zeros((4, 8, 8, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match="unknown video backend"):
        VideoSource.open(__file__, backend="opencv")


def test_frame_arrays_follow_one_rule():
    """uint8 whatever the shape, so float frames in [0, 1] are refused like any other dtype (casting them would
    give black frames), with how to convert; grey [T, H, W] (or [T, H, W, 1]) uint8 frames become RGB."""
    clip = synthetic_video(4, 16, 24)
    floats = clip / 255.0
    for bad in (floats, floats[..., 0], clip.astype(np.float32)):
        with pytest.raises(ValueError, match=rf"a frame array must be uint8 .*got dtype {bad.dtype}") as err:
            VideoSource.open(bad)
        assert "floats in [0, 1]: (frames * 255).round().astype(np.uint8)" in str(err.value)
    with pytest.raises(ValueError, match=r"got dtype int64 .* values in \[0, 255\]: frames.astype\(np.uint8\)"):
        VideoSource.open(clip.astype(np.int64))
    # the conversion the message gives is exact for frames that were uint8
    converted = (floats * 255).round().astype(np.uint8)
    assert np.array_equal(VideoSource.open(converted).read(range(4)), clip)
    # grey frames: the value in all three channels, [T, H, W] or [T, H, W, 1]
    grey = clip[..., 1]
    rgb = np.repeat(grey[..., None], 3, axis=-1)
    for frames in (grey, grey[..., None]):
        source = VideoSource.open(frames)
        assert (source.num_frames, source.height, source.width) == (4, 16, 24)
        assert np.array_equal(source.read(range(4)), rgb)
    # one image is not a grey video; RGBA is refused with how to drop the alpha
    with pytest.raises(ValueError, match=r"is one image \[H, W, 3\], not a video.*frames\[None\]"):
        VideoSource.open(clip[0])
    with pytest.raises(ValueError, match=r"is RGBA; pass RGB \[T, H, W, 3\]: frames\[\.\.\., :3\]"):
        VideoSource.open(np.concatenate([clip, clip[..., :1]], axis=-1))
    # the same rule through the public entry points, and for encoding a clip (the serving client sends these)
    _, processor = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match="must be uint8"):
        vtc.prepare_inputs(processor, floats, "What happens?", num_frames=4)
    inputs = vtc.prepare_inputs(processor, grey, "What happens?", num_frames=4)
    assert torch.equal(
        inputs["pixel_values_videos"],
        vtc.prepare_inputs(processor, rgb, "What happens?", num_frames=4)["pixel_values_videos"],
    )
    with pytest.raises(ValueError, match="must be uint8"):
        encode_video(floats)


def test_more_frames_than_the_video_has_warns_naming_both_counts(monkeypatch):
    """Not an error (a short clip gets every frame, or repeats under the floor rule), but never silent: who asked,
    how many, how many there are, and what the model gets."""
    _, qwen = model_and_processor("qwen2_vl")
    _, llava = model_and_processor("llava_onevision")
    clip = synthetic_video(8, 64, 64)
    calls = read_spy(monkeypatch)
    with pytest.warns(UserWarning) as record:
        vtc.prepare_inputs(qwen, clip, "What happens?", "uniform", num_frames=64)
    assert calls[-1] == list(range(8))
    (warning,) = record
    assert str(warning.message) == (
        "num_frames=64 asks for 64 frames but the video has only 8 frames: the model gets 8 frames. Ask for at most "
        "8 frames (num_frames=) to match this video"
    )
    assert warning.filename == __file__  # points at the caller of prepare_inputs
    # the sampler's own parameter (here its qualified name), and the floor rule's repeats
    with pytest.warns(UserWarning, match=r"^uniform's num_frames=64 asks for 64 frames but the video has only 8"):
        vtc.prepare_inputs(qwen, clip, "What happens?", "uniform", **{"uniform.num_frames": 64})
    with pytest.warns(UserWarning, match=r"the model gets 12 frames, only 8 of them distinct \(frames repeat\)"):
        vtc.prepare_inputs(llava, clip, "What happens?", num_frames=12)
    assert calls[-1] == uniform_indices(8, 12, "floor")
    # no sample stage: vtc's default count
    with pytest.warns(UserWarning, match=r"^the default num_frames=16 asks for 16 frames but the video has only 8"):
        vtc.prepare_inputs(qwen, clip, "What happens?", "random")
    # enough frames: silent; sample_frames keeps the warning with the frames it returns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vtc.prepare_inputs(qwen, clip, "What happens?", num_frames=8)
        assert sample_frames(clip, "q", num_frames=8).warnings == []
    with pytest.warns(UserWarning):
        sampled = sample_frames(clip, "q", num_frames=9)
    assert len(sampled.warnings) == 1 and "asks for 9 frames but the video has only 8" in sampled.warnings[0]


def test_a_file_that_is_not_a_video_names_every_decoder(tmp_path):
    bad = tmp_path / "notes.mp4"
    bad.write_text("this is not a video\n")
    with pytest.raises(ValueError) as err:
        VideoSource.open(bad)
    message = str(err.value)
    assert message.startswith(f"cannot read {bad} as a video; decoders tried: ")
    tried = message.split("decoders tried: ", 1)[1]
    assert [part.split(":")[0] for part in tried.split("; ")] == available_backends()
    with pytest.raises(ValueError, match=r"cannot read .*notes.mp4 as a video; decoders tried: pyav: \w+"):
        VideoSource.open(bad, backend="pyav")
    _, processor = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match=r"cannot read .*notes.mp4 as a video"):
        vtc.prepare_inputs(processor, str(bad), "What happens?", num_frames=4)


@pytest.mark.parametrize("num_frames", [0, -2, 2.5, True])
def test_bad_num_frames_is_refused(num_frames):
    _, processor = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match=r"num_frames must be a positive integer"):
        vtc.prepare_inputs(processor, videos()[0], "What happens?", num_frames=num_frames, fps=8)


@pytest.mark.parametrize("fps", [0, -1.0, float("nan"), "8"])
def test_bad_fps_is_refused(fps):
    _, processor = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match=r"fps must be a positive number"):
        vtc.prepare_inputs(processor, videos()[0], "What happens?", num_frames=4, fps=fps)
    with pytest.raises(ValueError, match=r"fps must be a positive number"):
        VideoSource.open(videos()[0], fps=fps)


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

    @vtc.method("t_question", paper="test")
    class Spy(vtc.Method):
        query_aware = True

        def connect(self, tokens, ctx):
            seen["question"] = ctx.question
            seen["ids"] = ctx.question_ids
            return tokens

    with vtc.patch(model, Spy()) as handle:
        inputs = handle.prepare(processor, videos()[0], "Which shape moves?", num_frames=4, fps=8)
        with torch.no_grad():
            model(**inputs)
    assert seen["question"] == "Which shape moves?"
    assert "Which shape moves?" in processor.tokenizer.decode(seen["ids"])


def test_sample_context_fields_are_typed(monkeypatch, clip_path):
    """A sampler gets the frame request, the processor, the family and its own `state` dict as Context fields (not
    `ctx.extra` keys), and what it leaves in `ctx.state` reaches the connect stage of that prompt as
    `ctx.prepared` (the method's own dict)."""
    seen = []
    connect = []

    @vtc.method("t_sampler", paper="test")
    class Spy(vtc.FrameSampler):
        def sample(self, video, ctx):
            seen.append(ctx)
            ctx.state["frames"] = video.num_frames
            return [0, video.num_frames - 1]

        def connect(self, tokens, ctx):
            connect.append(dict(ctx.prepared))
            return tokens

    assert Spy.card.stages == ("sample", "connect") and not Spy.card.reduces_tokens
    assert Spy.card.owns == frozenset({"frame_selection"})
    monkeypatch.setitem(registry()._methods, "t_sampler", Spy)
    model, processor = model_and_processor("qwen2_vl")
    vtc.prepare_inputs(processor, clip_path, "Which shape moves?", "t_sampler", num_frames=6)
    (ctx,) = seen
    assert (ctx.num_frames, ctx.processor, ctx.family, ctx.question) == (6, processor, "qwen2_vl", "Which shape moves?")
    assert ctx.state == {"frames": 40} and ctx.prepared == {} and ctx.extra == {}
    vtc.prepare_inputs(processor, clip_path, "Which shape moves?", "t_sampler")
    assert seen[-1].num_frames is None  # no request: the method's own default
    with vtc.patch(model, "t_sampler") as handle:
        inputs = handle.prepare(processor, clip_path, "Which shape moves?", num_frames=2)
        assert seen[-1].model is model and seen[-1].family == "qwen2_vl" and seen[-1].num_frames == 2
        assert inputs["video_grid_thw"][0, 0].item() == 1  # frames 0 and 39: one temporal patch
        with torch.no_grad():
            model(**inputs)
    assert connect == [{"frames": 40}]


def test_what_a_sampler_chose_and_reported_is_in_the_frame_selection():
    """A sampler may return a `vtc.FrameChoice` (candidates with their scores, metadata the processor is told) and
    explain itself with `ctx.report(...)`: `SampledVideo.selection` (and `handle.stats().frames`) carries all of it."""

    @vtc.method("test-every-third", paper="test")
    class EveryThird(vtc.FrameSampler):
        def sample(self, video, ctx):
            candidates = list(range(0, video.num_frames, 3))
            ctx.report(shots=[[0, 3], [6, 9]])
            return vtc.FrameChoice(
                candidates[::2], candidates=candidates, scores=[float(c) for c in candidates], metadata={"fps": 2.0}
            )

    source = VideoSource.open(synthetic_video(12, 32, 32), fps=4)
    sampled = sample_frames(source, "q", Pipeline(EveryThird()), family="qwen2_vl")
    chosen = sampled.selection
    assert sampled.indices == chosen.indices == [0, 6]
    assert chosen.method == "test-every-third" and chosen.timestamps == [0.0, 1.5]
    assert chosen.candidates == [0, 3, 6, 9] and chosen.scores == [0.0, 6.0]
    assert chosen.reports == {"shots": [[[0, 3], [6, 9]]]}
    assert sampled.metadata["fps"] == 2.0 and sampled.metadata["frames_indices"] == [0, 6]
    with pytest.raises(ValueError, match="one score per candidate"):
        vtc.FrameChoice([0], candidates=[0, 1], scores=[1.0])
