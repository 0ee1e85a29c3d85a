"""Client helpers: send frames (and images) to a vLLM server as OpenAI content parts, ask for a request's own vtc
settings, and choose frames against the question where it is known (`select_frames`)."""

from __future__ import annotations

import base64
import io
from typing import Any, Sequence

import numpy as np

from vtc.media.relevance import clip_yes_probabilities, frame_weights, load_clip
from vtc.media.video import encode_video


def video_data_url(frames: np.ndarray, fps: int = 8) -> str:
    """Frames [T, H, W, 3] uint8 as an MP4 (`vtc.media.video.encode_video`) in a `data:video/mp4;base64,` URL."""
    return "data:video/mp4;base64," + base64.b64encode(encode_video(frames, fps)).decode()


def image_data_url(image: Any) -> str:
    """A PIL image, or an [H, W, 3] uint8 array, as a PNG in a `data:image/png;base64,` URL."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def video_message(
    frames: np.ndarray | Sequence[np.ndarray], question: str, fps: int = 8, images: Sequence[Any] = ()
) -> dict[str, Any]:
    """One user chat message: the video (or several, a list of frame arrays; none: `[]`), then `images`, then the
    question. The server compresses each video and each image to its own count (images: unless it runs with
    `"images": false`)."""
    videos = [frames] if isinstance(frames, np.ndarray) else list(frames)
    content: list[dict[str, Any]] = [
        {"type": "video_url", "video_url": {"url": video_data_url(v, fps)}} for v in videos
    ]
    content += [{"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in images]
    return {"role": "user", "content": content + [{"type": "text", "text": question}]}


def image_message(images: Sequence[Any], question: str) -> dict[str, Any]:
    """One user chat message with images only (PIL images or [H, W, 3] uint8 arrays), then the question."""
    return video_message([], question, images=images)


def request_settings(
    retention: float | None = None, params: dict[str, Any] | None = None, seed: int | None = None
) -> dict[str, Any]:
    """`extra_body` for one request with its own vtc settings (the server's for whatever is left out):
    `client.chat.completions.create(..., extra_body=request_settings(retention=0.5))`. The server checks them
    (its `retention_range`, its methods' parameters) and answers HTTP 400 naming what it allows."""
    settings: dict[str, Any] = {}
    if retention is not None:
        settings["retention"] = retention
    if params:
        settings["params"] = dict(params)
    if seed is not None:
        settings["seed"] = seed
    return {"mm_processor_kwargs": {"vtc": settings}}


def select_frames(
    frames: np.ndarray,
    question: str,
    keep: int,
    clip_model: str = "ViT-B-32",
    clip_pretrained: str | None = "openai",
    weight_scale: tuple[float, float] = (100.0, 2.0),
) -> tuple[np.ndarray, list[int], list[float]]:
    """Query-aware frame selection where the question is known: on the client, before the request.

    QuoTA's frame relevance (its CLIP scorer, as `quota-clip`; `vtc.media.relevance`: P("relevant to the
    question") per frame, weighted w = (scale * p) ** power) ranks `frames` [T, H, W, 3]; the `keep` most relevant
    frames are returned in time order, with their indices and weights. A vLLM server cannot run QuoTA itself: it
    caches encoder outputs per video across questions, and QuoTA's per-frame token budgets depend on the question.
    Sending only the frames that matter is what a server can use; the connect method the server runs then
    compresses those frames.
    """
    if not 0 < keep <= len(frames):
        raise ValueError(f"keep must be in [1, {len(frames)}] (the number of frames given), got {keep}")
    clip, preprocess, tokenizer = load_clip(clip_model, clip_pretrained)
    weights = frame_weights(clip_yes_probabilities(clip, preprocess, tokenizer, frames, question, []), *weight_scale)
    order = sorted(range(len(frames)), key=lambda i: (-weights[i], i))[:keep]
    indices = sorted(order)
    return frames[indices], indices, [weights[i] for i in indices]
