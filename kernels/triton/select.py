"""Triton kernels of `vtc_kernels.select`: segmented top-k, and top-k fused with the gather of the kept rows.

One program per segment. Each score becomes an order-preserving int32 key (NaN above +inf, -0.0 equal to 0.0, bits
flipped for "smallest"); packed with its inverted position into one int64, every entry has a unique rank with ties
to the lower index. Short segments (and score order) count, for each entry, the entries that beat it (pairwise
comparison tiles): that count is its place in the order. Long segments in index order bisect the int32 key range
for the k-th best key instead (32 counting passes), then keep the lowest positions among the entries equal to it.
`tl.sort` would do the same on a GPU, but Triton's interpreter runs its bitonic network element by element, which
makes CPU tests minutes long. The kept global indices are written segment after segment; `topk_gather` then copies
the kept rows of up to FUSED_ROWS tensors in the same program (further tensors in launches that only copy).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from vtc_kernels.select import check_topk_args

Tensor = torch.Tensor

MAX_SEGMENT = 16384  # one program holds a whole segment in registers
PAIRWISE_MAX = 256  # up to this block, places come from pairwise comparisons; beyond, index order bisects
SCORE_ORDER_MAX = 2048  # score order (sort_indices=False) always counts pairwise: O(block x segment) per program
PAIRWISE_TILE = 4096  # entries of one [block, chunk] comparison tile
FUSED_ROWS = 4  # row tensors copied by one launch
SCORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROW_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
ROWS_BLOCK = tl.constexpr(16)  # kept rows per copy tile
WIDTH_BLOCK = tl.constexpr(64)  # row elements per copy tile


@triton.jit
def _copy_rows(index_ptr, out_start, kept, src_ptr, dst_ptr, width):
    """Rows index[out_start + r] of src [N, width] -> rows out_start + r of dst, r < kept."""
    r = tl.arange(0, ROWS_BLOCK)
    w = tl.arange(0, WIDTH_BLOCK)
    for r0 in range(0, kept, ROWS_BLOCK):
        row_ok = r0 + r < kept
        src_row = tl.load(index_ptr + out_start + r0 + r, mask=row_ok, other=0)
        dst_row = (out_start + r0 + r).to(tl.int64)
        for w0 in range(0, width, WIDTH_BLOCK):
            ok = row_ok[:, None] & (w0 + w < width)[None, :]
            values = tl.load(src_ptr + src_row[:, None] * width + w0 + w[None, :], mask=ok)
            tl.store(dst_ptr + dst_row[:, None] * width + w0 + w[None, :], values, mask=ok)


@triton.jit
def _order_key(scores_ptr, start, pos, valid, LARGEST: tl.constexpr):
    """int32 keys of scores[start + pos] whose signed order is the ranking (larger key = better)."""
    x = tl.load(scores_ptr + start + pos, mask=valid, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with 0.0, as in torch.topk
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed-int order == float order
    key = tl.where(x != x, 0x7FFFFFFF, key)  # NaN ranks first (largest) or last (smallest), as in torch.topk
    if not LARGEST:
        key = ~key
    return key


@triton.jit
def _packed(key, pos, valid, BLOCK: tl.constexpr):
    """Unique int64 ranks: key, then the lower position (low half BLOCK - pos >= 1); padding below everything."""
    packed = (key.to(tl.int64) << 32) | (BLOCK - pos).to(tl.int64)
    return tl.where(valid, packed, -9223372036854775808)


@triton.jit
def _topk_kernel(
    scores_ptr,
    offsets_ptr,
    kept_ptr,
    out_start_ptr,
    index_ptr,
    src0,
    dst0,
    width0,
    src1,
    dst1,
    width1,
    src2,
    dst2,
    width2,
    src3,
    dst3,
    width3,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    BISECT: tl.constexpr,
    LARGEST: tl.constexpr,
    SORT_INDICES: tl.constexpr,
    SELECT: tl.constexpr,
    NUM_ROWS: tl.constexpr,
):
    s = tl.program_id(0)
    start = tl.load(offsets_ptr + s)
    n = tl.load(offsets_ptr + s + 1) - start
    kept = tl.load(kept_ptr + s)
    out_start = tl.load(out_start_ptr + s)
    if SELECT:
        i = tl.arange(0, BLOCK)
        valid = i < n
        key = _order_key(scores_ptr, start, i, valid, LARGEST)
        if BISECT:
            # long segments, index order: bisect for the k-th best key (32 halvings of the int32 range), keep
            # every better key and the lowest positions among those equal to it
            lo = tl.min(tl.where(valid, key, 2147483647), axis=0).to(tl.int64)
            hi = tl.max(tl.where(valid, key, -2147483648), axis=0).to(tl.int64)
            for _ in range(32):
                mid = lo + (hi - lo + 1) // 2
                enough = tl.sum((valid & (key >= mid)).to(tl.int32), axis=0) >= kept
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid - 1)
            better = valid & (key > lo)
            tie = valid & (key == lo)
            room = kept - tl.sum(better.to(tl.int32), axis=0)
            keep = (better | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= room))) & (kept > 0)
            place = i  # unused: index order
        else:
            # place of each entry in the ranking = how many entries beat it, counted CHUNK columns at a time
            mine = _packed(key, i, valid, BLOCK)
            place = tl.zeros([BLOCK], dtype=tl.int32)
            j = tl.arange(0, CHUNK)
            for j0 in range(0, n, CHUNK):
                theirs_ok = j0 + j < n
                theirs = _packed(_order_key(scores_ptr, start, j0 + j, theirs_ok, LARGEST), j0 + j, theirs_ok, BLOCK)
                place += tl.sum((theirs[None, :] > mine[:, None]).to(tl.int32), axis=1)
            keep = valid & (place < kept)
        if SORT_INDICES:
            rank = tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(index_ptr + out_start + rank, start + i, mask=keep)
        else:
            tl.store(index_ptr + out_start + place, start + i, mask=keep)
        if NUM_ROWS > 0:
            # the copies below read the indices this program just wrote
            tl.debug_barrier()
    if NUM_ROWS > 0:
        _copy_rows(index_ptr, out_start, kept, src0, dst0, width0)
    if NUM_ROWS > 1:
        _copy_rows(index_ptr, out_start, kept, src1, dst1, width1)
    if NUM_ROWS > 2:
        _copy_rows(index_ptr, out_start, kept, src2, dst2, width2)
    if NUM_ROWS > 3:
        _copy_rows(index_ptr, out_start, kept, src3, dst3, width3)


def _flat_rows(row: Tensor, count: int) -> Tensor:
    """row [count, ...] as a contiguous [count, width] view (bool as uint8: Triton stores bytes)."""
    row = row.contiguous()
    if row.dtype == torch.bool:
        row = row.view(torch.uint8)
    return row.reshape(count, math.prod(row.shape[1:]))


def topk_gather(
    scores: Tensor,
    offsets: Tensor,
    k: int | Tensor,
    rows: Sequence[Tensor] = (),
    largest: bool = True,
    sort_indices: bool = True,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    rows = tuple(rows)
    offsets, kept = check_topk_args(scores, offsets, k, rows, "topk_gather")
    lengths = offsets.diff()
    device = scores.device
    out_start = torch.cumsum(kept, 0) - kept
    total = int(kept.sum())
    index = torch.empty(total, dtype=torch.long, device=device)
    gathered = [torch.empty((total, *row.shape[1:]), dtype=row.dtype, device=device) for row in rows]
    segments = lengths.numel()
    if total == 0:
        return index, tuple(gathered)
    block = max(16, triton.next_power_of_2(int(lengths.max())))
    pairs = [
        (_flat_rows(row, row.shape[0]), _flat_rows(out, total))
        for row, out in zip(rows, gathered)
        if out.numel()  # nothing to copy for rows of width 0
    ]
    groups = [pairs[i : i + FUSED_ROWS] for i in range(0, len(pairs), FUSED_ROWS)] or [[]]
    for g, group in enumerate(groups):
        args = []
        for j in range(FUSED_ROWS):
            src, dst = group[j] if j < len(group) else (index, index)
            args += [src, dst, src.shape[1] if j < len(group) else 0]
        _topk_kernel[(segments,)](
            scores,
            offsets,
            kept,
            out_start,
            index,
            *args,
            BLOCK=block,
            CHUNK=min(block, max(16, PAIRWISE_TILE // block)),
            BISECT=bool(sort_indices) and block > PAIRWISE_MAX,
            LARGEST=bool(largest),
            SORT_INDICES=bool(sort_indices),
            SELECT=g == 0,
            NUM_ROWS=len(group),
            num_warps=min(16, max(4, block // 1024)),
        )
    return index, tuple(gathered)


def segmented_topk(
    scores: Tensor, offsets: Tensor, k: int | Tensor, largest: bool = True, sort_indices: bool = True
) -> Tensor:
    return topk_gather(scores, offsets, k, (), largest, sort_indices)[0]


def _supports_topk_gather(
    scores: Tensor,
    offsets: Tensor,
    k: int | Tensor,
    rows: Sequence[Tensor] = (),
    largest: bool = True,
    sort_indices: bool = True,
) -> str | None:
    if not isinstance(scores, Tensor) or scores.dtype not in SCORE_DTYPES:
        got = getattr(scores, "dtype", scores)
        return f"scores must be one of {SCORE_DTYPES} (float64 keys do not fit the int32 keys), got {got}"
    for i, row in enumerate(rows):
        if isinstance(row, Tensor) and row.dtype not in ROW_DTYPES:
            return f"rows[{i}] has dtype {row.dtype}; the copy supports {ROW_DTYPES}"
        if isinstance(row, Tensor) and row.device != scores.device:
            return f"rows[{i}] is on {row.device}, scores on {scores.device}"
    if isinstance(offsets, Tensor) and offsets.dim() == 1 and offsets.numel() > 1:
        longest = int(offsets.diff().max())
        if longest > MAX_SEGMENT:
            return f"a segment of {longest} scores; one program ranks at most {MAX_SEGMENT}"
        if not sort_indices and longest > SCORE_ORDER_MAX:
            return f"a segment of {longest} scores in score order (sort_indices=False); at most {SCORE_ORDER_MAX}"
    return None


def _supports_segmented_topk(
    scores: Tensor, offsets: Tensor, k: int | Tensor, largest: bool = True, sort_indices: bool = True
) -> str | None:
    return _supports_topk_gather(scores, offsets, k, (), largest, sort_indices)


topk_gather.supports = _supports_topk_gather  # type: ignore[attr-defined]
segmented_topk.supports = _supports_segmented_topk  # type: ignore[attr-defined]
