"""`vtc.stream` sessions: equality with one whole-video prompt, bounded memory, asks that never change the memory,
interleaving, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vtc
from tests.conftest import FAMILIES
from vtc.core.families import get_family
from vtc.media.inputs import build_messages
from vtc.media.video import synthetic_video
from vtc.streaming.session import fixed_frame_size
from vtc.testing.fixtures import model_and_processor

QUESTION = "What happens in this video?"


@pytest.fixture(scope="module")
def clip():
    return synthetic_video(8, 224, 224, seed=3)


def whole_prompt(model, processor, frames, fps=0.5, max_new_tokens=4):
    """First-token logits and greedy answer of the whole clip passed as one prompt (the unpatched model)."""
    text = processor.apply_chat_template(build_messages(QUESTION), add_generation_prompt=True, tokenize=False)
    kwargs = {}
    if type(processor).__name__.startswith("Qwen"):
        n = len(frames)
        kwargs = dict(
            video_metadata=[{"fps": fps, "total_num_frames": n, "frames_indices": list(range(n))}],
            do_sample_frames=False,
            cap_pixels_per_frame=True,
        )
        if type(processor).__name__ == "Qwen3VLProcessor":
            kwargs["size"] = fixed_frame_size(processor.video_processor, 2)
    inputs = processor(text=[text], videos=[frames], return_tensors="pt", **kwargs)
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1].float()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return logits, out[0, inputs["input_ids"].shape[1] :].tolist(), inputs["input_ids"].shape[1]


@pytest.mark.parametrize("family", [f for f in FAMILIES if "streaming" in get_family(f).features])
def test_unbounded_uncompressed_stream_equals_one_whole_video_prompt(family, clip):
    model, processor = model_and_processor(family)
    frames = clip[:6]
    ref_logits, ref_ids, ref_rows = whole_prompt(model, processor, frames)
    with vtc.stream(model, processor) as s:
        for frame in frames:
            s.feed(frame)
        s.ask(QUESTION, max_new_tokens=4)
        record = s.last_ask
        # the same prompt, row for row: memory rows + question rows
        assert s.memory.cached_rows + record.prompt_rows == ref_rows
    torch.testing.assert_close(record.first_logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert record.token_ids == ref_ids


def test_retention_one_with_a_streaming_method_equals_the_whole_prompt(clip):
    model, processor = model_and_processor("qwen2_5_vl")
    frames = clip[:6]
    ref_logits, ref_ids, _ = whole_prompt(model, processor, frames)
    with vtc.stream(model, processor, "mssavt", retention=1.0) as s:
        for frame in frames:
            s.feed(frame)
        s.ask(QUESTION, max_new_tokens=4)
    torch.testing.assert_close(s.last_ask.first_logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert s.last_ask.token_ids == ref_ids


SMALL = {"size": {"shortest_edge": 112 * 112, "longest_edge": 112 * 112}}  # a 4 x 4 token grid per temporal patch


@pytest.mark.parametrize("frames", [10, 100, 1000])
def test_window_memory_is_flat(frames):
    """After N frames the memory holds what the budget says, in tokens and in bytes."""
    model, processor = model_and_processor("qwen2_vl")
    frame = synthetic_video(1, 112, 112, seed=0)[0]
    budget = 16 * 3  # three temporal patches of 16 tokens
    with vtc.stream(model, processor, budget_tokens=budget, chunk_frames=10, processor_kwargs=SMALL) as s:
        for k in range(frames):
            s.feed(np.roll(frame, k, axis=1))
        stats = s.stats()
        config = model.config.text_config
        head_dim = config.hidden_size // config.num_attention_heads
        per_row = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # fp32 keys + values
        assert stats.stored_tokens == budget
        assert stats.memory_bytes == (len(s.prefix_rows) + budget) * per_row
        assert stats.frames_encoded == frames and stats.visual_tokens_fed == 16 * frames // 2


def test_asking_leaves_the_memory_unchanged_and_interleaving_equals_asking_after(clip):
    model, processor = model_and_processor("qwen2_vl")
    frames = clip[:8]
    with vtc.stream(model, processor, "mssavt", retention=0.5, budget_tokens=10_000) as s:
        for k, frame in enumerate(frames):
            s.feed(frame)
            if k in (1, 5):
                s.ask("What is first?", max_new_tokens=3)
                s.ask("What is first?", max_new_tokens=3)  # asking twice: same answer, memory untouched
                assert s.asks[-1].token_ids == s.asks[-2].token_ids
                torch.testing.assert_close(s.asks[-1].first_logits, s.asks[-2].first_logits)
        interleaved = s.ask(QUESTION, max_new_tokens=4), s.last_ask.first_logits
        stored = s.stats().stored_tokens
    with vtc.stream(model, processor, "mssavt", retention=0.5, budget_tokens=10_000) as s:
        for frame in frames:
            s.feed(frame)
        after = s.ask(QUESTION, max_new_tokens=4), s.last_ask.first_logits
        assert s.stats().stored_tokens == stored
    assert interleaved[0] == after[0]
    torch.testing.assert_close(interleaved[1], after[1], atol=1e-5, rtol=1e-5)


def test_stream_leaves_the_model_unchanged(clip):
    model, processor = model_and_processor("llava_onevision")
    ref_logits, _, _ = whole_prompt(model, processor, clip[:2])
    with vtc.stream(model, processor, "streamingtom-ctr", budget_tokens=1000) as s:
        s.feed(clip[0])
        s.feed(clip[1])
        s.ask(QUESTION, max_new_tokens=2)
    after_logits, _, _ = whole_prompt(model, processor, clip[:2])
    assert torch.equal(ref_logits, after_logits)


def test_stats_report_tokens_memory_and_ttft(clip):
    model, processor = model_and_processor("qwen2_vl")
    with vtc.stream(model, processor, "mssavt", retention=0.25, budget_tokens=200) as s:
        for frame in clip[:5]:
            s.feed(frame)
        s.ask(QUESTION, max_new_tokens=2)
        stats = s.stats()
    grid = 12 * 12  # tokens of one temporal patch of the 224 x 224 clip on the tiny Qwen2-VL
    assert stats.frames_fed == 5 and stats.frames_encoded == 4 and stats.frames_pending == 1
    assert stats.visual_tokens_fed == 2 * grid
    assert stats.visual_tokens_kept == 2 * round(0.25 * grid)
    assert stats.stored_tokens == stats.visual_tokens_kept
    assert len(stats.asks) == 1 and stats.asks[0].ttft_s > 0 and stats.memory_bytes > 0
    assert stats.to_dict()["asks"][0]["question"] == QUESTION


def test_bad_input_gives_clear_errors(clip):
    model, processor = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match="cannot stream.*Methods that stream"):
        vtc.stream(model, processor, "holitom")
    with pytest.raises(ValueError, match="budget_tokens must be a positive integer"):
        vtc.stream(model, processor, budget_tokens=0)
    with pytest.raises(ValueError, match="chunk_frames must be a positive multiple of 2"):
        vtc.stream(model, processor, chunk_frames=3)
    s = vtc.stream(model, processor, budget_tokens=10)
    s.feed(clip[0])
    with pytest.raises(ValueError, match="smaller than one frame"):
        s.feed(clip[1])
    s.close()
    with vtc.stream(model, processor) as s:
        with pytest.raises(ValueError, match="nothing to answer from yet"):
            s.ask(QUESTION)
        with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
            s.feed(np.zeros((4, 4), dtype=np.uint8))
        s.feed(clip[0])
        s.feed(clip[1])
        with pytest.raises(ValueError, match="same size"):
            s.feed(np.zeros((64, 64, 3), dtype=np.uint8))
        with pytest.raises(ValueError, match="question must be a non-empty string"):
            s.ask("  ")
        assert s.ask(QUESTION, max_new_tokens=1) is not None  # a failed ask leaves the session usable
    with pytest.raises(RuntimeError, match="closed"):
        s.feed(clip[2])


def test_patch_refuses_stream_only_methods_and_stream_refuses_a_patched_model():
    model, processor = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match="streaming method.*vtc.stream"):
        vtc.patch(model, "streamingtom")
    with vtc.patch(model, "random", retention=0.5):
        with pytest.raises(ValueError, match="patched by vtc.patch.*unpatch"):
            vtc.stream(model, processor)
    vtc.stream(model, processor).close()  # unpatched: fine


@pytest.mark.parametrize(
    "family,method",
    [
        ("qwen2_5_vl", "mssavt"),
        ("qwen3_vl", "mssavt"),
        ("llava_next_video", "mssavt"),
        ("llava_onevision", "streamingtom-ctr"),
        ("qwen2_vl", "streamingtom-ctr"),
    ],
)
def test_a_compressed_stream_equals_the_same_method_on_the_whole_video(family, method, clip):
    """A causal method keeps the same tokens at the same positions whether the video arrives in chunks or at once:
    the stream's answer equals `vtc.patch` + generate on the whole video (positions, compact or kept, included)."""
    model, processor = model_and_processor(family)
    frames = clip[:6]
    with vtc.stream(model, processor, method, retention=0.5) as s:
        for frame in frames:
            s.feed(frame)
        s.ask(QUESTION, max_new_tokens=4)
        streamed = s.last_ask
    with vtc.patch(model, method, retention=0.5) as handle:
        ref_logits, ref_ids, _ = whole_prompt(model, processor, frames)
        assert handle.stats().visual_tokens_out == s.stats().stored_tokens
    torch.testing.assert_close(streamed.first_logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert streamed.token_ids == ref_ids


def test_patch_refuses_a_model_with_an_open_stream_naming_it():
    """A stream encodes its chunks with the model's own forward: a patch installed while it is open would compress
    them too, and the next feed read rows the patch had dropped (an IndexError deep in the session). vtc.patch
    refuses the model while a stream is open, naming the stream and saying to close it, and installs nothing; once
    the stream is closed the model takes a patch."""
    import gc

    from vtc.hf.patching import OPEN_STREAMS, PATCHED_MODELS

    model, processor = model_and_processor("qwen2_vl")
    frame = synthetic_video(1, 112, 112, seed=0)[0]

    def hooks():
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    with vtc.stream(model, processor, "mssavt", retention=0.5, processor_kwargs=SMALL) as s:
        s.feed(frame)
        s.feed(frame)
        before = hooks()
        with pytest.raises(ValueError) as err:
            vtc.patch(model, "random", retention=0.5)
        message = str(err.value)
        assert message.startswith(f"this model has an open vtc.stream session ({s!r}); ")
        assert "close the stream first (session.close(), or leave its `with` block)" in message
        assert "vtc.patch(model, 'random', ...)" in message
        assert hooks() == before and model not in PATCHED_MODELS  # the refused patch installed nothing
        s.feed(frame)  # the stream goes on as if nothing happened
        s.feed(frame)
        stats = s.stats()
        assert stats.chunks == 2 and stats.visual_tokens_kept == stats.visual_tokens_fed // 2
    assert model not in OPEN_STREAMS
    with vtc.patch(model, "random", retention=0.5):  # closed: the model takes a patch
        pass
    s = vtc.stream(model, processor)
    with pytest.raises(ValueError, match="open vtc.stream session"):
        vtc.patch(model, "random")
    s.close()  # closed by hand
    with vtc.patch(model, "random"):
        pass
    vtc.stream(model, processor)  # never closed, but dropped: a session nobody holds does not block the model
    gc.collect()
    with vtc.patch(model, "random"):
        pass
