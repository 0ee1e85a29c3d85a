"""Triton kernel of `vtc_kernels.diverse.max_min_select`: one program per segment makes every pick in-kernel
(one launch instead of ~5 per pick). The running min-distance vector lives in a float32 scratch row per
segment, so segments of any length work; picked tokens are marked -inf there, which keeps them out of every
later argmax (min(-inf, d) stays -inf)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtc_kernels.diverse import segment_counts
from vtc_kernels.segments import square_segments

Tensor = torch.Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # exact in float32; float64 would round
BLOCK_COLS = 1024
BLOCK_ROWS = 8


@triton.jit
def _max_min_kernel(
    dist_ptr,
    lengths_ptr,
    counts_ptr,
    picks_ptr,
    nearest_ptr,
    size,
    width,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    seg = tl.program_id(0).to(tl.int64)
    n = tl.load(lengths_ptr + seg)
    count = tl.load(counts_ptr + seg)
    base = dist_ptr + seg * size * size
    near = nearest_ptr + seg * size
    out = picks_ptr + seg * width
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for c0 in range(0, width, BLOCK):
        offs = c0 + lanes
        tl.store(out + offs, tl.full([BLOCK], -1, tl.int64), mask=(offs >= count) & (offs < width))
    if count > 0:
        # pick 1: per column the two smallest of its rows (with multiplicity), merged across row tiles
        best_val = tl.full([], float("-inf"), tl.float32)
        best_idx = tl.zeros([], tl.int64)
        for c0 in range(0, n, BLOCK):
            cols = c0 + lanes
            col_ok = cols < n
            low1 = tl.full([BLOCK], float("inf"), tl.float32)
            low2 = tl.full([BLOCK], float("inf"), tl.float32)
            for r0 in range(0, n, BLOCK_R):
                rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
                ok = (rows < n)[:, None] & col_ok[None, :]
                x = tl.load(base + rows[:, None] * size + cols[None, :], mask=ok, other=float("inf")).to(tl.float32)
                m1 = tl.min(x, axis=0)
                is_min = x == m1[None, :]
                repeated = tl.sum(is_min.to(tl.int32), axis=0) > 1
                m2 = tl.where(repeated, m1, tl.min(tl.where(is_min, float("inf"), x), axis=0))
                low2 = tl.minimum(tl.maximum(low1, m1), tl.minimum(low2, m2))
                low1 = tl.minimum(low1, m1)
            tl.store(near + cols, tl.full([BLOCK], float("inf"), tl.float32), mask=col_ok)
            score = tl.where(col_ok, low2, float("-inf"))
            tile_val = tl.max(score, axis=0)
            tile_idx = c0 + tl.argmax(score, axis=0).to(tl.int64)
            better = tile_val > best_val  # strict: an earlier tile keeps its tie
            best_idx = tl.where(better, tile_idx, best_idx)
            best_val = tl.where(better, tile_val, best_val)
        pick = best_idx
        tl.store(out, pick)
        tl.debug_barrier()
        for i in range(1, count):
            row = base + pick * size
            best_val = tl.full([], float("-inf"), tl.float32)
            best_idx = tl.zeros([], tl.int64)
            for c0 in range(0, n, BLOCK):
                cols = c0 + lanes
                col_ok = cols < n
                current = tl.load(near + cols, mask=col_ok, other=float("-inf"))
                d = tl.load(row + cols, mask=col_ok, other=float("-inf")).to(tl.float32)
                current = tl.where(cols == pick, float("-inf"), tl.minimum(current, d))
                tl.store(near + cols, current, mask=col_ok)
                score = tl.where(col_ok, current, float("-inf"))
                tile_val = tl.max(score, axis=0)
                tile_idx = c0 + tl.argmax(score, axis=0).to(tl.int64)
                better = tile_val > best_val
                best_idx = tl.where(better, tile_idx, best_idx)
                best_val = tl.where(better, tile_val, best_val)
            pick = best_idx
            tl.store(out + i, pick)
            tl.debug_barrier()  # this pick's scratch writes are read by the next pick


def max_min_select(dist: Tensor, count: int | Tensor, lengths: Tensor | None = None) -> Tensor:
    """Same signature and result as `vtc_kernels.diverse.max_min_select` (one launch for all segments)."""
    reason = _supports(dist)
    if reason is not None:
        raise ValueError(f"max_min_select (Triton): {reason}")
    dist, lengths, single = square_segments(dist, lengths, "max_min_select")
    counts = segment_counts(count, lengths, "max_min_select")
    segments, size = dist.shape[:2]
    width = int(counts.max()) if segments else 0  # the output's shape needs it on the host
    picks = torch.empty((segments, width), dtype=torch.long, device=dist.device)
    if width > 0:
        nearest = torch.empty((segments, size), dtype=torch.float32, device=dist.device)
        block = min(BLOCK_COLS, triton.next_power_of_2(size))
        _max_min_kernel[(segments,)](
            dist.contiguous(),
            lengths,
            counts,
            picks,
            nearest,
            size,
            width,
            BLOCK=block,
            BLOCK_R=BLOCK_ROWS,
            num_warps=8,
        )
    return picks[0] if single else picks


def _supports(dist: Tensor, *args, **kwargs) -> str | None:
    if not isinstance(dist, Tensor):
        return "dist must be a tensor"
    if dist.dtype not in DTYPES:
        return f"dist dtype {dist.dtype} (the kernel compares in float32: float32, bfloat16 or float16)"
    return None


max_min_select.supports = _supports  # type: ignore[attr-defined]
