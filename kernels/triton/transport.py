"""Triton kernel of `vtc_kernels.transport.sinkhorn`: the whole Sinkhorn loop in one launch, with no host
sync per iteration.

The stop test is on the mean change of r over the whole batch, so every iteration needs every batch item
before the next may start; Triton has no grid-wide barrier, so ONE program runs the batch: per iteration it
walks the items and, per item, tiles of K for r = u / (K c) and then for c = v / (K^T r). K is computed once
into a float32 scratch. Values are rounded to the cost's dtype at the points where the reference's torch ops
round (for float32 a no-op), which keeps the iteration count of bfloat16/float16 runs equal to the reference's.
One program is the right shape for AOT's sizes (frames x a few hundred tokens); `supports` declines batches
whose K is larger than MAX_ELEMENTS, where one streaming multiprocessor would fall behind torch's batched
matmuls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtc_kernels.triton.rounding import round_to

Tensor = torch.Tensor

DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
MAX_ELEMENTS = 1 << 22  # F * M * N; an estimate, not a measured crossover
BLOCK_M = 64
BLOCK_N = 128


@triton.jit(do_not_specialize=["batch", "m", "n", "max_iter"])
def _sinkhorn_kernel(
    cost_ptr,
    u_ptr,
    v_ptr,
    plan_ptr,
    kernel_ptr,
    r_ptr,
    c_ptr,
    iterations_ptr,
    batch,
    m,
    n,
    epsilon,
    inv_epsilon,
    max_iter,
    tol,
    DTYPE: tl.constexpr,
    ROUNDS: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row_lanes = tl.arange(0, BLOCK_M).to(tl.int64)
    col_lanes = tl.arange(0, BLOCK_N).to(tl.int64)
    for b in range(batch):
        item = b * m * n  # < MAX_ELEMENTS: int32 holds it
        for m0 in range(0, m, BLOCK_M):
            rows = m0 + row_lanes
            tl.store(r_ptr + b * m + rows, tl.full([BLOCK_M], 1.0, tl.float32), mask=rows < m)
        for n0 in range(0, n, BLOCK_N):
            cols = n0 + col_lanes
            tl.store(c_ptr + b * n + cols, tl.full([BLOCK_N], 1.0, tl.float32), mask=cols < n)
            for m0 in range(0, m, BLOCK_M):
                rows = m0 + row_lanes
                ok = (rows < m)[:, None] & (cols < n)[None, :]
                at = item + rows[:, None] * n + cols[None, :]
                x = tl.load(cost_ptr + at, mask=ok, other=0.0).to(tl.float32)
                # as torch divides a tensor by a scalar: times its float32 reciprocal on CUDA, IEEE division on CPU
                if RECIPROCAL:
                    value = -x * inv_epsilon
                else:
                    value = tl.math.div_rn(-x, epsilon)
                if ROUNDS:
                    value = round_to(value, DTYPE)
                value = tl.exp(value)
                if ROUNDS:
                    value = round_to(value, DTYPE)
                tl.store(kernel_ptr + at, value, mask=ok)
    tl.debug_barrier()

    done = tl.zeros([], tl.int32)
    go = max_iter > 0
    while go:
        change = tl.zeros([], tl.float32)
        for b in range(batch):
            item = b * m * n  # < MAX_ELEMENTS: int32 holds it
            for m0 in range(0, m, BLOCK_M):
                rows = m0 + row_lanes
                row_ok = rows < m
                acc = tl.zeros([BLOCK_M], tl.float32)
                for n0 in range(0, n, BLOCK_N):
                    cols = n0 + col_lanes
                    ok = row_ok[:, None] & (cols < n)[None, :]
                    k = tl.load(kernel_ptr + item + rows[:, None] * n + cols[None, :], mask=ok, other=0.0)
                    c = tl.load(c_ptr + b * n + cols, mask=cols < n, other=0.0)
                    acc += tl.sum(k * c[None, :], axis=1)
                u = tl.load(u_ptr + b * m + rows, mask=row_ok, other=1.0).to(tl.float32)
                acc = tl.where(row_ok, acc, 1.0)  # lanes past the matrix divide by 1, not 0
                if ROUNDS:
                    acc = round_to(acc, DTYPE)
                new = tl.math.div_rn(u, acc)
                if ROUNDS:
                    new = round_to(new, DTYPE)
                step = new - tl.load(r_ptr + b * m + rows, mask=row_ok, other=0.0)
                if ROUNDS:
                    step = round_to(step, DTYPE)
                change += tl.sum(tl.where(row_ok, tl.abs(step), 0.0), axis=0)
                tl.store(r_ptr + b * m + rows, new, mask=row_ok)
            tl.debug_barrier()  # c reads the whole new r of this item
            for n0 in range(0, n, BLOCK_N):
                cols = n0 + col_lanes
                col_ok = cols < n
                acc = tl.zeros([BLOCK_N], tl.float32)
                for m0 in range(0, m, BLOCK_M):
                    rows = m0 + row_lanes
                    ok = (rows < m)[:, None] & col_ok[None, :]
                    k = tl.load(kernel_ptr + item + rows[:, None] * n + cols[None, :], mask=ok, other=0.0)
                    r = tl.load(r_ptr + b * m + rows, mask=rows < m, other=0.0)
                    acc += tl.sum(k * r[:, None], axis=0)
                v = tl.load(v_ptr + b * n + cols, mask=col_ok, other=1.0).to(tl.float32)
                acc = tl.where(col_ok, acc, 1.0)
                if ROUNDS:
                    acc = round_to(acc, DTYPE)
                new = tl.math.div_rn(v, acc)
                if ROUNDS:
                    new = round_to(new, DTYPE)
                tl.store(c_ptr + b * n + cols, new, mask=col_ok)
            tl.debug_barrier()
        done += 1
        mean = tl.math.div_rn(change, (batch * m).to(tl.float32))
        if ROUNDS:
            mean = round_to(mean, DTYPE)
        go = ~(mean < tol) & (done < max_iter)  # a NaN change never converges, as in the reference
    tl.store(iterations_ptr, done.to(tl.int64))

    for b in range(batch):
        item = b * m * n  # < MAX_ELEMENTS: int32 holds it
        for m0 in range(0, m, BLOCK_M):
            rows = m0 + row_lanes
            r = tl.load(r_ptr + b * m + rows, mask=rows < m, other=0.0)
            for n0 in range(0, n, BLOCK_N):
                cols = n0 + col_lanes
                ok = (rows < m)[:, None] & (cols < n)[None, :]
                at = item + rows[:, None] * n + cols[None, :]
                k = tl.load(kernel_ptr + at, mask=ok, other=0.0)
                c = tl.load(c_ptr + b * n + cols, mask=cols < n, other=0.0)
                plan = r[:, None] * k
                if ROUNDS:
                    plan = round_to(round_to(plan, DTYPE) * c[None, :], DTYPE)  # then the store's cast is exact
                else:
                    plan = plan * c[None, :]
                tl.store(plan_ptr + at, plan.to(plan_ptr.dtype.element_ty), mask=ok)


def _float32_at_least(value: float) -> float:
    """The smallest float32 >= value: for float32 x, `x < value` holds exactly when `x < this` does."""
    rounded = torch.tensor(value, dtype=torch.float64).float()
    if float(rounded) < value:
        rounded = torch.nextafter(rounded, torch.tensor(float("inf")))
    return float(rounded)


def sinkhorn(
    cost: Tensor,
    epsilon: float = 0.1,
    max_iter: int = 100,
    tol: float = 1e-2,
    source_mass: Tensor | None = None,
    target_mass: Tensor | None = None,
    return_iterations: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Same signature and result (within the op's tolerance) as `vtc_kernels.transport.sinkhorn`."""
    reason = _supports(cost, epsilon, max_iter, tol, source_mass, target_mass)
    if reason is not None:
        raise ValueError(f"sinkhorn (Triton): {reason}")
    m, n = cost.shape[-2:]
    batch_shape = cost.shape[:-2]
    flat = cost.reshape(-1, m, n).contiguous()
    batch = flat.shape[0]
    if source_mass is None:
        source_mass = torch.full(cost.shape[:-1], 1.0 / m, dtype=cost.dtype, device=cost.device)
    if target_mass is None:
        target_mass = torch.full(batch_shape + (n,), 1.0 / n, dtype=cost.dtype, device=cost.device)
    u = source_mass.reshape(batch, m).contiguous()
    v = target_mass.reshape(batch, n).contiguous()
    plan = torch.empty_like(flat)
    scratch = torch.empty((batch, m, n), dtype=torch.float32, device=cost.device)
    r = torch.empty((batch, m), dtype=torch.float32, device=cost.device)
    c = torch.empty((batch, n), dtype=torch.float32, device=cost.device)
    iterations = torch.zeros(1, dtype=torch.long, device=cost.device)
    inv_epsilon = float(1.0 / torch.tensor(float(epsilon), dtype=torch.float32))
    _sinkhorn_kernel[(1,)](
        flat,
        u,
        v,
        plan,
        scratch,
        r,
        c,
        iterations,
        batch,
        m,
        n,
        float(torch.tensor(float(epsilon), dtype=torch.float32)),
        inv_epsilon,
        int(max_iter),
        _float32_at_least(float(tol)),
        DTYPE=DTYPES[cost.dtype],
        ROUNDS=cost.dtype != torch.float32,
        RECIPROCAL=cost.is_cuda,
        BLOCK_M=min(BLOCK_M, triton.next_power_of_2(m)),
        BLOCK_N=min(BLOCK_N, triton.next_power_of_2(n)),
        num_warps=8,
    )
    plan = plan.reshape(cost.shape)
    return (plan, iterations[0]) if return_iterations else plan


def _supports(
    cost: Tensor,
    epsilon: float = 0.1,
    max_iter: int = 100,
    tol: float = 1e-2,
    source_mass: Tensor | None = None,
    target_mass: Tensor | None = None,
    return_iterations: bool = False,
) -> str | None:
    if not isinstance(cost, Tensor) or cost.dim() < 2:
        return "cost must be a tensor [..., M, N]"
    if cost.dtype not in DTYPES:
        return f"cost dtype {cost.dtype} (float32, bfloat16 or float16)"
    if cost.numel() == 0:
        return f"empty cost {tuple(cost.shape)}"
    if cost.numel() > MAX_ELEMENTS:
        return f"cost has {cost.numel()} elements; one program runs the batch, up to {MAX_ELEMENTS}"
    for name, mass, shape in (
        ("source_mass", source_mass, cost.shape[:-1]),
        ("target_mass", target_mass, cost.shape[:-2] + cost.shape[-1:]),
    ):
        if mass is None:
            continue
        if not isinstance(mass, Tensor) or mass.shape != shape or mass.dtype != cost.dtype:
            return f"{name} must be a {cost.dtype} tensor {tuple(shape)} (no broadcasting)"
        if mass.device != cost.device:
            return f"{name} is on {mass.device}, cost on {cost.device}"
    return None


sinkhorn.supports = _supports  # type: ignore[attr-defined]
