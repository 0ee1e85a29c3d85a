"""Images on vLLM (Qwen2.5-VL; Qwen2-VL shares the code; then LLaVA-OneVision's anyres images; tests/test_vllm.py
runs a video + image prompt on every family): an image request and an image + video request at retention 1.0 are
stock vLLM bit for bit; at 0.25 the prompt is the text plus each item's count (the image pipeline's for the image,
each view's for a LLaVA image, whose crop rows keep their newlines); a spec that cannot reduce an image is answered
with the reason (vLLM's 4xx on a server), and "images": false lets images through whole."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import vtc
from tests.probes import record_kept_cells
from vtc.media.inputs import build_messages
from vtc.media.video import synthetic_video
from vtc.testing import tiny
from vtc.testing.fixtures import model_and_processor, prompt_inputs
from vtc.testing.serving import clear_caches, engine, reconfigure, shutdown, video_request
from vtc.vllm import models as vllm_models
from vtc.vllm.config import ServeConfig

FAMILY = "qwen2_5_vl"
OPTIONS = dict(limit_mm_per_prompt={"video": 1, "image": 2}, max_num_batched_tokens=256)


def picture(seed: int = 3, height: int = 112, width: int = 140) -> Image.Image:
    return Image.fromarray(synthetic_video(1, height, width, seed=seed)[0])


def image_request(tokenizer, images: list) -> dict:
    chat = build_messages("What is in the picture?", videos=0, images=len(images))
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return {"prompt": prompt, "multi_modal_data": {"image": images[0] if len(images) == 1 else images}}


def answer(llm, request):
    from vllm import SamplingParams

    out = llm.generate([request], SamplingParams(max_tokens=2, temperature=0.0, logprobs=5), use_tqdm=False)[0]
    first = out.outputs[0]
    return list(out.prompt_token_ids), {t: v.logprob for t, v in first.logprobs[0].items()}, list(first.token_ids)


def stock_then_vtc(tmp_path_factory, family: str, two_images: list):
    """Stock vLLM answers an image, `two_images` and a video + image; then vtc's engine (random at 1.0) takes over
    (one engine at a time) -> yields (vtc's engine, the requests, stock's answers)."""
    path = tiny.save(family, str(tmp_path_factory.mktemp("vllm-images") / family))
    stock = engine(path, **OPTIONS)
    tokenizer = stock.get_tokenizer()
    requests = {
        "one image": image_request(tokenizer, [picture()]),
        "two images": image_request(tokenizer, two_images),
        "video, image": video_request(tokenizer, synthetic_video(8, 224, 224, seed=0), "What?", images=[picture()]),
    }
    answers = {name: answer(stock, r) for name, r in requests.items()}
    shutdown(stock)
    llm = engine(path, vtc={"methods": "random", "retention": 1.0}, **OPTIONS)
    try:
        yield llm, requests, answers
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from stock_then_vtc(tmp_path_factory, FAMILY, [picture(), picture(4)])


def test_images_at_retention_1_are_stock_vllm(served):
    llm, requests, stock = served
    for name, request in requests.items():
        assert answer(llm, request) == stock[name], name


@pytest.mark.parametrize("spec", ["random", "divprune", "visionzip", "uniform+vidcom2"])
def test_each_image_keeps_the_image_pipelines_count(served, spec):
    """Each image keeps `Pipeline.for_images().retained_count(grid)` (under uniform+vidcom2 the sampler has no image
    to act on: vidcom2 takes the image's whole 0.25), and the prompt is the text plus every item's count."""
    llm, requests, stock = served
    reconfigure(llm, {"methods": spec, "retention": 0.25})
    pipeline = ServeConfig.from_dict({"methods": spec, "retention": 0.25}).pipeline(FAMILY)  # fixed counts forced
    for name, request in requests.items():
        clear_caches(llm)
        vllm_models.LAST_KEPT.clear()
        vllm_models.LAST_KEPT_IMAGES.clear()
        prompt, _, _ = answer(llm, request)
        images, videos = list(vllm_models.LAST_KEPT_IMAGES), list(vllm_models.LAST_KEPT)
        assert len(images) == (2 if name == "two images" else 1) and len(videos) == (name == "video, image")
        for kept in images:
            t, h, w = kept["grid"]
            assert t == 1 and len(kept["cells"]) == pipeline.for_images().retained_count(kept["grid"]) < h * w
        items = images + videos
        expected = len(stock[name][0]) - sum(k["grid"][0] * k["grid"][1] * k["grid"][2] for k in items)
        assert len(prompt) == expected + sum(len(k["cells"]) for k in items), name


def test_a_spec_that_cannot_reduce_an_image_is_refused_or_passes_images_whole(served):
    llm, requests, stock = served
    reconfigure(llm, {"methods": "dycoke-ttm", "retention": 0.5})
    with pytest.raises(Exception, match=r"dycoke-ttm: needs time .*\"images\": false"):
        answer(llm, requests["one image"])
    reconfigure(llm, {"methods": "dycoke-ttm", "retention": 0.5, "images": False})
    vllm_models.LAST_KEPT_IMAGES.clear()
    assert answer(llm, requests["one image"]) == stock["one image"]
    assert vllm_models.LAST_KEPT_IMAGES == []


def test_more_images_than_the_server_allows_is_vllms_own_error(served):
    """The engine allows two images per prompt (limit_mm_per_prompt): a third is refused by vLLM itself, before vtc."""
    llm, _, _ = served
    reconfigure(llm, {"methods": "random", "retention": 0.25})
    with pytest.raises(Exception, match=r"At most 2 image"):
        answer(llm, image_request(llm.get_tokenizer(), [picture(k) for k in range(3)]))


def test_sttm_connect_compresses_a_video_once_for_every_question(served):
    """STTM is query-agnostic: served as sttm-connect, a video asked about twice is compressed once (the encoder
    cache holds its compressed embeddings), and the second prompt differs from the first only by its text."""
    llm, _, _ = served
    reconfigure(llm, {"methods": "sttm-connect", "retention": 0.25})
    tokenizer = llm.get_tokenizer()
    clip = synthetic_video(8, 224, 224, seed=7)
    questions = ["What happens?", "Which colour is the square in the middle?"]
    requests = [video_request(tokenizer, clip, q) for q in questions]
    clear_caches(llm)
    vllm_models.LAST_KEPT.clear()
    first, again = (answer(llm, r)[0] for r in requests)
    assert len(vllm_models.LAST_KEPT) == 1  # compressed once, reused for the second question
    text = [len(tokenizer.encode(r["prompt"], add_special_tokens=False)) for r in requests]
    assert len(again) - len(first) == text[1] - text[0]


# --- encode methods on images (an image: a video of one temporal patch) -------------------------------------------


def half_blank_picture() -> Image.Image:
    frame = synthetic_video(1, 112, 224, seed=5)[0].copy()
    frame[:, :112] = 128
    return Image.fromarray(frame)


def hf_image_cells(monkeypatch, family: str, spec: str, retention: float, params: dict) -> list[torch.Tensor]:
    """The cells each image keeps under `vtc.patch` on the tiny HF model (the same weights as the server's)."""
    model, processor = model_and_processor(family)
    seen = record_kept_cells(monkeypatch)
    inputs = prompt_inputs(processor, [], [half_blank_picture()])
    with vtc.patch(model, spec, retention=retention, processor=processor, **params), torch.no_grad():
        model(**inputs)
    monkeypatch.undo()
    return seen


def test_encode_methods_on_images_serve_the_hf_backends_units(served, monkeypatch):
    """pixelprune (before the tower, in the prompt processor) and tome (between the tower's blocks) act on images as
    on videos: at 1.0 the image and video + image requests are stock vLLM; at 0.25 each image keeps the image
    pipeline's count, the prompt is the text plus the kept tokens, and the server keeps the units `vtc.patch` keeps
    on the same image (pixelprune's blank half loses every unit but the predictor's anchor)."""
    llm, requests, stock = served
    for spec in ("pixelprune", "tome"):
        reconfigure(llm, {"methods": spec, "retention": 1.0})
        for name in ("one image", "video, image"):
            clear_caches(llm)
            assert answer(llm, requests[name]) == stock[name], (spec, name)
    request = image_request(llm.get_tokenizer(), [half_blank_picture()])
    reconfigure(llm, {"methods": "random", "retention": 1.0})  # stock vLLM (above)
    full, _, _ = answer(llm, request)
    for spec in ("pixelprune", "tome", "pixelprune+random"):
        config = ServeConfig.from_dict({"methods": spec, "retention": 0.25})
        reconfigure(llm, config.to_dict())
        clear_caches(llm)
        vllm_models.LAST_KEPT_IMAGES.clear()
        prompt, _, _ = answer(llm, request)
        (kept,) = vllm_models.LAST_KEPT_IMAGES
        t, h, w = kept["grid"]
        assert len(kept["cells"]) == config.pipeline(FAMILY).for_images().retained_count(kept["grid"]) == 8, spec
        assert len(prompt) == len(full) - t * h * w + 8, spec
        if spec == "pixelprune+random":
            continue
        (hf,) = hf_image_cells(monkeypatch, FAMILY, spec, 0.25, config.serving_params())
        assert torch.equal(kept["cells"], hf), spec
        if spec == "pixelprune":
            assert kept["cells"][kept["cells"] % w < w // 2].tolist() == [0]


# --- LLaVA-OneVision: anyres images (a base view, then the crops packed into one grid with a newline per row) -------


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """The one image has 2 views (its crops unpadded to 21 x 27); of the two images, one has a wide crop grid, the
    other one crop."""
    yield from stock_then_vtc(tmp_path_factory, "llava_onevision", [picture(4, 160, 480), picture(5, 384, 384)])


def test_llava_images_at_retention_1_are_stock_vllm(llava):
    """Every view through the image pipeline keeps all its tokens, and the span is vLLM's own: base, crops, newlines."""
    llm, requests, stock = llava
    for name, request in requests.items():
        vllm_models.LAST_KEPT_IMAGES.clear()
        assert answer(llm, request) == stock[name], name
        views = [(k["view"], k["grid"]) for k in vllm_models.LAST_KEPT_IMAGES]
        if name == "one image":
            assert views == [("base", (1, 27, 27)), ("crops", (1, 21, 27))]
        if name == "two images":
            assert [v for v, _ in views] == ["base", "crops"] * 2 and views[1][1][2] > views[1][1][1], views


@pytest.mark.parametrize("spec", ["divprune", "visionzip", "vispruner"])
def test_each_llava_view_keeps_its_own_count_and_the_rows_keep_their_newlines(llava, spec):
    """At 0.25 the base view and the crop grid each keep the image pipeline's count for their grid; the prompt is the
    stock one less every view's dropped tokens (the newline after each crop row stays)."""
    llm, requests, stock = llava
    reconfigure(llm, {"methods": spec, "retention": 0.25})
    pipeline = ServeConfig.from_dict({"methods": spec, "retention": 0.25}).pipeline("llava_onevision").for_images()
    for name, request in requests.items():
        clear_caches(llm)
        vllm_models.LAST_KEPT_IMAGES.clear()
        vllm_models.LAST_KEPT.clear()
        prompt, _, _ = answer(llm, request)
        views = list(vllm_models.LAST_KEPT_IMAGES)
        assert len(views) == (4 if name == "two images" else 2), name
        for view in views:
            _, h, w = view["grid"]
            assert len(view["cells"]) == pipeline.retained_count(view["grid"]) <= round(0.26 * h * w), name
        items = views + list(vllm_models.LAST_KEPT)
        dropped = sum(k["grid"][0] * k["grid"][1] * k["grid"][2] - len(k["cells"]) for k in items)
        assert len(prompt) == len(stock[name][0]) - dropped, name


def test_hf_and_vllm_split_a_llava_image_alike_and_keep_the_same_tokens(llava, monkeypatch):
    """The same image through `vtc.patch` and the server: the same views (grids), and each view keeps the same cells
    under divprune (features), visionzip (the tower's attention, packed onto the crop grid as the features are) and
    tome+divprune (ToMe merging inside the tower on every view, unmerged before the projector: the prompt keeps
    divprune's count), up to a 2 % share swapped at near-ties (the two backends' towers differ in the last bits).
    ToMe at r = 0 is stock vLLM."""
    llm, requests, stock = llava
    reconfigure(llm, {"methods": "tome", "params": {"tome.r": 0}})
    clear_caches(llm)
    assert answer(llm, requests["one image"]) == stock["one image"]
    model, processor = model_and_processor("llava_onevision")
    seen = record_kept_cells(monkeypatch)
    inputs = prompt_inputs(processor, [], [picture()])
    for spec, params in (("divprune", {}), ("visionzip", {}), ("tome+divprune", {"tome.r": 8})):
        seen.clear()
        with vtc.patch(model, spec, retention=0.25, **params), torch.no_grad():
            model(**inputs)
        reconfigure(llm, {"methods": spec, "retention": 0.25, "params": params})
        clear_caches(llm)
        vllm_models.LAST_KEPT_IMAGES.clear()
        prompt, _, _ = answer(llm, requests["one image"])
        served = [(k["grid"], k["cells"]) for k in vllm_models.LAST_KEPT_IMAGES]
        assert [g for g, _ in served] == [(1, 27, 27), (1, 21, 27)] and len(seen) == 2, spec
        assert len(prompt) == len(stock["one image"][0]) - sum(27 * 27 - len(c) for (_, c) in served[:1]) - sum(
            21 * 27 - len(c) for (_, c) in served[1:]
        ), spec
        for (_, cells), hf_cells in zip(served, seen):
            swapped = set(cells.tolist()) ^ set(hf_cells.tolist())
            assert len(cells) == len(hf_cells) and len(swapped) <= 2 * max(1, len(hf_cells) // 50), spec
