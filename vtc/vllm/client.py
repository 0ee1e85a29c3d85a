"""Client helpers: send frames to a vLLM server as an OpenAI `video_url` content part."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np


def video_data_url(frames: np.ndarray, fps: int = 8) -> str:
    """Frames [T, H, W, 3] uint8 as an MP4 (MPEG-4 part 2, encoded with PyAV) in a `data:video/mp4;base64,` URL."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buffer.getvalue()).decode()


def video_message(frames: np.ndarray, question: str, fps: int = 8) -> dict[str, Any]:
    """One user chat message with the video then the question."""
    return {
        "role": "user",
        "content": [
            {"type": "video_url", "video_url": {"url": video_data_url(frames, fps)}},
            {"type": "text", "text": question},
        ],
    }
