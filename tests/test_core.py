"""Unit tests of the backend-neutral core: VideoTokens (views and operations), Context reports, the pipeline
(ordering, retention split, family binding, counts, capability and order checks) and family geometry."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.probes import renamed
from vtc.core.geometry import DEFAULT_GEOMETRY, FamilyGeometry, default_geometry
from vtc.core.pipeline import Pipeline, validate_grid
from vtc.core.registry import Registry
from vtc.core.stats import StatsRecorder
from vtc.core.tokens import Context, VideoTokens, dense_mix, frame_groups

# --- VideoTokens ---------------------------------------------------------------------------------------------------


def test_from_grid_is_raster_order_with_positions():
    tokens = VideoTokens.from_grid(torch.arange(24.0).view(12, 2), (3, 2, 2), mrope=True)
    assert tokens.frame.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert tokens.row.tolist() == [0, 0, 1, 1] * 3 and tokens.col.tolist() == [0, 1] * 6
    assert tokens.positions.shape == (3, 12) and tokens.positions[:, 5].tolist() == [1, 0, 1]
    assert tokens.is_full_grid and tokens.weight.tolist() == [1.0] * 12
    assert VideoTokens.from_grid(torch.zeros(4, 1), (1, 2, 2)).positions.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="holds 12 tokens but embeds has 5"):
        VideoTokens.from_grid(torch.zeros(5, 2), (3, 2, 2))


def test_select_keeps_fields_aligned_and_refuses_repeats():
    tokens = VideoTokens.from_grid(torch.arange(12.0).view(12, 1), (3, 2, 2))
    tokens.extras["deepstack"] = torch.arange(12.0).view(12, 1) * 10
    tokens.tags["window"] = torch.arange(12) // 6
    out = tokens.select(torch.tensor([11, 0, 5]))
    assert out.embeds.flatten().tolist() == [11.0, 0.0, 5.0] and out.positions.tolist() == [11, 0, 5]
    assert out.extras["deepstack"].flatten().tolist() == [110.0, 0.0, 50.0] and out.tags["window"].tolist() == [1, 0, 0]
    assert (out.frame.tolist(), out.patch.tolist()) == ([2, 0, 1], [3, 0, 1]) and not out.is_full_grid
    with pytest.raises(ValueError, match="appears twice"):
        tokens.select(torch.tensor([1, 1]))
    assert len(tokens.select(torch.tensor([1, 1]), allow_repeats=True)) == 2
    with pytest.raises(IndexError, match=r"must be in \[0, 12\)"):
        tokens.select(torch.tensor([12]))


def test_merge_and_dense_merge_apply_one_linear_map():
    x = torch.randn(6, 3)
    tokens = VideoTokens.from_grid(x, (2, 1, 3))
    tokens.extras["side"] = x * 2
    out = tokens.merge(
        torch.tensor([0, 3]),
        dst=torch.tensor([0, 0, 1]),
        src=torch.tensor([1, 2, 4]),
        src_weight=torch.tensor([0.25, 0.25, 0.5]),
        keep_weight=torch.tensor([0.5, 0.5]),
    )
    torch.testing.assert_close(out.embeds[0], 0.5 * x[0] + 0.25 * x[1] + 0.25 * x[2])
    torch.testing.assert_close(out.extras["side"][1], 2 * (0.5 * x[3] + 0.5 * x[4]))
    assert out.weight.tolist() == [3.0, 2.0] and out.positions.tolist() == [0, 3]
    weights = torch.tensor([[0.2, 0.0, 0.3], [0.0, 0.7, 0.1]])
    dense = tokens.merge_dense(torch.tensor([0, 3]), torch.tensor([0.5, 0.2]), torch.tensor([1, 2, 5]), weights)
    torch.testing.assert_close(dense.embeds[1], 0.2 * x[3] + 0.7 * x[2] + 0.1 * x[5])
    torch.testing.assert_close(
        dense.extras["side"],
        dense_mix(x * 2, torch.tensor([0, 3]), torch.tensor([0.5, 0.2]), torch.tensor([1, 2, 5]), weights),
    )
    assert dense.weight.tolist() == [3.0, 2.0]  # each source counts for the output it feeds most (1, 5 -> 0; 2 -> 1)
    with pytest.raises(ValueError, match="src_weight must be"):
        tokens.merge_dense(torch.tensor([0]), torch.ones(1), torch.tensor([1, 2]), torch.ones(2, 2))


def test_frame_groups_and_grid_index():
    tokens = VideoTokens.from_grid(torch.zeros(12, 1), (3, 2, 2)).select(torch.tensor([5, 1, 4, 3, 11, 8]))
    assert [g.tolist() for g in tokens.frame_groups("patch")] == [[1, 3], [2, 0], [5, 4]]
    assert [g.tolist() for g in tokens.frame_groups("index")] == [[1, 3], [0, 2], [4, 5]]
    assert [g.tolist() for g in frame_groups(tokens.frame)] == [[1, 3], [0, 2], [4, 5]]
    assert tokens.frames().tolist() == [0, 1, 2]
    assert tokens.grid_index().tolist() == [[-1, 1, -1, 3], [2, 0, -1, -1], [5, -1, -1, 4]]
    with pytest.raises(ValueError, match="mymethod needs whole frames"):
        tokens.whole_frames("mymethod")
    whole = VideoTokens.from_grid(torch.zeros(12, 1), (3, 2, 2)).select(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]))
    frames, idx = whole.whole_frames("mymethod")  # frame 1 dropped entirely is fine
    assert frames.tolist() == [0, 2] and idx.tolist() == [[4, 5, 6, 7], [0, 1, 2, 3]]
    twice = VideoTokens.from_grid(torch.zeros(4, 1), (1, 2, 2)).select(torch.tensor([0, 0]), allow_repeats=True)
    with pytest.raises(ValueError, match="same grid cell"):
        twice.grid_index()


def test_context_report_collects_values():
    ctx = Context()
    ctx.report(kept=3, plan="a")
    ctx.report(kept=4)
    assert ctx.reports == {"kept": [3, 4], "plan": ["a"]}
    recorder = StatsRecorder()
    recorder.begin(True)
    recorder.report("m", ctx.reports)
    recorder.end()
    recorder.report("m", {"step": [1]})  # a decode-time report lands on the prefill it continues
    assert recorder.last.reports == {"m": {"kept": [3, 4], "plan": ["a"], "step": [1]}}


# --- pipeline ------------------------------------------------------------------------------------------------------


@vtc.method("a", paper="test")
class Keeper(vtc.Method):
    """Keeps its share of the tokens it gets (a fixed-count connect method), counting its calls in its state."""

    def fraction(self):
        return self.retention if self.retention is not None else 0.5

    def retained_count(self, num_tokens, grid, family):
        return max(1, round(num_tokens * self.fraction()))

    def connect(self, tokens, ctx):
        ctx.state.setdefault("calls", []).append(len(tokens))
        ctx.report(calls=len(ctx.state["calls"]))
        return tokens.select(torch.arange(max(1, round(len(tokens) * self.fraction()))))


@vtc.method("s", paper="test")
class Sampler(vtc.FrameSampler):
    def sample(self, video, ctx):
        return [0]

    def connect(self, tokens, ctx):
        return tokens


def methods(*classes) -> Registry:
    reg = Registry()
    for cls in classes:
        reg.add(cls)
    return reg


def test_methods_run_by_earliest_stage_then_spec_order():
    reg = methods(Keeper, renamed(Keeper, "b"), Sampler)
    assert Pipeline("a+b", methods=reg).names() == ["a", "b"]
    assert Pipeline("b+a", methods=reg).names() == ["b", "a"]
    # s acts at the sample stage, so its connect hook also runs first, whatever the spec says
    assert [e.card.name for e in Pipeline("a+s+b", methods=reg).stage_entries("connect")] == ["s", "a", "b"]


def test_retention_split_chained_counts_and_state():
    reg = methods(Keeper, renamed(Keeper, "b"))
    pipe = Pipeline("a+b", 0.25, methods=reg, family="qwen2_vl")
    assert [e.retention for e in pipe.entries] == [0.5, 0.5]
    assert pipe.retained_count((4, 12, 12)) == 144  # 576 -> 288 -> 144
    tokens = VideoTokens.from_grid(torch.zeros(576, 2), (4, 12, 12))
    recorder = StatsRecorder()
    recorder.begin(True)
    ctx = Context(family="qwen2_vl")
    pipe.begin_prompt()
    out = pipe.run_connect(tokens, ctx, recorder)
    out = pipe.run_connect(tokens, ctx, recorder)  # a second video of the same prompt: same state
    recorder.end()
    assert len(out) == 144 and [pipe._stores[n]["calls"] for n in "ab"] == [[576, 576], [288, 288]]
    assert recorder.last.reports == {"a": {"calls": [1, 2]}, "b": {"calls": [1, 2]}}
    assert [(r.plugin, r.tokens_in, r.tokens_out) for r in recorder.last.stages][:2] == [
        ("a", 576, 288),
        ("b", 288, 144),
    ]
    assert ctx.state == {} and ctx.reports == {}  # the caller's context is untouched: each hook got its own view
    pipe.begin_prompt()
    assert all(store == {} for store in pipe._stores.values())


def test_instances_compose_and_are_never_changed():
    from vtc_plugins.divprune import DivPrune
    from vtc_plugins.fastv import FastV

    divprune, fastv = DivPrune(ratio=0.1), FastV(k=3)
    pipe = Pipeline(divprune + fastv, 0.25, family="qwen2_vl")
    assert pipe.names() == ["divprune", "fastv"] and pipe.spec == "divprune+fastv"
    assert pipe.entries[0].method.ratio == 0.1 and pipe.entries[1].method.k == 3
    assert pipe.entries[1].retention == 0.5 and fastv.retention is None  # the pipeline binds a copy
    assert pipe.retained_count((4, 10, 10)) == Pipeline(
        "divprune+fastv", 0.25, {"divprune.ratio": 0.1, "fastv.k": 3}, family="qwen2_vl"
    ).retained_count((4, 10, 10))
    mixed = Pipeline([DivPrune(ratio=0.1), "fastv"], 0.25, {"fastv.k": 1})  # names and instances, params routed
    assert mixed.entries[1].method.k == 1
    assert Pipeline(FastV(k=3), params={"k": 1}).entries[0].method.k == 1 and fastv.k == 3
    with pytest.raises(ValueError, match="appear twice"):
        Pipeline([FastV(), "fastv"])
    with pytest.raises(TypeError, match="method names and method instances"):
        Pipeline([3])


def test_retained_count_needs_a_family_and_a_valid_grid():
    reg = methods(Keeper)
    pipe = Pipeline("a", 0.5, methods=reg)
    with pytest.raises(ValueError, match="depends on the model family"):
        pipe.retained_count((4, 12, 12))
    assert pipe.retained_count((4, 12, 12), family="llava_onevision") == 288
    for grid in [(0, 4, 4), (4, 12), (4, 12, 1.5), "abc", (True, 2, 2)]:
        with pytest.raises(ValueError, match="token grid is"):
            validate_grid(grid)
    with pytest.raises(ValueError, match="unknown model family 'gpt4'; known families: .*qwen2_vl"):
        Pipeline("a", methods=reg, family="gpt4")
    needy = renamed(Keeper, "n", requires=frozenset({"teleportation"}))
    assert needy.card.families == ()
    with pytest.raises(ValueError, match="does not support llava_onevision: it needs teleportation"):
        Pipeline("n", methods=methods(needy), family="llava_onevision")


def test_a_broken_promise_is_caught():
    class Liar(Keeper):
        def retained_count(self, num_tokens, grid, family):
            return 10

    pipe = Pipeline("l", 0.5, methods=methods(renamed(Liar, "l")), family="qwen2_vl")
    with pytest.raises(RuntimeError, match=r"'l' promised 10 tokens .* but returned 4"):
        pipe.run_connect(VideoTokens.from_grid(torch.zeros(8, 2), (2, 2, 2)), Context(family="qwen2_vl"), None)

    class Empty(Keeper):
        def connect(self, tokens, ctx):
            return tokens.select(torch.zeros(0, dtype=torch.long))

    pipe = Pipeline("e", 0.5, methods=methods(renamed(Empty, "e")), family="qwen2_vl")
    with pytest.raises(RuntimeError, match="returned no tokens"):
        pipe.run_connect(VideoTokens.from_grid(torch.zeros(8, 2), (2, 2, 2)), Context(family="qwen2_vl"), None)


def test_capabilities_are_derived_from_the_class():
    class Plain(vtc.Method):
        def connect(self, tokens, ctx):
            return tokens

    plain = vtc.method("p", paper="test")(Plain)
    assert plain.card.stages == ("connect",) and plain.card.fixed_count_mode == "no"
    assert not plain.card.vision_stats and not plain.card.stream_memory
    assert Keeper.card.fixed_count_mode == "always"  # overriding retained_count is the fixed count

    @dataclasses.dataclass
    class Switch(Keeper):
        fixed_count: bool = False

    assert renamed(Switch, "w").card.fixed_count_mode == "optional"

    class InLLM(Plain):
        def prefill(self, llm, ctx):
            pass

    assert renamed(InLLM, "l").card.stages == ("connect", "prefill")
    for attributes, message in [
        ({"during_decode": True}, "during_decode needs a prefill hook"),
        ({"retention_reference": "last_layer"}, "only methods acting in the LLM"),
        ({"prepool": True, "connect": None}, "prepool describes a connect hook"),
        ({"positions": "shuffle"}, "positions must be 'keep' or 'compact'"),
    ]:
        attributes = {k: v for k, v in attributes.items() if v is not None}
        body = dict(attributes)
        base = vtc.Method if "prepool" in attributes else Plain
        if base is vtc.Method:
            body["prefill"] = lambda self, llm, ctx: None
        with pytest.raises(TypeError, match=message):
            vtc.method("x", paper="test")(type("X", (base,), body))
    with pytest.raises(TypeError, match="overrides no stage hook"):
        vtc.method("x", paper="test")(type("X", (vtc.Method,), {}))
    with pytest.raises(TypeError, match="unknown conformance check"):
        vtc.method("x", paper="test", exempt={"speed": "slow"})(type("X", (Plain,), {}))
    with pytest.raises(TypeError, match="subclasses vtc.Method"):
        vtc.method("x", paper="test")(type("X", (), {}))


def test_parameters_are_validated_from_their_declaration():
    @vtc.method("v", paper="test")
    class Validated(vtc.Method):
        ratio: float | None = vtc.param(None, range="(0, 1]")
        k: int = vtc.param(2, range="[1, inf)")
        mode: str = vtc.param("a", choices=("a", "b"))
        dtype: vtc.DType | None = None
        flag: bool = False

        def connect(self, tokens, ctx):
            return tokens

    assert Validated(ratio=1).ratio == 1.0 and isinstance(Validated(ratio=1).ratio, float)
    for kwargs, message in [
        ({"ratio": 0}, r"v: ratio must be in \(0, 1\], got 0"),
        ({"ratio": "0.5"}, "v: ratio must be float or None, got '0.5'"),
        ({"k": 0}, r"v: k must be in \[1, inf\)"),
        ({"k": 1.5}, "v: k must be int, got 1.5"),
        ({"k": True}, "v: k must be int, got True"),
        ({"mode": "c"}, "v: mode must be one of 'a', 'b', got 'c'"),
        ({"dtype": "int8"}, "v: dtype must be one of 'float32', 'float16', 'bfloat16', 'float64' or None"),
        ({"flag": 1}, "v: flag must be bool, got 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            Validated(**kwargs)
    with pytest.raises(ValueError, match="method 'v' has no parameter 'q'; its parameters: dtype, flag, k, mode"):
        Pipeline(Validated(), params={"v.q": 1}, methods=methods(Validated))
    with pytest.raises(ValueError, match=r"v: k must be in \[1, inf\)"):  # routed values are validated too
        Pipeline(Validated(), params={"k": 0}, methods=methods(Validated))


def test_whole_frame_methods_must_run_first_among_connect_methods():
    reg = methods(Keeper, renamed(Keeper, "w", whole_frames=True))
    assert Pipeline("w+a", methods=reg).names() == ["w", "a"]
    with pytest.raises(ValueError, match="w needs whole frames .* put w first .* e.g. 'w\\+a'"):
        Pipeline("a+w", methods=reg)


def test_counts_after_a_method_acting_in_the_llm_are_not_promised():
    """A connect method after one whose count is a last-layer count thins that method's input in between:
    no promise, rather than a wrong one."""

    class InLLM(Keeper):
        retention_reference = "last_layer"

        def prefill(self, llm, ctx):
            pass

    reg = methods(Keeper, renamed(InLLM, "m"))
    assert Pipeline("a+m", 0.25, methods=reg, family="qwen2_vl").retained_count((2, 2, 2)) == 2
    assert Pipeline("m+a", 0.25, methods=reg, family="qwen2_vl").retained_count((2, 2, 2)) is None


def test_capabilities_listing_covers_every_field():
    caps = vtc.registry()["holitom"].card.capabilities()
    assert caps["stages"] == ["connect", "prefill"] and caps["fixed_count"] == "optional"
    assert caps["needs_whole_frames"] and caps["vision_stats"] and caps["acts_in_llm"]
    assert caps["parameters"]["k"] == 18 and caps["fixed_count_counts"] == "last_layer"
    assert vtc.registry()["random"].card.capabilities()["fixed_count"] == "always"
    assert vtc.registry()["framefusion"].card.capabilities()["retention_reference"] == "layer_mean"


# --- geometry ------------------------------------------------------------------------------------------------------


def test_geometry_maps_tower_values_like_the_models_pooling():
    x = torch.rand(2, 27 * 27, 3)
    ov = default_geometry("llava_onevision")
    ref = F.interpolate(x.view(2, 27, 27, 3).permute(0, 3, 1, 2), size=[14, 14], mode="bilinear")
    torch.testing.assert_close(ov.to_token_grid(x, (14, 14)), ref.permute(0, 2, 3, 1).reshape(2, 196, 3))
    clip = torch.rand(2, 1 + 24 * 24)  # CLS first
    nv = default_geometry("llava_next_video")
    ref = F.avg_pool2d(clip[:, 1:].view(2, 1, 24, 24), 2).reshape(2, 144)
    torch.testing.assert_close(nv.to_token_grid(clip, (12, 12)), ref)
    maxed = dataclasses.replace(nv, pooling="max")
    torch.testing.assert_close(
        maxed.to_token_grid(clip, (12, 12)), F.max_pool2d(clip[:, 1:].view(2, 1, 24, 24), 2).reshape(2, 144)
    )
    qwen = torch.rand(2, 36)
    assert default_geometry("qwen2_vl").to_token_grid(qwen, (6, 6)) is qwen
    assert ov.token_grid_size() == (14, 14) and nv.token_grid_size() == (12, 12)
    assert set(DEFAULT_GEOMETRY) == set(vtc.core.families.family_names())
    with pytest.raises(ValueError, match="expected 1 \\+ 24x24"):
        nv.to_token_grid(torch.rand(2, 24 * 24), (12, 12))
    with pytest.raises(ValueError, match="pooling must be one of"):
        FamilyGeometry("x", mrope=False, pooling="conv")
