"""Entropic optimal transport (Sinkhorn), as AOT runs it."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def sinkhorn(
    cost: Tensor,
    epsilon: float = 0.1,
    max_iter: int = 100,
    tol: float = 1e-2,
    source_mass: Tensor | None = None,
    target_mass: Tensor | None = None,
) -> Tensor:
    """Transport plan T [M, N] for cost [M, N] between uniform (or given) marginals.

    K = exp(-cost / epsilon); starting from r = c = 1, repeat r = u / (K c), c = v / (K^T r) until the mean
    absolute change of r drops below `tol` (at most `max_iter` times); T = diag(r) K diag(c). This is AOT's
    `Sinkhorn_v1`: c is updated last, so column sums equal v exactly while row sums only approach u (within
    the tolerance; about 8 % off at AOT's tol=1e-2). Runs in the cost's dtype, like the official code.
    """
    m, n = cost.shape[-2:]
    u = (
        source_mass
        if source_mass is not None
        else torch.full(cost.shape[:-1], 1.0 / m, dtype=cost.dtype, device=cost.device)
    )
    v = (
        target_mass
        if target_mass is not None
        else torch.full(cost.shape[:-2] + (n,), 1.0 / n, dtype=cost.dtype, device=cost.device)
    )
    kernel = torch.exp(-cost / epsilon)
    r = torch.ones_like(u)
    c = torch.ones_like(v)
    for _ in range(max_iter):
        previous = r
        r = u / (kernel @ c.unsqueeze(-1)).squeeze(-1)
        c = v / (kernel.transpose(-1, -2) @ r.unsqueeze(-1)).squeeze(-1)
        if (r - previous).abs().mean().item() < tol:
            break
    return r.unsqueeze(-1) * kernel * c.unsqueeze(-2)
