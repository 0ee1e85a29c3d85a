"""Tower methods on vLLM's LLaVA families (ToMe, and GRT's two stages, inside vLLM's own SigLIP / CLIP towers run
block by block; the CPU build, one in-process engine per family on the tiny models, shared by that family's tests):
ToMe keeps the prompt at stock size (its tokens are unmerged before LLaVA's pooling) and hands the LLM the features
`vtc.patch` gives, ToMe with r=0 is stock vLLM, GRT sizes the prompt to its count and hands the LLM the tokens and
features `vtc.patch` gives (its stage 1 record reaching its stage 2 per video, two videos in one call included), and
what cannot serve is refused before any engine starts."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import vtc
from tests.probes import record_survivors
from tests.test_vllm import answer, expected_prompt_length
from tests.test_vllm_encode import ask
from vtc.api import prepare_inputs
from vtc.core.engine import grid_cells
from vtc.media.video import static_clip
from vtc.testing import tiny
from vtc.testing.fixtures import model_and_processor
from vtc.testing.serving import engine, reconfigure, shutdown, video_request
from vtc.vllm import models as vllm_models
from vtc.vllm.config import ServeConfig, check_tower_parallelism, servable_encoders

LLAVA = ("llava_onevision", "llava_next_video")
QUESTION = "What happens in this video?"
FRAMES = 4
R = 100  # ToMe's tokens merged per block per frame: 200 of a frame's 729 SigLIP / 577 CLIP tokens over the 2 blocks
TOME = {"methods": "tome", "params": {"r": R}}
GRT = {"methods": "grt", "retention": 0.25}


def noise(seed: int = 0) -> np.ndarray:
    """Random frames: no two patches alike, so no exact tie in ToMe's matching (the two backends' towers differ in
    the last bits, which would order a tie either way)."""
    return np.random.default_rng(seed).integers(0, 256, size=(FRAMES, 224, 224, 3), dtype=np.uint8)


def tower_tokens(model) -> list[int]:
    """Tokens the tower methods left of each video of the worker's last call (`llm.apply_model`)."""
    return [len(t) for t in model.vtc._frame_tokens if t is not None]


def record_outputs(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every `connect_video` call of the HF and the vLLM backend, recorded as what the connect stage hands the LLM:
    (its tokens' grid cells, their features), in the connect stage's order."""
    import vtc.hf.patching

    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recorder(original):
        def connect_video(*args, **kwargs):
            tokens, out = original(*args, **kwargs)
            recorded.append((grid_cells(out).cpu(), out.embeds.float().cpu()))
            return tokens, out

        return connect_video

    monkeypatch.setattr(vtc.hf.patching, "connect_video", recorder(vtc.hf.patching.connect_video))
    monkeypatch.setattr(vllm_models, "connect_video", recorder(vllm_models.connect_video))
    return recorded


@pytest.fixture(scope="module", params=LLAVA)
def served(request, tmp_path_factory):
    """Per family: the tiny HF model, an engine on the same weights started with ToMe, and stock vLLM's answer to one
    video (`random` at retention 1.0: stock vLLM bit for bit, tests/test_vllm.py)."""
    family = request.param
    model, processor = model_and_processor(family)
    path = tiny.save(family, str(tmp_path_factory.mktemp("tiny-vllm-llava") / family), built=(model, processor))
    videos = 2 if family == "llava_onevision" else 1  # vLLM's LLaVA-NeXT-Video takes one video a prompt
    llm = engine(path, vtc=TOME, limit_mm_per_prompt={"video": videos, "image": 0})
    try:
        one = video_request(llm.get_tokenizer(), noise(), QUESTION)
        reconfigure(llm, {"methods": "random", "retention": 1.0})
        yield types.SimpleNamespace(
            family=family, model=model, processor=processor, llm=llm, one=one, stock=answer(llm, one)
        )
    finally:
        shutdown(llm)


def hf_run(served, frames: np.ndarray, method: str, **params):
    """`vtc.patch` on the tiny HF model of the served family, one forward on `frames`; returns the handle."""
    inputs = prepare_inputs(served.processor, frames, QUESTION, num_frames=FRAMES, fps=8)
    with vtc.patch(served.model, method, processor=served.processor, **params) as handle, torch.no_grad():
        served.model(**inputs)
    return handle


# --- (a) ToMe: tower compute only, the LLM gets HF's features; r=0 is stock vLLM ---------------------------------


def test_tome_keeps_the_prompt_and_hands_the_llm_hfs_features(served, monkeypatch):
    """ToMe with r=100 on random frames: the prompt is stock's (every frame is unmerged onto its grid before the
    pooling: the LLM's count is unchanged), vLLM's tower left as many tokens as HF's (2 x 100 merged per frame), and
    the connect stage gets the same cells, each standing for one frame, with HF's features up to float rounding
    (the two towers differ in the last bits)."""
    recorded = record_survivors(monkeypatch)
    handle = hf_run(served, noise(), "tome", r=R)
    hf_cells, hf_weights, hf_features = recorded[-1]
    recorded.clear()
    got, kept = ask(served.llm, TOME, served.one)
    cells, weights, features = recorded[-1]
    grid = kept[0]["grid"]
    assert got.prompt == served.stock.prompt
    assert len(cells) == grid[0] * grid[1] * grid[2] and torch.equal(cells, hf_cells)
    assert torch.equal(weights, hf_weights) and bool((weights == 1).all())
    assert served.llm.apply_model(tower_tokens) == [handle.stats().reports["tome"]["tower_tokens_out"]]
    per_frame = {"llava_onevision": 729, "llava_next_video": 577}[served.family]
    assert served.llm.apply_model(tower_tokens) == [[FRAMES * (per_frame - 2 * R)]]
    torch.testing.assert_close(features, hf_features, rtol=1e-5, atol=1e-5)


def test_tome_with_r_0_is_stock_vllm(served):
    """r=0 (the official default) merges nothing: vLLM's tower runs as its own, and the prompt, the greedy tokens and
    the first token's logprobs are stock vLLM's."""
    got, _ = ask(served.llm, {"methods": "tome", "params": {"r": 0}}, served.one, max_tokens=3)
    assert served.llm.apply_model(tower_tokens) == [[]]  # the tower was not run block by block
    stock = served.stock
    assert got.prompt == stock.prompt and got.tokens == stock.tokens and got.logprobs == stock.logprobs


# --- (b) GRT: its count, HF's tokens and features -----------------------------------------------------------------


def test_grt_sizes_the_prompt_to_its_count_and_hands_the_llm_hfs_tokens(served, monkeypatch):
    """GRT at retention 0.25 on a static-heavy clip (stage 1 reuses most patches' embeddings, stage 2 packs every
    frame to ceil(k / 4) tokens): the prompt is the text plus `retained_count`, and the LLM gets the cells and
    features `vtc.patch` gives. On LLaVA-OneVision the clip is the second of two videos in one call: its stage 1
    record reaches its own stage 2 (the first video's gate, all of whose patches move, would pack it otherwise)."""
    recorded = record_outputs(monkeypatch)
    clip = static_clip(FRAMES)
    hf_run(served, clip, "grt", retention=0.25)
    hf_cells, hf_features = recorded[-1]
    recorded.clear()
    pipeline = ServeConfig.from_dict(GRT).pipeline(served.family)
    got, kept = ask(served.llm, GRT, video_request(served.llm.get_tokenizer(), clip, QUESTION))
    grid = kept[0]["grid"]
    count = pipeline.retained_count(grid)
    assert count == FRAMES * {"llava_onevision": 49, "llava_next_video": 36}[served.family]
    assert [len(k["cells"]) for k in kept] == [count]
    assert len(got.prompt) == expected_prompt_length(len(served.stock.prompt), [grid], [count])
    cells, features = recorded[-1]
    assert torch.equal(cells, hf_cells)
    torch.testing.assert_close(features, hf_features, rtol=1e-5, atol=1e-5)
    if served.family != "llava_onevision":
        return
    recorded.clear()
    two = video_request(served.llm.get_tokenizer(), [noise(1), clip], QUESTION)
    got, kept = ask(served.llm, GRT, two)
    assert [len(k["cells"]) for k in kept] == [count, count]
    video_token = served.llm.llm_engine.model_config.hf_config.video_token_index
    assert got.prompt.count(video_token) == 2 * (count + 1)  # each video's count, then its newline
    cells, features = recorded[-1]
    assert torch.equal(cells, hf_cells)
    torch.testing.assert_close(features, hf_features, rtol=1e-5, atol=1e-5)


# --- (c) what cannot serve -----------------------------------------------------------------------------------------


def test_what_cannot_serve_on_llava_is_refused_naming_the_reason():
    """EarlyTom's count depends on the content; ToMe alone with a retention has no share of it on LLaVA (its tokens
    are unmerged before the pooling); GRT needs LLaVA's pre-pool grid (not on Qwen) and the whole LM head on the
    encoding rank (no tensor or pipeline parallelism); a tower method on a LLaVA tower split by tensor parallelism
    (vLLM's LLaVA models take no --mm-encoder-tp-mode data)."""
    assert {"tome", "grt"} <= set(servable_encoders()) and "earlytom" not in servable_encoders()
    with pytest.raises(ValueError, match=r"earlytom merges tokens between the vision tower's blocks, but its count "):
        ServeConfig.from_dict({"methods": "earlytom", "retention": 0.25})
    for family in LLAVA:
        with pytest.raises(ValueError, match=f"no method of 'tome' changes that count on {family}.*tome.r"):
            ServeConfig.from_dict({"methods": "tome", "retention": 0.25}).pipeline(family)
        tome = ServeConfig.from_dict(TOME).pipeline(family)
        assert tome.retained_count((8, 14, 14)) == 8 * 14 * 14
        with pytest.raises(ValueError, match=f"vLLM's {family} model splits its tower.*--tensor-parallel-size 1"):
            check_tower_parallelism(tome, 2, "data", family)
        grt = ServeConfig.from_dict(GRT).pipeline(family)
        for tp, pp, where in ((2, 1, "splits it by vocabulary"), (1, 2, "the first stage, which encodes the video")):
            with pytest.raises(ValueError, match=f"grt compares key frames by the LLM's LM head.*{where}"):
                check_tower_parallelism(grt, tp, "weights", family, pp)
        check_tower_parallelism(grt, 1, None, family, 1)
    with pytest.raises(ValueError, match=r"grt acts between the vision tower's blocks and needs what qwen2_vl's "):
        ServeConfig.from_dict(GRT).pipeline("qwen2_vl")
