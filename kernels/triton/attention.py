"""Triton kernel of `vtc_kernels.attention.attention_rows`: one program per (batch, head, selected row). It reads
the row's query once, then walks the keys of its key head (h // (H / Hkv), so grouped-query keys are never
repeated) in tiles twice: first for the running per-lane max and sum of exponentials (online softmax), then to
write exp(logit - max) / sum. Inputs are read through their strides (transformers hands over transposed views).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtc_kernels.attention import check_attention_rows
from vtc_kernels.triton.rounding import round_to, round_to_bfloat16

Tensor = torch.Tensor

MAX_HEAD_DIM = 1024
MAX_TILE = 4096  # elements of one (keys x head dim) tile
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _logits(
    q,
    k_ptr,
    kk,
    d,
    key_mask,
    dim_mask,
    vis_ptr,
    scaling,
    stride_kk,
    stride_kd,
    stride_vk,
    DTYPE: tl.constexpr,
    ROUND: tl.constexpr,
):
    keys = tl.load(
        k_ptr + kk[:, None] * stride_kk + d[None, :] * stride_kd,
        mask=key_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    logit = tl.sum(keys * q[None, :], axis=1)
    if ROUND:
        # the reference's q @ k^T and * scaling each round to the inputs' dtype
        logit = round_to(round_to(logit, DTYPE) * scaling, DTYPE)
    else:
        logit = logit * scaling
    visible = tl.load(vis_ptr + kk * stride_vk, mask=key_mask, other=0) != 0
    return tl.where(key_mask & visible, logit, float("-inf"))


@triton.jit
def _attention_rows_kernel(
    q_ptr,
    k_ptr,
    rows_ptr,
    vis_ptr,
    out_ptr,
    heads,
    n_rows,
    n_keys,
    dim,
    rep,
    scaling,
    sq_b,
    sq_h,
    sq_q,
    sq_d,
    sk_b,
    sk_h,
    sk_k,
    sk_d,
    sr_b,
    sr_r,
    sv_b,
    sv_r,
    sv_k,
    DTYPE: tl.constexpr,
    ROUND: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    row = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    query_index = tl.load(rows_ptr + b * sr_b + row * sr_r).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dim_mask = d < dim
    q = tl.load(q_ptr + b * sq_b + h * sq_h + query_index * sq_q + d * sq_d, mask=dim_mask, other=0.0)
    q = q.to(tl.float32)
    k_base = k_ptr + b * sk_b + (h // rep) * sk_h
    vis_base = vis_ptr + b * sv_b + row * sv_r
    lanes = tl.arange(0, BLOCK_K)
    lane_max = tl.full([BLOCK_K], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, n_keys, BLOCK_K):
        kk = start + lanes
        logit = _logits(q, k_base, kk, d, kk < n_keys, dim_mask, vis_base, scaling, sk_k, sk_d, sv_k, DTYPE, ROUND)
        new_max = tl.maximum(lane_max, logit)
        # a lane that has seen only masked keys keeps max -inf and sum 0 (exp(-inf - -inf) would be NaN)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(logit - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(lane_sum * tl.exp(lane_max - shift), axis=0)
    # no visible key: row_max = -inf, so exp(-inf - -inf) = NaN everywhere, the reference's softmax of all -inf
    out_base = out_ptr + ((b * heads + h) * n_rows + row) * n_keys
    for start in range(0, n_keys, BLOCK_K):
        kk = start + lanes
        key_mask = kk < n_keys
        logit = _logits(q, k_base, kk, d, key_mask, dim_mask, vis_base, scaling, sk_k, sk_d, sv_k, DTYPE, ROUND)
        p = tl.exp(logit - row_max) / total
        if OUT_BF16:
            p = round_to_bfloat16(p)  # ties to even on the interpreter too (its own cast truncates)
        tl.store(out_base + kk, p.to(out_ptr.dtype.element_ty), mask=key_mask)


def attention_rows(
    query: Tensor,
    key: Tensor,
    rows: Tensor,
    key_visible: Tensor,
    scaling: float,
    upcast: bool,
) -> Tensor:
    """Triton `vtc_kernels.attention.attention_rows` (same signature and contract; `upcast` changes nothing
    here: the softmax always runs in float32 and the result has query's dtype, as the reference's)."""
    check_attention_rows(query, key, rows, key_visible)
    reason = attention_rows.supports(query, key)
    if reason is not None:
        raise ValueError(f"attention_rows: {reason}")
    batch, heads, n_queries, dim = query.shape
    hkv, n_keys = key.shape[1], key.shape[2]
    n_rows = rows.shape[1]
    # the kernel would read any address it is given; the reference's gather raises instead (one host sync)
    if rows.numel() and bool(((rows < 0) | (rows >= n_queries)).any()):
        raise ValueError(f"attention_rows: rows must be query indices in [0, {n_queries}), got {rows.tolist()}")
    out = torch.empty(batch, heads, n_rows, n_keys, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    block_k = max(1, min(triton.next_power_of_2(n_keys), MAX_TILE // block_d))
    visible = key_visible.view(torch.uint8)  # same strides, loads as bytes
    _attention_rows_kernel[(batch * heads, n_rows)](
        query,
        key,
        rows,
        visible,
        out,
        heads,
        n_rows,
        n_keys,
        dim,
        heads // hkv,
        float(scaling),
        *query.stride(),
        *key.stride(),
        *rows.stride(),
        *visible.stride(),
        DTYPE=_TL_DTYPE[query.dtype],
        ROUND=query.dtype != torch.float32,
        OUT_BF16=query.dtype == torch.bfloat16,
        BLOCK_K=block_k,
        BLOCK_D=block_d,
    )
    return out


def _supports(query: Tensor, key: Tensor, *args, **kwargs) -> str | None:
    if query.dtype not in _TL_DTYPE or key.dtype != query.dtype:
        return f"query and key of one dtype among float32, bfloat16, float16, got {query.dtype} and {key.dtype}"
    if query.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {query.shape[-1]} is over {MAX_HEAD_DIM} (one query row is one tile)"
    return None


attention_rows.supports = _supports  # type: ignore[attr-defined]
