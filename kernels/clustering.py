"""Density-peak clustering with k-nearest-neighbour density (DPC-kNN), as used by PruneVid, HoliTom and
FastVID (all derive from TCFormer's `cluster_dpc_knn`).

The two passes over the distance matrix are kernel ops, segmented so one launch serves a batch of padded
matrices: `knn_density` (the k-NN density of every row) and `nearest_denser` (each row's distance to, and
index of, its nearest denser row). `dpc_knn_scores` composes them with the tie-breaking noise between."""

from __future__ import annotations

import torch

from vtc_kernels.dispatch import Tolerance, kernel_op
from vtc_kernels.segments import square_segments

Tensor = torch.Tensor

NO_PARENT = -1  # `nearest_denser`'s parent of a row that no row of its segment is denser than


def _neighbour_count(k: int, op: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"{op}: k must be an int (the number of nearest rows), got {type(k).__name__}")
    return k


@kernel_op(
    "knn_density",
    tolerance=Tolerance.allclose(
        {torch.float32: (1e-5, 1e-7), torch.bfloat16: (8e-3, 1e-6), torch.float16: (1e-3, 1e-7)},
        note="the k smallest distances are the same values; the kernel rounds to the input dtype where the "
        "reference's torch ops do, so only the order of the k-term sum and exp's last bits differ (one ulp of "
        "bfloat16/float16 when that flips a rounding)",
    ),
    triton="vtc_kernels.triton.clustering:knn_density",
)
def knn_density(dist: Tensor, k: int, lengths: Tensor | None = None) -> Tensor:
    """k-NN density of every row: exp(-mean of the squared distances to its k nearest rows, itself included).

    dist [n, n] -> density [n]; or dist [S, n, n] padded (segment s is the top-left lengths[s] x lengths[s]
    block) -> density [S, n], 0 on padding rows. k is clamped to [1, segment length] per segment. Returns
    dist's dtype. A single matrix runs TCFormer's exact arithmetic (`topk` of the k smallest, mean of the
    squares, exp); a batch groups segments by their clamped k and gives the same bits.

    Tolerance contract (Triton vs this reference): allclose; float32 rtol 1e-5 / atol 1e-7, bfloat16 rtol 8e-3 / atol
    1e-6, float16 rtol 1e-3 / atol 1e-7 (one ulp).
    """
    k = _neighbour_count(k, "knn_density")
    dist, lengths, single = square_segments(dist, lengths, "knn_density")
    segments, size = dist.shape[:2]
    if single:
        if size == 0:
            return dist.new_empty(0)
        nearest = torch.topk(dist[0], max(1, min(k, size)), dim=-1, largest=False).values
        return (-(nearest**2).mean(dim=-1)).exp()
    valid = torch.arange(size, device=dist.device)[None, :] < lengths[:, None]  # [S, n]
    density = dist.new_zeros(segments, size)
    if size == 0:
        return density
    column = dist.masked_fill(~valid[:, None, :], float("inf"))  # padded columns are never among the nearest
    ks = lengths.clamp(min=1, max=max(1, k))
    for group_k in ks[lengths > 0].unique().tolist():  # at most k groups, not one pass per segment
        group = (ks == group_k) & (lengths > 0)
        nearest = torch.topk(column[group], group_k, dim=-1, largest=False).values
        density[group] = (-(nearest**2).mean(dim=-1)).exp()
    return density.masked_fill(~valid, 0.0)


@kernel_op(
    "nearest_denser",
    tolerance=Tolerance.exact(
        note="delta is a copy of one distance and parent an index: both exact given the same density (density "
        "compares in float32, exact for float32/bfloat16/float16); parent ties go to the first index"
    ),
    triton="vtc_kernels.triton.clustering:nearest_denser",
)
def nearest_denser(dist: Tensor, density: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Distance to, and index of, each row's nearest denser row (density strictly greater).

    dist [n, n] with density [n] -> (delta [n] in dist's dtype, parent [n] int64); or dist [S, n, n] padded
    with density [S, n] and lengths [S] -> ([S, n], [S, n]). A row that no row of its segment is denser than
    (the densest row, and every row tied with it) gets delta = the largest distance of its segment (TCFormer's
    `dist.max()`) and parent = NO_PARENT (-1). Parent ties (equal distances) go to the first index. Padding
    rows: delta 0, parent -1.

    Tolerance contract (Triton vs this reference): exact, on finite distances in float32, bfloat16 or float16.
    """
    if not isinstance(density, Tensor) or density.shape != dist.shape[:-1]:
        got = tuple(density.shape) if isinstance(density, Tensor) else type(density).__name__
        raise ValueError(
            f"nearest_denser: density must have dist's shape minus its last dim, {tuple(dist.shape[:-1])}, got {got}"
        )
    dist, lengths, single = square_segments(dist, lengths, "nearest_denser")
    density = density.unsqueeze(0) if single else density
    segments, size = dist.shape[:2]
    delta = dist.new_zeros(segments, size)
    parent = torch.full((segments, size), NO_PARENT, dtype=torch.long, device=dist.device)
    if size > 0:
        valid = torch.arange(size, device=dist.device)[None, :] < lengths[:, None]
        inside = valid[:, :, None] & valid[:, None, :]
        denser = (density[:, None, :] > density[:, :, None]) & inside
        largest = dist.masked_fill(~inside, float("-inf")).amax(dim=(-2, -1))
        delta = torch.where(denser, dist, largest[:, None, None]).min(dim=-1).values.masked_fill(~valid, 0.0)
        nearest = torch.where(denser, dist, float("inf")).argmin(dim=-1)
        parent = torch.where(denser.any(dim=-1), nearest, NO_PARENT)
    return (delta[0], parent[0]) if single else (delta, parent)


def dpc_knn_scores(x: Tensor, k: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Density-peak scores of the rows of x [n, C].

    dist = cdist(x, x) / sqrt(C) (in float32); density_i = `knn_density(dist, k)` plus U(0, 1e-6) noise that
    breaks ties; delta_i = `nearest_denser`'s distance to the nearest row of higher density (the largest
    distance overall when none is denser). Returns (score = delta * density [n], dist [n, n]). The noise comes
    from `generator` so runs are repeatable.
    """
    dim = x.shape[1]
    dist = torch.cdist(x.float()[None], x.float()[None])[0] / dim**0.5
    density = knn_density(dist, int(k))
    noise = torch.rand(density.shape, generator=generator, dtype=density.dtype).to(density.device)
    density = density + noise * 1e-6
    delta, _ = nearest_denser(dist, density)
    return delta * density, dist


def dpc_knn_centers(
    x: Tensor, num_clusters: int, k: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Indices of the `num_clusters` highest density-peak scores (score order) and the distance matrix."""
    score, dist = dpc_knn_scores(x, k, generator)
    return torch.topk(score, min(int(num_clusters), x.shape[0])).indices, dist


def assign_to_centers(dist: Tensor, centers: Tensor) -> Tensor:
    """Cluster id (index into `centers`) of every row: its nearest center; centers own their cluster."""
    labels = torch.argmin(dist[:, centers], dim=-1)
    labels[centers] = torch.arange(centers.numel(), device=dist.device)
    return labels
