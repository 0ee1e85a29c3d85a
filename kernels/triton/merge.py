"""Triton kernel of `vtc_kernels.merge.merge_into_anchors`.

The sources are sorted by anchor (stable: source order within an anchor); one program per (anchor, feature
slice) adds its sources in float32 one after another, then applies the rule and rounds once to the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtc_kernels.merge import MERGE_RULES, check_merge_args

Tensor = torch.Tensor

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _merge_kernel(
    anchors_ptr,
    sources_ptr,
    order_ptr,
    starts_ptr,
    source_weight_ptr,
    anchor_weight_ptr,
    out_ptr,
    width,
    beta,
    RULE: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    j = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    col_ok = cols < width
    first = tl.load(starts_ptr + j)
    last = tl.load(starts_ptr + j + 1)
    total = tl.zeros([BLOCK_W], dtype=tl.float32)
    mass = tl.zeros([BLOCK_W], dtype=tl.float32)
    for e in range(first, last):
        s = tl.load(order_ptr + e)
        x = tl.load(sources_ptr + s * width + cols, mask=col_ok, other=0.0).to(tl.float32)
        if RULE == 3:
            w = tl.load(source_weight_ptr + s).to(tl.float32)
            total += w * x
            mass += w
        else:
            total += x
    count = (last - first).to(tl.float32)
    raw = tl.load(anchors_ptr + j.to(tl.int64) * width + cols, mask=col_ok, other=0.0)
    anchor = raw.to(tl.float32)
    if RULE == 0:  # mean
        merged = (anchor + total) / (count + 1.0)
    elif RULE == 1:  # add_mean
        merged = anchor + total / tl.maximum(count, 1.0)
    elif RULE == 2:  # blend
        w = tl.maximum(1.0 / (count + 1.0), beta)
        merged = w * anchor + (1.0 - w) * (total / tl.maximum(count, 1.0))
    else:  # weighted_mean
        a = tl.load(anchor_weight_ptr + j).to(tl.float32)
        merged = (a * anchor + total) / (a + mass)
    out = merged.to(out_ptr.dtype.element_ty)
    if RULE == 3:
        out = tl.where(last > first, out, raw)  # anchors without sources: unchanged, bit for bit
    tl.store(out_ptr + j.to(tl.int64) * width + cols, out, mask=col_ok)


def merge_into_anchors(
    anchors: Tensor,
    sources: Tensor,
    assign: Tensor,
    rule: str = "mean",
    beta: float = 0.0,
    source_weight: Tensor | None = None,
    anchor_weight: Tensor | None = None,
    summation: str = "index_add",
) -> Tensor:
    check_merge_args(anchors, sources, assign, rule, summation, source_weight, anchor_weight)
    count = anchors.shape[0]
    width = anchors[0].numel() if count else 0
    out = torch.empty_like(anchors, memory_format=torch.contiguous_format)
    if count == 0 or width == 0:
        return out
    assign = assign.to(device=anchors.device, dtype=torch.long)
    order = torch.sort(assign, stable=True).indices  # each anchor's sources, in source order
    starts = torch.zeros(count + 1, dtype=torch.long, device=anchors.device)
    starts[1:] = torch.cumsum(torch.bincount(assign, minlength=count), 0)
    weighted = rule == "weighted_mean"
    block_w = min(256, triton.next_power_of_2(width))
    _merge_kernel[(count, triton.cdiv(width, block_w))](
        anchors.contiguous(),
        sources.contiguous(),
        order,
        starts,
        source_weight.contiguous() if weighted else order,
        anchor_weight.contiguous() if weighted else order,
        out,
        width,
        float(beta),
        RULE=MERGE_RULES.index(rule),
        BLOCK_W=block_w,
    )
    return out


def _supports_merge(
    anchors: Tensor,
    sources: Tensor,
    assign: Tensor,
    rule: str = "mean",
    beta: float = 0.0,
    source_weight: Tensor | None = None,
    anchor_weight: Tensor | None = None,
    summation: str = "index_add",
) -> str | None:
    if not isinstance(anchors, Tensor) or anchors.dtype not in DTYPES:
        got = getattr(anchors, "dtype", anchors)
        return f"features must be one of {DTYPES} (the kernel computes in float32), got {got}"
    for name, w in (("source_weight", source_weight), ("anchor_weight", anchor_weight)):
        if isinstance(w, Tensor) and w.dtype == torch.float64:
            return f"{name} is float64; the kernel computes in float32"
    return None


merge_into_anchors.supports = _supports_merge  # type: ignore[attr-defined]
