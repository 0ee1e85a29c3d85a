"""Frame-selection rules shared by several samplers: candidate frames at a fixed rate, BOLT's inverse transform
sampling over per-frame scores (also Q-Gate's selector), and DIG's CAFS scene cuts (its candidates, its 60-s
chunks and its `find_peaks` rule; also InfoShot's shot partition). Pure functions over indices, scores and
features. scipy is needed by `scene_cuts` only, and imported there."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch


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


# --- DIG's CAFS scene cuts (Jialuo-Li/DIG pipeline/cafs.py::get_r_frames, ffe6d25) ----------------------------------
def cafs_candidates(total_frames: int, video_fps: float, per_second: float = 2) -> list[int]:
    """DIG's candidate frames: `linspace(0, T - 1, int(T / video_fps) * per_second, dtype=int)` (whole seconds of
    video times the rate; truncated, so a video slower than `per_second` repeats frames, as the official code does).

    vtc's deviation, where the official code has nothing: a clip shorter than one second (no candidates there)
    counts as one second, `per_second` frames spread over it (at most all of its frames)."""
    if not per_second > 0:
        raise ValueError(f"the candidate rate must be positive, got {per_second!r}")
    if total_frames < 1:
        raise ValueError(f"a video has at least one frame, got {total_frames}")
    count = int(int(total_frames / video_fps) * per_second)
    if count < 1:
        count = max(1, min(total_frames, int(per_second)))
    return np.linspace(0, total_frames - 1, count, dtype=int).tolist()


def cafs_chunks(candidates: Sequence[int], total_frames: int, video_fps: float, seconds: float = 60) -> list[list[int]]:
    """DIG's chunks, as positions into `candidates`: the frame range is cut into `ceil(int(T / video_fps) / seconds)`
    equal segments at `linspace(0, T - 1, n + 1, dtype=int)` (so a 90-s video gives two 45-s chunks, not 60 + 30),
    and a candidate belongs to the segment `[start, end)` it falls in (the last segment includes its end). Empty
    chunks are dropped (the official loop skips them). A video shorter than one chunk is one chunk, and so is one
    shorter than a second (official: no chunk, and no candidates either)."""
    frames = np.asarray(candidates, dtype=np.int64)
    count = math.ceil(int(total_frames / video_fps) / seconds)
    if count < 1:
        return [list(range(len(frames)))] if len(frames) else []
    edges = np.linspace(0, total_frames - 1, count + 1, dtype=int)
    chunks = []
    for i, (start, end) in enumerate(zip(edges[:-1], edges[1:])):
        inside = (frames >= start) & ((frames <= end) if i == count - 1 else (frames < end))
        positions = np.flatnonzero(inside).tolist()
        if positions:
            chunks.append(positions)
    return chunks


def scene_cuts(features, chunks: Sequence[Sequence[int]] | None = None, prominence: float = 0.1) -> list[int]:
    """Positions p (into `features`, [n, D] frame features in time order) after which a new scene starts: within each
    chunk, `d_i = 1 - cos(f_i, f_{i+1})` of consecutive frames and `scipy.signal.find_peaks(d, prominence=...)`;
    a peak at i is the cut p = i, the earlier frame of the pair (official: `chunk_indices[peaks]`), so the next scene
    starts at p + 1. No change is measured across a chunk edge (the official code encodes and compares each chunk on
    its own), a flat peak gives one cut (scipy: its middle, rounded down), and the first and last difference of a
    chunk are never peaks. `chunks`: lists of positions (`cafs_chunks`); None = one chunk. Sorted, in chunk order.

    DIG's shot `boundaries` are `[0] + [candidates[p] for p in cuts] + [T - 1]` (`scene_boundaries`)."""
    try:
        from scipy.signal import find_peaks
    except ImportError as err:
        raise ImportError("scene cuts (DIG's CAFS rule) need scipy: pip install 'vtc[samplers]'") from err
    feats = torch.as_tensor(np.asarray(features), dtype=torch.float32)
    if feats.ndim != 2:
        raise ValueError(f"features must be [frames, dim], got shape {tuple(feats.shape)}")
    cuts: list[int] = []
    for chunk in [range(len(feats))] if chunks is None else chunks:
        positions = list(chunk)
        if len(positions) < 2:
            continue
        f = feats[positions]
        diffs = 1 - torch.nn.functional.cosine_similarity(f[:-1], f[1:], dim=1)
        peaks, _ = find_peaks(diffs.numpy(), prominence=prominence)
        cuts.extend(positions[int(p)] for p in peaks)
    return cuts


def scene_boundaries(candidates: Sequence[int], cuts: Sequence[int], total_frames: int) -> list[int]:
    """DIG's `boundaries`: frame 0, the cut frames (`candidates[p]` for each cut position), and the last frame."""
    return [0] + [int(candidates[p]) for p in cuts] + [total_frames - 1]
