"""The streaming methods inside `vtc.stream`: StreamingTOM's OQM (4-bit groups, per-layer retrieval, positions),
LifeStream's memory, and flat memory for every memory at 10, 100 and 1000 frames."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import vtc
from vtc.media.video import synthetic_video
from vtc.testing.fixtures import model_and_processor
from vtc_kernels import dequantize_groups

QUESTION = "What happens in this video?"
SMALL = {"size": {"shortest_edge": 112 * 112, "longest_edge": 112 * 112}}  # Qwen2-VL: 4 x 4 tokens per patch


@pytest.fixture(scope="module")
def clip():
    return synthetic_video(12, 224, 224, seed=5)


def capture_segments(session):
    """Record every segment the session hands its memory."""
    segments = []
    append = session.memory.append

    def recording(segment):
        segments.append(segment)
        return append(segment)

    session.memory.append = recording
    return segments


def pre_rope_keys(model, adapter, embeds, positions, past):
    """Reference: each layer's keys before RoPE [L, kv_heads * d] from k_proj (k_norm on Qwen3), in one forward."""
    keys, hooks = {}, []
    for layer, block in enumerate(adapter.decoder_layers):
        attention = block.self_attn
        source = getattr(attention, "k_norm", None) or attention.k_proj

        def hook(module, args, output, layer=layer):
            keys[layer] = output[0].reshape(output.shape[1], -1).float()

        hooks.append(source.register_forward_hook(hook))
    try:
        from vtc.streaming.llm import StreamLLM

        StreamLLM(adapter).forward(embeds, positions, past)
    finally:
        for h in hooks:
            h.remove()
    return keys


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_5_vl"])
def test_streamingtom_retrieval_matches_a_brute_force_reference_on_float_keys(family, clip):
    model, processor = model_and_processor(family)
    frames = clip[:8]
    with vtc.stream(
        model, processor, "streamingtom", retention=0.25, chunk_frames=8, retrieval_tokens=1, budget_tokens=None
    ) as s:
        segments = capture_segments(s)
        for frame in frames:
            s.feed(frame)
        queries, hooks = {}, []  # the question's pre-RoPE queries, captured independently of the memory
        for layer, block in enumerate(s.adapter.decoder_layers):
            attention = block.self_attn
            source = getattr(attention, "q_norm", None) or attention.q_proj

            def hook(module, args, output, layer=layer):
                queries.setdefault(layer, output[0].detach().float())

            hooks.append(source.register_forward_hook(hook))
        s.ask(QUESTION, max_new_tokens=1)
        for h in hooks:
            h.remove()
        memory = s.memory
        (segment,) = segments  # one chunk: no dequantized window was involved
        visual = segment.visual
        positions = (
            torch.arange(memory.prefix_length, memory.prefix_length + len(segment))[None]
            if memory.window_relative
            else segment.positions
        )
        keys = pre_rope_keys(model, s.adapter, segment.embeds, positions, memory.prefix_kv)
        g, groups = memory.group_size, memory.num_groups
        kv_heads = model.config.get_text_config().num_key_value_heads
        assert groups == len(frames) // s.temporal_patch and memory.stored_tokens == groups * g
        for layer, key in keys.items():
            group_keys = key[visual].reshape(groups, g, -1).mean(dim=1)
            torch.testing.assert_close(memory.group_keys[layer], group_keys, atol=1e-4, rtol=1e-4)
            q = queries[layer]
            q_mean = q.reshape(q.shape[0], kv_heads, -1, group_keys.shape[1] // kv_heads).mean(dim=(0, 2)).flatten()
            sims = [float(torch.nn.functional.cosine_similarity(q_mean, k, dim=0)) for k in group_keys]
            best = max(range(groups), key=lambda i: sims[i])  # retrieval_tokens=1 -> ceil(1 / g) = 1 group
            assert memory.last_selection[layer].tolist() == [best]
        # the question starts after the retrieved cache on 1-D RoPE families (official), else at the stream's position
        record = s.last_ask
        assert record.retrieved_tokens == g


def test_streamingtom_4bit_groups_stay_within_their_error_bound(clip):
    model, processor = model_and_processor("qwen2_vl")
    with vtc.stream(model, processor, "streamingtom", retention=0.5, chunk_frames=8, budget_tokens=None) as s:
        segments = capture_segments(s)
        for frame in clip[:8]:
            s.feed(frame)
        memory = s.memory
        (segment,) = segments
        reference = s.llm.forward(segment.embeds, segment.positions, memory.prefix_kv).kv
        rows = torch.nonzero(segment.visual).flatten()
        for layer, (k, v) in enumerate(reference):
            stored = memory.values[layer]
            assert stored.bits == 4 and stored.packed.dtype == torch.uint8
            restored = dequantize_groups(stored)
            exact = v[:, :, rows]
            # per (head, channel, group): |x - x_hat| <= scale / 2
            bound = stored.scale.repeat_interleave(memory.group_size, dim=-2) / 2 + 1e-6
            assert bool(((restored - exact).abs() <= bound).all())
            # keys are stored before RoPE on M-RoPE families and rotate back to the forward's keys
            keys, _ = memory._groups_kv(layer, None)
            scale = memory.keys[layer].scale.repeat_interleave(memory.group_size, dim=-2)
            assert float((keys - k[:, :, rows]).abs().max()) <= float(scale.max())  # rotation mixes channel pairs
        # 4-bit storage: a group of G tokens costs half a byte per value plus float32 scale and minimum per channel
        config = model.config.get_text_config()
        head_dim = config.hidden_size // config.num_attention_heads
        per_group = config.num_key_value_heads * head_dim * (math.ceil(memory.group_size / 2) + 8)
        assert memory.values[0].nbytes == memory.num_groups * per_group


def test_streamingtom_one_dimensional_positions_follow_the_official_window(clip):
    """LLaVA: a chunk's positions are window-relative after the prefix; the question starts at the retrieved
    cache's length (prefix + k * G)."""
    model, processor = model_and_processor("llava_onevision")
    with vtc.stream(model, processor, "streamingtom", retention=0.25, chunk_frames=2, window_tokens=49 * 2) as s:
        calls = []
        forward = s.llm.forward

        def recording(embeds, positions, past=None, **kwargs):
            calls.append((positions.clone(), 0 if not past else past[0][0].shape[2]))
            return forward(embeds, positions, past, **kwargs)

        s.llm.forward = recording
        for frame in clip[:8]:
            s.feed(frame)
        g = s.memory.group_size
        prefix = s.memory.prefix_length
        assert g == round(0.25 * 196)
        # chunk k attends to the prefix and min(k, 2) stored frames; its positions start right after them
        for k, (positions, past_length) in enumerate(calls[:4]):
            window = min(2 * k, 2) * g if k else 0
            assert past_length == prefix + window
            assert positions[0, 0].item() == prefix + window
        s.llm.forward = forward
        s.ask(QUESTION, max_new_tokens=1)
        assert s.last_ask.retrieved_tokens == min(8, math.ceil(12544 / g)) * g


def test_streamingtom_interleaved_asks_equal_asking_after(clip):
    model, processor = model_and_processor("qwen2_5_vl")
    kwargs = dict(retention=0.25, chunk_frames=2, retrieval_tokens=80)
    with vtc.stream(model, processor, "streamingtom", **kwargs) as s:
        for k, frame in enumerate(clip[:10]):
            s.feed(frame)
            if k in (3, 7):
                s.ask(QUESTION, max_new_tokens=2)
        s.ask(QUESTION, max_new_tokens=3)
        interleaved = s.last_ask
    with vtc.stream(model, processor, "streamingtom", **kwargs) as s:
        for frame in clip[:10]:
            s.feed(frame)
        s.ask(QUESTION, max_new_tokens=3)
        after = s.last_ask
    assert interleaved.token_ids == after.token_ids
    torch.testing.assert_close(interleaved.first_logits, after.first_logits)


def test_lifestream_memory_answers_from_its_snapshot(clip):
    model, processor = model_and_processor("qwen2_vl")
    with vtc.stream(model, processor, "lifestream", budget_tokens=120) as s:
        for frame in clip:
            s.feed(frame)
        snapshot = s.memory.memory.snapshot()
        s.ask(QUESTION, max_new_tokens=2)
        first = s.last_ask
        s.ask(QUESTION, max_new_tokens=2)
        assert s.last_ask.token_ids == first.token_ids  # asking does not change the memory
        assert first.retrieved_tokens == len(snapshot) <= 120
        # the same answer from an explicit prefill of prefix + snapshot + question
        from vtc.streaming.llm import concat_kv

        memory_kv = s.llm.forward(snapshot.embeds, snapshot.positions, s.memory.prefix_kv).kv
        past = concat_kv(s.memory.prefix_kv, memory_kv)
        assert past[0][0].shape[2] == len(s.prefix_rows) + len(snapshot)


MEMORIES = [
    ("streamingtom", dict(retention=0.5)),  # 8 tokens per group
    ("lifestream", {}),
    ("mssavt", dict(retention=0.5)),
    ("memstream", dict(experts="internal")),  # adaptive: merged windows make frames of 4 to 16 tokens
]


@pytest.mark.parametrize("frames", [10, 100, 1000])
@pytest.mark.parametrize("spec,kwargs", MEMORIES, ids=[m[0] for m in MEMORIES])
def test_memory_is_flat_for_every_streaming_method(spec, kwargs, frames):
    model, processor = model_and_processor("qwen2_vl")
    frame = synthetic_video(1, 112, 112, seed=0)[0]
    budget = 40
    with vtc.stream(
        model, processor, spec, budget_tokens=budget, chunk_frames=10, processor_kwargs=SMALL, **kwargs
    ) as s:
        sizes = []
        for k in range(frames):
            s.feed(np.roll(frame, 7 * k, axis=1))
            if (k + 1) % 10 == 0:
                sizes.append((s.memory.stored_tokens, s.memory.nbytes))
        s.ask(QUESTION, max_new_tokens=1)
        stats = s.stats()
    assert stats.stored_tokens <= budget and stats.frames_encoded == frames
    per_frame = {"streamingtom": 8, "mssavt": 8}.get(spec)
    if per_frame:  # whole frames: the budget fills to whole frames
        assert stats.stored_tokens == budget // per_frame * per_frame
    if frames >= 100 and spec != "memstream":  # once full, neither the tokens nor the bytes grow
        assert len(set(sizes[-5:])) == 1, sizes[-5:]
    if spec == "streamingtom":  # exactly what the budget says: 5 groups of 8 tokens at 4 bits, and their keys
        config = model.config.get_text_config()
        head_dim = config.hidden_size // config.num_attention_heads
        channels = config.num_key_value_heads * head_dim
        groups, g = budget // 8, 8
        packed = 2 * channels * (math.ceil(g / 2) + 8)  # keys and values: 4-bit codes + float32 scale and minimum
        per_group = config.num_hidden_layers * (packed + channels * 4) + 3 * g * 8  # + group key, + positions
        prefix = len(s.prefix_rows) * config.num_hidden_layers * 2 * channels * 4
        assert stats.memory_bytes == prefix + groups * per_group
    if spec == "memstream":  # adaptive frames: bounded by the budget's keys and values plus one key per frame
        config = model.config.get_text_config()
        head_dim = config.hidden_size // config.num_attention_heads
        per_token = config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
        bound = (len(s.prefix_rows) + budget) * 2 * per_token + budget * per_token
        assert all(tokens <= budget and nbytes <= bound for tokens, nbytes in sizes)
