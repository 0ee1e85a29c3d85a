"""The public API: errors that name the problem and the allowed values, patch lifecycle (context manager,
patching twice, two models in one process), parameter routing, inputs without a video."""

from __future__ import annotations

import pytest
import torch

import vtc
from tests.conftest import model_and_processor, single_inputs
from vtc.testing import tiny


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_unknown_method_lists_known_ones():
    model, _ = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match=r"unknown method 'fastvv'; known methods: .*fastv.*framefusion.*random"):
        vtc.patch(model, "uniform+fastvv")


@pytest.mark.parametrize("retention", [0, -0.1, 1.5, float("nan"), "half", True])
def test_retention_outside_range(retention):
    model, _ = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match=r"retention must be .*\(0, 1\]"):
        vtc.patch(model, "fastv", retention=retention)


def test_unsupported_model_lists_families():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    )
    with pytest.raises(TypeError, match=r"does not support LlamaForCausalLM; supported model families: qwen2_vl"):
        vtc.patch(model, "fastv")


def test_two_plugins_owning_one_decision():
    model, _ = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match=r"'fastv' and 'framefusion' both decide llm token schedule"):
        vtc.patch(model, "fastv+framefusion")


def test_bad_spec_and_duplicates():
    model, _ = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match="invalid method spec"):
        vtc.patch(model, "fastv++random")
    with pytest.raises(ValueError, match="appear twice"):
        vtc.patch(model, "random+random")


def test_parameter_routing_and_errors():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "uniform+fastv", retention=0.5, k=3, num_frames=4) as handle:
        fastv = handle.pipeline.entries[-1]
        assert fastv.params.k == 3 and handle.pipeline.entries[0].params.num_frames == 4
    with vtc.patch(model, "fastv", **{"fastv.k": 1}) as handle:
        assert handle.pipeline.entries[0].params.k == 1
    with pytest.raises(ValueError, match=r"unknown parameter 'kk'.*fastv: k, ratio"):
        vtc.patch(model, "fastv", kk=3)
    with pytest.raises(ValueError, match=r"method 'fastv' has no parameter 'x'; its parameters: k, ratio"):
        vtc.patch(model, "fastv", **{"fastv.x": 1})
    with pytest.raises(ValueError, match=r"fastv: k must be >= 1"):
        vtc.patch(model, "fastv", k=0)


def test_positions_compact_refused_on_mrope():
    model, _ = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match=r"positions='compact' is only supported on 1-D RoPE families"):
        vtc.patch(model, "random", positions="compact")
    with pytest.raises(ValueError, match=r"positions must be 'keep' or 'compact'"):
        vtc.patch(model, "random", positions="gaps")


def test_compact_positions_on_llava_renumber_and_decode():
    model, _ = model_and_processor("llava_onevision")
    inputs = single_inputs("llava_onevision")
    seen = []
    probe = model.model.language_model.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["position_ids"]), with_kwargs=True
    )
    try:
        with vtc.patch(model, "random", retention=0.3, positions="compact"):
            model.generate(**inputs, max_new_tokens=2, do_sample=False)
    finally:
        probe.remove()
    prompt, step = seen[0], seen[1]
    n = prompt.shape[-1]
    assert torch.equal(prompt[0], torch.arange(n))  # renumbered 0..n-1
    assert int(step.flatten()[0]) == n  # decoding continues right after the compressed prompt


def test_input_without_video_runs_unchanged():
    model, processor = model_and_processor("qwen2_vl")
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    inputs = processor(text=[text], return_tensors="pt")
    ref = logits(model, inputs)
    with vtc.patch(model, "uniform+fastv", retention=0.3) as handle:
        assert torch.equal(logits(model, inputs), ref)
        stats = handle.stats()
    assert stats.has_video is False
    assert "no video" in stats.table()


def test_context_manager_and_handle_state():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    ref = logits(model, inputs)
    with vtc.patch(model, "random", retention=0.25) as handle:
        assert handle.active and "active" in repr(handle)
        assert logits(model, inputs).shape[1] < ref.shape[1]
    assert not handle.active
    assert torch.equal(logits(model, inputs), ref)


def test_patching_twice_replaces_previous_patch():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    ref = logits(model, inputs)
    first = vtc.patch(model, "random", retention=0.5)
    with pytest.warns(UserWarning, match="already patched with 'random'; replacing it with 'fastv'"):
        second = vtc.patch(model, "fastv", retention=0.5)
    assert not first.active and second.active
    logits(model, inputs)
    assert second.stats().stages[0].plugin == "fastv"
    assert first.stats() is None
    first.unpatch()  # stale handle: no effect
    assert second.active
    second.unpatch()
    assert torch.equal(logits(model, inputs), ref)


def test_two_models_in_one_process_are_independent():
    model_a, _ = model_and_processor("qwen2_vl")
    model_b, _ = tiny.build("qwen2_vl", seed=1)
    inputs = single_inputs("qwen2_vl")
    ref_b = logits(model_b, inputs)
    with vtc.patch(model_a, "fastv", retention=0.3) as handle_a:
        assert torch.equal(logits(model_b, inputs), ref_b)  # b is untouched
        with vtc.patch(model_b, "random", retention=0.5) as handle_b:
            logits(model_a, inputs)
            logits(model_b, inputs)
            assert handle_a.stats().stages[0].plugin == "fastv"
            assert handle_b.stats().stages[0].plugin == "random"
            assert handle_a.stats().visual_tokens_out == round(handle_a.stats().visual_tokens_in * 0.3)
    assert torch.equal(logits(model_b, inputs), ref_b)


def test_shared_config_object_does_not_leak_attention_function():
    """Two instances built from one config object share text_config; the other keeps plain SDPA."""
    from transformers import Qwen2VLForConditionalGeneration

    model_a, _ = model_and_processor("qwen2_vl")
    model_b = Qwen2VLForConditionalGeneration(model_a.config).eval()
    inputs = single_inputs("qwen2_vl")
    ref_b = logits(model_b, inputs)
    with vtc.patch(model_a, "fastv", retention=0.3):
        assert torch.equal(logits(model_b, inputs), ref_b)


def test_stats_report_stages_and_layers():
    model, _ = model_and_processor("qwen2_5_vl")
    inputs = single_inputs("qwen2_5_vl")
    with vtc.patch(model, "random+fastv", retention=0.25, k=2) as handle:
        logits(model, inputs)
        stats = handle.stats()
    n = stats.visual_tokens_in
    assert [s.plugin for s in stats.stages] == ["random", "fastv"]
    assert stats.stages[0].tokens_in == n and stats.stages[0].tokens_out == stats.llm_tokens_in
    assert stats.layer_visual_tokens[:2] == [stats.llm_tokens_in] * 2
    assert stats.layer_visual_tokens[2:] == [stats.visual_tokens_out] * 2
    assert stats.visual_tokens_out == round(round(n * 0.5) * 0.5)  # 0.25 split evenly over two reducers
    assert "random" in stats.table() and "per LLM layer" in stats.table()
    assert stats.to_dict()["retention"] == pytest.approx(stats.visual_tokens_out / n)


def test_retained_count_composes():
    model, _ = model_and_processor("qwen2_vl")
    with vtc.patch(model, "uniform+random", retention=0.3) as handle:
        assert handle.retained_count((4, 12, 12)) == round(576 * 0.3)
    with vtc.patch(model, "framefusion", retention=0.3) as handle:
        assert handle.retained_count((4, 12, 12)) is None  # adaptive


def test_methods_listing():
    infos = {info.name: info for info in vtc.methods()}
    assert infos["uniform"].stages == ("sample",) and not infos["uniform"].reduces_tokens
    assert infos["fastv"].stages == ("prefill",)
    assert infos["random"].fixed_count and not infos["framefusion"].fixed_count


def test_method_not_supporting_family(monkeypatch):
    import dataclasses

    from vtc.core.registry import registry

    info = registry()["random"]
    monkeypatch.setitem(registry()._methods, "random", dataclasses.replace(info, families=("qwen2_vl",)))
    model, _ = model_and_processor("llava_onevision")
    with pytest.raises(ValueError, match=r"method 'random' does not support llava_onevision; it supports qwen2_vl"):
        vtc.patch(model, "random")


def test_third_party_plugin_from_entry_point(tmp_path, monkeypatch):
    """A package exposing a module in the `vtc` entry-point group shows up in the registry."""
    package = tmp_path / "vtc_thirdparty_demo.py"
    package.write_text(
        "import dataclasses\n"
        "from vtc import MethodInfo, hookimpl\n"
        "@dataclasses.dataclass\n"
        "class P:\n"
        "    pass\n"
        "class Keep:\n"
        "    def __init__(self, params, retention):\n"
        "        pass\n"
        "    @hookimpl\n"
        "    def vtc_connect(self, tokens, ctx):\n"
        "        return tokens\n"
        "@hookimpl\n"
        "def vtc_register_methods(registry):\n"
        "    registry.add(MethodInfo(name='thirdparty', factory=Keep, params=P, stages=('connect',), paper='x'))\n"
    )
    dist = tmp_path / "vtc_thirdparty_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vtc-thirdparty-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vtc]\nthirdparty = vtc_thirdparty_demo\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VTC_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    from vtc.core.registry import registry

    registry.cache_clear()
    try:
        names = registry().names()
        assert "thirdparty" in names and "fastv" in names
        model, _ = model_and_processor("qwen2_vl")
        with vtc.patch(model, "thirdparty") as handle:
            logits(model, single_inputs("qwen2_vl"))
            assert handle.stats().visual_tokens_out == handle.stats().visual_tokens_in
    finally:
        monkeypatch.setenv("VTC_DISABLE_PLUGIN_AUTOLOAD", "1")
        registry.cache_clear()


def test_suspended_runs_the_model_unpatched():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    ref = logits(model, inputs)
    with vtc.patch(model, "random+fastv", retention=0.25) as handle:
        with handle.suspended():
            assert torch.equal(logits(model, inputs), ref)
        assert logits(model, inputs).shape[1] < ref.shape[1]
    with handle.suspended():  # an unpatched handle: nothing to suspend
        assert torch.equal(logits(model, inputs), ref)
