"""The plugin x family matrix: every token-reducing method on every model family must

* give logits identical to the unpatched model at retention 1.0,
* keep exactly the planned number of visual tokens (and, in fixed-count mode, exactly `retained_count(grid)`),
* leave every surviving token at its original position (RoPE rows gathered, never recomputed),
* generate and decode,
* restore the unpatched model exactly on unpatch (no hook, attribute or config change left),
* handle a left-padded batch of two different videos exactly like the two prompts run one by one,
* run in bf16 (identity at retention 1.0 included).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import vtc
from tests.conftest import (
    FAMILIES,
    NUM_FRAMES,
    QUESTIONS,
    batch_inputs,
    model_and_processor,
    reducing_methods,
    single_inputs,
    videos,
)

METHODS = reducing_methods()
RETENTION = 0.3
# the tiny test models have 4 LLM layers: methods acting at a deep layer by default act at layer 2 here;
# QuoTA's decoupling generates a short answer and quota-clip uses a tiny random CLIP
TINY_PARAMS = {
    "holitom": {"k": 2},
    "prunevid": {"selected_layer": 2},
    "quota": {"decouple_max_new_tokens": 4},
    "quota-clip": {"decouple_max_new_tokens": 4, "clip_model": "vtc-tiny-clip", "clip_pretrained": None},
}
# methods that hand a fixed budget to frames by relevance: at retention 1.0 they redistribute, not keep
REALLOCATING = {"quota", "quota-clip"}
# token order inside the LLM is strictly increasing in original position, except where the official output
# order is not temporal (static tokens first, clusters, OT merges) or resized frames share anchors (an upsampled
# frame reuses its grid's anchors row by row): there only "each token sits at one of the original positions"
UNORDERED = {"dycoke", "aot", "holitom", "visionzip", "prunevid", "quota", "quota-clip"}


def patch(model, method, retention, **params):
    return vtc.patch(model, method, retention=retention, **{**TINY_PARAMS.get(method, {}), **params})


def prepared(handle, family, which=None):
    """Inputs for a patched model: through `handle.prepare` when the method has a sample stage (it scores the
    frames there), else the shared cached inputs. `which`: 0 or 1 for one prompt, None for the padded batch."""
    if "sample" not in vtc.registry()[handle.pipeline.entries[-1].info.name].stages:
        return batch_inputs(family) if which is None else single_inputs(family, which)
    _, processor = model_and_processor(family)
    if which is None:
        return handle.prepare(processor, list(videos()), list(QUESTIONS), num_frames=NUM_FRAMES, fps=8)
    return handle.prepare(processor, videos()[which], QUESTIONS[which], num_frames=NUM_FRAMES, fps=8)


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def greedy(model, inputs, tokens: int = 4) -> torch.Tensor:
    out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[:, inputs["input_ids"].shape[1] :]


def hook_counts(model) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(getattr(m, "_forward_hooks_with_kwargs", {}))
        for m in model.modules()
    )


def planned_kept(handle, stats) -> int:
    """Visual tokens the method promised to keep for these inputs."""
    counts = [handle.retained_count(grid) for grid in stats.grids]
    if all(c is not None for c in counts):
        return sum(counts)
    # adaptive methods report what they decided at the last forward (per video or per batch row)
    plugin = handle.pipeline.entries[-1].plugin
    assert hasattr(plugin, "last_kept"), f"adaptive method {handle.pipeline.spec} must expose last_kept"
    return sum(plugin.last_kept)


@pytest.mark.parametrize("method", METHODS)
def test_retention_one_is_identity(method, family):
    model, _ = model_and_processor(family)
    if method in REALLOCATING:  # the full budget is redistributed across frames: the total equals the budget
        with patch(model, method, 1.0, fixed_count=True) as handle:
            logits(model, prepared(handle, family, 0))
            stats = handle.stats()
            assert stats.visual_tokens_out == stats.visual_tokens_in == handle.retained_count(stats.grids[0])
        return
    single, batch = single_inputs(family), batch_inputs(family)
    ref_single, ref_batch = logits(model, single), logits(model, batch)
    ref_tokens = greedy(model, batch)
    with patch(model, method, 1.0) as handle:
        assert torch.equal(logits(model, single), ref_single)
        assert torch.equal(logits(model, batch), ref_batch)
        assert torch.equal(greedy(model, batch), ref_tokens)
        stats = handle.stats()
        assert stats.visual_tokens_out == stats.visual_tokens_in > 0


@pytest.mark.parametrize("method", METHODS)
def test_kept_count_matches_plan(method, family):
    model, _ = model_and_processor(family)
    with patch(model, method, RETENTION) as handle:
        for inputs in (prepared(handle, family, 0), prepared(handle, family)):
            logits(model, inputs)
            stats = handle.stats()
            assert stats.visual_tokens_out == planned_kept(handle, stats)
            assert stats.visual_tokens_out < stats.visual_tokens_in


@pytest.mark.parametrize("method", [m for m in METHODS if vtc.registry()[m].fixed_count])
def test_fixed_count_mode_is_exact(method, family):
    """The serving mode: `retained_count(grid)` is known before the forward and honoured exactly, for videos of
    different sizes in one padded batch and at two retentions."""
    info = vtc.registry()[method]
    switch = {"fixed_count": True} if "fixed_count" in {f.name for f in dataclasses.fields(info.params)} else {}
    model, _ = model_and_processor(family)
    counts = {}
    for retention in (RETENTION, 0.15):
        with patch(model, method, retention, **switch) as handle:
            for which in (0, None):
                logits(model, prepared(handle, family, which))
                stats = handle.stats()
                planned = [handle.retained_count(grid) for grid in stats.grids]
                assert None not in planned
                assert stats.visual_tokens_out == sum(planned) < stats.visual_tokens_in
            counts[retention] = sum(planned)
    assert counts[0.15] < counts[RETENTION]


def _probe_layers(model):
    """Record (hidden states, RoPE cos) entering every decoder layer; registered after vtc's hooks, so it
    sees what the layer really gets."""
    records: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        records.append((hidden[0].detach().clone(), kwargs["position_embeddings"][0][0].detach().clone()))

    layers = vtc.api.resolve_adapter(model).decoder_layers
    return records, [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]


def _rows_in(rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """For each row of `rows`, the index of an identical row in `table` (-1 if none)."""
    equal = (rows[:, None, :] == table[None, :, :]).all(-1)
    found = equal.any(1)
    return torch.where(found, equal.float().argmax(1), torch.full_like(found, -1, dtype=torch.long))


@pytest.mark.parametrize("method", METHODS)
def test_survivors_keep_original_positions(method, family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    records, handles = _probe_layers(model)
    logits(model, inputs)
    original = list(records)
    records.clear()
    for h in handles:
        h.remove()
    # positions="keep" on every family (renumbering on LLaVA is checked in test_api and the methods' own tests)
    with patch(model, method, RETENTION, positions="keep") as handle:
        records, handles = _probe_layers(model)
        logits(model, prepared(handle, family, 0))
        for h in handles:
            h.remove()
    # a scorer that runs the patched model itself (QuoTA) records its own passes first: keep the prompt's pass
    records = records[-len(original) :]
    first = next(i for i, (hid, _) in enumerate(records) if hid.shape[0] != original[i][0].shape[0])
    hidden, cos = records[first]
    ref_hidden, ref_cos = original[first]
    same_hidden = (hidden[:, None, :] == ref_hidden[None, :, :]).all(-1)
    same_cos = (cos[:, None, :] == ref_cos[None, :, :]).all(-1)
    if method not in REALLOCATING:  # resized tokens are new features that may equal an original one by value
        # tokens that reach this layer unchanged are found by their hidden state (identical frames give several
        # candidates); each must carry the RoPE row of one of its candidates
        matched = same_hidden.any(1)
        assert bool((same_hidden & same_cos).any(1)[matched].all())
    # text tokens are never dropped: each reaches the layer with its own hidden state and position
    if first == 0:
        text = inputs["input_ids"][0] != vtc.api.resolve_adapter(model).video_token_id
        assert bool((same_hidden & same_cos).any(0)[text].all())
    # every token of every later layer sits at one of the original positions, in the original order
    for _, cos_l in records[first:]:
        where = _rows_in(cos_l, ref_cos)
        assert bool((where >= 0).all())
        if method not in UNORDERED:
            assert bool((where[1:] > where[:-1]).all())


@pytest.mark.parametrize("method", METHODS)
def test_generate_decodes(method, family):
    model, processor = model_and_processor(family)
    with patch(model, method, RETENTION) as handle:
        new = greedy(model, prepared(handle, family), tokens=5)
    assert new.shape == (2, 5)
    texts = processor.batch_decode(new, skip_special_tokens=True)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


@pytest.mark.parametrize("method", METHODS)
def test_unpatch_restores_model(method, family):
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    ref = logits(model, inputs)
    hooks_before = hook_counts(model)
    text = vtc.api.resolve_adapter(model).text_model
    attrs_before = {name: set(vars(m)) for name, m in model.named_modules()}
    attn_before = text.config._attn_implementation
    handle = patch(model, method, RETENTION)
    assert not torch.equal(logits(model, prepared(handle, family, 0))[:, -1], ref[:, -1])
    handle.unpatch()
    assert torch.equal(logits(model, inputs), ref)
    assert hook_counts(model) == hooks_before
    assert {name: set(vars(m)) for name, m in model.named_modules()} == attrs_before
    assert text.config._attn_implementation == attn_before
    handle.unpatch()  # a second unpatch is a no-op


@pytest.mark.parametrize("method", METHODS)
def test_padded_batch_matches_single_prompts(method, family):
    model, _ = model_and_processor(family)
    with patch(model, method, RETENTION) as handle:
        batch = prepared(handle, family)
        assert bool((batch["attention_mask"] == 0).any()), "the batch must contain padding"
        out = logits(model, batch)[:, -1]
        batch_kept = handle.stats().visual_tokens_out
        singles, kept = [], 0
        for which in (0, 1):
            singles.append(logits(model, prepared(handle, family, which))[0, -1])
            kept += handle.stats().visual_tokens_out
    assert batch_kept == kept
    for row in (0, 1):
        torch.testing.assert_close(out[row], singles[row], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_connect_decode_continues_compressed_prompt(method, family):
    """Decoding with the cache must match re-running the whole (prompt + generated) sequence, which the
    patch compresses the same way (methods that do not read the question, acting before the LLM)."""
    info = vtc.registry()[method]
    if info.query_aware or info.stages != ("connect",):
        pytest.skip("decisions depend on the prompt's last tokens; covered by the method's own reference test")
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    with patch(model, method, RETENTION):
        out = model.generate(
            **inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        full = dict(inputs)
        new = out.sequences[:, inputs["input_ids"].shape[1] :]
        full["input_ids"] = out.sequences[:, :-1]
        full["attention_mask"] = torch.ones_like(full["input_ids"])
        if "mm_token_type_ids" in full:
            full["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(new[:, :-1])], 1)
        with torch.no_grad():
            recomputed = model(**full, use_cache=False).logits[:, -1]
    torch.testing.assert_close(out.logits[-1], recomputed, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_bf16(method, family):
    model, _ = model_and_processor(family, torch.bfloat16)

    def bf16(inputs):
        return {
            k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()
        }

    inputs = bf16(single_inputs(family))
    ref = logits(model, inputs)
    if method not in REALLOCATING:
        with patch(model, method, 1.0):
            assert torch.equal(logits(model, inputs), ref)
    with patch(model, method, RETENTION) as handle:
        inputs = bf16(prepared(handle, family, 0))
        out = logits(model, inputs)
        assert torch.isfinite(out).all()
        assert handle.stats().visual_tokens_out < handle.stats().visual_tokens_in
        new = greedy(model, inputs, tokens=3)
    assert new.shape == (1, 3)


def test_matrix_covers_every_family_and_method():
    from vtc.hf.adapters import SUPPORTED_FAMILIES

    assert set(FAMILIES) == set(SUPPORTED_FAMILIES)
    assert {"random", "fastv", "framefusion"} <= set(METHODS)
