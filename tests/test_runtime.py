"""The LLM runtime's services for prefill plugins, each checked against a layer-by-layer reference:
attention rows of the text after the video, pruning earlier layers' KV cache, replacing the residual
stream, and hiding cached keys during decode steps."""

from __future__ import annotations

import pytest
import torch

import vtc
from tests.conftest import model_and_processor, single_inputs
from tests.probes import renamed
from tests.reference import CAPTURED, start
from vtc.core.registry import registry

FAMILY = "qwen2_vl"


def register(name, method_cls, **attributes):
    """Register `method_cls` (a `vtc.Method` with a prefill hook) as method `name`, class attributes overridden."""
    registry().add(renamed(method_cls, name, **attributes))


@pytest.fixture
def methods():
    names = []
    yield names
    for name in names:
        registry()._methods.pop(name, None)


def visual_mask(inputs):
    return inputs["input_ids"][0] == vtc.api.resolve_adapter(model_and_processor(FAMILY)[0]).video_token_id


def test_after_visual_rows(methods):
    seen = {}

    class Rows(vtc.Method):
        def prefill(self, state, ctx):
            if state.point == "layer_start" and state.layer == 1:
                state.request_attention("after_visual", upcast=True)
            if state.point == "after_attention" and state.layer == 1:
                seen["probs"] = state.attention().clone()
                seen["valid"] = state.attention_rows_valid().clone()

    register("t_rows", Rows)
    methods.append("t_rows")
    model, _ = model_and_processor(FAMILY)
    inputs = single_inputs(FAMILY)
    with vtc.patch(model, "t_rows"), torch.no_grad():
        model(**inputs)
    ref, inputs_, x, hidden, cos, sin, visual = start(model, inputs)
    with ref.capturing(), torch.no_grad():
        ref.attention_block(0, ref.mlp_block(0, ref.attention_block(0, hidden, cos, sin)), cos, sin)
        h = ref.mlp_block(0, ref.attention_block(0, hidden, cos, sin))
        ref.attention_block(1, h, cos, sin)
        query, key = CAPTURED[1]
    last_visual = int(torch.nonzero(visual).max())
    rows = torch.arange(last_visual + 1, hidden.shape[1])
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    logits = query[0, :, rows] @ key[0].transpose(-1, -2) * query.shape[-1] ** -0.5
    causal = torch.arange(hidden.shape[1])[None, :] <= rows[:, None]
    expected = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1, dtype=torch.float32)
    assert seen["probs"].shape == (1, query.shape[1], rows.numel(), hidden.shape[1])
    assert bool(seen["valid"].all())
    torch.testing.assert_close(seen["probs"][0], expected, atol=1e-5, rtol=1e-4)


def test_prune_cache_of_earlier_layers_and_decode(methods):
    """Prune half the visual tokens at layer 2's input together with layers 0-1's KV cache: later tokens
    (decode steps) must never see them, at any layer."""
    chosen = {}

    class Prune(vtc.Method):
        def prefill(self, state, ctx):
            if state.point == "layer_start" and state.layer == 2:
                layout = state.layout
                keep = layout.valid.clone()
                visual = torch.nonzero(layout.visual[0]).flatten()
                keep[0, visual[1::2]] = False
                chosen["keep"] = keep[0].clone()
                state.keep(keep, prune_cache=True)

    register("t_prune", Prune)
    methods.append("t_prune")
    model, _ = model_and_processor(FAMILY)
    inputs = single_inputs(FAMILY)
    with vtc.patch(model, "t_prune"):
        gen = model.generate(
            **inputs,
            max_new_tokens=2,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
    keep = chosen["keep"]
    new = gen.sequences[:, inputs["input_ids"].shape[1] :]
    ref, _, x, hidden, cos, sin, _ = start(model, inputs, new[:, :1])
    n_prompt = inputs["input_ids"].shape[1]
    length = hidden.shape[1]
    # prompt rows: causal over the whole prompt in layers 0-1; the new token: causal but blind to dropped tokens
    dropped = torch.zeros(length, dtype=torch.bool)
    dropped[:n_prompt] = ~keep
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    mask[n_prompt:, dropped] = False
    with torch.no_grad():
        h = hidden
        for i in range(2):
            h = ref.mlp_block(i, ref.attention_block(i, h, cos, sin, mask))
        kept = torch.nonzero(~dropped).flatten()
        h, cos, sin = h[:, kept], cos[:, kept], sin[:, kept]
        for i in range(2, len(ref.layers)):
            h = ref.mlp_block(i, ref.attention_block(i, h, cos, sin))
        logits = ref.logits(h)[:, -1]
    torch.testing.assert_close(gen.logits[1], logits, atol=2e-5, rtol=1e-4)


def test_replace_hidden_mid_layer(methods):
    class Scale(vtc.Method):
        def prefill(self, state, ctx):
            if state.point == "after_attention" and state.layer == 1:
                state.replace_hidden(state.hidden * 0.5)

    register("t_scale", Scale)
    methods.append("t_scale")
    model, _ = model_and_processor(FAMILY)
    inputs = single_inputs(FAMILY)
    with vtc.patch(model, "t_scale"), torch.no_grad():
        out = model(**inputs).logits[:, -1]
    ref, _, x, hidden, cos, sin, _ = start(model, inputs)
    with torch.no_grad():
        h = hidden
        for i in range(len(ref.layers)):
            h = ref.attention_block(i, h, cos, sin)
            if i == 1:
                h = h * 0.5
            h = ref.mlp_block(i, h)
        expected = ref.logits(h)[:, -1]
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    from vtc.hf.llm.runtime import LLMRuntime

    runtime = LLMRuntime(model.model.language_model, [], lambda s, d: None, FAMILY)
    runtime.hidden = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="replace_hidden needs shape"):
        runtime.state.replace_hidden(torch.zeros(1, 3, 3))


def test_mask_keys_during_decode(methods):
    """A decode-time plugin hides the cached video tokens from layer 1 on, for every decode step."""

    class Hide(vtc.Method):  # decode-time calls are declared by the class attribute during_decode
        def prefill(self, state, ctx):
            if state.phase == "decode" and state.point == "layer_start" and state.layer == 1:
                layout = state.prefill_layout(1)
                state.mask_keys(layout.valid & ~layout.visual)

    register("t_hide", Hide, during_decode=True)
    methods.append("t_hide")
    model, _ = model_and_processor(FAMILY)
    inputs = single_inputs(FAMILY)
    with vtc.patch(model, "t_hide"):
        gen = model.generate(
            **inputs, max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    new = gen.sequences[:, inputs["input_ids"].shape[1] :]
    ref, inputs_, x, hidden, cos, sin, visual = start(model, inputs, new[:, :1])
    n_prompt = inputs["input_ids"].shape[1]
    length = hidden.shape[1]
    blind = torch.ones(length, length, dtype=torch.bool).tril()
    blind[n_prompt:, :n_prompt] &= ~visual[:n_prompt]
    with torch.no_grad():
        h = hidden
        for i in range(len(ref.layers)):
            h = ref.mlp_block(i, ref.attention_block(i, h, cos, sin, blind if i >= 1 else None))
        expected = ref.logits(h)[:, -1]
    torch.testing.assert_close(gen.logits[1], expected, atol=2e-5, rtol=1e-4)
    # the prefill itself is untouched (identical first token logits)
    with torch.no_grad():
        plain = model(**inputs).logits[:, -1]
    torch.testing.assert_close(gen.logits[0], plain, atol=1e-6, rtol=1e-6)


def test_decode_calls_need_the_declaration(methods):
    """Without `during_decode = True` a prefill method is never called on decode steps."""
    phases = {"t_decl": [], "t_undecl": []}

    def make(name):
        class Hide(vtc.Method):
            def prefill(self, state, ctx):
                phases[name].append(state.phase)
                if state.phase == "decode" and state.point == "layer_start" and state.layer == 1:
                    layout = state.prefill_layout(1)
                    state.mask_keys(layout.valid & ~layout.visual)

        return Hide

    register("t_decl", make("t_decl"), during_decode=True)
    register("t_undecl", make("t_undecl"))
    methods.extend(["t_decl", "t_undecl"])
    model, _ = model_and_processor(FAMILY)
    inputs = single_inputs(FAMILY)
    kwargs = dict(max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True)
    plain = model.generate(**inputs, **kwargs)
    with vtc.patch(model, "t_undecl"):
        undeclared = model.generate(**inputs, **kwargs)
    with vtc.patch(model, "t_decl"):
        declared = model.generate(**inputs, **kwargs)
    assert set(phases["t_undecl"]) == {"prefill"} and set(phases["t_decl"]) == {"prefill", "decode"}
    torch.testing.assert_close(undeclared.logits[1], plain.logits[1], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(declared.logits[1], plain.logits[1], atol=1e-4, rtol=1e-3)
