"""vtc on vLLM (the CPU build, in-process engines on the tiny models saved to disk): retention 1.0 gives vLLM's own
greedy tokens, every serving method sizes the prompt to `retained_count` exactly, the same method keeps the same
tokens in HF and in vLLM, batched requests are compressed each on their own, and bad configs are refused before
any engine starts. The `vtc serve` process test is in test_serve.py."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from PIL import Image

import vtc
from tests.positions_check import assert_positions_kept, video_slots
from tests.probes import record_kept_cells
from vtc.api import prepare_inputs
from vtc.core.registry import registry
from vtc.media.video import synthetic_video
from vtc.testing import tiny
from vtc.testing.fixtures import model_and_processor
from vtc.testing.serving import POSITIONS, clear_caches, engine, reconfigure, record_positions, shutdown, video_request
from vtc.vllm import models as vllm_models
from vtc.vllm.config import ARCHITECTURES, ServeConfig, family_of, servable_methods

FAMILIES = tuple(dict.fromkeys(ARCHITECTURES.values()))  # the families vtc serves on vLLM (not InternVL yet)
QUESTION = "What happens in this video?"
FRAMES = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vllm")
    return {family: tiny.save(family, str(root / family)) for family in FAMILIES}


def clip(seed: int = 0, frames: int = FRAMES, size: int = 224):
    return synthetic_video(frames, size, size, seed=seed)


def greedy(llm, requests, max_tokens: int = 6):
    from vllm import SamplingParams

    return llm.generate(requests, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)


# --- configs refused before any engine starts ------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"methods": "nope"}, "nope"),
        ({"methods": "vidcom2", "retention": 0}, r"retention must be in \(0, 1\]"),
        ({"methods": "vidcom2", "retention": 1.5}, r"retention must be in \(0, 1\]"),
        ({"methods": "fastv", "retention": 0.25}, "acts inside the LLM.*vidcom2"),
        ({"methods": "holitom", "retention": 0.25}, "serve its connect part as 'holitom-outer'"),
        ({"methods": "dycoke"}, "serve its connect part as 'dycoke-ttm'"),
        ({"methods": "prunevid"}, "acts inside the LLM"),
        ({"methods": "quota"}, "vtc.vllm.client.select_frames"),
        ({"methods": "vidcom2", "retntion": 0.2}, "unknown key.*retntion.*allowed: methods, retention, params, seed"),
        ({"retention": 0.2}, 'needs "methods"'),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_configs_name_the_allowed_values(raw, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig.from_dict(raw)


def test_fixed_count_is_forced_and_cannot_be_turned_off():
    config = ServeConfig.from_dict({"methods": "fastvid", "retention": 0.25})
    assert config.pipeline("qwen2_vl").retained_count((8, 12, 12)) == 8 * int(144 * 0.25)
    with pytest.raises(ValueError, match="fixed_count=False gives a content-dependent count"):
        ServeConfig.from_dict({"methods": "aot", "params": {"fixed_count": False}}).pipeline("qwen2_vl")


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*vtc serves Qwen2VLForConditionalGeneration"):
        family_of(["LlamaForCausalLM"])


def test_servable_methods_are_the_connect_methods_with_a_fixed_count():
    assert servable_methods() == [
        "aot",
        "divprune",
        "dycoke-ttm",
        "fastvid",
        "holitom-outer",
        "mssavt",
        "omnidelta",
        "prumerge-plus",
        "random",
        "streamingtom-ctr",
        "sttm-connect",
        "vidcom2",
        "visionzip",
        "vispruner",
    ]


def test_engine_start_fails_on_a_bad_config(saved):
    with pytest.raises(Exception, match="acts inside the LLM"):
        engine(saved["qwen2_vl"], vtc={"methods": "framefusion", "retention": 0.3})


def test_a_pipeline_stage_without_the_vision_tower_skips_statistics_and_compression():
    """Under vLLM's V2 runner with pipeline parallel, the stages after the first hold a `StageMissingLayer` where
    the vision tower would be (simulated here). Such a stage never encodes: vtc builds no statistics capture for
    it, even for a method that reads the tower's attention, and refuses to be asked to encode."""
    from vllm.model_executor.models.utils import StageMissingLayer

    from vtc.vllm.models import Serving
    from vtc.vllm.stages import holds_module

    hf_model, _ = model_and_processor("qwen2_vl")
    later_stage = types.SimpleNamespace(visual=StageMissingLayer("vision_tower", None), config=hf_model.config)
    config = ServeConfig.from_dict({"methods": "visionzip", "retention": 0.25})
    serving = Serving(later_stage, "qwen2_vl", config)
    assert not serving.encodes and serving.stats is None
    assert serving.pipeline.vision_stats("qwen2_vl")  # VisionZip does read statistics, on the first stage
    with pytest.raises(RuntimeError, match="holds no vision tower"):
        serving.encode(lambda: None, [(4, 12, 12)])
    assert holds_module(hf_model.model.visual) and not holds_module(later_stage.visual)


def test_the_first_stage_positions_travel_to_the_next_one():
    """The positions a first stage ran with go out with its intermediate tensors, and a later stage copies them
    into the positions buffer the runner gave it (what a captured CUDA graph reads), dropping vtc's entry."""
    from vllm.sequence import IntermediateTensors

    from vtc.vllm.stages import (
        STAGE_POSITIONS,
        positions_from_previous_stage,
        positions_to_next_stage,
        with_stage_positions,
    )

    def make_empty(batch_size, dtype, device):
        return IntermediateTensors({"hidden_states": torch.zeros(batch_size, 4, dtype=dtype, device=device)})

    buffers = with_stage_positions(make_empty)(8, torch.float32, "cpu")
    assert buffers[STAGE_POSITIONS].shape == (8, 3) and buffers[STAGE_POSITIONS].dtype == torch.long
    first = torch.tensor([[0, 1, 2, 5, 6], [0, 1, 3, 5, 6], [0, 1, 4, 5, 6]])
    sent = positions_to_next_stage(IntermediateTensors({"hidden_states": torch.ones(5, 4)}), first)
    buffers[STAGE_POSITIONS][:5] = sent[STAGE_POSITIONS]
    buffers["hidden_states"][:5] = sent["hidden_states"]
    runner_positions = torch.full((3, 5), -7)
    positions, rest = positions_from_previous_stage(runner_positions, buffers[:5])
    assert positions is runner_positions and torch.equal(runner_positions, first)
    assert set(rest.tensors) == {"hidden_states"}
    alone = torch.arange(5).expand(3, 5)
    assert positions_from_previous_stage(alone, None) == (alone, None)  # the first stage keeps its own


# --- engines -----------------------------------------------------------------------------------------------------

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# every prompt is prefilled in chunks of this many tokens, as under load: the media of a prompt reaches the LLM
# over several steps, some items split between two
CHUNK = 256


def picture():
    return Image.fromarray(synthetic_video(1, 112, 140, seed=3)[0])


def media_requests(family: str, tokenizer) -> dict[str, dict]:
    """What users send: one video; two videos (of different sizes where the family allows it); a video then an
    image; a Qwen video at 3 fps (2/3 s per temporal patch). vLLM's LLaVA-NeXT-Video takes one video and no
    image per prompt (its own limit, not vtc's)."""
    out = {"one video": video_request(tokenizer, clip(0), QUESTION)}
    if family == "llava_next_video":
        return out
    # stock vLLM 0.32 fails LLaVA-OneVision prompts with videos of different sizes (3-D embeddings); vtc does not
    second = clip(1) if family == "llava_onevision" else clip(1, frames=12, size=192)
    out["two videos"] = video_request(tokenizer, [clip(0), second], QUESTION)
    out["video, image"] = video_request(tokenizer, clip(0), QUESTION, images=[picture()])
    if family in QWEN:
        out["3 fps"] = video_request(tokenizer, clip(2, frames=12), QUESTION, fps=3.0)
    return out


@dataclasses.dataclass
class Answer:
    prompt: list[int]
    tokens: list[int]
    logprobs: dict[int, float]  # the first generated token's top 5
    positions: torch.Tensor | None  # final M-RoPE positions of the prompt (Qwen families)


def answer(llm, request, max_tokens: int = 3) -> Answer:
    from vllm import SamplingParams

    POSITIONS.clear()
    out = llm.generate([request], SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5), use_tqdm=False)
    first = out[0].outputs[0]
    logprobs = {token: value.logprob for token, value in first.logprobs[0].items()}
    return Answer(list(out[0].prompt_token_ids), list(first.token_ids), logprobs, POSITIONS[-1] if POSITIONS else None)


@dataclasses.dataclass
class Engines:
    family: str
    llm: object  # vtc's engine, started with random at retention 1.0
    stock: dict[str, Answer]  # stock vLLM's answers to media_requests
    requests: dict[str, dict]


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request, saved):
    """Per family: stock vLLM answers every media request, then vtc's engine takes over (one engine at a time:
    engines in one process must not overlap)."""
    family = request.param
    options = dict(limit_mm_per_prompt={"video": 2, "image": 1}, max_num_batched_tokens=CHUNK)
    if family == "llava_next_video":
        options["limit_mm_per_prompt"] = {"video": 1}
    stock = engine(saved[family], **options)
    stock.apply_model(record_positions)
    requests = media_requests(family, stock.get_tokenizer())
    # one request at a time: stock vLLM 0.32 fails LLaVA-OneVision batches of different-size videos
    stock_answers = {name: answer(stock, r) for name, r in requests.items()}
    shutdown(stock)
    llm = engine(saved[family], vtc={"methods": "random", "retention": 1.0}, **options)
    llm.apply_model(record_positions)
    try:
        yield Engines(family, llm, stock_answers, requests)
    finally:
        shutdown(llm)


def expected_prompt_length(stock_length: int, grids: list[tuple[int, int, int]], counts: list[int]) -> int:
    """The stock prompt with each video's T*H*W placeholders replaced by its count (the rest, LLaVA-OneVision's
    newline and Qwen3-VL's timestamps and frame markers included, is unchanged)."""
    return stock_length - sum(t * h * w for t, h, w in grids) + sum(counts)


def test_retention_1_is_stock_vllm_bit_for_bit(engines):
    """Same prompt tokens, same first-token logprobs (exactly), same greedy tokens and, on the M-RoPE families,
    the same positions as stock vLLM: for two videos, a video and an image, any frame rate, chunked prefill."""
    reconfigure(engines.llm, {"methods": "random", "retention": 1.0})
    for name, request in engines.requests.items():
        vllm_models.LAST_KEPT.clear()
        got, stock = answer(engines.llm, request), engines.stock[name]
        assert got.prompt == stock.prompt, name
        assert got.logprobs == stock.logprobs, name
        assert got.tokens == stock.tokens, name
        if engines.family in QWEN:
            assert torch.equal(got.positions, stock.positions), name
        assert all(len(k["cells"]) == k["grid"][0] * k["grid"][1] * k["grid"][2] for k in vllm_models.LAST_KEPT)


def test_each_video_is_compressed_to_its_own_count_and_keeps_its_positions(engines):
    """At 0.25, every video of a prompt keeps its own `retained_count`, and an image the image pipeline's count (each
    view of a LLaVA-OneVision image its own);
    on the M-RoPE families each survivor keeps its stock (t, h, w) while the text between and after the media
    keeps its own."""
    config = {"methods": "vidcom2", "retention": 0.25}
    reconfigure(engines.llm, config)
    pipeline = ServeConfig.from_dict(config).pipeline(engines.family)
    hf_config = engines.llm.llm_engine.model_config.hf_config
    video_token = getattr(hf_config, "video_token_id", getattr(hf_config, "video_token_index", None))
    views_per_image = 2 if engines.family == "llava_onevision" else 1  # a LLaVA image: its base view, its crops
    for name, request in engines.requests.items():
        clear_caches(engines.llm)  # every video of the prompt is compressed here, none comes from the cache
        vllm_models.LAST_KEPT.clear()
        vllm_models.LAST_KEPT_IMAGES.clear()
        got, stock = answer(engines.llm, request, max_tokens=1), engines.stock[name]
        kept, kept_images = list(vllm_models.LAST_KEPT), list(vllm_models.LAST_KEPT_IMAGES)
        assert len(kept) == (2 if name == "two videos" else 1), name
        assert len(kept_images) == (views_per_image if name == "video, image" else 0), name
        grids = [k["grid"] for k in kept]
        counts = [len(k["cells"]) for k in kept]
        assert counts == [pipeline.retained_count(g) for g in grids], name
        assert all(c < g[0] * g[1] * g[2] for c, g in zip(counts, grids)), name
        image_grids = [k["grid"] for k in kept_images]
        image_counts = [len(k["cells"]) for k in kept_images]
        assert image_counts == [pipeline.for_images().retained_count(g) for g in image_grids], name
        expected = expected_prompt_length(len(stock.prompt), grids + image_grids, counts + image_counts)
        assert len(got.prompt) == expected, name
        if engines.family in QWEN:
            slots = video_slots(stock.prompt, video_token, [t * h * w for t, h, w in grids])
            cells = [k["cells"] for k in kept]
            if kept_images:
                slots += video_slots(stock.prompt, hf_config.image_token_id, [t * h * w for t, h, w in image_grids])
                cells += [k["cells"] for k in kept_images]
            assert_positions_kept(stock.positions, got.positions, slots, cells, len(got.prompt))


def test_every_serving_method_sizes_the_prompt_to_its_count(engines):
    """Every serving method at 0.25: the prompt is sized to retained_count, and the model kept exactly that."""
    request, stock = engines.requests["one video"], engines.stock["one video"]
    for method in servable_methods():
        config = {"methods": method, "retention": 0.25, "params": registry()[method].testing.params}
        reconfigure(engines.llm, config)
        vllm_models.LAST_KEPT.clear()
        got = answer(engines.llm, request, max_tokens=1)
        grid = vllm_models.LAST_KEPT[-1]["grid"]
        count = ServeConfig.from_dict(config).pipeline(engines.family).retained_count(grid)
        assert count < grid[0] * grid[1] * grid[2], method
        assert len(got.prompt) == expected_prompt_length(len(stock.prompt), [grid], [count]), method
        assert [len(k["cells"]) for k in vllm_models.LAST_KEPT] == [count], method


def test_the_encoder_cache_holds_media_only_results(engines):
    """The same video with another question is not encoded again, and the text around it is what differs."""
    reconfigure(engines.llm, {"methods": "vidcom2", "retention": 0.25})
    tokenizer = engines.llm.get_tokenizer()
    vllm_models.LAST_KEPT.clear()
    first = answer(engines.llm, video_request(tokenizer, clip(0), QUESTION), max_tokens=1)
    again = answer(engines.llm, video_request(tokenizer, clip(0), "Which colour is the square?"), max_tokens=1)
    assert len(vllm_models.LAST_KEPT) == 1  # compressed once, reused for the second question
    texts = [video_request(tokenizer, clip(0), q)["prompt"] for q in (QUESTION, "Which colour is the square?")]
    text_lengths = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    assert len(again.prompt) - len(first.prompt) == text_lengths[1] - text_lengths[0]


def test_requests_batched_together_are_compressed_as_when_alone(engines):
    """Two requests with videos of different sizes in one batch: each compressed on its own, as when it is alone
    (same kept cells, prompt and greedy tokens; first-token logprobs equal up to the last bits a batched forward
    changes in stock vLLM too)."""
    from vllm import SamplingParams

    reconfigure(engines.llm, {"methods": "vidcom2", "retention": 0.25})
    tokenizer = engines.llm.get_tokenizer()
    requests = [video_request(tokenizer, clip(0), QUESTION), video_request(tokenizer, clip(1, 12, 192), QUESTION)]
    alone = []
    for r in requests:
        clear_caches(engines.llm)
        vllm_models.LAST_KEPT.clear()
        alone.append((answer(engines.llm, r, max_tokens=2), vllm_models.LAST_KEPT[-1]["cells"]))
    clear_caches(engines.llm)
    vllm_models.LAST_KEPT.clear()
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=5)
    both = engines.llm.generate(requests, params, use_tqdm=False)
    kept = {tuple(k["grid"]): k["cells"] for k in vllm_models.LAST_KEPT}
    assert len(kept) == 2
    for (out_alone, cells_alone), out_both in zip(alone, both):
        assert any(torch.equal(cells_alone, cells) for cells in kept.values())
        assert list(out_both.prompt_token_ids) == out_alone.prompt
        assert list(out_both.outputs[0].token_ids) == out_alone.tokens
        first = {token: value.logprob for token, value in out_both.outputs[0].logprobs[0].items()}
        assert first.keys() == out_alone.logprobs.keys()
        assert all(abs(first[t] - out_alone.logprobs[t]) < 1e-5 for t in first)


def test_a_request_sets_its_own_retention(engines):
    """`mm_processor_kwargs={"vtc": {...}}` overrides the server's retention and parameters for one request: its
    prompt is sized to its own count, the encoder cache keeps each setting's result apart, and a value outside what
    the server allows is refused naming it."""
    tokenizer = engines.llm.get_tokenizer()
    reconfigure(engines.llm, {"methods": "vidcom2", "retention": 0.25, "retention_range": [0.1, 0.8]})

    def ask(settings):
        request = video_request(tokenizer, clip(0), QUESTION)
        if settings is not None:
            request["mm_processor_kwargs"] = {"vtc": settings}
        vllm_models.LAST_KEPT.clear()
        got = answer(engines.llm, request, max_tokens=1)
        return len(got.prompt), [(k["grid"], len(k["cells"]), k["retention"]) for k in vllm_models.LAST_KEPT]

    runs = [ask(s) for s in (None, {"retention": 0.5}, None, {"retention": 0.5}, {"params": {"ratio": 0.5}})]
    grid = runs[0][1][0][0]
    count = {
        r: ServeConfig.from_dict({"methods": "vidcom2", "retention": r}).pipeline(engines.family).retained_count(grid)
        for r in (0.25, 0.5)
    }
    stock = len(engines.stock["one video"].prompt)
    lengths = [length for length, _ in runs]
    assert lengths == [expected_prompt_length(stock, [grid], [count[r]]) for r in (0.25, 0.5, 0.25, 0.5, 0.5)]
    # each setting is compressed once; a repeat is served from the encoder cache, which keeps settings apart
    assert [kept for _, kept in runs] == [
        [(grid, count[0.25], 0.25)],
        [(grid, count[0.5], 0.5)],
        [],
        [],
        [(grid, count[0.5], 0.25)],
    ]
    # two requests in one batch, with and without their own setting: each video gets its request's count
    from vllm import SamplingParams

    requests = [video_request(tokenizer, clip(k + 5), QUESTION) for k in range(2)]
    requests[1]["mm_processor_kwargs"] = {"vtc": {"retention": 0.5}}
    vllm_models.LAST_KEPT.clear()
    outs = engines.llm.generate(requests, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in outs] == [lengths[0], lengths[1]]
    assert sorted((len(k["cells"]), k["retention"]) for k in vllm_models.LAST_KEPT) == [
        (count[0.25], 0.25),
        (count[0.5], 0.5),
    ]
    for settings, message in [
        ({"retention": 0.9}, r"retention must be in \[0.1, 0.8\] on this server"),
        ({"retention": 0}, r"retention must be in \(0, 1\]"),
        ({"methods": "random"}, "a request may set retention, params, seed, question; this server runs 'vidcom2'"),
        ({"params": {"vidcom2.alpha": 0.5}}, "method 'vidcom2' has no parameter 'alpha'; its parameters: alphas"),
        ({"params": {"fixed_count": False}}, "fixed_count=False gives a content-dependent count"),
        ("0.5", "must be an object with keys retention, params, seed"),
    ]:
        with pytest.raises(Exception, match=message):
            ask(settings)
    reconfigure(engines.llm, {"methods": "vidcom2", "retention": 0.25, "request_settings": False})
    with pytest.raises(Exception, match="does not take per-request vtc settings"):
        ask({"retention": 0.5})


DETERMINISTIC = ("vidcom2", "divprune", "dycoke-ttm")


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_and_vllm_keep_the_same_tokens(family, saved, monkeypatch):
    """The same method on the same frames keeps the same grid cells in HF (vtc.patch) and in vLLM (up to a 2 %
    share swapped at near-ties: the two backends' vision towers differ in the last bits)."""
    video = clip(0)
    model, processor = model_and_processor(family)
    seen = record_kept_cells(monkeypatch)
    inputs = prepare_inputs(processor, video, QUESTION, num_frames=FRAMES, fps=8)
    hf_cells = {}
    for method in DETERMINISTIC:
        seen.clear()
        params = ServeConfig.from_dict({"methods": method, "retention": 0.25}).serving_params()
        with vtc.patch(model, method, retention=0.25, **params), torch.no_grad():
            model(**inputs)
        hf_cells[method] = seen[-1]

    llm = engine(saved[family], vtc={"methods": DETERMINISTIC[0], "retention": 0.25})
    try:
        request = video_request(llm.get_tokenizer(), video, QUESTION)
        for method in DETERMINISTIC:
            reconfigure(llm, {"methods": method, "retention": 0.25})
            vllm_models.LAST_KEPT.clear()
            greedy(llm, [request], max_tokens=1)
            # HF's and vLLM's vision towers differ in the last bits, which can swap a near-tied token or two
            swapped = set(vllm_models.LAST_KEPT[-1]["cells"].tolist()) ^ set(hf_cells[method].tolist())
            assert len(vllm_models.LAST_KEPT[-1]["cells"]) == len(hf_cells[method]), method
            assert len(swapped) <= 2 * max(1, len(hf_cells[method]) // 50), method
    finally:
        shutdown(llm)


PARALLEL_SCRIPT = """
import json, os, sys
from vtc.media.video import synthetic_video
from vtc.testing.serving import engine, last_kept_cells, video_request
if __name__ == "__main__":
    path, options, config = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    from vllm import SamplingParams
    if options:
        options["distributed_executor_backend"] = "mp"
    llm = engine(path, vtc=config, **options)
    clips = [synthetic_video(8, 224, 224, seed=0), synthetic_video(12, 192, 192, seed=1)]
    request = video_request(llm.get_tokenizer(), clips, "What happens?")
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=5)
    out = llm.generate([request], params, use_tqdm=False)[0]
    first = {str(t): v.logprob for t, v in out.outputs[0].logprobs[0].items()}
    result = [len(out.prompt_token_ids), llm.apply_model(last_kept_cells), list(out.outputs[0].token_ids), first]
    print("RESULT " + json.dumps(result), flush=True)
"""


def run_parallel(path: str, options: dict, config: dict, tmp_path) -> list:
    """Prompt length, kept cells per worker, greedy tokens and first-token logprobs of a two-video request on an
    engine with `options` (tensor_parallel_size / pipeline_parallel_size; {}: one in-process rank)."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "parallel.py"
    script.write_text(PARALLEL_SCRIPT)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends a function to the worker processes
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if options else "0"
    done = subprocess.run(
        [sys.executable, str(script), path, json.dumps(options), json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_tensor_and_pipeline_parallel_2_on_cpu_give_what_one_rank_gives(saved, tmp_path):
    """Two videos in one prompt on Qwen2-VL with VisionZip (which reads the vision tower's attention).

    Tensor parallel 2 (each rank holds half the heads; the attention statistics are averaged over them): both ranks
    keep the same tokens (the first rank's choice is broadcast), as many as one rank keeps. Greedy tokens of a
    random-weight model are not compared: its near-flat logits flip with the all-reduce order.

    Pipeline parallel 2: only the first stage encodes and compresses; the second stage gets the first stage's
    M-RoPE positions with the hidden states. Same prompt, same kept tokens, and the same logits as one rank,
    exactly. The CPU build binds one worker per NUMA node unless told otherwise."""
    config = {"methods": "visionzip", "retention": 0.25}
    length_1, cells_1, tokens_1, logprobs_1 = run_parallel(saved["qwen2_vl"], {}, config, tmp_path)
    length_tp, cells_tp, _, _ = run_parallel(saved["qwen2_vl"], {"tensor_parallel_size": 2}, config, tmp_path)
    length_pp, cells_pp, tokens_pp, logprobs_pp = run_parallel(
        saved["qwen2_vl"], {"pipeline_parallel_size": 2}, config, tmp_path
    )
    assert length_1 == length_tp == length_pp < 700  # compressed (1458 tokens uncompressed)
    assert len(cells_1) == 1 and len(cells_tp) == 2 and len(cells_pp) == 2  # one list of kept cells per worker
    assert cells_tp[0] == cells_tp[1], "the two ranks kept different tokens"
    assert len(cells_tp[0]) == len(cells_1[0])
    # Not asserted: the same kept set as one rank under TP. Equal in 3 of 3 local runs, but one CI run shared only
    # 34 % of one rank's tokens (VisionZip's head-averaged attention under TP=2); open, see docs/serving.md.
    assert cells_pp == [cells_1[0], []]  # the second stage never sees the video
    assert tokens_pp == tokens_1 and logprobs_pp == logprobs_1
