"""Frame-selection rules shared by several samplers: candidate frames at a fixed rate, and BOLT's inverse transform
sampling over per-frame scores (also Q-Gate's selector). Pure functions over indices and scores."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def fps_candidates(total_frames: int, video_fps: float, fps: float) -> list[int]:
    """Frames at `fps` per second (BOLT's `extract_feature.py`): `int(total / video_fps * fps)` samples, the k-th at
    frame `round(k / fps * video_fps)`, clipped to the video. A clip shorter than one sample period gets frame 0."""
    if not fps > 0:
        raise ValueError(f"the candidate rate fps must be positive, got {fps!r}")
    count = int(total_frames / video_fps * fps)
    if count < 1:
        return [0]
    ks = np.arange(0, count, 1)
    return np.clip(np.round(ks / fps * video_fps), 0, total_frames - 1).astype(int).tolist()


def inverse_transform_sampling(scores: Sequence[float], n: int, power: float = -1) -> list[int]:
    """BOLT's `inverse_transform_sampling` (`select_frames.py`): positions into `scores` of `n` draws at the
    quantiles `linspace(1/n, 1 - 1/n, n)` of the distribution `p ~ minmax(scores) ** power` (`power=-1`: no power).
    Sorted; a high-scoring stretch gets several draws, so positions repeat.

    vtc's deviations, both where the official code fails: scores that are all equal (it divides by zero) give the
    uniform distribution, and a quantile past the last cumulative value by rounding (n = 1 asks for 1.0) takes the
    last position instead of one past the end."""
    if n < 1:
        raise ValueError(f"number of frames must be at least 1, got {n}")
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or not len(s):
        raise ValueError(f"scores must be a non-empty 1-D sequence, got shape {s.shape}")
    s = s - s.min()
    if s.max() <= 0:
        s = np.ones_like(s)
    else:
        s = s / s.max()
    if power != -1:
        s = s**power
    cdf = np.cumsum(s / s.sum())
    u = np.linspace(1 / n, 1 - 1 / n, n)
    return np.minimum(np.searchsorted(cdf, u), len(s) - 1).astype(int).tolist()
