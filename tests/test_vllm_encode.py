"""Encode-stage methods on vLLM (the CPU build, one in-process engine per Qwen family on the tiny models, shared by
the tests of that family): the prompt processor chooses each video's merge units, the prompt holds the text plus the
kept units, vLLM's tower runs on the survivors alone and gives what HF's does, the survivors keep their original
M-RoPE positions, and the caches hold media-only results. Configs that cannot serve are refused before any engine
starts."""

from __future__ import annotations

import re
import types

import pytest
import torch

import vtc
from tests.positions_check import assert_positions_kept, video_slots
from tests.probes import record_survivors
from tests.test_vllm import Answer, answer, clip, expected_prompt_length
from vtc.api import prepare_inputs
from vtc.testing.fixtures import model_and_processor
from vtc.testing.serving import clear_caches, engine, reconfigure, record_positions, shutdown, video_request
from vtc.vllm import models as vllm_models
from vtc.vllm.config import ServeConfig, servable_encoders

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
QUESTION = "What happens in this video?"
CHUNK = 256  # prompts are prefilled in chunks, as under load: survivors of one video reach the LLM in several steps
FRAMES = 4  # short clips: the file runs in CI beside everything else


def short(seed: int = 0, frames: int = FRAMES, size: int = 224):
    return clip(seed, frames=frames, size=size)


@vtc.method("t_vllm_keep_pattern", paper="test")
class KeepPattern(vtc.PatchSelector):
    """A ragged subset: drop every unit whose grid index is 1 mod 3, and every unit of temporal patch 1 (an emptied
    attention segment; on Qwen2.5-VL, windows emptied and thinned)."""

    def retained_count(self, num_tokens, grid, family):
        return None

    def choose(self, patches, count, ctx):
        frame, _, _ = patches.frame_row_col()
        return torch.nonzero((patches.kept % 3 != 1) & (frame != 1)).flatten()


@vtc.method("t_vllm_in_tower", paper="test")
class InTower(vtc.Method):
    """An encode method that is no PatchSelector (as a method acting between the tower's blocks would be)."""

    def encode(self, patches, ctx):
        return patches


@pytest.fixture(scope="module")
def registered():
    """This file's test methods, in the registry a server's config names methods from."""
    for cls in (KeepPattern, InTower):
        vtc.register(cls)
    yield
    for cls in (KeepPattern, InTower):
        vtc.registry().remove(cls.card.name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The shared tiny HF models saved for vLLM (what `tiny.save` writes for a Qwen family, without building the
    model a second time): HF and vLLM hold the same weights."""
    root = tmp_path_factory.mktemp("tiny-vllm-encode")
    paths = {}
    for family in QWEN:
        model, processor = model_and_processor(family)
        paths[family] = str(root / family)
        model.save_pretrained(paths[family])
        processor.save_pretrained(paths[family])
    return paths


@pytest.fixture(scope="module", params=QWEN)
def served(request, saved, registered):
    """Per family: one engine started with an encode method, and its uncompressed answer to a prompt with two videos
    of different sizes (`random` at retention 1.0: stock vLLM bit for bit, tests/test_vllm.py)."""
    family = request.param
    llm = engine(saved[family], vtc={"methods": "pixelprune"}, max_num_batched_tokens=CHUNK)
    try:
        llm.apply_model(record_positions)
        two = video_request(llm.get_tokenizer(), [short(0), short(1, frames=6, size=192)], QUESTION)
        reconfigure(llm, {"methods": "random", "retention": 1.0})
        full = answer(llm, two)
        yield types.SimpleNamespace(family=family, llm=llm, two=two, full=full)
    finally:
        shutdown(llm)


def ask(llm, config: dict, request: dict, max_tokens: int = 1) -> tuple[Answer, list[dict]]:
    """The answer under `config` with nothing cached, and what the model kept of each video."""
    reconfigure(llm, config)
    vllm_models.LAST_KEPT.clear()
    got = answer(llm, request, max_tokens=max_tokens)
    return got, list(vllm_models.LAST_KEPT)


def frame_counts(prompt: list[int], tokenizer, video_token: int) -> list[int]:
    """Video tokens between each `<|vision_start|>` and `<|vision_end|>` of a Qwen3-VL prompt (one run per frame)."""
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    counts, inside = [], None
    for token in prompt:
        if token == start:
            inside = 0
        elif token == end and inside is not None:
            counts.append(inside)
            inside = None
        elif token == video_token and inside is not None:
            inside += 1
    return counts


# --- (a) + (c): the prompt holds the text plus the kept units, each at its original position ----------------------


@pytest.mark.parametrize(
    "config",
    [{"methods": "pixelprune"}, {"methods": "pixelprune-video", "retention": 0.5}],
    ids=["adaptive", "fixed-count"],
)
def test_the_prompt_holds_the_text_and_the_kept_units_at_their_original_positions(served, config):
    """Two videos of different sizes: each video's placeholders are the units its encode stage kept (the official
    adaptive rule, and pixelprune-video's fixed count round(r * n)), the worker encodes and hands the LLM exactly
    those, each survivor at the M-RoPE position its cell has in the uncompressed prompt, the text around them at its
    own; on Qwen3-VL each frame's span holds its temporal patch's survivors."""
    got, kept = ask(served.llm, config, served.two)
    hf_config = served.llm.llm_engine.model_config.hf_config
    grids = [k["grid"] for k in kept]
    counts = [len(k["cells"]) for k in kept]
    assert len(kept) == 2 and grids[0] != grids[1]
    assert counts == [k["encoded"] for k in kept]  # no connect method: the encode stage's survivors reach the LLM
    assert all(c < g[0] * g[1] * g[2] for c, g in zip(counts, grids))
    if "retention" in config:
        assert counts == [round(0.5 * g[0] * g[1] * g[2]) for g in grids]
    assert len(got.prompt) == expected_prompt_length(len(served.full.prompt), grids, counts)
    video_token = hf_config.video_token_id
    if served.family == "qwen3_vl":  # the processor lays each frame out with its own survivors, as the model does
        per_frame = [torch.bincount(k["cells"] // (g[1] * g[2]), minlength=g[0]).tolist() for k, g in zip(kept, grids)]
        assert frame_counts(got.prompt, served.llm.get_tokenizer(), video_token) == sum(per_frame, [])
    slots = video_slots(served.full.prompt, video_token, [t * h * w for t, h, w in grids])
    assert_positions_kept(served.full.positions, got.positions, slots, [k["cells"] for k in kept], len(got.prompt))


def test_connect_methods_after_the_encode_stage_count_from_its_survivors(served):
    """`pixelprune-video+random` at 0.25: the encode stage keeps round(0.5 n), random keeps half of those, and the
    prompt is sized from that."""
    got, kept = ask(served.llm, {"methods": "pixelprune-video+random", "retention": 0.25}, served.two)
    grids = [k["grid"] for k in kept]
    encoded = [round(0.5 * g[0] * g[1] * g[2]) for g in grids]
    assert [k["encoded"] for k in kept] == encoded
    assert [len(k["cells"]) for k in kept] == [round(0.5 * e) for e in encoded]
    assert len(got.prompt) == expected_prompt_length(len(served.full.prompt), grids, [len(k["cells"]) for k in kept])


# --- (b): the same units and the same survivors' features as HF; identity at retention 1.0 -------------------------


def test_hf_and_vllm_keep_the_same_units_and_encode_them_alike(served, monkeypatch):
    """One video, the same frames: `vtc.patch` on the tiny HF model and the server keep the same units, and vLLM's
    tower gives the survivors the features HF's tower gives them, DeepStack's included (HF's tower inputs for a
    ragged subset are checked against a brute-force derivation in tests/test_encode_stage.py; the two towers differ
    in the last bits).
    pixelprune's adaptive rule; then a ragged subset (every unit of temporal patch 1 dropped: an emptied attention
    segment; a third of the others: thinned Qwen2.5-VL windows) thinned further by pixelprune-video's fixed count,
    whose residuals tie in steps of 1/255 (vLLM's raw pixels are normalised as transformers does, bit for bit)."""
    family = served.family
    model, processor = model_and_processor(family)
    recorded = record_survivors(monkeypatch)
    inputs = prepare_inputs(processor, short(0), QUESTION, num_frames=FRAMES, fps=8)
    configs = [{"methods": "pixelprune"}, {"methods": "t_vllm_keep_pattern+pixelprune-video", "retention": 0.5}]
    hf = []
    for config in configs:
        recorded.clear()
        with vtc.patch(model, config["methods"], retention=config.get("retention"), processor=processor):
            with torch.no_grad():
                model(**inputs)
        hf.append(recorded[-1][::2])  # (cells, features)
    request = video_request(served.llm.get_tokenizer(), short(0), QUESTION)
    for config, (hf_kept, hf_features) in zip(configs, hf):
        recorded.clear()
        ask(served.llm, config, request)
        kept, _, features = recorded[-1]
        assert torch.equal(kept, hf_kept), config["methods"]
        torch.testing.assert_close(features, hf_features, rtol=1e-5, atol=1e-5, msg=config["methods"])


def test_retention_1_keeps_every_unit_and_is_stock_vllm(served):
    """pixelprune-video at retention 1.0 keeps every unit: the tower runs as vLLM's own, and the prompt, the greedy
    tokens, the first token's logprobs and the positions are those of `random` at 1.0, which is stock vLLM bit for
    bit (tests/test_vllm.py::test_retention_1_is_stock_vllm_bit_for_bit)."""
    got, kept = ask(served.llm, {"methods": "pixelprune-video", "retention": 1.0}, served.two, max_tokens=3)
    assert [len(k["cells"]) for k in kept] == [g[0] * g[1] * g[2] for g in (k["grid"] for k in kept)]
    full = served.full
    assert got.prompt == full.prompt and got.tokens == full.tokens and got.logprobs == full.logprobs
    assert torch.equal(got.positions, full.positions)


# --- (d): the caches hold media-only results ------------------------------------------------------------------------


def test_the_caches_hold_media_only_results(served):
    """The kept set depends on the video and the request's vtc settings only: the same video with another question is
    served from the processor and encoder caches (not encoded again, the prompt differs by the text alone), the same
    request again answers as it did, the same video encoded afresh keeps the same units, and a request's own
    retention gets its own entry."""
    llm = served.llm
    tokenizer = llm.get_tokenizer()
    other = "Which colour is the square?"
    first, kept = ask(
        llm, {"methods": "pixelprune-video", "retention": 0.5}, video_request(tokenizer, short(0), QUESTION)
    )
    assert len(kept) == 1
    second = answer(llm, video_request(tokenizer, short(0), other), max_tokens=1)
    again = answer(llm, video_request(tokenizer, short(0), QUESTION), max_tokens=1)
    assert len(vllm_models.LAST_KEPT) == 1  # encoded once, reused for the other question and the repeat
    texts = [len(tokenizer.encode(video_request(tokenizer, short(0), q)["prompt"])) for q in (QUESTION, other)]
    assert len(second.prompt) - len(first.prompt) == texts[1] - texts[0]
    assert (again.prompt, again.tokens, again.logprobs) == (first.prompt, first.tokens, first.logprobs)
    clear_caches(llm)
    afresh = answer(llm, video_request(tokenizer, short(0), other), max_tokens=1)
    assert afresh.prompt == second.prompt
    assert torch.equal(vllm_models.LAST_KEPT[-1]["cells"], kept[0]["cells"])
    own = video_request(tokenizer, short(0), QUESTION)
    own["mm_processor_kwargs"] = {"vtc": {"retention": 0.25}}
    vllm_models.LAST_KEPT.clear()
    answer(llm, own, max_tokens=1)
    grid = kept[0]["grid"]
    assert [len(k["cells"]) for k in vllm_models.LAST_KEPT] == [round(0.25 * grid[0] * grid[1] * grid[2])]


def test_the_count_starts_from_what_the_encode_stage_kept():
    """`Pipeline.retained_count(grid, encoded=K)`: K replaces the encode methods' counts (an adaptive one included),
    the connect methods after them count from K, and a pipeline's count without K is unchanged."""
    grid = (4, 6, 6)
    adaptive = ServeConfig.from_dict({"methods": "pixelprune"}).pipeline("qwen2_vl")
    assert adaptive.retained_count(grid) is None and adaptive.retained_count(grid, encoded=50) == 50
    chained = ServeConfig.from_dict({"methods": "pixelprune-video+random", "retention": 0.25}).pipeline("qwen2_vl")
    assert chained.retained_count(grid) == 36  # 144 -> 72 -> 36
    assert chained.retained_count(grid, encoded=50) == 25
    with pytest.raises(ValueError, match=r"encoded must be a unit count in \[0, 144\]"):
        chained.retained_count(grid, encoded=145)


# --- (e): what cannot serve ---------------------------------------------------------------------------------------


def test_configs_that_cannot_serve_are_refused_naming_the_reason(registered):
    """Pre-tower encode methods serve on the three Qwen families only (the merge units are the Qwen towers'); an
    encode method serves only if it chooses patches before the tower or acts between its blocks; each refusal names
    why and what the server runs."""
    assert {"pixelprune", "pixelprune-video", "t_vllm_keep_pattern"} <= set(servable_encoders())
    assert "t_vllm_in_tower" not in servable_encoders()
    for family in QWEN:
        ServeConfig.from_dict({"methods": "pixelprune"}).pipeline(family)  # adaptive: sized from the pixels
        ServeConfig.from_dict({"methods": "pixelprune-video+random", "retention": 0.25}).pipeline(family)
    for family in ("llava_onevision", "llava_next_video"):
        with pytest.raises(ValueError) as refused:
            ServeConfig.from_dict({"methods": "pixelprune", "retention": 0.5}).pipeline(family)
        message = str(refused.value)
        reason = "pixelprune drops merge units (each 2x2 block of patches that becomes one LLM token) before the "
        assert reason + f"vision tower, but {family}'s tower has none (it lacks encode_units)" in message
        assert "pixelprune serves on qwen2_vl, qwen2_5_vl, qwen3_vl" in message
        assert f"methods a {family} server runs: aot, divprune" in message
        # what a LLaVA server runs in its encode stage: the tower methods (tests/test_vllm_llava_tower.py)
        assert message.endswith(
            f"encode-stage methods (alone or before one of the methods above, on {family}): grt, tome"
        )
    with pytest.raises(ValueError, match="t_vllm_in_tower acts in the encode stage but does not choose patches") as e:
        ServeConfig.from_dict({"methods": "t_vllm_in_tower"})
    assert re.search(r"encode-stage methods the server runs: [^;]*pixelprune-video", str(e.value))
    with pytest.raises(ValueError, match=r"acts inside the LLM.*encode-stage methods \(alone or before one of the"):
        ServeConfig.from_dict({"methods": "fastv"})
