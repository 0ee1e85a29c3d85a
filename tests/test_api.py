"""The public API: errors that name the problem and the allowed values, patch lifecycle (context manager,
a second patch of a patched model refused, two models in one process), parameter routing, inputs without a video,
fewer frames than asked warned and kept in the stats; what `vtc.patch` refuses before any model runs
(compositions, methods without their own card, families lacking what a method requires, vision statistics the
tower does not have), what method classes contradicting their hooks are refused when defined, what
each forward checks (connect outputs, promised counts, a new video on a continued cache), `retained_count` bound
to a family, and third-party plugins that fail to load."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch

import vtc
from tests.conftest import model_and_processor, single_inputs, videos
from tests.probes import fake_distribution, keep_plugin_source, renamed
from vtc.core.pipeline import Pipeline, validate_grid
from vtc.core.registry import Registry, registry
from vtc.core.vision_stats import VisionStat
from vtc.hf.patching import PATCHED_MODELS
from vtc.media.video import synthetic_video
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
    with pytest.raises(
        TypeError, match=r"does not support LlamaForCausalLM; supported model families: .*qwen2_vl \(Qwen2VLForCond"
    ):
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
        assert fastv.method.k == 3 and handle.pipeline.entries[0].method.num_frames == 4
    with vtc.patch(model, "fastv", **{"fastv.k": 1}) as handle:
        assert handle.pipeline.entries[0].method.k == 1
    with pytest.raises(ValueError, match=r"unknown parameter 'kk'.*fastv: k, ratio"):
        vtc.patch(model, "fastv", kk=3)
    with pytest.raises(ValueError, match=r"method 'fastv' has no parameter 'x'; its parameters: k, ratio"):
        vtc.patch(model, "fastv", **{"fastv.x": 1})
    with pytest.raises(ValueError, match=r"fastv: k must be in \[1, inf\), got 0"):
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


def test_patching_a_patched_model_is_refused_naming_the_active_handle():
    """Two patches on one model would both hook it: the sequence compressed by one, and unpatching either leaving
    the other's handle reporting a state the model is not in. The second is refused, naming the first."""
    model, _ = model_and_processor("qwen2_vl")
    other, _ = tiny.build("qwen2_vl", seed=1)
    inputs = single_inputs("qwen2_vl")
    ref, ref_other = logits(model, inputs), logits(other, inputs)
    text = vtc.api.resolve_adapter(model).text_model
    first = vtc.patch(model, "random", retention=0.5)
    try:
        compressed = logits(model, inputs)
        hooks = len(text._forward_pre_hooks)
        with pytest.raises(ValueError) as err:
            vtc.patch(model, "fastv", retention=0.3)
        message = str(err.value)
        assert message.startswith("this model is already patched by PatchHandle('random', retention=0.5, active)")
        assert "Compose the methods in one spec instead, e.g. vtc.patch(model, 'random+fastv', retention=...)" in (
            message
        )
        assert "call handle.unpatch() on the active handle first" in message
        # the refused call installed nothing: the first patch acts alone, and its handle says so
        assert len(text._forward_pre_hooks) == hooks
        assert first.active and torch.equal(logits(model, inputs), compressed)
        assert [s.plugin for s in first.stats().stages] == ["random"]
        # another model in the same process is not affected, and can be patched meanwhile
        assert torch.equal(logits(other, inputs), ref_other)
        with vtc.patch(other, "fastv", retention=0.3) as handle_other:
            logits(other, inputs)
            assert [s.plugin for s in handle_other.stats().stages] == ["fastv"]
        assert torch.equal(logits(other, inputs), ref_other)
    finally:
        first.unpatch()
    assert torch.equal(logits(model, inputs), ref)
    # once unpatched, the model takes a new patch
    with vtc.patch(model, "fastv", retention=0.3) as second:
        logits(model, inputs)
        assert [s.plugin for s in second.stats().stages] == ["fastv"]
    assert torch.equal(logits(model, inputs), ref)
    first.unpatch()  # a stale handle: no effect


def test_composing_in_one_spec_is_what_the_refusal_suggests():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with vtc.patch(model, "random", retention=0.5):
        with pytest.raises(ValueError, match=r"vtc\.patch\(model, 'random\+fastv'"):
            vtc.patch(model, "fastv")
    with vtc.patch(model, "random+fastv", retention=0.5) as handle:
        logits(model, inputs)
        assert [s.plugin for s in handle.stats().stages] == ["random", "fastv"]


def test_fewer_frames_than_asked_is_warned_and_kept_in_the_stats():
    """uniform with num_frames=64 on an 8-frame clip samples the 8 frames there are: a UserWarning naming both
    counts, and the same sentence in the stats of the prefill that used those inputs (not in a later one)."""
    model, processor = model_and_processor("qwen2_vl")
    clip = synthetic_video(8, 64, 64)
    expected = "uniform's num_frames=64 asks for 64 frames but the video has only 8 frames: the model gets 8 frames"
    with vtc.patch(model, "uniform+random", retention=0.5, num_frames=64) as handle:
        with pytest.warns(UserWarning, match=re.escape(expected)) as record:
            inputs = handle.prepare(processor, clip, "What happens?")
        assert [w.filename for w in record] == [__file__]  # the warning points at the caller of prepare
        assert inputs["video_grid_thw"][0, 0].item() == 4  # 8 frames, temporal pairs
        logits(model, inputs)
        stats = handle.stats()
        assert len(stats.warnings) == 1 and stats.warnings[0].startswith(expected)
        assert f"warning: {expected}" in stats.table() and stats.to_dict()["warnings"] == stats.warnings
        logits(model, inputs)  # the warning belongs to the request that was prepared, not to every later one
        assert handle.stats().warnings == []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            inputs = handle.prepare(processor, clip, "What happens?", num_frames=4)  # enough frames: silent
        logits(model, inputs)
        assert handle.stats().warnings == []


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
    with vtc.patch(model, "random+fastv", retention=0.25) as handle:  # the last-layer count of the chain
        assert handle.retained_count((4, 12, 12)) == round(round(576 * 0.5) * 0.5) == 144


def test_retained_count_needs_a_family_and_a_valid_grid():
    pipeline = Pipeline("random", 0.5)
    assert pipeline.family is None
    with pytest.raises(
        ValueError, match=r"retained_count depends on the model family: bind one with .*family=.*qwen2_vl"
    ):
        pipeline.retained_count((4, 12, 12))
    assert pipeline.retained_count((4, 12, 12), family="qwen2_vl") == 288
    pipeline.bind("llava_onevision")
    assert pipeline.family == "llava_onevision" and pipeline.retained_count((4, 12, 12)) == 288
    bound = Pipeline("random", 0.5, family="qwen2_vl")
    for grid in ((0, 4, 4), (4, -1, 4)):
        with pytest.raises(ValueError, match=r"a token grid is \(T, H, W\) with every entry >= 1"):
            bound.retained_count(grid)
    for grid in ((4, 12), (4, 12.5, 12), (4, True, 12), 7, "4x12x12"):
        with pytest.raises(ValueError, match=r"a token grid is \(T, H, W\): three positive integers"):
            bound.retained_count(grid)
    assert validate_grid([4.0, 12, 12]) == (4, 12, 12)
    with pytest.raises(ValueError, match=r"unknown model family 'qwen9'; known families: .*qwen2_vl"):
        Pipeline("random", 0.5, family="qwen9")
    # a count depends on the family: FastVID's official ratio differs between Qwen and LLaVA
    qwen = Pipeline("fastvid", params={"fixed_count": True}, family="qwen2_vl").retained_count((8, 14, 14))
    llava = Pipeline("fastvid", params={"fixed_count": True}, family="llava_onevision").retained_count((8, 14, 14))
    assert qwen != llava


def one_method(cls) -> Registry:
    """A private registry holding one method class (the global one is left alone)."""
    methods = Registry()
    methods.add(cls)
    return methods


def test_handle_retained_count_uses_the_models_family(monkeypatch):
    families = []

    @vtc.method("t_family", paper="test")
    class FamilyCount(vtc.Method):
        def retained_count(self, num_tokens, grid, family):
            families.append(family)
            return {"qwen2_vl": 7, "llava_onevision": 5}[family]

        def connect(self, tokens, ctx):
            return tokens.select(torch.arange(self.retained_count(len(tokens), tokens.grid, ctx.family)))

    monkeypatch.setitem(registry()._methods, "t_family", FamilyCount)
    for family, count in (("qwen2_vl", 7), ("llava_onevision", 5)):
        model, _ = model_and_processor(family)
        with vtc.patch(model, "t_family") as handle:
            assert handle.pipeline.family == family
            assert handle.retained_count((4, 12, 12)) == count
            logits(model, single_inputs(family))
            assert handle.stats().visual_tokens_out == count
    assert set(families) == {"qwen2_vl", "llava_onevision"}


# --- refused at patch time -----------------------------------------------------------------------------------


def test_whole_frame_methods_must_come_first():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    ref = logits(model, inputs)
    for spec, suggestion, before in (
        ("random+holitom", "holitom+random", "random"),
        ("visionzip+holitom", "holitom+visionzip", "visionzip"),
        ("random+divprune+holitom", "holitom+random+divprune", "random, divprune"),
    ):
        with pytest.raises(ValueError) as err:
            vtc.patch(model, spec, retention=0.5)
        message = str(err.value)
        assert message.startswith(f"holitom needs whole frames (every token of every frame it gets), but {before} ")
        assert f"put holitom first among the connect methods, e.g. '{suggestion}'" in message
        with pytest.raises(ValueError, match="holitom needs whole frames"):
            Pipeline(spec, 0.5)  # refused by the pipeline itself, before any model
    assert torch.equal(logits(model, inputs), ref)  # nothing was installed
    assert Pipeline("holitom+random", 0.5).names() == ["holitom", "random"]  # the other order is fine
    assert Pipeline("uniform+holitom", 0.5).names() == ["uniform", "holitom"]  # a sampler does not touch frames
    # QuoTA acts from the sample stage on, so it is ordered before connect-only methods whatever the spec says
    assert Pipeline("divprune+quota", 0.5).names() == ["quota", "divprune"]
    methods = registry()
    assert methods["holitom"].card.whole_frames and methods["quota"].card.whole_frames


@vtc.method("t_keep", paper="test")
class Keep(vtc.Method):
    """A connect method that keeps every token (the tests below derive their methods from it)."""

    def connect(self, tokens, ctx):
        return tokens


class KeepWithCount(Keep):
    def retained_count(self, num_tokens, grid, family):
        return num_tokens


class KeepWithStats(Keep):
    def vision_stats(self, family):
        return [VisionStat("received", -1)]


class Prefill(vtc.Method):
    def prefill(self, llm, ctx):
        pass


# What a method class declares must fit what it overrides. Capabilities are derived from the overrides (a class
# that defines retained_count has a fixed count, one that defines vision_stats reads them, a stage is acted in when
# its hook is defined), so they cannot disagree with the class any more; what remains are class attributes that
# describe a hook the class lacks, which @vtc.method refuses when the class is defined. test_core covers
# during_decode without prefill, retention_reference past the LLM input without prefill, prepool without connect,
# an unknown positions policy, no stage hook at all and an unknown conformance exemption; these are the others.
@pytest.mark.parametrize(
    "base, attributes, message",
    [
        (Prefill, {"vision_stats": KeepWithStats.vision_stats}, "vision_stats feed a connect hook, but the class has"),
        (Prefill, {"whole_frames": True}, "whole_frames describes a connect hook, but the class has none"),
        (Prefill, {"streams": True}, "streams describes a connect hook, but the class has none"),
        (Keep, {"stream_only": True}, r"stream_only methods are streaming memories: override stream_memory\(\)"),
        (Keep, {"retention_reference": "tokens"}, "retention_reference must be one of llm_input, last_layer"),
    ],
)
def test_a_class_contradicting_its_hooks_is_refused_when_defined(base, attributes, message):
    with pytest.raises(TypeError, match=rf"method 't_decl' \(Decl\): {message}"):
        vtc.method("t_decl", paper="test")(type("Decl", (base,), attributes))


def test_patch_refuses_a_method_without_its_own_card():
    """A subclass of a method that is not decorated itself would run under its parent's card (name, flags,
    parameters); vtc.patch refuses it before a hook is installed, and the model runs unchanged."""
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    ref = logits(model, inputs)
    text = vtc.api.resolve_adapter(model).text_model
    hooks = len(text._forward_pre_hooks)

    class Undecorated(KeepWithCount):
        pass

    with pytest.raises(TypeError, match="Undecorated is not decorated with @vtc.method, so vtc has no card for it"):
        vtc.patch(model, Undecorated())
    with pytest.raises(TypeError, match="a spec holds method names and method instances, got type"):
        vtc.patch(model, [Keep])  # the class, not an instance
    assert len(text._forward_pre_hooks) == hooks and model not in PATCHED_MODELS
    assert torch.equal(logits(model, inputs), ref)


def test_capabilities_follow_the_overrides_into_the_pipeline():
    """The capabilities vtc derives from a class are the ones the pipeline acts on."""
    plain = Pipeline("t_keep", 0.5, methods=one_method(Keep), family="qwen2_vl")
    assert Keep.card.stages == ("connect",) and not Keep.card.fixed_count and not Keep.card.vision_stats
    assert plain.retained_count((4, 12, 12)) is None and plain.vision_stats("qwen2_vl") == set()
    assert not plain.needs_prepool and not plain.acts_during_decode

    counted = renamed(KeepWithCount, "t_count")
    assert counted.card.fixed_count and counted.card.fixed_count_mode == "always"
    assert Pipeline("t_count", 0.5, methods=one_method(counted), family="qwen2_vl").retained_count((4, 12, 12)) == 576

    stats = renamed(KeepWithStats, "t_stats")
    assert stats.card.vision_stats and not stats.card.fixed_count
    pipeline = Pipeline("t_stats", 0.5, methods=one_method(stats), family="qwen2_vl")
    assert pipeline.vision_stats("qwen2_vl") == {VisionStat("received", -1)}

    prepool = renamed(Keep, "t_prepool", prepool=True)
    assert prepool.card.prepool and Pipeline("t_prepool", methods=one_method(prepool)).needs_prepool

    decode = renamed(Prefill, "t_decode", during_decode=True)
    assert decode.card.stages == ("prefill",) and decode.card.acts_in_llm and decode.card.during_decode
    assert Pipeline("t_decode", methods=one_method(decode)).acts_during_decode
    assert not Pipeline("t_prefill", methods=one_method(renamed(Prefill, "t_prefill"))).acts_during_decode


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_vision_statistics_at_a_missing_layer_are_refused(family, monkeypatch):
    @vtc.method("t_far", paper="test")
    class FarLayer(Keep):
        reduces_tokens = False

        def vision_stats(self, fam):
            return [VisionStat("received", 9)]

    monkeypatch.setitem(registry()._methods, "t_far", FarLayer)
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    ref = logits(model, inputs)
    with pytest.raises(
        ValueError,
        match=rf"vision statistic 'received' at layer 9 resolves to encoder layer 9, but this {family} vision "
        r"tower has layers 0\.\.",
    ):
        vtc.patch(model, "t_far")
    assert torch.equal(logits(model, inputs), ref)
    # the refused patch left no mark: the model is not "already patched"
    assert model not in PATCHED_MODELS
    with vtc.patch(model, "random", retention=0.5):
        pass


# --- checked on every forward ----------------------------------------------------------------------------------


def patched_with(monkeypatch, model, cls, **params):
    """`vtc.patch(model, name, **params)` with the method class `cls` in the global registry for this test."""
    monkeypatch.setitem(registry()._methods, cls.card.name, cls)
    return vtc.patch(model, cls.card.name, **params)


def test_connect_output_needs_a_token(monkeypatch):
    @vtc.method("t_empty", paper="test")
    class Empty(vtc.Method):
        def connect(self, tokens, ctx):
            return tokens.select(torch.zeros(0, dtype=torch.long))

    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with patched_with(monkeypatch, model, Empty):
        with pytest.raises(
            RuntimeError, match=r"method 't_empty' returned no tokens for a video of 576: keep at least one"
        ):
            logits(model, inputs)


def test_connect_output_repeats_need_allow_repeats(monkeypatch):
    seen = {}

    @vtc.method("t_repeat", paper="test")
    class Repeat(vtc.Method):
        keep: int = 0

        def connect(self, tokens, ctx):
            index = torch.tensor([0, 0, 1, 2])
            if self.keep:
                out = tokens.select(index, allow_repeats=True)
                seen["positions"] = out.positions
                return out
            return tokens.select(index)

    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with patched_with(monkeypatch, model, Repeat):
        with pytest.raises(ValueError, match=r"select: a token index appears twice \(pass allow_repeats=True"):
            logits(model, inputs)
    with patched_with(monkeypatch, model, Repeat, keep=1) as handle:
        logits(model, inputs)
        assert handle.stats().llm_tokens_in == handle.stats().visual_tokens_out == 4
    assert torch.equal(seen["positions"][..., 0], seen["positions"][..., 1])  # the repeated token, twice


def test_connect_output_must_keep_its_promise(monkeypatch):
    @vtc.method("t_liar", paper="test")
    class Liar(vtc.Method):
        keep: int = 10

        def retained_count(self, num_tokens, grid, family):
            return self.keep

        def connect(self, tokens, ctx):
            return tokens.select(torch.arange(self.keep + 1))

    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with patched_with(monkeypatch, model, Liar):
        with pytest.raises(
            RuntimeError,
            match=r"method 't_liar' promised 10 tokens \(retained_count\(576, \(4, 12, 12\), 'qwen2_vl'\)\) "
            r"but returned 11",
        ):
            logits(model, inputs)


def test_last_layer_count_must_keep_the_promise(monkeypatch):
    """A method acting in the LLM promises the count at the last layer; the prefill end checks it."""

    @vtc.method("t_drop", paper="test")
    class Drop(vtc.Method):
        keep: int = 10
        retention_reference = "last_layer"

        def retained_count(self, num_tokens, grid, family):
            return num_tokens - self.keep

        def prefill(self, llm, ctx):
            if llm.point == "layer_start" and llm.layer == 2:
                layout = llm.layout
                keep = layout.valid.clone()
                visual = torch.nonzero(layout.visual[0] & layout.valid[0]).flatten()
                keep[0, visual[: self.keep - 1]] = False  # one token short of the promise
                llm.keep(keep)

    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with patched_with(monkeypatch, model, Drop) as handle:
        assert handle.retained_count((4, 12, 12)) == 566
        with pytest.raises(
            RuntimeError,
            match=r"'t_drop' promised 566 visual tokens for an item \(video\) with grid \(4, 12, 12\) "
            r"\(retained_count\) but the last LLM layer kept 567",
        ):
            logits(model, inputs)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_new_video_on_a_continued_cache_is_refused_and_text_continues(family):
    model, processor = model_and_processor(family)
    inputs = single_inputs(family)
    with vtc.patch(model, "random", retention=0.5):
        out = model.generate(**inputs, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
        cached = out.past_key_values.get_seq_length()
        second = single_inputs(family, 1)  # another prompt with another video
        with pytest.raises(ValueError, match="continues a cached sequence and brings a new video"):
            model(**second, past_key_values=out.past_key_values)
        assert out.past_key_values.get_seq_length() == cached  # nothing reached the cache
        # a plain text continuation: the last generated token (not yet in the cache) and more text
        new = torch.cat([out.sequences[:, -1:], processor.tokenizer(" and then?", return_tensors="pt").input_ids], 1)
        full_ids = torch.cat([out.sequences[:, :-1], new], 1)
        full = {**inputs, "input_ids": full_ids, "attention_mask": torch.ones_like(full_ids)}
        extra = {}
        if "mm_token_type_ids" in inputs:
            pad = full_ids.shape[1] - inputs["input_ids"].shape[1]
            full["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, pad))
            # transformers derives Qwen's M-RoPE positions from the whole mask: pass the new tokens' positions
            # the cache argument is `past_key_values` in transformers 5.19 (vLLM's pin) and `cache` in 5.24
            compute = model.model.compute_3d_position_ids
            cache_arg = "cache" if "cache" in inspect.signature(compute).parameters else "past_key_values"
            positions = compute(
                input_ids=full_ids,
                image_grid_thw=None,
                video_grid_thw=inputs["video_grid_thw"],
                inputs_embeds=None,
                attention_mask=full["attention_mask"],
                mm_token_type_ids=full["mm_token_type_ids"],
                **{cache_arg: None},
            )
            extra["position_ids"] = positions[..., -new.shape[1] :]
        with torch.no_grad():
            continued = model(
                input_ids=new, attention_mask=full["attention_mask"], past_key_values=out.past_key_values, **extra
            ).logits
        assert out.past_key_values.get_seq_length() == cached + new.shape[1]
        # the same as compressing the whole conversation anew (random keeps the same tokens: same seed)
        expected = logits(model, full)[:, -new.shape[1] :]
    torch.testing.assert_close(continued, expected, atol=2e-5, rtol=1e-4)


def test_prepare_keeps_only_its_latest_request():
    model, processor = model_and_processor("qwen2_vl")
    clips = list(videos())
    with vtc.patch(model, "uniform+random", retention=0.5, num_frames=4) as handle:
        batch = handle.prepare(processor, clips, ["first question", "second question"], fps=8)
        prepared = handle._patch.prepared
        assert len(prepared) == 2
        assert sorted(v["question"] for v in prepared.values()) == ["first question", "second question"]
        single = handle.prepare(processor, clips[0], "third question", fps=8)
        prepared = handle._patch.prepared
        assert len(prepared) == 1
        (key,) = prepared
        assert key == tuple(single["input_ids"][0].tolist()) and prepared[key]["question"] == "third question"
        for _ in range(3):  # the same request again: still one
            handle.prepare(processor, clips[1], "fourth question", fps=8)
        assert [v["question"] for v in handle._patch.prepared.values()] == ["fourth question"]
        assert batch["input_ids"].shape[0] == 2


def test_methods_listing():
    infos = {info.name: info for info in vtc.methods()}
    assert infos["uniform"].stages == ("sample",) and not infos["uniform"].reduces_tokens
    assert infos["fastv"].stages == ("prefill",)
    assert infos["random"].fixed_count and not infos["framefusion"].fixed_count


def test_method_not_supporting_family(monkeypatch):
    """A method's families are those offering what it `requires`; vtc.patch refuses the others, naming what is
    missing and where the method runs, before a hook is installed."""
    from vtc.core.families import family_names, get_family

    qwen_only = renamed(registry()["random"], "random", requires=frozenset({"mrope"}))
    monkeypatch.setitem(registry()._methods, "random", qwen_only)
    supported = qwen_only.card.families
    assert supported == tuple(f for f in family_names() if "mrope" in get_family(f).features)
    assert "qwen2_vl" in supported and "llava_onevision" not in supported
    model, _ = model_and_processor("llava_onevision")
    with pytest.raises(
        ValueError,
        match=rf"method 'random' does not support llava_onevision: it needs mrope, which llava_onevision does not "
        rf"offer; it supports {', '.join(supported)}$",
    ):
        vtc.patch(model, "random")
    assert model not in PATCHED_MODELS
    qwen, _ = model_and_processor("qwen2_vl")
    with vtc.patch(qwen, "random", retention=0.5) as handle:  # a family offering it: accepted
        assert handle.pipeline.entries[0].card.cls is qwen_only


def test_third_party_plugin_from_entry_point(tmp_path, monkeypatch):
    """A package exposing a module in the `vtc` entry-point group shows up in the registry; an entry point naming a
    class (`module:Class`) adds that class only."""
    fake_distribution(
        tmp_path, "vtc_thirdparty_demo", "vtc-thirdparty-demo", "thirdparty", keep_plugin_source("thirdparty")
    )
    two = keep_plugin_source("classplugin") + keep_plugin_source("notexported").replace("class Keep", "class Other")
    fake_distribution(tmp_path, "vtc_class_demo", "vtc-class-demo", "classplugin", two)
    (tmp_path / "vtc_class_demo-0.1.dist-info" / "entry_points.txt").write_text(
        "[vtc]\nclassplugin = vtc_class_demo:Keep\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VTC_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    from vtc.core.registry import registry

    registry.cache_clear()
    try:
        names = registry().names()
        assert "thirdparty" in names and "fastv" in names
        assert "classplugin" in names and "notexported" not in names
        assert registry()["classplugin"].__module__ == "vtc_class_demo"
        model, _ = model_and_processor("qwen2_vl")
        with vtc.patch(model, "thirdparty") as handle:
            logits(model, single_inputs("qwen2_vl"))
            assert handle.stats().visual_tokens_out == handle.stats().visual_tokens_in
    finally:
        monkeypatch.setenv("VTC_DISABLE_PLUGIN_AUTOLOAD", "1")
        registry.cache_clear()


def test_broken_third_party_plugins_are_skipped_with_a_warning(tmp_path, monkeypatch):
    """A plugin package that fails to import (a missing dependency, or raising after defining a method), clashes
    with a known method name, or defines no method is skipped with a RuntimeWarning naming it; the built-in methods
    and a working third-party plugin keep working."""
    good = keep_plugin_source("goodplugin")
    fake_distribution(tmp_path, "vtc_good_demo", "vtc-good-demo", "goodplugin", good)
    fake_distribution(
        tmp_path, "vtc_noimport_demo", "vtc-noimport-demo", "noimport", "import vtc_missing_dependency_xyz\n"
    )
    # defines a method, then raises: nothing of the module is registered
    halfway = keep_plugin_source("halfway") + "raise RuntimeError('boom')\n"
    fake_distribution(tmp_path, "vtc_raising_demo", "vtc-raising-demo", "raising", halfway)
    # a name a built-in method already has
    fake_distribution(tmp_path, "vtc_duplicate_demo", "vtc-duplicate-demo", "duplicate", keep_plugin_source("fastv"))
    fake_distribution(tmp_path, "vtc_empty_demo", "vtc-empty-demo", "empty", "X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VTC_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    from vtc.core.registry import registry as global_registry

    global_registry.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            names = {info.name for info in vtc.methods()}
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert "goodplugin" in names and {"fastv", "random", "uniform", "framefusion"} <= names
        assert "halfway" not in names  # the module that raised after defining it left no trace

        def one(*parts):
            found = [m for m in messages if all(p in m for p in parts)]
            assert len(found) == 1, (parts, messages)
            return found[0]

        one(
            "vtc plugin 'noimport' (package 'vtc-noimport-demo', vtc_noimport_demo)",
            "failed to load and is skipped",
            "ModuleNotFoundError",
            "vtc_missing_dependency_xyz",
        )
        one(
            "vtc plugin 'raising' (package 'vtc-raising-demo', vtc_raising_demo)",
            "failed to load and is skipped",
            "RuntimeError: boom",
        )
        one(
            "vtc plugin 'duplicate' (package 'vtc-duplicate-demo', vtc_duplicate_demo)",
            "failed to load and is skipped",
            "ValueError: method(s) fastv are already registered",
        )
        one(
            "vtc plugin 'empty' (package 'vtc-empty-demo', vtc_empty_demo)",
            "defines no method",
            "the entry point must name a module defining (or a class that is) a class decorated with @vtc.method",
        )
        assert not any("goodplugin" in m or "vtc-good-demo" in m for m in messages)
        assert len(messages) == 4
        # the built-in fastv is the registered one, not the duplicate
        assert vtc.registry()["fastv"].__module__ == "vtc_plugins.fastv"
        model, _ = model_and_processor("qwen2_vl")
        inputs = single_inputs("qwen2_vl")
        with vtc.patch(model, "goodplugin+fastv", retention=0.5) as handle:
            logits(model, inputs)
            # two token-reducing methods share the retention: fastv gets sqrt(0.5), goodplugin keeps everything
            assert handle.stats().visual_tokens_out == round(handle.stats().visual_tokens_in * 0.5**0.5)
        with warnings.catch_warnings(record=True) as again:  # the registry is built once: no new warnings
            warnings.simplefilter("always")
            vtc.methods()
        assert not [w for w in again if issubclass(w.category, RuntimeWarning)]
    finally:
        monkeypatch.setenv("VTC_DISABLE_PLUGIN_AUTOLOAD", "1")
        global_registry.cache_clear()


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
