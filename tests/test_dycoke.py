"""DyCoke: TTM on hand-built frames whose answer is known (least-similar tokens in ascending-similarity order,
the shifted pair similarity, the group-of-4 pass and its loop bound, the odd last frame), TTM against a
re-derivation of the official `dycole_ttm` in its own structure, the decode-time KV pruning rule, and the
patched model end to end: the LLM receives exactly the TTM selection (renumbered on LLaVA), and decode steps
match a layer-by-layer reference in which layers >= L of each step see the pruned cache (or the full one when
the attention is stable, the official quirk)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.conftest import FAMILIES, batch_inputs, grid_tokens, model_and_processor, single_inputs
from tests.probes import llm_inputs
from tests.reference import CAPTURED, ManualLLM, compressible_video_mask, start
from vtc.core.tokens import Context, VideoTokens
from vtc.hf.llm.runtime import TokenLayout
from vtc_plugins.dycoke import (
    DyCoke,
    DyCokeParams,
    image_span,
    kv_prune,
    ttm_frame_counts,
    ttm_keep,
    ttm_select,
)


def rotated(angles) -> torch.Tensor:
    """Unit 2-D tokens at the given angles: cos(a_j - 0) is their similarity with a frame of (1, 0) tokens."""
    a = torch.tensor(angles, dtype=torch.float64)
    return torch.stack([torch.cos(a), torch.sin(a)], dim=-1)


def reference_frame(n: int) -> torch.Tensor:
    return rotated([0.0] * n)


# --- TTM on hand-built frames ---------------------------------------------------------------------------------


def test_pair_keeps_the_least_similar_tokens_in_ascending_similarity_order():
    # frame 1's token j has similarity cos(angle_j) with frame 0: order of similarity 3 < 0 < 4 < 1 < 5 < 2
    angles = [1.0, 0.4, 0.1, 1.3, 0.7, 0.2]
    x = torch.stack([reference_frame(6), rotated(angles)])
    kept = ttm_keep(x, k=0.5)  # keep int(0.5 * 6) = 3 of frame 1
    assert kept[0].tolist() == [0, 1, 2, 3, 4, 5]  # frame 0 in full, spatial order
    assert kept[1].tolist() == [3, 0, 4]  # least similar first: NOT spatial order (official quirk)


def test_identical_pairs_keep_n_tokens_and_count_uses_int():
    x = torch.randn(2, 10, 4, dtype=torch.float64)
    x[1] = x[0] * 2.0  # identical directions: every similarity is 1
    kept = ttm_keep(x, k=0.7)
    assert kept[1].numel() == int((1 - 0.7) * 10) == 3  # the official arithmetic: int((1 - k) * N)
    assert ttm_frame_counts(2, 196, 0.7) == [196, 58]  # int(0.3 * 196) = int(58.8)


def test_pair_is_ranked_by_the_previous_pairs_similarity():
    # two pairs with different similarity profiles; the official `similarities[(i - 2) // 2]` ranks frame 1 by
    # pair (2, 3)'s similarity (index -1) and frame 3 by pair (0, 1)'s
    a_angles = [0.1, 0.2, 0.3, 1.4]  # pair (0,1): least similar = token 3, then 2
    b_angles = [1.4, 0.3, 0.2, 0.1]  # pair (2,3): least similar = token 0, then 1
    x = torch.stack([reference_frame(4), rotated(a_angles), reference_frame(4), rotated(b_angles)])
    shifted = ttm_keep(x, k=0.5)
    assert shifted[1].tolist() == [0, 1]  # ranked by pair (2, 3)
    assert shifted[3].tolist() == [3, 2]  # ranked by pair (0, 1)
    own = ttm_keep(x, k=0.5, shifted_pairs=False)  # the paper's description / the VidCom2 port
    assert own[1].tolist() == [3, 2]
    assert own[3].tolist() == [0, 1]


def test_group_of_four_pass_and_its_loop_bound():
    n = 6
    counts = {f: ttm_frame_counts(f, n, 0.5) for f in (4, 5, 8, 9, 12, 32)}
    assert counts[4] == [6, 3, 6, 3]  # range(0, 0, 4): no second pass
    assert counts[5] == [6, 3, 3, 3, 0]  # i = 0 only; the unpaired last frame is left out
    assert counts[8] == [6, 3, 3, 3, 6, 3, 6, 3]  # i = 0 only: the last group (4..7) is left alone
    assert counts[9] == [6, 3, 3, 3, 6, 3, 3, 3, 0]  # i = 0, 4
    assert counts[12] == [6, 3, 3, 3, 6, 3, 3, 3, 6, 3, 6, 3]
    full = [f for f, c in enumerate(counts[32]) if c == n]
    assert full == [0, 4, 8, 12, 16, 20, 24, 28, 30]  # the spec's 32-frame example
    assert sum(ttm_frame_counts(32, 196, 0.7)) == 9 * 196 + 23 * 58 == 3098
    assert ttm_frame_counts(9, 6, 0.5, drop_unpaired_frame=False)[-1] == 6

    # frame i+2 is re-selected against frame i, not kept from the first pass
    angles = [0.9, 0.1, 0.5, 0.3, 1.2, 0.2]  # order of similarity to frame 0: 4, 0, 2, 3, 5, 1
    x = torch.stack([reference_frame(n)] * 8)
    x[2] = rotated(angles)
    kept = ttm_keep(x, k=0.5, shifted_pairs=False)
    assert kept[2].tolist() == [4, 0, 2]
    assert kept[6].tolist() == list(range(n))  # outside the loop bound: frame 6 stays whole


def test_fewer_than_two_frames_or_k_zero_keep_everything():
    x = torch.randn(1, 5, 3)
    assert [t.tolist() for t in ttm_keep(x, k=0.7)] == [[0, 1, 2, 3, 4]]
    x = torch.randn(3, 5, 3)
    assert [t.tolist() for t in ttm_keep(x, k=0.0)] == [list(range(5))] * 3
    assert ttm_frame_counts(1, 196, 0.7) == [196]
    assert ttm_frame_counts(7, 196, 0.0) == [196] * 7


def official_ttm(feature: torch.Tensor, tokens_per_frame: int, k: float) -> torch.Tensor:
    """A re-derivation of the official `dycole_ttm` in its own structure: list of frames, pair similarity
    list indexed (i - 2) // 2, second pass rewriting list entries i and i + 2, concatenation. (The official
    code crashes with fewer than 5 frames, when a similarity list is empty; this one skips the empty pass.)"""
    num_frames = feature.shape[0] // tokens_per_frame
    keep_ratio = 1 - k
    n = tokens_per_frame

    def frame(i):
        return feature[i * n : (i + 1) * n]

    sims = []
    for i in range(0, num_frames - 1, 2):
        sims.append(F.cosine_similarity(F.normalize(frame(i), p=2, dim=1), F.normalize(frame(i + 1), p=2, dim=1)))
    out = []
    for i in range(0, num_frames - 1, 2):
        idx = sims[(i - 2) // 2].topk(int(keep_ratio * n), largest=False).indices
        out.append(frame(i))
        out.append(frame(i + 1)[idx])
    for i in range(0, num_frames - 4, 4):
        sim = F.cosine_similarity(frame(i), frame(i + 2), dim=1)
        out[i] = frame(i)
        out[i + 2] = frame(i + 2)[sim.topk(int(keep_ratio * n), largest=False).indices]
    return torch.cat(out)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("frames", [2, 3, 5, 8, 9, 12, 13])
@pytest.mark.parametrize("k", [0.7, 0.3, 0.75])
def test_matches_the_official_structure(seed, frames, k):
    g = torch.Generator().manual_seed(seed)
    n, d = 16, 8
    x = torch.randn(frames * n, d, generator=g)
    frame = torch.arange(frames).repeat_interleave(n)
    patch = torch.arange(n).repeat(frames)
    keep = ttm_select(x, frame, patch, n, k)
    assert torch.equal(x[keep], official_ttm(x, n, k))
    assert keep.numel() == sum(ttm_frame_counts(frames, n, k))


def test_thinned_frames_are_aligned_by_patch():
    # frame 0 lacks patch 2 (frame 1's patch 2 is new: least similar); frame 1 lacks patch 3 (never kept)
    n = 5
    f0 = reference_frame(n)
    f1 = rotated([0.1, 0.2, 0.0, 0.0, 0.9])
    embeds = torch.cat([f0[[0, 1, 3, 4]], f1[[0, 1, 2, 4]]])
    frame = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    patch = torch.tensor([0, 1, 3, 4, 0, 1, 2, 4])
    keep = ttm_select(embeds, frame, patch, n, k=0.5)  # frame 1: int(0.5 * 4) = 2 of its 4 tokens
    assert keep.tolist() == [0, 1, 2, 3, 6, 7]  # frame 0 whole; frame 1: patch 2 (new), then patch 4
    with pytest.raises(ValueError, match="share a spatial patch"):
        ttm_select(embeds, torch.zeros(8, dtype=torch.long), patch, n, k=0.5)


# --- decode-time KV pruning rule --------------------------------------------------------------------------------


def test_kv_prune_first_step_stable_step_and_changed_step():
    a = torch.tensor([0.10, 0.40, 0.05, 0.30, 0.15])
    kept, sim = kv_prune(a, None, p=0.6)  # first step: similarity 0 -> prune, keep int(5 * 0.4) = 2
    assert sim == 0.0 and sorted(kept.tolist()) == [1, 3]
    kept, sim = kv_prune(a * 1.01, a, p=0.6)  # stable (cosine 1 >= 0.9): the full cache, nothing reused
    assert kept is None and sim == pytest.approx(1.0)
    b = torch.tensor([0.40, 0.01, 0.30, 0.02, 0.27])
    kept, sim = kv_prune(b, a, p=0.6)
    assert sim == pytest.approx(float(F.cosine_similarity(b, a, dim=0))) and sim < 0.9
    assert sorted(kept.tolist()) == [0, 2]
    assert kv_prune(b, a, p=0.6, threshold=-1.0)[0] is None
    assert kv_prune(a, a[:3], p=0.6)[1] == 0.0  # a span of another length: treated as the first step


def test_image_span_leaves_out_the_last_token_of_each_video():
    visual = torch.tensor([[False, True, True, True, False, True, True, False]])
    video = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1]])
    layout = TokenLayout(
        index=torch.arange(8)[None],
        valid=torch.ones(1, 8, dtype=torch.bool),
        visual=visual,
        frame=torch.zeros(1, 8, dtype=torch.long),
        patch=torch.zeros(1, 8, dtype=torch.long),
        video=video,
    )
    assert image_span(layout).tolist() == [[False, True, True, False, False, True, False, False]]
    assert torch.equal(image_span(layout, exclude_last_token=False), visual)


# --- parameters and retention -------------------------------------------------------------------------------------


def test_defaults_and_retention_mapping():
    params = DyCokeParams()
    assert (params.k, params.layer, params.p, params.threshold) == (None, 3, None, 0.9)
    assert params.shifted_pairs and params.drop_unpaired_frame and params.exclude_last_token
    plugin = vtc.registry()["dycoke"].factory(params, None)
    assert (plugin.k, plugin.p) == (0.7, 0.8)  # lmms-eval defaults
    plugin = DyCoke(params, 0.3)
    assert plugin.k == pytest.approx(0.7) and plugin.p == 0.8  # k = 1 - retention; P stays official
    plugin = DyCoke(params, 1.0)
    assert (plugin.k, plugin.p) == (0.0, 0.0)  # retention 1: both stages off
    plugin = DyCoke(DyCokeParams(k=0.5, p=0.7), 0.25)
    assert (plugin.k, plugin.p) == (0.5, 0.7)  # explicit parameters win
    assert DyCoke(params, 0.25).retained_count(32 * 196, (32, 14, 14)) == 9 * 196 + 23 * 49
    assert DyCoke(params, 1.0).retained_count(1000, (32, 14, 14)) == 1000
    assert DyCoke(params, 0.3).retained_count(100, (32, 14, 14)) is None  # already thinned by another plugin
    info = vtc.registry()["dycoke"]
    assert info.stages == ("connect", "prefill") and info.fixed_count and info.query_aware
    assert info.position_policy == "compact" and DyCoke.acts_during_decode


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k": 1.5}, "k"),
        ({"p": -0.1}, "p"),
        ({"layer": 0}, "layer"),
        ({"layer": 2.5}, "layer"),
        ({"threshold": 2.0}, "threshold"),
    ],
)
def test_invalid_parameters(kwargs, match):
    with pytest.raises(ValueError, match=f"dycoke: {match}"):
        DyCokeParams(**kwargs)


def make_tokens(x: torch.Tensor) -> VideoTokens:
    """Frames x [T, n, D] with n = side^2 patches as one video's tokens."""
    t, n, d = x.shape
    side = int(math.isqrt(n))
    return grid_tokens(x.reshape(-1, d), (t, side, side))


def test_connect_hook_identity_selection_and_last_kept():
    x = torch.randn(4, 9, 6)
    tokens = make_tokens(x)
    ctx = Context()
    assert DyCoke(DyCokeParams(), 1.0).vtc_connect(tokens=tokens, ctx=ctx) is tokens
    plugin = DyCoke(DyCokeParams(), 0.5)
    out = plugin.vtc_connect(tokens=tokens, ctx=ctx)
    expected = ttm_select(tokens.embeds, tokens.frame, tokens.patch, 9, 0.5)
    assert torch.equal(out.embeds, tokens.embeds[expected])
    assert torch.equal(out.positions, tokens.positions[expected])
    assert plugin.last_kept == [len(out)] == [plugin.retained_count(36, (4, 3, 3))] == [9 + 4 + 9 + 4]
    plugin.vtc_connect(tokens=tokens, ctx=ctx)  # a second video of the same forward
    assert plugin.last_kept == [26, 26]


# --- the patched model ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_patched_model_sees_the_ttm_selection(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    full, full_positions, _ = llm_inputs(model, inputs)
    video = compressible_video_mask(model, inputs["input_ids"])
    slots = torch.nonzero(video).flatten()
    out, positions, handle = llm_inputs(model, inputs, "dycoke", retention=0.25)
    stats = handle.stats()
    (grid,) = stats.grids
    t, h, w = grid
    assert slots.numel() == t * h * w
    keep = ttm_select(full[slots], torch.arange(t).repeat_interleave(h * w), torch.arange(h * w).repeat(t), h * w, 0.75)
    assert stats.visual_tokens_out == keep.numel() == sum(ttm_frame_counts(t, h * w, 0.75))
    first, last = int(slots[0]), int(slots[-1])
    expected = torch.cat([full[:first], full[slots][keep], full[last + 1 :]])
    assert torch.equal(out, expected)
    if family == "llava_onevision":  # the official LLaVA code renumbers the shortened sequence
        assert torch.equal(positions.flatten(), torch.arange(expected.shape[0]))
    else:  # Qwen: original M-RoPE positions of the chosen tokens
        sel = torch.cat([torch.arange(first), slots[keep], torch.arange(last + 1, full.shape[0])])
        assert torch.equal(positions[..., 0, :], full_positions[..., 0, sel])


def dycoke_decode_reference(model, inputs, new, layer=3, p=0.8, threshold=0.9, reuse=False):
    """The official decode-time pruning, batch 1, on the uncompressed prompt (TTM off): see `decode_reference`."""
    ref, _, x, hidden, cos, sin, visual = start(model, inputs, new)
    deepstack = (x.get("visual_pos_masks", [None])[0], x.get("deepstack_visual_embeds"))
    n_prompt = inputs["input_ids"].shape[1]
    return decode_reference(ref, hidden, cos, sin, visual, n_prompt, layer, p, threshold, reuse, deepstack)


def decode_reference(ref, hidden, cos, sin, visual, n_prompt, layer, p, threshold, reuse=False, deepstack=(None,) * 2):
    """Layer by layer: the decisions come from layer L-1's attention of each decode token (model-dtype softmax,
    head mean, image span = the prompt's video tokens minus the last one); layers >= L of that token's row then
    see only the kept video tokens, or the whole cache when the cosine with the previous step's attention is
    >= threshold (with `reuse`, the previous step's pruned set instead: NOT the official behaviour, to show the
    test tells them apart). `hidden` [1, prompt + new, D] holds the prompt and the decode tokens."""
    length = hidden.shape[1]
    span = torch.nonzero(visual[:n_prompt]).flatten()[:-1]
    with ref.capturing(), torch.no_grad():
        h = hidden
        for i in range(layer):
            h = ref.deepstack(i, ref.mlp_block(i, ref.attention_block(i, h, cos, sin)), *deepstack)
        query, key = CAPTURED[layer - 1]
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    previous, hidden_prev, decisions = None, None, []
    for row in range(n_prompt, length):  # decode step row - n_prompt + 1 runs the token at `row`
        logits = query[0, :, row : row + 1] @ key[0, :, : row + 1].transpose(-1, -2) * query.shape[-1] ** -0.5
        attention = torch.softmax(logits[:, 0], dim=-1).mean(0)[span]
        sim = 0.0 if previous is None else float(F.cosine_similarity(attention, previous, dim=0))
        previous = attention
        if sim < threshold:
            top = torch.topk(attention, int(span.numel() * (1 - p))).indices
            dropped = torch.ones(span.numel(), dtype=torch.bool)
            dropped[top] = False
            mask[row, span[dropped]] = False
            hidden_prev = span[dropped]
            decisions.append(int(top.numel()))
        else:
            if reuse and hidden_prev is not None:
                mask[row, hidden_prev] = False
            decisions.append(None)
    with torch.no_grad():
        h = hidden
        for i in range(len(ref.layers)):
            block = ref.attention_block(i, h, cos, sin, mask if i >= layer else None)
            h = ref.deepstack(i, ref.mlp_block(i, block), *deepstack)
        return ref.logits(h)[0], decisions


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_match_the_layer_by_layer_reference(family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    n_prompt = inputs["input_ids"].shape[1]
    with vtc.patch(model, "dycoke", k=0.0) as handle:  # TTM off: the decode stage alone, official P = 0.8
        plugin = handle.pipeline.entries[0].plugin
        gen = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        steps = list(plugin.steps)
    new = gen.sequences[:, n_prompt:]
    ref_logits, decisions = dycoke_decode_reference(model, inputs, new[:, :3])
    assert [s.kept[0] for s in steps] == decisions
    assert decisions[0] is not None and steps[0].similarity == [0.0]  # the first step always prunes
    for step in (1, 2, 3):
        torch.testing.assert_close(gen.logits[step][0], ref_logits[n_prompt + step - 1], atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        plain = model(**inputs).logits[:, -1]
    torch.testing.assert_close(gen.logits[0], plain, atol=1e-6, rtol=1e-6)  # the prefill is never pruned


def test_stable_steps_use_the_full_cache_and_always_pruning_matches_too():
    family = "qwen2_vl"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    n_prompt = inputs["input_ids"].shape[1]
    for threshold in (0.9, 1.0):
        with vtc.patch(model, "dycoke", k=0.0, threshold=threshold) as handle:
            plugin = handle.pipeline.entries[0].plugin
            gen = model.generate(
                **inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        new = gen.sequences[:, n_prompt:]
        ref_logits, decisions = dycoke_decode_reference(model, inputs, new[:, :3], threshold=threshold)
        assert [s.kept[0] for s in plugin.steps] == decisions
        for step in (1, 2, 3):
            torch.testing.assert_close(gen.logits[step][0], ref_logits[n_prompt + step - 1], atol=2e-5, rtol=1e-4)
        if threshold == 0.9:
            assert decisions[1] is None  # stable attention on the tiny model: the whole cache
            reused, _ = dycoke_decode_reference(model, inputs, new[:, :3], reuse=True)
            assert not torch.allclose(gen.logits[2][0], reused[n_prompt + 1], atol=1e-4, rtol=1e-3)
        else:
            assert all(d is not None for d in decisions)


def test_padded_batch_decodes_like_single_prompts():
    family = "qwen2_vl"
    model, _ = model_and_processor(family)
    kwargs = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with vtc.patch(model, "dycoke", retention=0.3) as handle:
        plugin = handle.pipeline.entries[0].plugin
        batch = model.generate(**batch_inputs(family), **kwargs)
        batch_steps = list(plugin.steps)
        singles = []
        for which in (0, 1):
            singles.append((model.generate(**single_inputs(family, which), **kwargs), list(plugin.steps)))
    for row, (single, steps) in enumerate(singles):
        assert [s.kept[row] for s in batch_steps] == [s.kept[0] for s in steps]
        for step in range(3):
            torch.testing.assert_close(batch.logits[step][row], single.logits[step][0], atol=2e-5, rtol=1e-4)


def test_llava_onevision_ttm_then_decode_pruning_on_the_renumbered_prompt():
    """Both stages on LLaVA-OneVision: the prompt is the TTM selection with contiguous positions (official
    LLaVA), the image span is the TTM output minus its last token, the newline after it is text."""
    family = "llava_onevision"
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    full, _, _ = llm_inputs(model, inputs)
    video = compressible_video_mask(model, inputs["input_ids"])
    slots = torch.nonzero(video).flatten()
    t, n = 8, 196
    keep = ttm_select(full[slots], torch.arange(t).repeat_interleave(n), torch.arange(n).repeat(t), n, 0.7)
    first, last = int(slots[0]), int(slots[-1])
    prompt = torch.cat([full[:first], full[slots][keep], full[last + 1 :]])
    with vtc.patch(model, "dycoke", retention=0.3) as handle:
        plugin = handle.pipeline.entries[0].plugin
        gen = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        assert handle.stats().visual_tokens_out == keep.numel()
    new = gen.sequences[:, inputs["input_ids"].shape[1] :]
    ref = ManualLLM(model)
    with torch.no_grad():
        hidden = torch.cat([prompt, model.get_input_embeddings()(new[0, :3])])[None]
    cos, sin = ref.rope(hidden, torch.arange(hidden.shape[1])[None])
    visual = torch.zeros(hidden.shape[1], dtype=torch.bool)
    visual[first : first + keep.numel()] = True
    n_prompt = prompt.shape[0]
    ref_logits, decisions = decode_reference(ref, hidden, cos, sin, visual, n_prompt, layer=3, p=0.8, threshold=0.9)
    assert [s.kept[0] for s in plugin.steps] == decisions
    assert decisions[0] == int((keep.numel() - 1) * (1 - 0.8))
    torch.testing.assert_close(gen.logits[0][0], ref.logits(ref_prefill(ref, prompt, cos, sin))[0, -1], **TOL)
    for step in (1, 2, 3):
        torch.testing.assert_close(gen.logits[step][0], ref_logits[n_prompt + step - 1], **TOL)


TOL = dict(atol=2e-5, rtol=1e-4)


def ref_prefill(ref, prompt, cos, sin):
    with torch.no_grad():
        h = prompt[None]
        for i in range(len(ref.layers)):
            h = ref.mlp_block(i, ref.attention_block(i, h, cos[:, : h.shape[1]], sin[:, : h.shape[1]]))
        return h


def test_layer_beyond_the_model_is_a_clear_error():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "dycoke", retention=0.3, layer=4):
        with pytest.raises(ValueError, match=r"dycoke: layer=4 but the language model has only 4 layers"):
            model.generate(**single_inputs("qwen2_vl"), max_new_tokens=2, do_sample=False)
