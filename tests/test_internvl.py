"""InternVL (the sixth family, declared in one file: vtc/hf/adapters/internvl.py): frames are one-tile images behind
`FrameK: ` labels, so the adapter finds each video's frames among the image runs; images pass whole; retention 1.0
is the unpatched model exactly; compressed videos keep the counts their methods promise; vision statistics arrive
on the token grid; a method reading a statistic InternVL does not offer is refused at vtc.patch."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import vtc
from vtc.core.families import get_family
from vtc.core.vision_stats import VisionStat
from vtc.hf.adapters import resolve_adapter
from vtc.hf.adapters.internvl import InternVLAdapter, video_chains
from vtc.hf.vision import VisionCapture
from vtc.media.inputs import build_messages
from vtc.media.video import synthetic_video, uniform_indices
from vtc.testing.fixtures import batch_inputs, model_and_processor, prompt_inputs, single_inputs

FAMILY = "internvl"


def spans_of(inputs):
    model, _ = model_and_processor(FAMILY)
    adapter = resolve_adapter(model)
    return adapter.video_spans(adapter.capture(inputs["input_ids"], inputs.get("attention_mask"), dict(inputs)))


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_the_family_record():
    family = get_family(FAMILY)
    model, processor = model_and_processor(FAMILY)
    assert isinstance(resolve_adapter(model), InternVLAdapter)
    assert family.model_classes == ("InternVLForConditionalGeneration",)
    assert type(processor).__name__ in family.processor_classes and family.frame_rule == "middle"
    assert vtc.media.inputs.processor_family(processor) == FAMILY
    assert uniform_indices(32, 8, family.frame_rule) == [1, 5, 9, 13, 17, 20, 24, 28]
    assert not family.geometry.mrope and not family.geometry.has_prepool_grid
    assert {"mrope", "merge_units", "patch_grid", "prepool"}.isdisjoint(family.features)
    assert set(family.media_kwargs) >= {"pixel_values", "mm_encoder_outputs"}


def test_frames_are_found_among_the_image_runs():
    """One video per prompt row, each frame its own run (written back in place), the pixel rows of its frames."""
    (span,) = spans_of(single_inputs(FAMILY))
    assert span.grid == (8, 8, 8) and span.num_tokens == 512
    ids = single_inputs(FAMILY)["input_ids"][0]
    model, _ = model_and_processor(FAMILY)
    assert bool((ids[span.seq_index] == model.config.image_token_id).all())
    assert span.frame_slot.tolist() == span.seq_index[::64].tolist()
    assert span.media_rows.tolist() == list(range(8))
    batch = spans_of(batch_inputs(FAMILY))
    assert [(s.batch, s.grid) for s in batch] == [(0, (8, 8, 8)), (1, (8, 8, 8))]
    assert batch[1].media_rows.tolist() == list(range(8, 16))


def test_two_videos_an_image_and_long_videos_in_one_prompt():
    _, processor = model_and_processor(FAMILY)
    # one processor call takes videos of one length only (it stacks their frames)
    first, second = synthetic_video(12, 224, 224, seed=0), synthetic_video(12, 160, 200, seed=1)
    wide = Image.fromarray(synthetic_video(1, 224, 448, seed=3)[0])  # several tiles: an image, whole
    square = Image.fromarray(synthetic_video(1, 96, 96, seed=4)[0])  # one tile, like a frame: whole too
    two = spans_of(prompt_inputs(processor, [first, second]))
    assert [s.grid[0] for s in two] == [12, 12]  # Frame10.. stay in their video; Frame1 again starts the next
    mixed = prompt_inputs(processor, [second], [wide, square])
    (span,) = spans_of(mixed)
    tiles = mixed["pixel_values"].shape[0]
    assert span.grid[0] == 12 and span.media_rows.tolist() == list(range(12)) and tiles > 12 + 2
    chat = build_messages("Which is wider?", videos=0, images=2)
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert spans_of(processor(text=[text], images=[wide, square], return_tensors="pt")) == []
    # the rule on bare token ids: runs of 4 tokens, labels of 3 tokens between </img> (8) and <img> (7)
    label = lambda k: [8, 5, k, 6, 7]  # noqa: E731
    ids = [1, 2, 5, 1, 6, 7] + [9] * 4 + label(2) + [9] * 4 + label(1) + [9] * 4 + label(2) + [9] * 4 + [8, 7] + [9] * 4
    chains = video_chains(torch.tensor(ids), 9, 4)
    assert [[s for s, _ in chain] for chain in chains] == [[6, 15], [24, 33]]  # the last run (no label) is an image


def test_identity_at_full_retention_and_images_tile_by_tile():
    """A video and an image of several tiles (each tile a frame of the image item): identity at 1.0; at 0.25 the video
    and every tile keep their own quarter; with images=False the image passes whole."""
    model, processor = model_and_processor(FAMILY)
    inputs = prompt_inputs(processor, [synthetic_video(8, 224, 224, seed=0)], [Image.new("RGB", (448, 224))])
    batch = batch_inputs(FAMILY)
    reference, batch_reference = logits(model, inputs), logits(model, batch)
    image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum()) - 512
    tiles = image_tokens // 64
    with vtc.patch(model, "random", retention=1.0) as handle:
        assert torch.equal(logits(model, inputs), reference)
        assert handle.stats().visual_tokens_in == handle.stats().visual_tokens_out == 512 + image_tokens
        assert torch.equal(logits(model, batch), batch_reference)
    with vtc.patch(model, "random", retention=0.25) as handle:
        logits(model, inputs)
        stats = handle.stats()
    assert tiles >= 2 and [(i.kind, i.grid) for i in stats.items] == [("video", (8, 8, 8)), ("image", (tiles, 8, 8))]
    assert stats.llm_tokens_per_video == [128] and handle.retained_count((8, 8, 8)) == 128
    assert stats.items[1].tokens_out == handle.retained_count((tiles, 8, 8), "image") == tiles * 16
    assert stats.sequence_out == inputs["input_ids"].shape[1] - 512 + 128 - image_tokens + tiles * 16
    with vtc.patch(model, "random", retention=0.25, images=False) as handle:
        logits(model, inputs)
        stats = handle.stats()
    assert stats.llm_tokens_in == 128 and not stats.items[1].compressed
    assert stats.sequence_out == inputs["input_ids"].shape[1] - 512 + 128


@pytest.mark.parametrize("spec,kept", [("divprune", 2 * 128), ("visionzip", 2 * 16 * 8)])
def test_methods_keep_their_counts(spec, kept):
    model, _ = model_and_processor(FAMILY)
    if spec not in vtc.registry():
        pytest.skip(f"{spec} is not registered")
    batch = batch_inputs(FAMILY)
    with vtc.patch(model, spec, retention=0.25) as handle:
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
        stats = handle.stats()
    assert out.shape[1] == batch["input_ids"].shape[1] + 3
    assert stats.llm_tokens_per_video == [kept // 2, kept // 2] and stats.visual_tokens_out == kept


def test_vision_statistics_arrive_on_the_token_grid():
    """CLS dropped, each 2 x 2 pixel-shuffle unit averaged: [T, H*W] like the Qwen families."""
    model, _ = model_and_processor(FAMILY)
    adapter = resolve_adapter(model)
    inputs = single_inputs(FAMILY)
    stats = {VisionStat("received", -1), VisionStat("keys", 0)}
    capture = VisionCapture(adapter, stats)
    capture.install()
    try:
        logits(model, inputs)
        (per_video,) = capture.video_stats(spans_of(inputs))
        assert not capture.calls  # consumed
    finally:
        capture.remove()
    received, keys = per_video[VisionStat("received", -1)], per_video[VisionStat("keys", 0)]
    assert received.shape == (8, 64) and keys.shape == (8, 64, 16)
    assert bool((received > 0).all()) and torch.isfinite(keys).all()


def test_a_method_reading_a_statistic_internvl_lacks_is_refused():
    model, _ = model_and_processor(FAMILY)
    if "fastvid" not in vtc.registry():
        pytest.skip("fastvid is not registered")
    with pytest.raises(ValueError, match=r"'fastvid' reads the vision-tower statistic\(s\) mean_query on internvl"):
        vtc.patch(model, "fastvid", retention=0.25)
    assert not any(m._forward_pre_hooks for m in model.modules())  # refused before any hook stayed


def test_streams_are_refused():
    """The processor numbers frame labels per call (`Frame1:` again in every chunk), so a stream of chunks is not
    the whole-video prompt: vtc.stream refuses the family (it lacks the 'streaming' feature)."""
    model, processor = model_and_processor(FAMILY)
    assert "streaming" not in get_family(FAMILY).features
    with pytest.raises(ValueError, match="vtc.stream does not support internvl"):
        vtc.stream(model, processor)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_the_conformance_command_runs_a_familys_matrix(capsys):
    """`python -m vtc.testing.conformance --family internvl` (docs/add-a-family.md), narrowed to one case here."""
    from vtc.testing import conformance

    assert conformance.main(["--family", FAMILY, "--method", "random", "--check", "retention"]) == 0
    assert "ok   retention-random-internvl" in capsys.readouterr().out
    # FastVID reads a statistic InternVL lacks: it is not part of the family's matrix
    assert "fastvid" not in {case.method for case in conformance.cases(families=[FAMILY])}
    with pytest.raises(SystemExit):
        conformance.main(["--family", "nope"])
    assert "unknown family nope; known families:" in capsys.readouterr().err
