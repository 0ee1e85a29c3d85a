"""The public API: errors that name the problem and the allowed values, patch lifecycle (context manager,
patching twice, two models in one process), parameter routing, inputs without a video; what `vtc.patch`
refuses before any model runs (compositions, plugins whose object and declaration disagree, vision statistics
the tower does not have), what each forward checks (connect outputs, promised counts, a new video on a
continued cache), `retained_count` bound to a family, and third-party plugins that fail to load."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch

import vtc
from tests.conftest import model_and_processor, single_inputs, videos
from tests.probes import fake_distribution, keep_plugin_source
from vtc.core.hookspecs import hookimpl
from vtc.core.pipeline import Pipeline, validate_grid
from vtc.core.registry import MethodInfo, Registry, registry
from vtc.core.vision_stats import VisionStat
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
    with pytest.raises(ValueError, match=r"unknown family 'qwen9'; families: qwen2_vl"):
        Pipeline("random", 0.5, family="qwen9")
    # a count depends on the family: FastVID's official ratio differs between Qwen and LLaVA
    qwen = Pipeline("fastvid", params={"fixed_count": True}, family="qwen2_vl").retained_count((8, 14, 14))
    llava = Pipeline("fastvid", params={"fixed_count": True}, family="llava_onevision").retained_count((8, 14, 14))
    assert qwen != llava


@dataclasses.dataclass
class NoParams:
    pass


@dataclasses.dataclass
class CountParams:
    keep: int = 10


def one_method(name, cls, params=NoParams, **info) -> Registry:
    """A private registry holding one method (the global one is left alone)."""
    methods = Registry()
    methods.add(MethodInfo(name=name, factory=lambda p, r: cls(p), params=params, paper="test", **info))
    return methods


def test_handle_retained_count_uses_the_models_family(monkeypatch):
    families = []

    class FamilyCount:
        def __init__(self, params):
            self.params = params

        def retained_count(self, num_tokens, grid, family):
            families.append(family)
            return {"qwen2_vl": 7, "llava_onevision": 5}[family]

        @hookimpl
        def vtc_connect(self, tokens, ctx):
            return tokens.select(torch.arange(self.retained_count(len(tokens), tokens.grid, ctx.family)))

    info = one_method("t_family", FamilyCount, stages=("connect",), fixed_count=True)["t_family"]
    monkeypatch.setitem(registry()._methods, "t_family", info)
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
    info = registry()
    assert info["holitom"].needs_whole_frames and info["quota"].needs_whole_frames


class Keep:
    def __init__(self, params=None):
        self.params = params

    @hookimpl
    def vtc_connect(self, tokens, ctx):
        return tokens


class KeepWithCount(Keep):
    def retained_count(self, num_tokens, grid, family):
        return num_tokens


class KeepWithStats(Keep):
    def vision_stats(self, family):
        return [VisionStat("received", -1)]


class KeepWithPrepoolAttribute(Keep):
    needs_prepool = True


class PrefillWithDecodeAttribute:
    acts_during_decode = True

    def __init__(self, params=None):
        pass

    @hookimpl
    def vtc_prefill(self, state, ctx):
        pass


@pytest.mark.parametrize(
    "cls, stages, info, message",
    [
        (
            Keep,
            ("connect",),
            {"fixed_count": True},
            r"declares fixed_count=True but its plugin has no retained_count\(\)",
        ),
        (
            Keep,
            ("connect",),
            {"vision_stats": True},
            r"declares vision_stats=True but its plugin has no vision_stats\(\)",
        ),
        (
            KeepWithCount,
            ("connect",),
            {},
            r"defines retained_count\(\) but its MethodInfo does not declare fixed_count",
        ),
        (KeepWithStats, ("connect",), {}, r"defines vision_stats\(\) but its MethodInfo does not declare vision_stats"),
        (
            KeepWithPrepoolAttribute,
            ("connect",),
            {},
            r"attribute 'needs_prepool' is not read any more; declare MethodInfo\(prepool=True\)",
        ),
        (
            PrefillWithDecodeAttribute,
            ("prefill",),
            {},
            r"attribute 'acts_during_decode' is not read any more; declare MethodInfo\(acts_during_decode=True\)",
        ),
        (Keep, ("connect", "prefill"), {}, r"declares the prefill stage but its plugin has no vtc_prefill hook"),
    ],
)
def test_plugin_object_must_match_its_declaration(cls, stages, info, message, monkeypatch):
    methods = one_method("t_decl", cls, stages=stages, **info)
    with pytest.raises(TypeError, match=rf"method 't_decl'.*{message}"):
        Pipeline("t_decl", methods=methods, family="qwen2_vl")
    # the same through vtc.patch: refused before a hook is installed, the model runs unchanged
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    ref = logits(model, inputs)
    monkeypatch.setitem(registry()._methods, "t_decl", methods["t_decl"])
    with pytest.raises(TypeError, match=message):
        vtc.patch(model, "t_decl")
    assert torch.equal(logits(model, inputs), ref)


def test_matching_declarations_are_accepted():
    for cls, info in ((KeepWithCount, {"fixed_count": True}), (KeepWithStats, {"vision_stats": True})):
        pipeline = Pipeline(
            "t_ok", 0.5, methods=one_method("t_ok", cls, stages=("connect",), **info), family="qwen2_vl"
        )
        assert pipeline.names() == ["t_ok"]
    prefill = one_method("t_dec", PrefillWithDecodeAttribute, stages=("prefill",), acts_during_decode=True)
    with pytest.raises(TypeError, match="acts_during_decode"):  # declared, but the old attribute is still set
        Pipeline("t_dec", methods=prefill)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_vision_statistics_at_a_missing_layer_are_refused(family, monkeypatch):
    class FarLayer(Keep):
        def vision_stats(self, fam):
            return [VisionStat("received", 9)]

    methods = one_method("t_far", FarLayer, stages=("connect",), vision_stats=True, reduces_tokens=False)
    monkeypatch.setitem(registry()._methods, "t_far", methods["t_far"])
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


# --- checked on every forward ----------------------------------------------------------------------------------


def patched_with(monkeypatch, model, name, cls, params=NoParams, **info):
    monkeypatch.setitem(registry()._methods, name, one_method(name, cls, params, **info)[name])
    return vtc.patch(model, name)


def test_connect_output_needs_a_token(monkeypatch):
    class Empty(Keep):
        @hookimpl
        def vtc_connect(self, tokens, ctx):
            return tokens.select(torch.zeros(0, dtype=torch.long))

    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with patched_with(monkeypatch, model, "t_empty", Empty, stages=("connect",)):
        with pytest.raises(
            RuntimeError, match=r"plugin 't_empty' returned no tokens for a video of 576: keep at least one"
        ):
            logits(model, inputs)


def test_connect_output_repeats_need_allow_repeats(monkeypatch):
    seen = {}

    class Repeat(Keep):
        @hookimpl
        def vtc_connect(self, tokens, ctx):
            index = torch.tensor([0, 0, 1, 2])
            if self.params.keep:
                out = tokens.select(index, allow_repeats=True)
                seen["positions"] = out.positions
                return out
            return tokens.select(index)

    @dataclasses.dataclass
    class RepeatParams:
        keep: int = 0

    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with patched_with(monkeypatch, model, "t_repeat", Repeat, RepeatParams, stages=("connect",)):
        with pytest.raises(ValueError, match=r"select: a token index appears twice \(pass allow_repeats=True"):
            logits(model, inputs)
    monkeypatch.setitem(
        registry()._methods, "t_repeat", one_method("t_repeat", Repeat, RepeatParams, stages=("connect",))["t_repeat"]
    )
    with vtc.patch(model, "t_repeat", keep=1) as handle:
        logits(model, inputs)
        assert handle.stats().llm_tokens_in == handle.stats().visual_tokens_out == 4
    assert torch.equal(seen["positions"][..., 0], seen["positions"][..., 1])  # the repeated token, twice


def test_connect_output_must_keep_its_promise(monkeypatch):
    class Liar:
        def __init__(self, params):
            self.params = params

        def retained_count(self, num_tokens, grid, family):
            return self.params.keep

        @hookimpl
        def vtc_connect(self, tokens, ctx):
            return tokens.select(torch.arange(self.params.keep + 1))

    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    with patched_with(monkeypatch, model, "t_liar", Liar, CountParams, stages=("connect",), fixed_count=True):
        with pytest.raises(
            RuntimeError,
            match=r"plugin 't_liar' promised 10 tokens \(retained_count\(576, \(4, 12, 12\), 'qwen2_vl'\)\) "
            r"but returned 11",
        ):
            logits(model, inputs)


def test_last_layer_count_must_keep_the_promise(monkeypatch):
    """A method acting in the LLM promises the count at the last layer; the prefill end checks it."""

    class Drop:
        def __init__(self, params):
            self.params = params

        def retained_count(self, num_tokens, grid, family):
            return num_tokens - self.params.keep

        @hookimpl
        def vtc_prefill(self, state, ctx):
            if state.point == "layer_start" and state.layer == 2:
                layout = state.layout
                keep = layout.valid.clone()
                visual = torch.nonzero(layout.visual[0] & layout.valid[0]).flatten()
                keep[0, visual[: self.params.keep - 1]] = False  # one token short of the promise
                state.keep(keep)

    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    info = dict(stages=("prefill",), fixed_count=True, retention_reference="last_layer")
    with patched_with(monkeypatch, model, "t_drop", Drop, CountParams, **info) as handle:
        assert handle.retained_count((4, 12, 12)) == 566
        with pytest.raises(
            RuntimeError,
            match=r"'t_drop' promised 566 visual tokens for a video with grid \(4, 12, 12\) \(retained_count\) but "
            r"the last LLM layer kept 567",
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
    import dataclasses

    from vtc.core.registry import registry

    info = registry()["random"]
    monkeypatch.setitem(registry()._methods, "random", dataclasses.replace(info, families=("qwen2_vl",)))
    model, _ = model_and_processor("llava_onevision")
    with pytest.raises(ValueError, match=r"method 'random' does not support llava_onevision; it supports qwen2_vl"):
        vtc.patch(model, "random")


def test_third_party_plugin_from_entry_point(tmp_path, monkeypatch):
    """A package exposing a module in the `vtc` entry-point group shows up in the registry."""
    fake_distribution(
        tmp_path, "vtc_thirdparty_demo", "vtc-thirdparty-demo", "thirdparty", keep_plugin_source("thirdparty")
    )
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


def test_broken_third_party_plugins_are_skipped_with_a_warning(tmp_path, monkeypatch):
    """A plugin package that fails to import, fails to register, or registers nothing is skipped with a
    RuntimeWarning naming it; the built-in methods and a working third-party plugin keep working."""
    good = keep_plugin_source("goodplugin")
    fake_distribution(tmp_path, "vtc_good_demo", "vtc-good-demo", "goodplugin", good)
    fake_distribution(
        tmp_path, "vtc_noimport_demo", "vtc-noimport-demo", "noimport", "import vtc_missing_dependency_xyz\n"
    )
    # adds a method, then raises: all or nothing, so the half-registered method must not stay
    halfway = keep_plugin_source("halfway") + "    raise RuntimeError('boom')\n"
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
        assert "halfway" not in names  # the plugin that raised after adding it left no trace

        def one(*parts):
            found = [m for m in messages if all(p in m for p in parts)]
            assert len(found) == 1, (parts, messages)
            return found[0]

        one(
            "vtc plugin 'noimport'",
            "package 'vtc-noimport-demo'",
            "failed to import and is skipped",
            "ModuleNotFoundError",
            "vtc_missing_dependency_xyz",
        )
        one(
            "vtc plugin 'vtc-raising-demo:raising'",
            "package 'vtc-raising-demo'",
            "failed to register and is skipped",
            "RuntimeError: boom",
        )
        one(
            "vtc plugin 'vtc-duplicate-demo:duplicate'",
            "failed to register and is skipped",
            "method(s) fastv are already registered",
        )
        one(
            "vtc plugin 'vtc-empty-demo:empty'",
            "package 'vtc-empty-demo'",
            "registered no method",
            "vtc_register_methods(registry)",
        )
        assert not any("goodplugin" in m or "vtc-good-demo" in m for m in messages)
        assert len(messages) == 4
        # the built-in fastv is the registered one, not the duplicate
        assert vtc.registry()["fastv"].factory.__module__ == "vtc_plugins.fastv"
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
