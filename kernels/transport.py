"""Entropic optimal transport (Sinkhorn), as AOT runs it."""

from __future__ import annotations

import torch

from vtc_kernels.dispatch import Tolerance, kernel_op

Tensor = torch.Tensor


@kernel_op(
    "sinkhorn",
    tolerance=Tolerance.allclose(
        {torch.float32: (1e-4, 1e-9), torch.bfloat16: (4e-2, 1e-5), torch.float16: (8e-3, 1e-6)},
        note="the kernel rounds to the cost's dtype where the reference does (kernel, each matvec, each update, "
        "the mean change) but sums matvecs in its own order and uses Triton's exp, so values differ in the last "
        "bits (bfloat16/float16: a flip of the last bit may propagate); the iteration count "
        "(return_iterations=True) must be equal: it can differ only when the stop is decided by those bits (the "
        "mean change within a few ulps of r of tol, e.g. a tol below r's float resolution)",
    ),
    triton="vtc_kernels.triton.transport:sinkhorn",
)
def sinkhorn(
    cost: Tensor,
    epsilon: float = 0.1,
    max_iter: int = 100,
    tol: float = 1e-2,
    source_mass: Tensor | None = None,
    target_mass: Tensor | None = None,
    return_iterations: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Transport plan T [..., M, N] for cost [..., M, N] between uniform (or given) marginals.

    K = exp(-cost / epsilon); starting from r = c = 1, repeat r = u / (K c), c = v / (K^T r) until the mean
    absolute change of r drops below `tol` (at most `max_iter` times); T = diag(r) K diag(c). This is AOT's
    `Sinkhorn_v1`: c is updated last, so column sums equal v exactly while row sums only approach u (within
    the tolerance; about 8 % off at AOT's tol=1e-2). Runs in the cost's dtype, like the official code. A
    batch shares one stop: the mean change is taken over the whole batch (AOT runs all frames at once).
    `return_iterations` also returns the number of updates made (int64 scalar tensor).

    Tolerance contract (Triton vs this reference): allclose, float32 rtol 1e-4 / atol 1e-9, bfloat16 rtol 4e-2 /
    atol 1e-5, float16 rtol 8e-3 / atol 1e-6; the same iteration count.
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
    iterations = 0
    for _ in range(max_iter):
        previous = r
        r = u / (kernel @ c.unsqueeze(-1)).squeeze(-1)
        c = v / (kernel.transpose(-1, -2) @ r.unsqueeze(-1)).squeeze(-1)
        iterations += 1
        if (r - previous).abs().mean().item() < tol:
            break
    plan = r.unsqueeze(-1) * kernel * c.unsqueeze(-2)
    if return_iterations:
        return plan, torch.tensor(iterations, dtype=torch.long, device=cost.device)
    return plan
