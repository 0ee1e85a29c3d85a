"""InfoShot: "Shot-Aware Frame Sampling for Video Understanding" (arXiv 2603.17374, 2026). Abstract only: the
repository `mengyu02/InfoShot` holds a one-line readme, so this is vtc's reading of the abstract
(`from-abstracts.md` §3), not a port.

Cut the video into shots, fit the number of shots to half the frame budget (merge the most similar neighbours,
split the longest shot where it changes most), then take two frames from each shot: the one nearest the shot's mean
embedding (its main content) and the one farthest from it relative to the shot's spread (its most unusual moment,
the highest self-information under a per-shot isotropic Gaussian). Query-agnostic. Stage: sample.

vtc's readings of what the abstract leaves open (each marked on docs/methods/infoshot.md):
- candidates at 2 fps, DINOv2 features averaged over every output token, and DIG's CAFS cut rule
  (`find_peaks(1 - cos, prominence=0.1)` in 60-s chunks; `vtc.media.frame_selection.scene_cuts`);
- S = floor(K / 2) shots, merged / split as above;
- representative = argmin ||e - mu||, deviation frame = argmax ||e - mu||^2 / (sigma^2 + 1e-6);
- a one-frame shot gives one frame; spare slots go to the highest normalised deviations anywhere.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

import vtc
from vtc.media.encoders import frame_features, image_encoder
from vtc.media.frame_selection import cafs_candidates, cafs_chunks, scene_cuts

EPS = 1e-6  # added to a shot's spread sigma^2 (a shot of identical frames has none)
TIE = 1e-9  # values this close count as equal, so the first wins (identical frames tie despite rounding)

Shot = tuple[int, int]  # [start, stop) positions into the candidates


def normalised(features) -> np.ndarray:
    """L2-normalised rows, float64."""
    e = np.asarray(features, dtype=np.float64)
    return e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)


def first_max(values) -> int:
    """The first position whose value is within `TIE` of the largest."""
    v = np.asarray(values, dtype=np.float64)
    return int(np.flatnonzero(v >= v.max() - TIE)[0])


def shots_from_cuts(count: int, cuts: Sequence[int]) -> list[Shot]:
    """Shots over `count` candidates: a cut at p (`scene_cuts`) ends a shot at p, the next starts at p + 1."""
    edges = [0] + sorted({int(p) + 1 for p in cuts if 0 <= p < count - 1}) + [count]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:])]


def fit_shots(shots: Sequence[Shot], embeddings: np.ndarray, target: int) -> list[Shot]:
    """`target` shots: while there are more, merge the adjacent pair whose mean embeddings are most similar (cosine;
    the first such pair on ties); while there are fewer, split the longest shot (the first on ties) after its
    largest internal change `1 - cos(e_p, e_{p+1})`. Stops early when every shot is one frame."""
    shots = list(shots)
    e = normalised(embeddings)
    while len(shots) > max(target, 1):
        means = normalised(np.stack([e[a:b].mean(axis=0) for a, b in shots]))
        similarity = (means[:-1] * means[1:]).sum(axis=1)
        i = first_max(similarity)
        shots[i : i + 2] = [(shots[i][0], shots[i + 1][1])]
    change = 1 - (e[:-1] * e[1:]).sum(axis=1)
    while len(shots) < target:
        lengths = [b - a for a, b in shots]
        i = int(np.argmax(lengths))
        if lengths[i] < 2:
            break
        a, b = shots[i]
        p = a + first_max(change[a : b - 1])
        shots[i : i + 1] = [(a, p + 1), (p + 1, b)]
    return shots


def shot_keyframes(shots: Sequence[Shot], embeddings: np.ndarray) -> tuple[list[int], list[int | None], np.ndarray]:
    """Per shot (positions T_s, mean mu_s, spread sigma_s^2 = mean ||e_t - mu_s||^2): the representative
    argmin ||e_t - mu_s|| and the deviation frame argmax over the others of ||e_t - mu_s||^2 / (sigma_s^2 + 1e-6)
    (None for a one-frame shot); first on ties. Also that normalised deviation for every candidate."""
    e = normalised(embeddings)
    deviation = np.zeros(len(e))
    reps: list[int] = []
    devs: list[int | None] = []
    for a, b in shots:
        distance = ((e[a:b] - e[a:b].mean(axis=0)) ** 2).sum(axis=1)
        z = distance / (distance.mean() + EPS)
        deviation[a:b] = z
        rep = first_max(-distance)
        reps.append(a + rep)
        if b - a < 2:
            devs.append(None)
            continue
        others = z.copy()
        others[rep] = -np.inf
        devs.append(a + first_max(others))
    return reps, devs, deviation


def infoshot_positions(embeddings, shots: Sequence[Shot], budget: int) -> tuple[list[int], np.ndarray]:
    """The chosen positions (sorted) and every candidate's normalised deviation: the shots fitted to
    S = max(1, floor(K / 2)), their representatives, then their deviation frames, then the unselected candidates
    of highest normalised deviation anywhere while slots remain (a one-frame shot's spare slot, an odd K's last):
    min(K, candidates) positions."""
    if budget < 1:
        raise ValueError(f"infoshot needs a frame budget of at least 1, got {budget}")
    e = normalised(embeddings)
    fitted = fit_shots(shots, e, max(1, budget // 2))
    reps, devs, deviation = shot_keyframes(fitted, e)
    chosen: list[int] = []
    for p in reps + [d for d in devs if d is not None]:
        if len(chosen) < budget and p not in chosen:
            chosen.append(p)
    for p in np.argsort(-np.round(deviation / TIE) * TIE, kind="stable"):
        if len(chosen) >= budget:
            break
        if int(p) not in chosen:
            chosen.append(int(p))
    return sorted(chosen), deviation


@vtc.method(
    "infoshot",
    paper="InfoShot (arXiv 2603.17374, abstract only)",
    url="https://arxiv.org/abs/2603.17374",
    summary="shots by DINOv2 scene cuts fitted to K/2; per shot the frame nearest its mean and its most deviant frame",
    test_params={"encoder": "vtc-tiny-dinov2"},
)
class InfoShot(vtc.FrameSampler):
    """Two frames per shot: the shot's representative and its most unusual frame (vtc's reading of the abstract)."""

    num_frames: int = vtc.param(32, range="[1, inf)", doc="K, frames handed to the processor (K/2 shots)")
    fps: float = vtc.param(2.0, range="(0, inf)", doc="candidate rate (DIG's CAFS); raise it for sub-second events")
    prominence: float = vtc.param(0.1, range="(0, inf)", doc="find_peaks prominence of 1 - cos between neighbours")
    chunk_seconds: float = vtc.param(60.0, range="(0, inf)", doc="length of the chunks cuts are found in (DIG: 60)")
    encoder: Any = vtc.param(
        "facebook/dinov2-base", doc="transformers image model (hub name or local directory), or an encoder object"
    )

    query_aware = False

    def sample(self, video, ctx):
        count = int(ctx.num_frames or self.num_frames)
        encoder = image_encoder(self.encoder, pooling="mean", param="infoshot.encoder")
        candidates = cafs_candidates(video.num_frames, video.fps, self.fps)
        features = frame_features(encoder, video, candidates)
        chunks = cafs_chunks(candidates, video.num_frames, video.fps, self.chunk_seconds)
        shots = shots_from_cuts(len(candidates), scene_cuts(features, chunks, self.prominence))
        positions, deviation = infoshot_positions(features, shots, count)
        return vtc.FrameChoice([candidates[p] for p in positions], candidates=candidates, scores=deviation.tolist())
