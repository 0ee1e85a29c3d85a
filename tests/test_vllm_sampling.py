"""Frame samplers on vLLM (`vtc.vllm.sampling`): the server's prompt processor chooses frames after vLLM decodes a
video and before its encoder runs. In-process engines on the tiny models, with a colour "CLIP" whose answer is
known (the question "red" scores red frames highest):

* the server encodes exactly the chosen frames: its prompt, positions, first-token logprobs and greedy tokens are
  stock vLLM's when stock vLLM is sent only those frames (with their true frame numbers);
* two questions about one video get their own frames, and a repeated question (or a query-agnostic sampler) is
  served from the encoder cache, which is keyed by (video, chosen frames);
* several videos in one prompt are each sampled against the question; a sampler composes with a connect method;
  a request may name its question; a prompt without one is refused with what to do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.probes import ColourEncoder, coloured_clip
from tests.test_vllm import answer
from vtc.core.pipeline import Pipeline
from vtc.media.encoders import register_encoder
from vtc.media.inputs import sample_frames
from vtc.testing import tiny
from vtc.testing.serving import clear_caches, engine, reconfigure, record_positions, shutdown, video_request
from vtc.vllm import models as vllm_models
from vtc.vllm import sampling
from vtc.vllm.config import ServeConfig

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "llava_onevision")
QWEN = ("qwen2_5_vl", "qwen3_vl")
FPS = 4
RED, BLUE = "Where is the red ball?", "When does the blue light appear?"
BOLT_PARAMS = {"bolt.encoder": "test-colour", "bolt.encoder_pretrained": None, "bolt.num_frames": 4}
BOLT = {"methods": "bolt", "params": BOLT_PARAMS}

register_encoder("test-colour", ColourEncoder())


# 10 s at FPS: red in seconds 6-7, blue in second 2; the second video red in second 1, blue in seconds 8-9
VIDEOS = [coloured_clip(10, FPS, (6, 7), (2,), size=112), coloured_clip(10, FPS, (1,), (8, 9), size=112)]


def chosen(video: np.ndarray, question: str, params=BOLT_PARAMS) -> list[int]:
    """What the HF backend's sample stage chooses (the same call the server makes)."""
    return sample_frames(video, question, Pipeline("bolt", params=params), fps=FPS).indices


def frames_request(prompt: str, videos: list[np.ndarray], indices: list[list[int]]) -> dict:
    """Stock vLLM's request for only the chosen frames, with their true frame numbers."""
    items = []
    for video, idx in zip(videos, indices):
        metadata = {
            "fps": float(FPS),
            "total_num_frames": len(video),
            "duration": len(video) / FPS,
            "frames_indices": list(idx),
            "do_sample_frames": False,
        }
        items.append((video[idx], metadata))
    return {"prompt": prompt, "multi_modal_data": {"video": items[0] if len(items) == 1 else items}}


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """Per family: stock vLLM's answers to the chosen frames, then vtc's engine running bolt."""
    family = request.param
    path = tiny.save(family, str(tmp_path_factory.mktemp("sampling") / family))
    stock = engine(path)
    stock.apply_model(record_positions)
    tokenizer = stock.get_tokenizer()
    cases = {
        "red": ([VIDEOS[0]], RED),
        "blue": ([VIDEOS[0]], BLUE),
        "two videos": (VIDEOS, RED),
    }
    requests, expected = {}, {}
    for name, (videos, question) in cases.items():
        requests[name] = video_request(tokenizer, videos, question, fps=FPS)
        indices = [chosen(v, question) for v in videos]
        expected[name] = (indices, answer(stock, frames_request(requests[name]["prompt"], videos, indices)))
    shutdown(stock)
    llm = engine(path, vtc=BOLT)
    llm.apply_model(record_positions)
    try:
        yield family, llm, requests, expected
    finally:
        shutdown(llm)


def test_the_server_encodes_exactly_the_chosen_frames(served):
    family, llm, requests, expected = served
    reconfigure(llm, BOLT)
    for name, request in requests.items():
        sampling.LAST_FRAMES.clear()
        got = answer(llm, request)
        indices, stock = expected[name]
        assert [f["selection"].indices for f in sampling.LAST_FRAMES] == indices, name
        assert got.prompt == stock.prompt, name
        assert got.logprobs == stock.logprobs, name
        assert got.tokens == stock.tokens, name
        if family in QWEN:
            assert torch.equal(got.positions, stock.positions), name

    # the known answer: 3 of bolt's 4 frames at least lie where the colour asked about is (4 frames per second;
    # inverse transform sampling puts its last quantile past a one-second peak)
    def seconds(name: str, video: int = 0) -> list[int]:
        return [i // FPS for i in expected[name][0][video]]

    assert all(s in (6, 7) for s in seconds("red"))
    assert seconds("blue").count(2) >= 3
    assert seconds("two videos", 1).count(1) >= 3  # the second video is red in its second second


def test_two_questions_about_one_video_get_their_own_frames(served):
    """No cache is cleared between the questions: the second question's frames are encoded for it, and the first
    question asked again is served from the encoder cache (same video, same frames)."""
    _, llm, requests, expected = served
    reconfigure(llm, BOLT)
    vllm_models.LAST_KEPT.clear()
    sampling.LAST_FRAMES.clear()
    answers = [answer(llm, requests[name]) for name in ("red", "blue", "red")]
    hashes = [f["hash"] for f in sampling.LAST_FRAMES]
    assert hashes[0] != hashes[1] and hashes[0] == hashes[2]
    assert len(vllm_models.LAST_KEPT) == 2  # the repeat was not encoded again
    assert answers[1].prompt == expected["blue"][1].prompt and answers[1].tokens == expected["blue"][1].tokens
    assert answers[2].tokens == answers[0].tokens == expected["red"][1].tokens


def test_a_query_agnostic_sampler_shares_the_encoder_cache(served):
    _, llm, requests, _ = served
    reconfigure(llm, {"methods": "uniform", "params": {"uniform.num_frames": 4}})
    vllm_models.LAST_KEPT.clear()
    sampling.LAST_FRAMES.clear()
    answer(llm, requests["red"])
    answer(llm, requests["blue"])
    first, second = sampling.LAST_FRAMES
    assert first["selection"].indices == second["selection"].indices == [0, 13, 26, 39]
    assert first["hash"] == second["hash"]
    assert len(vllm_models.LAST_KEPT) == 1


def test_a_sampler_composes_with_a_connect_method(served):
    """bolt+vidcom2: the chosen frames, then vidcom2's count of their grid: the prompt is stock vLLM's on the chosen
    frames with the video's placeholders cut to that count."""
    family, llm, requests, expected = served
    config = {"methods": "bolt+vidcom2", "retention": 0.5, "params": BOLT_PARAMS}
    reconfigure(llm, config)
    vllm_models.LAST_KEPT.clear()
    got = answer(llm, requests["red"], max_tokens=1)
    grid = vllm_models.LAST_KEPT[-1]["grid"]
    count = ServeConfig.from_dict(config).pipeline(family).retained_count(grid)
    assert 0 < count < grid[0] * grid[1] * grid[2]
    assert len(vllm_models.LAST_KEPT[-1]["cells"]) == count
    assert len(got.prompt) == len(expected["red"][1].prompt) - grid[0] * grid[1] * grid[2] + count


QGATE = {"q-gate.weights": (1.0, 0.0, 0.0), "q-gate.encoder": "test-colour", "q-gate.encoder_pretrained": None}
DIG = {"dig.query_type": "global", "dig.encoder": "vtc-tiny-dinov2"}


@pytest.mark.parametrize(
    "spec, params",
    [("q-gate", {**QGATE, "q-gate.num_frames": 4}), ("dig", {**DIG, "dig.num_frames": 4})],
    ids=["q-gate", "dig"],
)
def test_samplers_that_would_ask_the_model_serve_when_told_not_to(served, spec, params):
    """q-gate with a fixed gate and DIG on a global question never call the host model, so they serve: the server
    chooses what the HF backend chooses. DIG also tells the model its official 0.5-s spacing (frame numbers 0..3
    at 2 fps) instead of the true frame numbers."""
    _, llm, requests, _ = served
    reconfigure(llm, {"methods": spec, "params": params})
    sampling.LAST_FRAMES.clear()
    answer(llm, requests["red"], max_tokens=1)
    served_frames = sampling.LAST_FRAMES[-1]
    hf = sample_frames(VIDEOS[0], RED, Pipeline(spec, params=params), fps=FPS)
    assert served_frames["selection"].indices == hf.indices
    if spec == "q-gate":  # the visual-grounding expert alone: the red seconds
        assert sum(i // FPS in (6, 7) for i in hf.indices) >= 3
    else:
        assert hf.indices == [0, 13, 26, 39] and served_frames["frames"] == [0, 1, 2, 3]
    clear_caches(llm)


def test_a_request_names_its_question_and_a_prompt_without_one_is_refused(served):
    _, llm, requests, expected = served
    reconfigure(llm, BOLT)
    sampling.LAST_FRAMES.clear()
    named = dict(requests["blue"], mm_processor_kwargs={"vtc": {"question": "red"}})
    answer(llm, named, max_tokens=1)
    assert sampling.LAST_FRAMES[-1]["selection"].indices == expected["red"][0][0]
    assert sampling.LAST_FRAMES[-1]["question"] == "red"
    tokenizer = llm.get_tokenizer()
    silent = video_request(tokenizer, VIDEOS[0], "")
    with pytest.raises(Exception, match=r"question.*put the question after the video"):
        answer(llm, silent, max_tokens=1)
    clear_caches(llm)


@pytest.mark.parametrize(
    "prompt, question",
    [
        (
            "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Where is it?<|im_end|>\n"
            "<|im_start|>assistant\n",
            "Where is it?",
        ),
        (
            "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>"
            "Compare them.<|im_end|>\n<|im_start|>assistant\n",
            "Compare them.",
        ),
        ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n", None),
    ],
)
def test_each_video_s_question_is_the_text_after_it_in_its_turn(prompt, question):
    tokenizer = tiny.build_tokenizer("qwen2_5_vl", vocab_size=1024)
    tokenizer.chat_template = tiny.QWEN_CHAT_TEMPLATE
    ids = tokenizer.encode(prompt)
    video = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    count = prompt.count("<|video_pad|>")
    assert sampling.questions_of(ids, video, tokenizer, count) == [question] * count


def test_frame_budget_splits_the_overall_retention_with_the_sampler():
    from vtc.tools.bench import frame_budget

    assert frame_budget("vidcom2", 0.25, 16) == (16, 0.25)
    assert frame_budget("bolt", 0.25, 16) == (4, None)
    assert frame_budget("bolt+vidcom2", 0.25, 16) == (8, 0.5)
    assert frame_budget(None, None, 16) == (16, None)


def test_vllm_bench_shows_fewer_frames_for_a_sampler_at_the_same_tokens(tmp_path):
    """`vtc bench --backend vllm` with uniform+vidcom2 at 0.25 of 8 frames: 4 frames reach the tower, vidcom2 keeps
    half their tokens, so the prompt holds as many visual tokens as vidcom2 at 0.25 of all 8 frames."""
    from rich.console import Console

    from vtc.tools.bench_vllm import bench_vllm

    report = bench_vllm(
        methods=("vidcom2", "uniform+vidcom2"),
        retentions=(0.25,),
        frames=8,
        repeats=1,
        requests=1,
        evs=False,
        out_dir=str(tmp_path),
        console=Console(file=open(tmp_path / "out.txt", "w")),
    )
    rows = {row["method"]: row for row in report["rows"]}
    assert [rows[m]["frames_shown"] for m in ("none", "vidcom2", "uniform+vidcom2")] == [8, 8, 4]
    assert rows["uniform+vidcom2"]["prompt_tokens"] == rows["vidcom2"]["prompt_tokens"] < rows["none"]["prompt_tokens"]
    assert (tmp_path / "bench-vllm.json").exists() and "toy vision tower" in (tmp_path / "out.txt").read_text()
