"""Cached offline fixtures: tiny random-weight models of every family, two generated clips, processor inputs.

    model, processor = model_and_processor("qwen2_vl")          # built once per process, no download
    inputs = single_inputs("qwen2_vl")                           # one clip and question, 8 frames
    batch = batch_inputs("qwen2_vl")                             # two clips of different sizes, left-padded

The clips (`vtc.media.video.synthetic_video`) have moving shapes, scene cuts and static stretches, so
similarity-driven methods have real structure to find. Everything is built with a fixed seed.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from vtc.api import prepare_inputs
from vtc.core.families import family_names
from vtc.hf.adapters import resolve_adapter
from vtc.media.demo_encoders import register_tiny_clip, register_tiny_dinov2, tiny_dinov2_path  # noqa: F401
from vtc.media.inputs import SampledVideo, build_messages, processor_video_kwargs
from vtc.media.video import VideoSource, synthetic_video
from vtc.testing import tiny

QUESTIONS = ("What happens in this video?", "How many objects are visible in the whole clip, and which one moves?")
NUM_FRAMES = 8


def __getattr__(name: str):
    # `FAMILIES`: every registered family (`vtc.core.families.family_names()`), asked of the registry on use
    if name == "FAMILIES":
        return family_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# the models `model_and_processor` shares between tests (a test that leaves one patched breaks the tests after it)
SHARED_MODELS: weakref.WeakSet = weakref.WeakSet()


@functools.lru_cache(maxsize=None)
def model_and_processor(family: str, dtype: torch.dtype = torch.float32, size: str = "tiny"):
    """A tiny random-weight model of `family` and its processor (built once per process)."""
    model, processor = tiny.build(family, size=size, dtype=dtype)
    SHARED_MODELS.add(model)
    return model, processor


@functools.lru_cache(maxsize=None)
def videos():
    """Two clips of different sizes (so a batch needs padding), [T, H, W, 3] uint8."""
    return synthetic_video(32, 224, 224, seed=0), synthetic_video(24, 160, 200, seed=1)


@functools.lru_cache(maxsize=None)
def single_inputs(family: str, which: int = 0):
    _, processor = model_and_processor(family)
    return prepare_inputs(processor, videos()[which], QUESTIONS[which], num_frames=NUM_FRAMES, fps=8)


@functools.lru_cache(maxsize=None)
def batch_inputs(family: str):
    _, processor = model_and_processor(family)
    return prepare_inputs(processor, list(videos()), list(QUESTIONS), num_frames=NUM_FRAMES, fps=8)


@functools.lru_cache(maxsize=None)
def mixed_inputs(family: str):
    """One prompt with a video (NUM_FRAMES frames of the first clip) and then an image (a frame of the second clip,
    resized to 112 x 140): what the matrix sends to check images beside videos."""
    from PIL import Image

    _, processor = model_and_processor(family)
    clip = videos()[0][:: len(videos()[0]) // NUM_FRAMES][:NUM_FRAMES]
    picture = Image.fromarray(videos()[1][0]).resize((140, 112))
    return prompt_inputs(processor, [clip], [picture])


def prompt_inputs(processor, videos: list[Any], images: list[Any] = (), question: str = QUESTIONS[0], fps: float = 8):
    """Processor inputs of ONE prompt holding several videos ([T, H, W, 3] uint8 each, all frames used), then
    `images` (PIL), then the question: what a user sends when a prompt compares clips or adds a picture (no videos:
    an image prompt)."""
    chat = build_messages(question, videos=len(videos), images=len(images))
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    sampled = [SampledVideo(v, list(range(len(v))), VideoSource.open(v, fps=fps)) for v in videos]
    extra = {"images": list(images)} if images else {}
    if videos:
        extra.update(videos=list(videos), **processor_video_kwargs(processor, sampled))
    return processor(text=[text], return_tensors="pt", **extra)


def token_grids(model: torch.nn.Module, inputs: Any) -> list[tuple[int, int, int]]:
    """The token grid (T, H, W) of every video in `inputs`, read from the processor outputs alone (no forward),
    as a serving frontend sizes its placeholders."""
    adapter = resolve_adapter(model)
    captured = adapter.capture(inputs["input_ids"], inputs.get("attention_mask"), dict(inputs))
    return [span.grid for span in adapter.video_spans(captured)]
