"""Triton kernel of `vtc_kernels.matching.best_match`.

One program per BLOCK_M sources. It walks the destination columns its sources may match (the union of
their segments' ranges, contiguous because segments are laid end to end) in BLOCK_N tiles, takes the dot products
with `tl.dot` (float32, IEEE precision) over BLOCK_D slices of the features, divides by the norms the variant asks
for, and keeps a running best per source: the first column of the tile's maximum, replacing the best so far only
when strictly larger, so ties go to the first destination as with `argmax`. The [n_src, n_dst] matrix is never
stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtc_kernels.matching import check_match_args

Tensor = torch.Tensor

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NORMALIZE_CODE = {"none": 0, "exact": 1, "eps": 2}


@triton.jit
def _best_match_kernel(
    src_ptr,
    dst_ptr,
    lo_ptr,
    hi_ptr,
    assign_ptr,
    best_ptr,
    n_src,
    n_dst,
    dim,
    NORMALIZE: tl.constexpr,
    RATIO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_src
    lo = tl.load(lo_ptr + rows, mask=row_ok, other=n_dst)  # each source's destinations: [lo, hi)
    hi = tl.load(hi_ptr + rows, mask=row_ok, other=0)
    d = tl.arange(0, BLOCK_D)
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        a = tl.load(
            src_ptr + rows[:, None].to(tl.int64) * dim + d0 + d[None, :],
            mask=row_ok[:, None] & (d0 + d < dim)[None, :],
            other=0.0,
        ).to(tl.float32)
        squares += tl.sum(a * a, axis=1)
    src_norm = tl.where(row_ok, tl.sqrt(squares), 1.0)  # padding rows: no 0 / 0
    if NORMALIZE == 2:
        src_norm = tl.maximum(src_norm, 1e-12)  # F.normalize's eps
    best_key = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    best_value = tl.zeros([BLOCK_M], dtype=tl.float32)
    best_col = tl.full([BLOCK_M], -1, dtype=tl.int64)
    n = tl.arange(0, BLOCK_N)
    for c0 in range(tl.min(lo, axis=0), tl.max(hi, axis=0), BLOCK_N):
        cols = c0 + n
        col_ok = cols < n_dst
        dots = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        col_squares = tl.zeros([BLOCK_N], dtype=tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            d_ok = (d0 + d < dim)[None, :]
            a = tl.load(
                src_ptr + rows[:, None].to(tl.int64) * dim + d0 + d[None, :], mask=row_ok[:, None] & d_ok, other=0.0
            ).to(tl.float32)
            b = tl.load(
                dst_ptr + cols[:, None].to(tl.int64) * dim + d0 + d[None, :], mask=col_ok[:, None] & d_ok, other=0.0
            ).to(tl.float32)
            dots += tl.dot(a, tl.trans(b), input_precision="ieee")
            col_squares += tl.sum(b * b, axis=1)
        if NORMALIZE != 0 or RATIO:
            col_norm = tl.where(col_ok, tl.sqrt(col_squares), 1.0)
            if NORMALIZE == 2:
                col_norm = tl.maximum(col_norm, 1e-12)
            sim = dots / (src_norm[:, None] * col_norm[None, :])
        else:
            sim = dots
        inside = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        key = tl.where(sim != sim, float("inf"), sim)  # NaN ranks as +inf (torch.argmax takes the first NaN)
        tile_key = tl.max(tl.where(inside, key, float("-inf")), axis=1)
        hit = inside & (key == tile_key[:, None])
        tile_col = tl.min(tl.where(hit, cols[None, :], 2147483647), axis=1).to(tl.int64)
        found = tile_col < 2147483647
        tile_value = tl.sum(tl.where(cols[None, :] == tile_col[:, None], sim, 0.0), axis=1)
        better = found & ((tile_key > best_key) | (best_col < 0))
        best_key = tl.where(better, tile_key, best_key)
        best_value = tl.where(better, tile_value, best_value)
        best_col = tl.where(better, tile_col, best_col)
    tl.store(assign_ptr + rows, best_col, mask=row_ok)
    tl.store(best_ptr + rows, best_value.to(best_ptr.dtype.element_ty), mask=row_ok)


def best_match(
    src: Tensor,
    dst: Tensor,
    normalize: str = "exact",
    formula: str = "dot",
    src_offsets: Tensor | None = None,
    dst_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    src_offsets, dst_offsets = check_match_args(src, dst, normalize, formula, src_offsets, dst_offsets)
    n_src, dim = src.shape
    assign = torch.empty(n_src, dtype=torch.long, device=src.device)
    best = torch.empty(n_src, dtype=src.dtype, device=src.device)
    if n_src == 0:
        return assign, best
    lengths = src_offsets.diff()
    lo = torch.repeat_interleave(dst_offsets[:-1], lengths, output_size=n_src)
    hi = torch.repeat_interleave(dst_offsets[1:], lengths, output_size=n_src)
    block_m, block_n = 32, 32
    block_d = max(16, min(64, triton.next_power_of_2(dim)))
    _best_match_kernel[(triton.cdiv(n_src, block_m),)](
        src.contiguous(),
        dst.contiguous(),
        lo,
        hi,
        assign,
        best,
        n_src,
        dst.shape[0],
        dim,
        NORMALIZE=NORMALIZE_CODE[normalize],
        RATIO=formula == "ratio",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return assign, best


def _supports_best_match(
    src: Tensor,
    dst: Tensor,
    normalize: str = "exact",
    formula: str = "dot",
    src_offsets: Tensor | None = None,
    dst_offsets: Tensor | None = None,
) -> str | None:
    if not isinstance(src, Tensor) or src.dtype not in DTYPES:
        return f"features must be one of {DTYPES} (the kernel computes in float32), got {getattr(src, 'dtype', src)}"
    return None


best_match.supports = _supports_best_match  # type: ignore[attr-defined]
