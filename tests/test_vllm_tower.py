"""Tower methods on vLLM (ToMe between the blocks of vLLM's own Qwen vision towers; the CPU build, one in-process
engine per Qwen family on the tiny models, shared by the tests of that family): the prompt holds the text plus
ToMe's promised count, the survivors keep their original M-RoPE positions, HF's `vtc.patch` and the server keep the
same units with the same features and sizes, a ToMe that merges nothing is stock vLLM, and what cannot serve is
refused before any engine starts."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import vtc
from tests.positions_check import assert_positions_kept, video_slots
from tests.probes import record_survivors
from tests.test_vllm import answer, expected_prompt_length
from tests.test_vllm_encode import CHUNK, FRAMES, QUESTION, QWEN, ask, frame_counts, saved, short  # noqa: F401
from vtc.api import prepare_inputs
from vtc.core.pipeline import Pipeline
from vtc.testing.fixtures import model_and_processor
from vtc.testing.serving import engine, reconfigure, record_positions, shutdown, video_request
from vtc.vllm import models as vllm_models
from vtc.vllm.config import ServeConfig, check_tower_parallelism, servable_encoders
from vtc_plugins.tome import clipped_schedule, parse_r


@vtc.method("t_vllm_tower_noop", paper="test")
class TowerNoop(vtc.TowerMerger):
    """Runs the tower block by block, reads the keys at every block and changes nothing (a fixed count: every unit)."""

    needs_keys = True

    def retained_count(self, num_tokens, grid, family):
        return num_tokens

    def encode_block(self, tokens, ctx):
        assert tokens.point != "after_attention" or tokens.keys.shape[:2] == tokens.hidden.shape[:2]
        return tokens


@pytest.fixture(scope="module")
def registered():
    """This file's test method, in the registry a server's config names methods from."""
    vtc.register(TowerNoop)
    yield
    vtc.registry().remove(TowerNoop.card.name)


@pytest.fixture(scope="module", params=QWEN)
def served(request, saved, registered):  # noqa: F811
    """Per family: one engine started with ToMe, and its uncompressed answer to a prompt with two videos of different
    sizes (`random` at retention 1.0: stock vLLM bit for bit, tests/test_vllm.py)."""
    family = request.param
    llm = engine(saved[family], vtc={"methods": "tome", "retention": 0.5}, max_num_batched_tokens=CHUNK)
    try:
        llm.apply_model(record_positions)
        two = video_request(llm.get_tokenizer(), [short(0), short(1, frames=6, size=192)], QUESTION)
        reconfigure(llm, {"methods": "random", "retention": 1.0})
        full = answer(llm, two)
        depth = llm.llm_engine.model_config.hf_config.vision_config.depth
        yield types.SimpleNamespace(family=family, llm=llm, two=two, full=full, depth=depth)
    finally:
        shutdown(llm)


def noise(seed: int = 0, frames: int = FRAMES, size: int = 224) -> np.ndarray:
    """Random frames [T, H, W, 3] uint8: no two merge units alike. A clip with flat regions (`short`) has units with
    identical keys, whose exactly tied similarities ToMe's (unstable) sort orders by the last bits of the other
    scores, and the two backends' towers differ there (vLLM normalises the pixels on the device, 1 ulp apart from
    the processor's values, 3e-6 after the patch embedding): such a tie can fall on either side of a block's r."""
    return np.random.default_rng(seed).integers(0, 256, size=(frames, size, size, 3), dtype=np.uint8)


def tome_count(config: dict, grid: tuple[int, int, int], depth: int) -> int:
    """What ToMe promises for a video of `grid` (independently of `ToMe.retained_count`): a frame of n units keeps
    round(r n) of them, or, with an int r, what the official schedule leaves after ToMe's clip."""
    t, h, w = grid
    if "retention" in config:
        return t * round(config["retention"] * h * w)
    return t * (h * w - sum(clipped_schedule(parse_r(depth, config["params"]["r"]), h * w)))


# --- (a): the prompt holds the text plus ToMe's count, every survivor at its original position ---------------------


@pytest.mark.parametrize(
    "config",
    [{"methods": "tome", "retention": 0.5}, {"methods": "tome", "params": {"r": 5}}],
    ids=["retention", "int-r"],
)
def test_the_prompt_holds_the_text_and_tomes_count_at_the_original_positions(served, config):
    """Two videos of different sizes: each video's placeholders are ToMe's promised count (from the retention, or
    from an int r and the served tower's depth, which the server read from the model's config), the worker merges
    inside vLLM's tower and hands the LLM exactly that many survivors, each at the M-RoPE position its cell has in the
    uncompressed prompt, every unit in exactly one survivor; on Qwen3-VL every frame's span holds the same count."""
    got, kept = ask(served.llm, config, served.two)
    grids = [k["grid"] for k in kept]
    counts = [len(k["cells"]) for k in kept]
    assert len(kept) == 2 and grids[0] != grids[1]
    assert counts == [tome_count(config, g, served.depth) for g in grids]
    assert all(c < g[0] * g[1] * g[2] for c, g in zip(counts, grids))
    assert [float(k["sizes"].sum()) for k in kept] == [g[0] * g[1] * g[2] for g in grids]
    assert len(got.prompt) == expected_prompt_length(len(served.full.prompt), grids, counts)
    video_token = served.llm.llm_engine.model_config.hf_config.video_token_id
    if served.family == "qwen3_vl":  # ToMe keeps as many units in every temporal patch
        per_frame = [torch.bincount(k["cells"] // (g[1] * g[2]), minlength=g[0]).tolist() for k, g in zip(kept, grids)]
        assert per_frame == [[c // g[0]] * g[0] for c, g in zip(counts, grids)]
        assert frame_counts(got.prompt, served.llm.get_tokenizer(), video_token) == sum(per_frame, [])
    slots = video_slots(served.full.prompt, video_token, [t * h * w for t, h, w in grids])
    assert_positions_kept(served.full.positions, got.positions, slots, [k["cells"] for k in kept], len(got.prompt))


def test_a_connect_method_after_tome_counts_from_its_survivors(served):
    """`tome+random` at 0.25: ToMe keeps half of every frame inside the tower, random half of those (each its share of
    the retention), and the prompt is sized from that."""
    got, kept = ask(served.llm, {"methods": "tome+random", "retention": 0.25}, served.two)
    grids = [k["grid"] for k in kept]
    assert [k["encoded"] for k in kept] == [g[0] * round(0.5 * g[1] * g[2]) for g in grids]
    assert [len(k["cells"]) for k in kept] == [round(0.5 * k["encoded"]) for k in kept]
    assert len(got.prompt) == expected_prompt_length(len(served.full.prompt), grids, [len(k["cells"]) for k in kept])


# --- (b): HF and vLLM merge the same units and give them the same features --------------------------------------


def test_hf_and_vllm_merge_the_same_units_into_the_same_features(served, monkeypatch):
    """One video (random frames, `noise`), `tome` at retention 0.5: `vtc.patch` on the tiny HF model and the server
    keep the same cells, each standing for the same number of units, with the same features (DeepStack's included)
    up to the two towers' float rounding: the merges, sizes, proportional attention and scatter happen alike in both
    backends (each backend's block loop against its own tower: tests/test_tower.py, and the test below)."""
    model, processor = model_and_processor(served.family)
    recorded = record_survivors(monkeypatch)
    inputs = prepare_inputs(processor, noise(), QUESTION, num_frames=FRAMES, fps=8)
    with vtc.patch(model, "tome", retention=0.5, processor=processor), torch.no_grad():
        model(**inputs)
    hf_cells, hf_sizes, hf_features = recorded[-1]
    recorded.clear()
    _, kept = ask(
        served.llm, {"methods": "tome", "retention": 0.5}, video_request(served.llm.get_tokenizer(), noise(), QUESTION)
    )
    cells, sizes, features = recorded[-1]
    assert torch.equal(cells, hf_cells) and torch.equal(kept[0]["cells"], hf_cells)
    assert torch.equal(sizes, hf_sizes)
    torch.testing.assert_close(features, hf_features, rtol=1e-5, atol=1e-5)


def test_the_block_by_block_tower_gives_what_vllms_own_tower_gives(served, monkeypatch):
    """A tower method that changes nothing makes vtc run vLLM's tower block by block with its own modules (the
    attention per temporal patch, Qwen2.5-VL's windows rebuilt from the cells, Qwen3-VL's position embedding and
    DeepStack taps): every video's features are vLLM's own tower's (within float rounding: Qwen2.5-VL's full-attention
    blocks sum a frame in the grid's order, vLLM's in window order), and the prompt is stock."""
    recorded: list[torch.Tensor] = []

    def recorder(original):
        def connect_video(*args, **kwargs):
            embeds = args[1]
            deepstack = (kwargs.get("extras") or {}).get("deepstack")
            recorded.append(torch.cat([embeds] + ([] if deepstack is None else [deepstack]), dim=-1).float().cpu())
            return original(*args, **kwargs)

        return connect_video

    monkeypatch.setattr(vllm_models, "connect_video", recorder(vllm_models.connect_video))
    stock, _ = ask(served.llm, {"methods": "random", "retention": 1.0}, served.two)
    want = list(recorded)
    recorded.clear()
    got, kept = ask(served.llm, {"methods": "t_vllm_tower_noop"}, served.two)
    assert got.prompt == stock.prompt and len(recorded) == len(want) == 2
    assert [k["sizes"].tolist() for k in kept] == [[1.0] * len(k["cells"]) for k in kept]  # ran in the tower
    for have, ref in zip(recorded, want):
        torch.testing.assert_close(have, ref, rtol=1e-5, atol=1e-5)


# --- (c): a ToMe that merges nothing is stock vLLM ------------------------------------------------------------------


@pytest.mark.parametrize(
    "config", [{"methods": "tome", "params": {"r": 0}}, {"methods": "tome", "retention": 1.0}], ids=["r-0", "ret-1"]
)
def test_r_0_and_retention_1_are_stock_vllm(served, config):
    """ToMe with r=0 (the official default) or at retention 1.0 merges nothing: vLLM's tower runs as its own, and the
    prompt, the greedy tokens, the first token's logprobs and the positions are those of `random` at 1.0, which is
    stock vLLM bit for bit (tests/test_vllm.py::test_retention_1_is_stock_vllm_bit_for_bit)."""
    got, kept = ask(served.llm, config, served.two, max_tokens=3)
    assert [len(k["cells"]) for k in kept] == [g[0] * g[1] * g[2] for g in (k["grid"] for k in kept)]
    full = served.full
    assert got.prompt == full.prompt and got.tokens == full.tokens and got.logprobs == full.logprobs
    assert torch.equal(got.positions, full.positions)


# --- (d): what cannot serve, and the count the processor sizes the prompt with ---------------------------------------


def test_what_cannot_serve_is_refused_naming_the_reason():
    """EarlyTom's count depends on the content; after a pre-tower method ToMe's count depends on what it left of each
    frame; a tensor-parallel tower would have to merge the same tokens on every rank; a request cannot change the
    tower's depth. (ToMe and GRT on the LLaVA families: tests/test_vllm_llava_tower.py.)"""
    assert {"tome", "pixelprune"} <= set(servable_encoders()) and "earlytom" not in servable_encoders()
    with pytest.raises(ValueError, match=r"earlytom merges tokens between the vision tower's blocks, but its count "):
        ServeConfig.from_dict({"methods": "earlytom", "retention": 0.25})
    with pytest.raises(ValueError, match="tome after pixelprune has no fixed count: pixelprune leaves each temporal"):
        ServeConfig.from_dict({"methods": "pixelprune+tome", "retention": 0.5}).pipeline("qwen2_vl")
    int_r = ServeConfig.from_dict({"methods": "tome", "params": {"r": 4}})
    with pytest.raises(ValueError, match="with an int r the count depends on the vision tower's depth"):
        int_r.pipeline("qwen2_vl")
    served = int_r.for_model({"depth": 3})
    assert served.params == {"r": 4, "tome.depth": 3}
    pipeline = served.pipeline("qwen2_vl")
    assert pipeline.retained_count((2, 6, 6)) == 2 * (36 - 12)
    with pytest.raises(ValueError, match=r"tome.depth=2, but the served model's vision tower has 3 blocks"):
        ServeConfig.from_dict({"methods": "tome", "params": {"r": 4, "depth": 2}}).for_model({"depth": 3})
    with pytest.raises(ValueError, match=r"params: tome.depth is the served model's vision-tower depth"):
        served.for_request({"params": {"tome.depth": 5}})
    with pytest.raises(ValueError, match="a tower split across 2 tensor-parallel ranks.*--mm-encoder-tp-mode data"):
        check_tower_parallelism(pipeline, 2, "weights")
    check_tower_parallelism(pipeline, 2, "data")  # each rank runs the whole tower: served
    check_tower_parallelism(
        ServeConfig.from_dict({"methods": "random", "retention": 0.5}).pipeline("qwen2_vl"), 2, None
    )


def test_the_encoded_count_replaces_only_the_pre_tower_methods_counts():
    """`Pipeline.retained_count(grid, encoded=K)`: K is what the pre-tower methods kept; a tower method's own count
    still applies (ToMe alone: every unit before the tower, then its count), counted after the pre-tower methods
    whatever its place in the spec, as they run (ToMe on a partial grid: None)."""
    grid = (4, 6, 6)
    tome = Pipeline("tome", 0.5, family="qwen2_vl")
    assert tome.retained_count(grid) == tome.retained_count(grid, encoded=144) == 4 * 18
    for spec in ("pixelprune-video+tome", "tome+pixelprune-video"):
        chained = Pipeline(spec, 0.25, family="qwen2_vl")
        assert chained.retained_count(grid, encoded=72) is None, spec
        assert chained.retained_count(grid) is None, spec  # pixelprune-video leaves partial frames, wherever named
    connect = Pipeline("tome+random", 0.25, family="qwen2_vl")
    assert connect.retained_count(grid) == round(0.5 * 4 * 18)
