"""Prompts as users send them, on the HF backend: two videos in one prompt, and a video followed by an image, on
every family; Qwen videos at a frame rate that makes seconds per temporal patch fractional. At retention 1.0 the
logits are the unpatched model's; at 0.25 each video and each image (each view of a LLaVA anyres image) is
compressed to its own `retained_count`, and on the M-RoPE families every surviving token keeps its original
(t, h, w) position while the text between and after the media keeps its own. (tests/test_images.py: image
prompts, images=False, the refusals.)"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import vtc
from tests.conftest import FAMILIES
from tests.positions_check import assert_positions_kept, video_slots
from tests.probes import connect_inputs, llm_inputs
from vtc.core.engine import grid_cells
from vtc.core.families import get_family
from vtc.media.video import synthetic_video
from vtc.testing.fixtures import model_and_processor, prompt_inputs

QWEN = tuple(f for f in FAMILIES if get_family(f).geometry.mrope)  # the M-RoPE families
SERVING = {"fixed_count": True}


def clips(family: str):
    """Two clips; the Qwen processors take videos of different sizes and lengths in one prompt, the others do not."""
    first = synthetic_video(8, 224, 224, seed=0)
    second = synthetic_video(8, 224, 224, seed=1) if family not in QWEN else synthetic_video(12, 192, 192, seed=1)
    return first, second


def picture():
    return Image.fromarray(synthetic_video(1, 112, 140, seed=3)[0])


def prompts(family: str) -> dict:
    model, processor = model_and_processor(family)
    first, second = clips(family)
    out = {
        "two videos": prompt_inputs(processor, [first, second]),
        "video, image": prompt_inputs(processor, [first], [picture()]),
    }
    if family in QWEN:
        out["3 fps"] = prompt_inputs(processor, [synthetic_video(12, 224, 224, seed=2)], fps=3)  # 2/3 s per patch
    return out


def original_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[3, L] positions of row 0 (transformers may add a leading text row)."""
    positions = position_ids[1:] if position_ids.shape[0] == 4 else position_ids
    return positions[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_several_media_in_one_prompt(family, monkeypatch):
    model, _ = model_and_processor(family)
    kept: list[torch.Tensor] = []
    original = vtc.hf.patching.connect_video

    def recording(*args, **kwargs):
        tokens, out = original(*args, **kwargs)
        kept.append(grid_cells(out).cpu())
        return tokens, out

    monkeypatch.setattr(vtc.hf.patching, "connect_video", recording)
    for name, inputs in prompts(family).items():
        with torch.no_grad():
            reference = model(**inputs).logits
            with vtc.patch(model, "random", retention=1.0):
                same = model(**inputs).logits
        assert torch.equal(same, reference), name

        _, stock_positions, _ = llm_inputs(model, inputs)
        kept.clear()
        _, positions, handle = llm_inputs(model, inputs, "vidcom2", retention=0.25, **SERVING)
        stats = handle.stats()
        assert stats.videos == (2 if name == "two videos" else 1), name
        assert stats.images == (1 if name == "video, image" else 0), name
        promised = [handle.retained_count(i.grid, i.kind) for i in stats.items]
        assert [i.tokens_out for i in stats.items] == promised == [len(k) for k in kept], name
        assert stats.llm_tokens_per_video == [i.tokens_out for i in stats.items if i.kind == "video"], name
        assert [i.kind for i in stats.items].count("image") >= stats.images and all(i.compressed for i in stats.items)
        assert len(set(stats.grids)) == stats.videos or family not in QWEN, name  # two different grids
        image_id = getattr(model.config, "image_token_id", getattr(model.config, "image_token_index", None))
        if "shared_media_token" not in get_family(family).features:  # InternVL's frames are images to the model
            assert bool(inputs["input_ids"].eq(image_id).any()) == (name == "video, image"), name
        # every item's tokens beyond its promise are gone from the prompt
        length = inputs["input_ids"].shape[1] - stats.visual_tokens_in + sum(promised)
        if family in QWEN:
            tokens = [
                model.config.image_token_id if i.kind == "image" else model.config.video_token_id for i in stats.items
            ]
            slots = [
                slot
                for token in dict.fromkeys(tokens)
                for slot in video_slots(
                    inputs["input_ids"][0], token, [i.tokens_in for i, t in zip(stats.items, tokens) if t == token]
                )
            ]
            cells = [k for token in dict.fromkeys(tokens) for k, t in zip(kept, tokens) if t == token]
            assert_positions_kept(original_positions(stock_positions), positions[:, 0], slots, cells, length)
        else:  # 1-D RoPE: vidcom2's LLaVA port renumbers the compressed prompt
            assert torch.equal(positions[0], torch.arange(length))


@pytest.mark.parametrize("family", ["qwen2_5_vl"])
def test_fractional_seconds_per_patch_reach_the_methods(family):
    """At 3 fps a temporal patch (2 frames) lasts 2/3 s: the connect stage sees those timestamps, not the whole
    M-RoPE steps (tokens_per_second x seconds, truncated) they were once read back from."""
    model, _ = model_and_processor(family)
    inputs = prompts(family)["3 fps"]
    assert inputs["second_per_grid_ts"].tolist() == pytest.approx([2 / 3])
    tokens, _ = connect_inputs(model, inputs)
    assert tokens.timestamps.tolist() == pytest.approx([k * 2 / 3 for k in range(6)])
