"""Images on the HF backend (`vtc.patch(..., images=True)`, the default): an image prompt on every family keeps the
unpatched logits at retention 1.0 and, at 0.25, each image item (each view of a LLaVA anyres image) its own
`retained_count(grid, "image")`; `images=False` lets images through whole and lists them; a spec that cannot reduce
an image is refused, naming why; LLaVA's crop grid keeps a newline after each row. (Video + image prompts:
tests/test_multi_media.py.)"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import vtc
import vtc.hf.patching
from tests.conftest import FAMILIES
from tests.probes import llm_inputs
from vtc.core.engine import grid_cells, video_tokens
from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context
from vtc.media.inputs import build_messages
from vtc.media.video import synthetic_video
from vtc.testing.fixtures import model_and_processor, prompt_inputs

QWEN_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def picture(height: int = 112, width: int = 140, seed: int = 3) -> Image.Image:
    return Image.fromarray(synthetic_video(1, height, width, seed=seed)[0])


def image_prompt(family: str):
    _, processor = model_and_processor(family)
    return prompt_inputs(processor, [], [picture()])


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_prompt_is_compressed_item_by_item(family):
    model, _ = model_and_processor(family)
    inputs = image_prompt(family)
    with torch.no_grad():
        reference = model(**inputs).logits
        with vtc.patch(model, "random", retention=1.0):
            assert torch.equal(model(**inputs).logits, reference)

    embeds, _, handle = llm_inputs(model, inputs, "random", retention=0.25)
    stats = handle.stats()
    assert stats.has_video and stats.videos == 0 and stats.images == 1
    views = ["base", "crops"] if family.startswith("llava") else [""]
    assert [(i.kind, i.index, i.view) for i in stats.items] == [("image", 0, v) for v in views]
    for item in stats.items:
        t, h, w = item.grid
        assert item.tokens_in == t * h * w and item.compressed
        assert item.tokens_out == handle.retained_count(item.grid, "image") == round(0.25 * item.tokens_in)
    assert stats.visual_tokens_in == sum(i.tokens_in for i in stats.items)
    assert embeds.shape[0] == inputs["input_ids"].shape[1] - stats.visual_tokens_in + stats.llm_tokens_in


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_images_false_lets_images_through_whole_and_lists_them(family):
    model, _ = model_and_processor(family)
    inputs = image_prompt(family)
    with torch.no_grad():
        reference = model(**inputs).logits
        with vtc.patch(model, "dycoke", retention=0.25, images=False) as handle:  # a temporal method: no error
            assert torch.equal(model(**inputs).logits, reference)
    stats = handle.stats()
    assert not stats.has_video and stats.images == 1 and stats.note == "images pass whole (images=False)"
    assert stats.items and all(not i.compressed and i.tokens_out == i.tokens_in for i in stats.items)
    grid = stats.items[0].grid
    assert handle.retained_count(grid, "image") == grid[0] * grid[1] * grid[2]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_generate_on_a_padded_batch_of_image_prompts(family):
    """`generate` on two left-padded prompts, one image and two images (a wide one): generate encodes the images
    before the prefill and passes the forward only their features, so vtc takes LLaVA's image sizes from that call.
    At 1.0 the tokens and scores are the unpatched model's; at 0.25 every item (every LLaVA view) keeps its count."""
    model, processor = model_and_processor(family)
    processor.tokenizer.padding_side = "left"
    chats = [build_messages("What is it?", videos=0, images=1), build_messages("Compare them.", videos=0, images=2)]
    texts = [processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    pictures = [picture(seed=1), picture(160, 480, seed=2), picture(seed=3)]
    inputs = processor(text=texts, images=pictures, return_tensors="pt", padding=True)
    options = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        stock = model.generate(**inputs, **options)
        with vtc.patch(model, "visionzip", retention=1.0):
            same = model.generate(**inputs, **options)
        with vtc.patch(model, "visionzip", retention=0.25) as handle:
            out = model.generate(**inputs, **options)
    assert torch.equal(same.sequences, stock.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(same.scores, stock.scores))
    items = handle.stats().items
    assert [(i.batch, i.index) for i in items if i.view != "crops"] == [(0, 0), (1, 1), (1, 2)]
    assert all(i.tokens_out == handle.retained_count(i.grid, "image") < i.tokens_in for i in items)
    assert out.sequences.shape == stock.sequences.shape


def test_llava_crop_grid_keeps_each_rows_newline():
    """The packed crops are one item whose rows end with the model's newline token: kept tokens return to their own
    rows (positions `keep`: each token's original index), so every newline still closes the row it closed."""
    model, _ = model_and_processor("llava_onevision")
    inputs = image_prompt("llava_onevision")
    stock, _, _ = llm_inputs(model, inputs)
    embeds, positions, handle = llm_inputs(model, inputs, "random", retention=0.25, positions="keep")
    original = positions[0]
    assert bool((original[1:] > original[:-1]).all())  # the prompt's order, with gaps where tokens left
    newline = model.model.image_newline.to(stock.dtype)
    at = lambda e: torch.nonzero((e == newline).all(-1)).flatten()  # noqa: E731
    assert torch.equal(original[at(embeds)], at(stock))  # every newline, at its own original index
    crops = next(i for i in handle.stats().items if i.view == "crops")
    assert at(stock).numel() == crops.grid[1]  # one per crop row (the base view of a split image has none)


def test_a_known_answer_image_loses_its_blank_half_first():
    """divprune on one image (grid (1, 4, 8)) whose left half is blank (one repeated feature): greedy max-min
    diversity keeps at most one blank token while distinct ones remain."""
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 4, 8, 16, generator=g)
    embeds[:, :, :4] = torch.randn(16, generator=g)  # the blank left half
    tokens = video_tokens(embeds.reshape(32, 16), (1, 4, 8), mrope=True)
    pipeline = Pipeline("uniform+divprune", retention=0.5, family="qwen2_5_vl").for_images()
    assert pipeline.names() == ["divprune"]  # the sampler has no image to act on: divprune takes the whole 0.5
    out = pipeline.run_connect(tokens, Context(retention=0.5, family="qwen2_5_vl", media="image"), None)
    cols = grid_cells(out) % 8
    assert len(out) == 16 and int((cols < 4).sum()) <= 1


@pytest.mark.parametrize(
    ("spec", "videos", "message"),
    [
        ("dycoke", 0, "dycoke: needs time"),
        ("uniform", 0, "uniform: samples the frames of videos"),
        ("divprune+framefusion", 1, "framefusion acts inside the LLM"),
    ],
)
def test_a_spec_that_cannot_reduce_an_image_is_refused(spec, videos, message):
    model, processor = model_and_processor("qwen2_vl")
    clips = [synthetic_video(4, 112, 112, seed=0)] * videos
    inputs = prompt_inputs(processor, clips, [picture()])
    with vtc.patch(model, spec, retention=0.5), pytest.raises(ValueError, match=message) as err:
        with torch.no_grad():
            model(**inputs)
    assert "images=False" in str(err.value)


def test_images_must_be_a_bool():
    model, _ = model_and_processor("qwen2_vl")
    with pytest.raises(ValueError, match="images must be True"):
        vtc.patch(model, "random", retention=0.5, images="yes")


# --- encode methods on images (Qwen families: an image is a video of one temporal patch) -------------------------


def half_blank_picture() -> Image.Image:
    """224 x 112 px: a flat grey left half, a moving-square clip frame on the right (the Qwen processors keep the
    size, so the boundary falls between merge units)."""
    frame = synthetic_video(1, 112, 224, seed=5)[0].copy()
    frame[:, :112] = 128
    return Image.fromarray(frame)


def recorded_survivors(monkeypatch) -> list[tuple[str, torch.Tensor | None]]:
    """(media, survivors the encode stage handed the connect stage) of every item, as the prefill runs it."""
    seen: list[tuple[str, torch.Tensor | None]] = []
    original = vtc.hf.patching.connect_video

    def recording(*args, **kwargs):
        seen.append((kwargs["ctx"].media, kwargs.get("survivors")))
        return original(*args, **kwargs)

    monkeypatch.setattr(vtc.hf.patching, "connect_video", recording)
    return seen


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_pixelprune_on_an_image_keeps_the_official_units_and_drops_its_blank_half(family, monkeypatch):
    """pixelprune with no retention (the official adaptive rule, tau = 0) on an image keeps exactly the units
    `pixelprune_keep` (the official Pred2DSelector over the processor's pixels) keeps; of the flat left half only the
    predictor's anchor survives. At retention 1.0 pixelprune and tome leave the model's logits unchanged."""
    from plugins.pixelprune import pixelprune_keep

    model, processor = model_and_processor(family)
    inputs = prompt_inputs(processor, [], [half_blank_picture()])
    vision = model.config.vision_config
    assert processor.image_processor.image_mean == processor.video_processor.image_mean  # one normalisation
    assert processor.image_processor.image_std == processor.video_processor.image_std
    mean, std = processor.image_processor.image_mean, processor.image_processor.image_std
    reference = pixelprune_keep(
        inputs["pixel_values"], inputs["image_grid_thw"], mean, std, vision.temporal_patch_size, vision.patch_size
    ).indices
    seen = recorded_survivors(monkeypatch)
    with vtc.patch(model, "pixelprune", processor=processor) as handle, torch.no_grad():
        model(**inputs)
    ((media, survivors),) = seen
    (item,) = handle.stats().items
    _, h, w = item.grid
    assert media == "image" and torch.equal(survivors, reference) and item.tokens_out == len(reference) < h * w
    left = survivors[survivors % w < w // 2]
    assert left.tolist() == [0]  # the anchor: every other unit of the flat half is its own prediction

    with torch.no_grad():
        stock = model(**inputs).logits
        for spec in ("pixelprune", "tome"):
            with vtc.patch(model, spec, retention=1.0):
                assert torch.equal(model(**inputs).logits, stock), spec


@pytest.mark.parametrize("spec", ["tome", "pixelprune+random", "tome+divprune"])
def test_encode_methods_compress_every_image_and_video_of_a_prompt_to_its_count(spec):
    """A video and an image in one prompt (Qwen2.5-VL): the encode methods act on both, and each item reaches the
    LLM with its own count (`retained_count(grid, kind)`, tome's round(r * n) per frame); the LLM's sequence is the
    text plus the kept tokens."""
    model, processor = model_and_processor("qwen2_5_vl")
    inputs = prompt_inputs(processor, [synthetic_video(4, 112, 112, seed=0)], [half_blank_picture()])
    embeds, _, handle = llm_inputs(model, inputs, spec, retention=0.25)
    stats = handle.stats()
    assert [i.kind for i in stats.items] == ["video", "image"]
    encode = [s for s in stats.stages if s.stage == "encode"]
    assert len(encode) == 2 and {s.tokens_in for s in encode} == {i.tokens_in for i in stats.items}
    for item in stats.items:
        assert item.tokens_out == handle.retained_count(item.grid, item.kind) < item.tokens_in, item
    assert embeds.shape[0] == inputs["input_ids"].shape[1] - stats.visual_tokens_in + stats.llm_tokens_in


@pytest.mark.parametrize("family", ["llava_onevision", "llava_next_video"])
def test_tome_merges_inside_the_tower_on_every_view_of_a_llava_image(family):
    """ToMe on a LLaVA image: every view is one image to ToMe (each block up to the feature layer merges r of its
    tokens), and the views are unmerged before the projector, so the packed image reaches the LLM whole (tower
    compute only). At r = 0 the logits are the unpatched model's; beside divprune each view keeps divprune's count."""
    from vtc.hf.adapters.base import tower_feature_layer

    model, _ = model_and_processor(family)
    inputs = image_prompt(family)
    with torch.no_grad():
        stock = model(**inputs).logits
        with vtc.patch(model, "tome", **{"tome.r": 0}):
            assert torch.equal(model(**inputs).logits, stock)
        with vtc.patch(model, "tome", **{"tome.r": 8}) as handle:
            merged = model(**inputs).logits
    stats = handle.stats()
    views = stats.items[0].tokens_in // (stats.items[0].grid[1] * stats.items[0].grid[2])  # base view: 1
    layers = len(vtc.api.resolve_adapter(model).vision_encoder_layers())
    blocks = tower_feature_layer(model.config.vision_feature_layer, layers) + 1
    report = stats.reports["tome"]
    side = model.config.vision_config.image_size // model.config.vision_config.patch_size
    crops = sum(1 for i in stats.items if i.view == "crops")
    assert views == 1 and crops == 1
    n_views = report["tower_tokens_in"][0] // (side * side + (family == "llava_next_video"))  # CLIP's class token
    assert n_views >= 2 and report["tower_tokens_out"][0] == report["tower_tokens_in"][0] - 8 * blocks * n_views
    assert all(i.tokens_out == i.tokens_in for i in stats.items) and merged.shape == stock.shape
    assert not torch.equal(merged, stock)

    embeds, _, handle = llm_inputs(model, inputs, "tome+divprune", retention=0.25, **{"tome.r": 8})
    items = handle.stats().items
    assert all(i.tokens_out == handle.retained_count(i.grid, "image") < i.tokens_in for i in items)
