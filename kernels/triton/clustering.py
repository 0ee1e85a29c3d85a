"""Triton kernels of `vtc_kernels.clustering`'s DPC-kNN passes, on a grid of (segment, block of rows).

`knn_density`: each program keeps, per row, the k smallest distances seen so far in registers and merges every
column tile into them by k rounds of min extraction (k is small), so rows of any length stream through once.
`nearest_denser`: each program reduces its rows to (nearest denser distance, its first index, row max); a
second launch, one program per segment, turns the row maxima into the segment's largest distance and gives it
to the rows that have no denser row. Nothing beyond dist is read, and nothing larger than [S, n] is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtc_kernels.clustering import NO_PARENT
from vtc_kernels.segments import square_segments
from vtc_kernels.triton.rounding import round_to

Tensor = torch.Tensor

DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}  # float64 would round
BLOCK_ROWS = 16
BLOCK_COLS = 128
MAX_K = 64  # k rounds of extraction per column tile: beyond this a sort-based kernel would be the right tool


@triton.jit
def _knn_density_kernel(
    dist_ptr,
    lengths_ptr,
    out_ptr,
    size,
    k_asked,
    DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0).to(tl.int64)
    n = tl.load(lengths_ptr + seg)
    k = tl.maximum(tl.minimum(n, k_asked), 1)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    row_ok = rows < n
    slots = tl.arange(0, BLOCK_K)
    lanes = tl.arange(0, BLOCK_C)
    base = dist_ptr + seg * size * size + rows[:, None] * size
    kept = tl.full([BLOCK_R, BLOCK_K], float("inf"), tl.float32)  # ascending k smallest so far
    for c0 in range(0, n, BLOCK_C):
        cols = c0 + lanes.to(tl.int64)
        ok = row_ok[:, None] & (cols < n)[None, :]
        tile = tl.load(base + cols[None, :], mask=ok, other=float("inf")).to(tl.float32)
        merged = tl.full([BLOCK_R, BLOCK_K], float("inf"), tl.float32)
        for t in range(0, k):
            low_kept = tl.min(kept, axis=1)
            low_tile = tl.min(tile, axis=1)
            from_kept = low_kept <= low_tile
            merged = tl.where(slots[None, :] == t, tl.minimum(low_kept, low_tile)[:, None], merged)
            # remove exactly one occurrence of the extracted value, so repeated distances count repeatedly
            at_kept = tl.argmin(kept, axis=1)
            at_tile = tl.argmin(tile, axis=1)
            kept = tl.where(from_kept[:, None] & (slots[None, :] == at_kept[:, None]), float("inf"), kept)
            tile = tl.where(~from_kept[:, None] & (lanes[None, :] == at_tile[:, None]), float("inf"), tile)
        kept = merged
    # rounded to the input dtype where the reference's torch ops round (no-ops for float32)
    squares = round_to(tl.where(slots[None, :] < k, kept * kept, 0.0), DTYPE)
    mean = round_to(tl.math.div_rn(tl.sum(squares, axis=1), k.to(tl.float32)), DTYPE)
    density = round_to(tl.where(row_ok, tl.exp(-mean), 0.0), DTYPE)  # so the store's cast is exact
    tl.store(out_ptr + seg * size + rows, density.to(DTYPE), mask=rows < size)


@triton.jit
def _nearest_denser_kernel(
    dist_ptr,
    density_ptr,
    lengths_ptr,
    delta_ptr,
    parent_ptr,
    row_max_ptr,
    size,
    NONE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    seg = tl.program_id(0).to(tl.int64)
    n = tl.load(lengths_ptr + seg)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    row_ok = rows < n
    own = tl.load(density_ptr + seg * size + rows, mask=row_ok, other=0.0).to(tl.float32)
    base = dist_ptr + seg * size * size + rows[:, None] * size
    best = tl.full([BLOCK_R], float("inf"), tl.float32)
    parent = tl.full([BLOCK_R], NONE, tl.int64)
    found = tl.zeros([BLOCK_R], tl.int1)
    row_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for c0 in range(0, n, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
        col_ok = cols < n
        ok = row_ok[:, None] & col_ok[None, :]
        tile = tl.load(base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        other = tl.load(density_ptr + seg * size + cols, mask=col_ok, other=0.0).to(tl.float32)
        denser = ok & (other[None, :] > own[:, None])
        candidates = tl.where(denser, tile, float("inf"))
        tile_min = tl.min(candidates, axis=1)
        tile_at = c0 + tl.argmin(candidates, axis=1).to(tl.int64)
        tile_found = tl.max(denser.to(tl.int32), axis=1) > 0
        better = tile_found & ((tile_min < best) | ~found)  # strict: an earlier tile keeps its tie
        parent = tl.where(better, tile_at, parent)
        best = tl.where(better, tile_min, best)
        found = found | tile_found
        row_max = tl.maximum(row_max, tl.max(tl.where(ok, tile, float("-inf")), axis=1))
    out = seg * size + rows
    in_matrix = rows < size
    tl.store(delta_ptr + out, tl.where(found, best, 0.0).to(delta_ptr.dtype.element_ty), mask=in_matrix)
    tl.store(parent_ptr + out, parent, mask=in_matrix)
    tl.store(row_max_ptr + out, row_max, mask=in_matrix)


@triton.jit
def _largest_for_densest_kernel(delta_ptr, parent_ptr, row_max_ptr, lengths_ptr, size, BLOCK: tl.constexpr):
    seg = tl.program_id(0).to(tl.int64)
    n = tl.load(lengths_ptr + seg)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    largest = tl.full([], float("-inf"), tl.float32)
    for r0 in range(0, n, BLOCK):
        rows = r0 + lanes
        values = tl.load(row_max_ptr + seg * size + rows, mask=rows < n, other=float("-inf"))
        largest = tl.maximum(largest, tl.max(values, axis=0))
    for r0 in range(0, n, BLOCK):
        rows = r0 + lanes
        at = seg * size + rows
        densest = (rows < n) & (tl.load(parent_ptr + at, mask=rows < n, other=0) < 0)
        value = tl.full([BLOCK], 0.0, tl.float32) + largest
        tl.store(delta_ptr + at, value.to(delta_ptr.dtype.element_ty), mask=densest)


def knn_density(dist: Tensor, k: int, lengths: Tensor | None = None) -> Tensor:
    """Same signature and result (within the op's tolerance) as `vtc_kernels.clustering.knn_density`."""
    reason = _density_supports(dist, k, lengths)
    if reason is not None:
        raise ValueError(f"knn_density (Triton): {reason}")
    dist, lengths, single = square_segments(dist, lengths, "knn_density")
    segments, size = dist.shape[:2]
    density = torch.empty((segments, size), dtype=dist.dtype, device=dist.device)
    if segments and size:
        block_k = triton.next_power_of_2(max(1, min(k, size)))
        grid = (segments, triton.cdiv(size, BLOCK_ROWS))
        _knn_density_kernel[grid](
            dist.contiguous(),
            lengths,
            density,
            size,
            max(1, k),
            DTYPE=DTYPES[dist.dtype],
            BLOCK_R=BLOCK_ROWS,
            BLOCK_C=min(BLOCK_COLS, triton.next_power_of_2(size)),
            BLOCK_K=block_k,
        )
    return density[0] if single else density


def nearest_denser(dist: Tensor, density: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Same signature and result as `vtc_kernels.clustering.nearest_denser` (two launches for all segments)."""
    reason = _denser_supports(dist, density, lengths)
    if reason is not None:
        raise ValueError(f"nearest_denser (Triton): {reason}")
    if density.shape != dist.shape[:-1]:
        raise ValueError(
            f"nearest_denser: density must have dist's shape minus its last dim, {tuple(dist.shape[:-1])}, "
            f"got {tuple(density.shape)}"
        )
    dist, lengths, single = square_segments(dist, lengths, "nearest_denser")
    density = density.reshape(dist.shape[:2])
    segments, size = dist.shape[:2]
    delta = torch.empty((segments, size), dtype=dist.dtype, device=dist.device)
    parent = torch.empty((segments, size), dtype=torch.long, device=dist.device)
    if segments and size:
        row_max = torch.empty((segments, size), dtype=torch.float32, device=dist.device)
        block_c = min(BLOCK_COLS, triton.next_power_of_2(size))
        _nearest_denser_kernel[(segments, triton.cdiv(size, BLOCK_ROWS))](
            dist.contiguous(),
            density.contiguous(),
            lengths,
            delta,
            parent,
            row_max,
            size,
            NONE=NO_PARENT,
            BLOCK_R=BLOCK_ROWS,
            BLOCK_C=block_c,
        )
        _largest_for_densest_kernel[(segments,)](delta, parent, row_max, lengths, size, BLOCK=block_c)
    return (delta[0], parent[0]) if single else (delta, parent)


def _density_supports(dist: Tensor, k: int, lengths: Tensor | None = None) -> str | None:
    if not isinstance(dist, Tensor) or dist.dtype not in DTYPES:
        return f"dist must be a float32, bfloat16 or float16 tensor, got {getattr(dist, 'dtype', type(dist))}"
    if isinstance(k, bool) or not isinstance(k, int):
        return f"k must be an int, got {type(k).__name__}"
    if min(k, dist.shape[-1]) > MAX_K:
        return f"k = {k} (the kernel extracts the k smallest one by one; at most {MAX_K})"
    return None


def _denser_supports(dist: Tensor, density: Tensor, lengths: Tensor | None = None) -> str | None:
    for name, value in (("dist", dist), ("density", density)):
        if not isinstance(value, Tensor) or value.dtype not in DTYPES:
            got = getattr(value, "dtype", type(value).__name__)
            return f"{name} must be a float32, bfloat16 or float16 tensor (compared in float32), got {got}"
    return None


knn_density.supports = _density_supports  # type: ignore[attr-defined]
nearest_denser.supports = _denser_supports  # type: ignore[attr-defined]
