"""vtc on vLLM (the CPU build, in-process engines on the tiny models saved to disk): retention 1.0 gives vLLM's own
greedy tokens, every serving method sizes the prompt to `retained_count` exactly, the same method keeps the same
tokens in HF and in vLLM, batched requests are compressed each on their own, and bad configs are refused before
any engine starts. The `vtc serve` process test is in test_serve.py."""

from __future__ import annotations

import pytest
import torch

import vtc
from vtc.api import prepare_inputs
from vtc.core.engine import grid_cells
from vtc.core.registry import registry
from vtc.media.video import synthetic_video
from vtc.testing import tiny
from vtc.testing.fixtures import model_and_processor
from vtc.testing.serving import clear_caches, engine, reconfigure, shutdown, video_request
from vtc.vllm import models as vllm_models
from vtc.vllm.config import ServeConfig, family_of, servable_methods

FAMILIES = tiny.FAMILIES
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
        "random",
        "streamingtom-ctr",
        "vidcom2",
        "visionzip",
    ]


def test_engine_start_fails_on_a_bad_config(saved):
    with pytest.raises(Exception, match="acts inside the LLM"):
        engine(saved["qwen2_vl"], vtc={"methods": "framefusion", "retention": 0.3})


# --- engines -----------------------------------------------------------------------------------------------------


def expected_prompt_length(stock_length: int, grid: tuple[int, int, int], count: int) -> int:
    """The stock prompt with the video's T*H*W placeholders replaced by `count` (the rest, LLaVA-OneVision's
    newline and Qwen3-VL's timestamps and frame markers included, is unchanged)."""
    t, h, w = grid
    return stock_length - t * h * w + count


@pytest.mark.parametrize("family", FAMILIES)
def test_serving_on_vllm(family, saved):
    """One stock engine and one vtc engine per family (engines take ~20 s to start on 2 cores)."""
    video, other = clip(0), clip(1, frames=12, size=192)

    stock = engine(saved[family])
    tokenizer = stock.get_tokenizer()
    request = video_request(tokenizer, video, QUESTION)
    # one request at a time: stock vLLM 0.32 fails LLaVA-OneVision batches of different-size videos (its
    # embed_multimodal returns 3-D tensors for them); vtc's classes return 2-D ones
    stock_out = [greedy(stock, [r])[0] for r in (request, video_request(tokenizer, other, QUESTION))]
    stock_len = [len(o.prompt_token_ids) for o in stock_out]
    shutdown(stock)

    llm = engine(saved[family], vtc={"methods": "random", "retention": 1.0})
    try:
        # retention 1.0: vLLM's own prompt and greedy tokens
        vllm_models.LAST_KEPT.clear()
        out = greedy(llm, [request])[0]
        assert len(out.prompt_token_ids) == stock_len[0]
        assert list(out.outputs[0].token_ids) == list(stock_out[0].outputs[0].token_ids)
        grid = vllm_models.LAST_KEPT[-1]["grid"]
        assert len(vllm_models.LAST_KEPT[-1]["cells"]) == grid[0] * grid[1] * grid[2]

        # every serving method at 0.25: the prompt is sized to retained_count, and the model kept exactly that
        for method in servable_methods():
            config = {"methods": method, "retention": 0.25, "params": registry()[method].test_params}
            reconfigure(llm, config)
            count = ServeConfig.from_dict(config).pipeline(family).retained_count(grid)
            assert count < grid[0] * grid[1] * grid[2]
            vllm_models.LAST_KEPT.clear()
            out = greedy(llm, [request], max_tokens=2)[0]
            assert len(out.prompt_token_ids) == expected_prompt_length(stock_len[0], grid, count), method
            assert [len(k["cells"]) for k in vllm_models.LAST_KEPT] == [count], method

        # the encoder cache holds media-only results: the same video with another question is not encoded again
        reconfigure(llm, {"methods": "vidcom2", "retention": 0.25})
        vllm_models.LAST_KEPT.clear()
        first = greedy(llm, [request], max_tokens=1)[0]
        again = greedy(llm, [video_request(tokenizer, video, "Which colour is the square?")], max_tokens=1)[0]
        assert len(vllm_models.LAST_KEPT) == 1  # compressed once, reused for the second question
        texts = [video_request(tokenizer, video, q)["prompt"] for q in (QUESTION, "Which colour is the square?")]
        text_lengths = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        assert len(again.prompt_token_ids) - len(first.prompt_token_ids) == text_lengths[1] - text_lengths[0]

        # two videos of different sizes in one batch: each compressed on its own, as it is alone
        requests = [request, video_request(tokenizer, other, QUESTION)]
        alone = []
        for r in requests:
            clear_caches(llm)
            vllm_models.LAST_KEPT.clear()
            alone.append((greedy(llm, [r], max_tokens=2)[0], vllm_models.LAST_KEPT[-1]["cells"]))
        clear_caches(llm)
        vllm_models.LAST_KEPT.clear()
        both = greedy(llm, requests, max_tokens=2)
        kept = {tuple(k["grid"]): k["cells"] for k in vllm_models.LAST_KEPT}
        assert len(kept) == 2
        for (out_alone, cells_alone), out_both in zip(alone, both):
            assert any(torch.equal(cells_alone, cells) for cells in kept.values())
            assert out_both.prompt_token_ids == out_alone.prompt_token_ids
            assert list(out_both.outputs[0].token_ids) == list(out_alone.outputs[0].token_ids)
    finally:
        shutdown(llm)


DETERMINISTIC = ("vidcom2", "divprune", "dycoke-ttm")


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_and_vllm_keep_the_same_tokens(family, saved, monkeypatch):
    """The same method on the same frames keeps the same grid cells in HF (vtc.patch) and in vLLM."""
    video = clip(0)
    model, processor = model_and_processor(family)
    seen: list[torch.Tensor] = []
    original = vtc.hf.patching.connect_video

    def recording(*args, **kwargs):
        tokens, out = original(*args, **kwargs)
        seen.append(grid_cells(out).sort().values.cpu())
        return tokens, out

    monkeypatch.setattr(vtc.hf.patching, "connect_video", recording)
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
            assert torch.equal(vllm_models.LAST_KEPT[-1]["cells"], hf_cells[method]), method
    finally:
        shutdown(llm)


TP_SCRIPT = """
import json, os, sys
from vtc.media.video import synthetic_video
from vtc.testing.serving import engine, last_kept_cells, video_request
if __name__ == "__main__":
    path, tp, config = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    from vllm import SamplingParams
    options = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    llm = engine(path, vtc=config, **options)
    request = video_request(llm.get_tokenizer(), synthetic_video(8, 224, 224, seed=0), "What happens?")
    out = llm.generate([request], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    print("RESULT " + json.dumps([len(out.prompt_token_ids), llm.apply_model(last_kept_cells)]), flush=True)
"""


def test_tensor_parallel_2_on_cpu_gives_what_one_rank_gives(saved, tmp_path):
    """Two CPU ranks (each holds half the heads; VisionZip's attention statistics are averaged over them) keep the
    same tokens on both ranks (the first rank's choice is broadcast), as many as one rank keeps. The CPU build
    binds one worker per NUMA node unless told otherwise. (Greedy tokens of a random-weight model are not
    compared: its near-flat logits flip with the all-reduce order.)"""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    config = json.dumps({"methods": "visionzip", "retention": 0.25})
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends a function to the worker processes
    results = []
    for tp in (1, 2):
        done = subprocess.run(
            [sys.executable, str(script), saved["qwen2_vl"], str(tp), config],
            capture_output=True,
            text=True,
            timeout=400,
            env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if tp == 1 else "1"},
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, done.stdout[-2000:] + done.stderr[-4000:]
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    (length_1, cells_1), (length_2, cells_2) = results
    assert length_1 == length_2 < 400  # compressed (592 tokens uncompressed)
    assert len(cells_1) == 1 and len(cells_2) == 2  # one list of kept cells per rank
    assert cells_2[0] == cells_2[1], "the two ranks kept different tokens"
    assert len(cells_2[0]) == len(cells_1[0])
    # Not asserted: the same kept set as one rank. Equal in 3 of 3 local runs, but one CI run shared only 34 % of
    # one rank's tokens (VisionZip's head-averaged attention under TP=2); open, see docs/serving.md.
