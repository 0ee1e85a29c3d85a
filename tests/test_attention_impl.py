"""The LLM runtime keeps the model's own attention implementation (docs/concepts.md, "Attention implementations").

Spies record which attention function each decoder layer's forward really runs, and with what mask: SDPA and eager
(transformers' own functions), a stand-in for flash-attention-2 (registered like transformers registers FA2: a
function that takes a 2-D padding mask or none, with FA2's mask function) and an implementation that registered no
mask function (as kernels fed packed sequences do). Logits must match the SDPA model, whose results are those of
the runtime before this rule (the method tests check them against the official algorithms).
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

import vtc
from tests.conftest import batch_inputs, model_and_processor, single_inputs
from vtc.core.stats import AttentionFallback
from vtc.hf.adapters import resolve_adapter
from vtc.hf.llm.attention import DispatchConfig
from vtc.hf.llm.runtime import AttentionFallbackWarning
from vtc.testing import tiny

FLASH = "vtc_test_flash_attention_2"  # "flash" in the name, as transformers tells flash implementations apart
MASKLESS = "vtc_test_maskless"
FAMILIES = ("qwen2_vl", "llava_onevision")  # M-RoPE with 3-D positions, and 1-D position ids handed to attention
TOL = dict(atol=5e-5, rtol=1e-4)


def fake_flash_attention(module, query, key, value, attention_mask, scaling=None, is_causal=None, **kwargs):
    """flash_attention_forward's contract, computed with SDPA: no dense mask; causal (bottom-right aligned) unless
    `is_causal=False`; a 2-D mask marks the real tokens, queries first from the right; padding rows come back 0."""
    assert attention_mask is None or attention_mask.dim() == 2, "flash attention takes no dense mask"
    causal = module.is_causal if is_causal is None else is_causal
    bsz, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    allowed = torch.ones(bsz, 1, q_len, kv_len, dtype=torch.bool, device=query.device)
    if causal:
        allowed &= torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    real_queries = torch.ones(bsz, q_len, dtype=torch.bool)
    if attention_mask is not None:
        allowed &= attention_mask[:, -kv_len:].bool()[:, None, None, :]
        real_queries = attention_mask[:, -q_len:].bool()
    allowed |= ~real_queries[:, None, :, None]  # a padding row sees everything (finite), then is zeroed
    out, _ = sdpa_attention_forward(module, query, key, value, allowed, scaling=scaling, **kwargs)
    return out * real_queries[:, :, None, None].to(out.dtype), None


def maskless_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """An implementation transformers never gives a mask (no mask function registered): plain causal attention."""
    assert attention_mask is None, "no mask function is registered for this implementation"
    return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=True, **kwargs)


AttentionInterface.register(FLASH, fake_flash_attention)
AttentionMaskInterface.register(FLASH, flash_attention_mask)
AttentionInterface.register(MASKLESS, maskless_attention)


def mask_kind(mask) -> str:
    if mask is None:
        return "none"
    if mask.dim() == 2:
        return "2d"
    return "bool" if mask.dtype == torch.bool else "float"


class Spy:
    """Which function each decoder layer's attention ran, on how many queries, with which kind of mask."""

    def __init__(self, model):
        layers = resolve_adapter(model).decoder_layers
        self.index = {layer.self_attn: i for i, layer in enumerate(layers)}
        self.num_layers = len(layers)
        self.calls: list[tuple[int, str, int, str]] = []

    def wrap(self, label, fn):
        def spy(module, query, key, value, attention_mask, *args, **kwargs):
            if module in self.index:
                self.calls.append((self.index[module], label, query.shape[2], mask_kind(attention_mask)))
            return fn(module, query, key, value, attention_mask, *args, **kwargs)

        return spy

    def ran(self) -> list[set[str]]:
        """Per layer, the implementations that ran there."""
        return [{c[1] for c in self.calls if c[0] == i} for i in range(self.num_layers)]

    def masks(self, layer: int) -> set[str]:
        return {c[3] for c in self.calls if c[0] == layer}

    def query_lengths(self, layer: int) -> set[int]:
        return {c[2] for c in self.calls if c[0] == layer}


@contextlib.contextmanager
def spying(model, monkeypatch):
    """Every attention function a decoder layer can reach, spied (installed before `vtc.patch` looks them up)."""
    spy = Spy(model)
    module = sys.modules[type(resolve_adapter(model).decoder_layers[0].self_attn).__module__]
    mapping = AttentionInterface._global_mapping
    monkeypatch.setitem(mapping, "sdpa", spy.wrap("sdpa", mapping["sdpa"]))
    monkeypatch.setitem(mapping, FLASH, spy.wrap(FLASH, fake_flash_attention))
    monkeypatch.setitem(mapping, MASKLESS, spy.wrap(MASKLESS, maskless_attention))
    monkeypatch.setattr(module, "eager_attention_forward", spy.wrap("eager", module.eager_attention_forward))
    yield spy


def build(family: str, impl: str):
    """A fresh tiny model of `family` (the same weights as the shared fixture) whose LLM runs `impl`."""
    model, _ = tiny.build(family)
    resolve_adapter(model).text_model.config._attn_implementation = impl
    return model


def reference_logits(family, spec, inputs, **params):
    """The SDPA model patched with `spec`: the runtime's results before it kept other implementations."""
    model, _ = model_and_processor(family)
    with vtc.patch(model, spec, **params), torch.no_grad():
        return model(**inputs).logits[:, -1]


def no_fallback_warnings(caught) -> bool:
    return not [w for w in caught if issubclass(w.category, AttentionFallbackWarning)]


@pytest.mark.parametrize(
    "family, spec, impl",
    [("qwen2_vl", "fastv", "sdpa")]
    + [(family, spec, impl) for family in FAMILIES for spec in ("fastv", "framefusion") for impl in ("eager", FLASH)],
)
def test_every_layer_runs_the_models_own_implementation(family, spec, impl, monkeypatch):
    """No padding: before, at and after the prune every layer runs the model's own function; the shortened layers
    get no mask from SDPA/flash (is_causal) and eager's additive causal mask; the requested rows come from vtc."""
    model = build(family, impl)
    inputs = single_inputs(family)
    with spying(model, monkeypatch) as spy, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with vtc.patch(model, spec, retention=0.5) as handle, torch.no_grad():
            logits = model(**inputs).logits[:, -1]
        stats = handle.stats()
    layers = spy.num_layers
    assert spy.ran() == [{impl}] * layers
    assert stats.layer_attention == [impl] * layers
    assert stats.attention_fallbacks == [] and no_fallback_warnings(caught)
    prompt = inputs["input_ids"].shape[1]
    counts = stats.layer_visual_tokens  # visual tokens entering each layer
    shortened = [i for i in range(layers) if counts[i] < stats.llm_tokens_in]
    assert shortened, "the method must prune inside the LLM for this test to mean anything"
    for i in range(layers):
        if i in shortened:
            assert max(spy.query_lengths(i)) < prompt
            assert spy.masks(i) == {"float" if impl == "eager" else "none"}
        else:
            assert spy.query_lengths(i) == {prompt}
    torch.testing.assert_close(logits, reference_logits(family, spec, inputs, retention=0.5), **TOL)


@pytest.mark.parametrize("impl", ["eager", FLASH])
@pytest.mark.parametrize("spec", ["fastv", "framefusion"])
def test_a_padded_batch_with_ragged_lengths_keeps_the_implementation(spec, impl, monkeypatch):
    """Two videos of different sizes, left-padded: after the prune the rows keep different numbers of tokens.
    Eager takes the dense (additive) mask, flash-attention its 2-D padding mask; neither falls back."""
    family = "qwen2_vl"
    model = build(family, impl)
    inputs = batch_inputs(family)
    with spying(model, monkeypatch) as spy, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with vtc.patch(model, spec, retention=0.5) as handle, torch.no_grad():
            logits = model(**inputs).logits[:, -1]
        stats = handle.stats()
    assert spy.ran() == [{impl}] * spy.num_layers
    assert stats.layer_attention == [impl] * spy.num_layers
    assert stats.attention_fallbacks == [] and no_fallback_warnings(caught)
    assert spy.masks(spy.num_layers - 1) == {"float" if impl == "eager" else "2d"}
    torch.testing.assert_close(logits, reference_logits(family, spec, inputs, retention=0.5), **TOL)


def test_decode_steps_keep_the_implementation(monkeypatch):
    """generate on the padded batch: decode steps over the ragged per-layer caches run flash-attention with a 2-D
    key mask, and the logits of every step match the SDPA model's."""
    family = "qwen2_vl"
    inputs = batch_inputs(family)
    kwargs = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    sdpa_model, _ = model_and_processor(family)
    with vtc.patch(sdpa_model, "fastv", retention=0.5):
        expected = sdpa_model.generate(**inputs, **kwargs)
    model = build(family, FLASH)
    with spying(model, monkeypatch) as spy, vtc.patch(model, "fastv", retention=0.5) as handle:
        got = model.generate(**inputs, **kwargs)
    assert spy.ran() == [{FLASH}] * spy.num_layers
    last = spy.num_layers - 1
    assert {c[3] for c in spy.calls if c[0] == last and c[2] == 1} == {"2d"}  # decode: one query, a key mask
    assert handle.stats().attention_fallbacks == []
    assert torch.equal(got.sequences, expected.sequences)
    for step in range(3):
        torch.testing.assert_close(got.logits[step], expected.logits[step], **TOL)


def test_an_implementation_without_masks_falls_back_on_padding_warns_once_and_is_recorded(monkeypatch):
    """An implementation that takes no mask cannot skip the padding of a ragged batch: those layers run SDPA with
    a dense mask, vtc warns once (two forwards, several layers) and lists every such layer in the stats. Without
    padding nothing falls back."""
    family = "qwen2_vl"
    model = build(family, MASKLESS)
    with spying(model, monkeypatch) as spy, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with vtc.patch(model, "fastv", retention=0.5) as handle, torch.no_grad():
            model(**single_inputs(family))
            single = handle.stats()
            assert single.attention_fallbacks == [] and no_fallback_warnings(caught)
            assert spy.ran() == [{MASKLESS}] * spy.num_layers
            spy.calls.clear()
            inputs = batch_inputs(family)
            logits = model(**inputs).logits[:, -1]
            model(**inputs)
            stats = handle.stats()
    fallback_warnings = [w for w in caught if issubclass(w.category, AttentionFallbackWarning)]
    assert len(fallback_warnings) == 1
    assert "handle.stats().attention_fallbacks" in str(fallback_warnings[0].message)
    shortened = [i for i, n in enumerate(stats.layer_visual_tokens) if n < stats.llm_tokens_in]
    assert shortened and stats.attention_fallbacks == [
        AttentionFallback(layer=i, from_impl=MASKLESS, to_impl="sdpa", reason="padding", phase="prefill")
        for i in shortened
    ]
    assert stats.layer_attention == ["sdpa" if i in shortened else MASKLESS for i in range(spy.num_layers)]
    assert [ran == {"sdpa"} for ran in spy.ran()] == [i in shortened for i in range(spy.num_layers)]
    assert "attention fallback (prefill)" in stats.table()
    assert stats.to_dict()["attention_fallbacks"][0]["from_impl"] == MASKLESS
    # the row without padding in the prompt gets the same result as on the SDPA model (the implementation cannot
    # see the other row's padding before the prune; after it SDPA masks it)
    full = inputs["attention_mask"].bool().all(dim=1)
    assert int(full.sum()) == 1
    expected = reference_logits(family, "fastv", inputs, retention=0.5)
    torch.testing.assert_close(logits[full], expected[full], **TOL)


def test_decode_fallback_is_recorded_on_the_prefill_it_continues(monkeypatch):
    """Decode steps over ragged caches need a key mask an implementation without masks cannot take."""
    family = "qwen2_vl"
    model = build(family, MASKLESS)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with vtc.patch(model, "fastv", retention=0.5) as handle:
            model.generate(**batch_inputs(family), max_new_tokens=2, do_sample=False)
        records = handle.stats().attention_fallbacks
    assert {r.phase for r in records} == {"prefill", "decode"}
    assert {r.reason for r in records if r.phase == "decode"} == {"masked keys"}
    assert len(records) == len(set((r.layer, r.phase) for r in records))  # once per layer, not per step


@pytest.mark.parametrize("impl", ["eager", FLASH, MASKLESS])
def test_bidirectional_layer(impl, monkeypatch):
    """HoliTom's `bidirectional_layer`: eager runs the non-causal layer itself (a dense additive mask),
    flash-attention with is_causal=False; an implementation vtc cannot make non-causal falls back to SDPA."""
    family = "qwen2_vl"
    params = dict(retain_ratio=1.0, r=0.5, k=2, bidirectional_layer=True)
    inputs = single_inputs(family)
    model = build(family, impl)
    with spying(model, monkeypatch) as spy, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with vtc.patch(model, "holitom", **params) as handle, torch.no_grad():
            logits = model(**inputs).logits[:, -1]
        stats = handle.stats()
    if impl == MASKLESS:
        assert stats.attention_fallbacks == [
            AttentionFallback(layer=1, from_impl=MASKLESS, to_impl="sdpa", reason="bidirectional", phase="prefill")
        ]
        assert spy.ran()[1] == {"sdpa"} and not no_fallback_warnings(caught)
    else:
        assert stats.attention_fallbacks == [] and no_fallback_warnings(caught)
        assert spy.ran() == [{impl}] * spy.num_layers
        assert spy.masks(1) == {"float" if impl == "eager" else "none"}
    torch.testing.assert_close(logits, reference_logits(family, "holitom", inputs, **params), **TOL)


def test_the_text_config_is_never_switched_and_unpatch_restores_every_module(monkeypatch):
    """transformers builds its masks from the real implementation; attention modules see vtc's dispatch name
    only inside their forward; a forward without video runs the model's own function untouched."""
    family = "llava_onevision"
    model = build(family, FLASH)
    adapter = resolve_adapter(model)
    config = adapter.text_model.config
    attention = [layer.self_attn for layer in adapter.decoder_layers]
    with vtc.patch(model, "fastv", retention=0.5) as handle:
        assert config._attn_implementation == FLASH
        with torch.no_grad():
            model(**single_inputs(family))
        assert all(m.config is config for m in attention)  # the view is gone once a forward is over
        with spying(model, monkeypatch) as spy, torch.no_grad():
            text = model_and_processor(family)[1].tokenizer("What happens here?", return_tensors="pt")
            model(**text)  # text only: vtc stays out of the way
        assert spy.ran() == [{FLASH}] * len(attention) and spy.masks(0) == {"none"}
        config._attn_implementation = "eager"  # what model.set_attn_implementation does to the text config
        with torch.no_grad():
            model(**single_inputs(family))
        assert handle.stats().layer_attention == ["eager"] * len(attention)  # read again at the next prefill
        config._attn_implementation = FLASH
    assert all(m.config is config for m in attention) and config._attn_implementation == FLASH
    view = DispatchConfig(config)
    assert view._attn_implementation == "vtc" and view.hidden_size == config.hidden_size
    view.vtc_test_attribute = 3  # writes go to the real config
    assert config.vtc_test_attribute == 3
    del config.vtc_test_attribute


def test_the_gpu_attention_check_runs_on_cpu(tmp_path):
    """eval/gpu_attention.py (step 4 of eval/gpu_check.sh) in its CPU mode: eager against SDPA; and its
    flash-attention-2 vs SDPA table from a gpu_prefill report."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "eval" / "gpu_attention.py"
    spec = importlib.util.spec_from_file_location("gpu_attention", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "attention.json"
    assert script.main(["--tiny", "--skip-timing", "--methods", "fastv", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["check"]["rows"]
    assert {(r["implementation"], r["input"]) for r in rows} == {
        (impl, name) for impl in ("sdpa", "eager") for name in ("one video", "padded batch")
    }
    assert all(r["ok"] and set(r["layer_attention"]) == {r["implementation"]} for r in rows)
    ms = lambda v: {"prefill_ms": {"median": v}}  # noqa: E731
    prefill = {"attention": {"sdpa": {"none": ms(100.0), "fastv": ms(50.0)}, "flash_attention_2": {"none": ms(80.0)}}}
    table = script.flash_vs_sdpa(prefill)
    assert table["none"]["flash_over_sdpa"] == pytest.approx(0.8) and "error" in table["fastv"]
    assert "skipped" in script.flash_vs_sdpa({"attention": {"sdpa": {}, "flash_attention_2": {"skipped": "no"}}})
