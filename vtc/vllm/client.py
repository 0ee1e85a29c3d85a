"""Client helpers: send frames to a vLLM server as an OpenAI `video_url` content part."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from vtc.media.video import encode_video


def video_data_url(frames: np.ndarray, fps: int = 8) -> str:
    """Frames [T, H, W, 3] uint8 as an MP4 (`vtc.media.video.encode_video`) in a `data:video/mp4;base64,` URL."""
    return "data:video/mp4;base64," + base64.b64encode(encode_video(frames, fps)).decode()


def video_message(frames: np.ndarray, question: str, fps: int = 8) -> dict[str, Any]:
    """One user chat message with the video then the question."""
    return {
        "role": "user",
        "content": [
            {"type": "video_url", "video_url": {"url": video_data_url(frames, fps)}},
            {"type": "text", "text": question},
        ],
    }


def select_frames(
    frames: np.ndarray,
    question: str,
    keep: int,
    clip_model: str = "ViT-B-32",
    clip_pretrained: str | None = "openai",
    weight_scale: tuple[float, float] = (100.0, 2.0),
) -> tuple[np.ndarray, list[int], list[float]]:
    """Query-aware frame selection where the question is known: on the client, before the request.

    QuoTA's frame relevance (its CLIP scorer, as `quota-clip`: P("relevant to the question") per frame, weighted
    w = (scale * p) ** power) ranks `frames` [T, H, W, 3]; the `keep` most relevant frames are returned in time
    order, with their indices and weights. A vLLM server cannot run QuoTA itself: it caches encoder outputs per
    video across questions, and QuoTA's per-frame token budgets depend on the question. Sending only the frames
    that matter is what a server can use; the connect method the server runs then compresses those frames.
    """
    from vtc_plugins.quota import clip_yes_probabilities, frame_weights, load_clip

    if not 0 < keep <= len(frames):
        raise ValueError(f"keep must be in [1, {len(frames)}] (the number of frames given), got {keep}")
    clip, preprocess, tokenizer = load_clip(clip_model, clip_pretrained)
    weights = frame_weights(clip_yes_probabilities(clip, preprocess, tokenizer, frames, question, []), *weight_scale)
    order = sorted(range(len(frames)), key=lambda i: (-weights[i], i))[:keep]
    indices = sorted(order)
    return frames[indices], indices, [weights[i] for i in indices]
