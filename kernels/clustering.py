"""Density-peak clustering with k-nearest-neighbour density (DPC-kNN), as used by PruneVid, HoliTom and
FastVID (all derive from TCFormer's `cluster_dpc_knn`)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def dpc_knn_scores(x: Tensor, k: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Density-peak scores of the rows of x [n, C].

    dist = cdist(x, x) / sqrt(C) (in float32); density_i = exp(-mean of the squared distances to its k
    nearest rows, itself included) plus U(0, 1e-6) noise that breaks ties; delta_i = distance to the nearest
    row of higher density (the largest distance overall when none is denser). Returns (score = delta *
    density [n], dist [n, n]). The noise comes from `generator` so runs are repeatable.
    """
    n, dim = x.shape
    dist = torch.cdist(x.float()[None], x.float()[None])[0] / dim**0.5
    k = max(1, min(int(k), n))
    nearest = torch.topk(dist, k, dim=-1, largest=False).values
    density = (-(nearest**2).mean(dim=-1)).exp()
    noise = torch.rand(density.shape, generator=generator, dtype=density.dtype).to(density.device)
    density = density + noise * 1e-6
    denser = density[None, :] > density[:, None]
    delta = torch.where(denser, dist, dist.max()).min(dim=-1).values
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
