"""Triton kernels of `vtc_kernels.quant`: one program per (leading index, group) and tile of channels.

The quantiser reads a group's tokens as a [rows, 8 // bits, channels] tile, so the packed byte of a row is a sum
of shifted codes over the middle axis. It reproduces the reference operation by operation (IEEE division
`div_rn`, clamp, round half to even, and in bfloat16 / float16 one rounding per op when the scale keeps x's
dtype), which is why the codes, scales and minima are exact. The dequantiser is compiled without fused
multiply-add, so q * scale + min rounds twice like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtc_kernels.quant import SCALE_FLOOR, QuantizedGroups, _check_bits
from vtc_kernels.triton.rounding import round_to

Tensor = torch.Tensor

MAX_TILE = 4096  # elements of one (tokens x channels) tile
MAX_GROUP_TOKENS = 4096  # a whole group is one tile along the tokens

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _quantize_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    min_ptr,
    groups,
    group_size,
    rows_per_group,
    channels,
    floor,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    LEVELS: tl.constexpr,
    WORK: tl.constexpr,
    ROUND: tl.constexpr,  # the work dtype is not float32: round to it after every op
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # (helpers are called only under constexpr flags: each call costs tens of ms in Triton's interpreter)
    tile = tl.program_id(0)  # leading index * groups + group
    lead = tile // groups
    group = tile % groups
    r = tl.arange(0, BLOCK_R)
    i = tl.arange(0, PER)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    token = r[:, None, None] * PER + i[None, :, None]  # token inside the group, [BLOCK_R, PER, 1]
    mask = (token < group_size) & (c < channels)[None, None, :]
    first = (lead * groups + group).to(tl.int64) * group_size  # first token row of the group in x [L * T, C]
    x = tl.load(x_ptr + (first + token) * channels + c[None, None, :], mask=mask, other=0.0).to(tl.float32)
    if ROUND:
        x = round_to(x, WORK)  # the reference casts x to the work dtype first
    low = tl.min(tl.min(tl.where(mask, x, float("inf")), axis=1), axis=0)
    high = tl.max(tl.max(tl.where(mask, x, float("-inf")), axis=1), axis=0)
    span = high - low
    if ROUND:
        span = round_to(span, WORK)
    scale = tl.math.div_rn(span, tl.full(span.shape, LEVELS, tl.float32))
    if ROUND:
        scale = round_to(scale, WORK)
    scale = tl.maximum(scale, floor)
    v = x - low[None, None, :]
    if ROUND:
        v = round_to(v, WORK)
    v = tl.math.div_rn(v, tl.broadcast_to(scale[None, None, :], v.shape))
    if ROUND:
        v = round_to(v, WORK)
    v = tl.minimum(tl.maximum(v, 0.0), LEVELS)
    # round half to even: floor, then up past .5, and at exactly .5 only from an odd floor
    whole = tl.floor(v)
    frac = v - whole  # exact for v in [0, LEVELS]
    up = (frac > 0.5) | ((frac == 0.5) & ((whole.to(tl.int32) & 1) == 1))
    codes = tl.where(mask & up, whole + 1.0, tl.where(mask, whole, 0.0)).to(tl.int32)
    byte = tl.sum(codes << (i * BITS)[None, :, None], axis=1)  # [BLOCK_R, BLOCK_C]
    row = tile.to(tl.int64) * rows_per_group + r
    out_mask = (r < rows_per_group)[:, None] & (c < channels)[None, :]
    tl.store(packed_ptr + row[:, None] * channels + c[None, :], byte.to(tl.uint8), mask=out_mask)
    c_mask = c < channels
    tl.store(scale_ptr + tile.to(tl.int64) * channels + c, scale.to(scale_ptr.dtype.element_ty), mask=c_mask)
    tl.store(min_ptr + tile.to(tl.int64) * channels + c, low.to(min_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _dequantize_kernel(
    packed_ptr,
    scale_ptr,
    min_ptr,
    out_ptr,
    groups,
    group_size,
    rows_per_group,
    channels,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    WORK: tl.constexpr,
    OUT: tl.constexpr,
    ROUND: tl.constexpr,  # the scale's dtype is not float32
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    tile = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    i = tl.arange(0, PER)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < channels
    row = tile.to(tl.int64) * rows_per_group + r
    row_mask = (r < rows_per_group)[:, None] & c_mask[None, :]
    byte = tl.load(packed_ptr + row[:, None] * channels + c[None, :], mask=row_mask, other=0).to(tl.int32)
    codes = (byte[:, None, :] >> (i * BITS)[None, :, None]) & ((1 << BITS) - 1)  # [BLOCK_R, PER, BLOCK_C]
    scale = tl.load(scale_ptr + tile.to(tl.int64) * channels + c, mask=c_mask, other=0.0).to(tl.float32)
    low = tl.load(min_ptr + tile.to(tl.int64) * channels + c, mask=c_mask, other=0.0).to(tl.float32)
    value = codes.to(tl.float32) * scale[None, None, :]
    if ROUND:
        value = round_to(value, WORK)
    value = value + low[None, None, :]
    if ROUND:
        value = round_to(value, WORK)
    if OUT == tl.bfloat16:
        value = round_to(value, OUT)  # the interpreter's own cast truncates
    token = r[:, None, None] * PER + i[None, :, None]
    mask = (token < group_size) & c_mask[None, None, :]
    first = tile.to(tl.int64) * group_size
    tl.store(out_ptr + (first + token) * channels + c[None, None, :], value.to(out_ptr.dtype.element_ty), mask=mask)


def _blocks(group_size: int, per: int, channels: int) -> tuple[int, int]:
    rows = -(-group_size // per)
    block_r = triton.next_power_of_2(rows)
    block_c = max(1, min(triton.next_power_of_2(max(channels, 1)), MAX_TILE // (block_r * per)))
    return block_r, block_c


def quantize_groups(
    x: Tensor, bits: int = 4, group_size: int = 50, scale_dtype: torch.dtype | None = torch.float32
) -> QuantizedGroups:
    """Triton `vtc_kernels.quant.quantize_groups` (same signature and contract)."""
    bits = _check_bits(bits)
    group_size = int(group_size)
    if group_size < 1:
        raise ValueError(f"quantize_groups: group_size must be >= 1, got {group_size}")
    if x.dim() < 2:
        raise ValueError(f"quantize_groups: x must be [..., T, C] (tokens on dim -2), got shape {tuple(x.shape)}")
    *lead, t, c = x.shape
    if t % group_size:
        raise ValueError(f"quantize_groups: {t} tokens (dim -2 of x) is not a multiple of group_size {group_size}")
    reason = quantize_groups.supports(x, bits, group_size, scale_dtype)
    if reason is not None:
        raise ValueError(f"quantize_groups: {reason}")
    per = 8 // bits
    groups = t // group_size
    rows = -(-group_size // per)
    work = x.dtype if scale_dtype is None else scale_dtype
    floor = max(SCALE_FLOOR, torch.finfo(work).tiny) if work == torch.float16 else SCALE_FLOOR
    floor = float(torch.tensor(floor, dtype=work))  # the clamp bound as the work dtype holds it
    leading = 1
    for n in lead:
        leading *= n
    packed = torch.empty(*lead, groups * rows, c, dtype=torch.uint8, device=x.device)
    scale = torch.empty(*lead, groups, c, dtype=work, device=x.device)
    minimum = torch.empty(*lead, groups, c, dtype=work, device=x.device)
    if leading * groups and c:
        block_r, block_c = _blocks(group_size, per, c)
        grid = (leading * groups, triton.cdiv(c, block_c))
        _quantize_kernel[grid](
            x.contiguous(),
            packed,
            scale,
            minimum,
            groups,
            group_size,
            rows,
            c,
            floor,
            BITS=bits,
            PER=per,
            LEVELS=2**bits - 1,
            WORK=_TL_DTYPE[work],
            ROUND=work != torch.float32,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
        )
    return QuantizedGroups(packed, scale, minimum, bits, group_size, t, x.dtype)


def _quantize_supports(x: Tensor, bits: int = 4, group_size: int = 50, scale_dtype=torch.float32, **_) -> str | None:
    work = x.dtype if scale_dtype is None else scale_dtype
    if x.dtype not in _TL_DTYPE or work not in _TL_DTYPE:
        return f"x and the scale in float32, bfloat16 or float16 only, got x {x.dtype}, scale {work}"
    per = 8 // int(bits) if int(bits) in (2, 4) else 1
    if -(-int(group_size) // per) * per > MAX_GROUP_TOKENS:
        return f"group_size {group_size} is over {MAX_GROUP_TOKENS} tokens (one group is one tile)"
    return None


quantize_groups.supports = _quantize_supports  # type: ignore[attr-defined]


def dequantize_groups(q: QuantizedGroups) -> Tensor:
    """Triton `vtc_kernels.quant.dequantize_groups` (same signature and contract)."""
    reason = dequantize_groups.supports(q)
    if reason is not None:
        raise ValueError(f"dequantize_groups: {reason}")
    lead, c = q.packed.shape[:-2], q.packed.shape[-1]
    out = torch.empty(*lead, q.num_tokens, c, dtype=q.dtype, device=q.packed.device)
    tiles = lead.numel() * q.num_groups
    if tiles and c:
        block_r, block_c = _blocks(q.group_size, q.per_byte, c)
        _dequantize_kernel[(tiles, triton.cdiv(c, block_c))](
            q.packed.contiguous(),
            q.scale.contiguous(),
            q.minimum.contiguous(),
            out,
            q.num_groups,
            q.group_size,
            q.rows_per_group,
            c,
            BITS=q.bits,
            PER=q.per_byte,
            WORK=_TL_DTYPE[q.scale.dtype],
            OUT=_TL_DTYPE[q.dtype],
            ROUND=q.scale.dtype != torch.float32,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            enable_fp_fusion=False,  # q * scale + min rounds twice, as the reference
        )
    return out


def _dequantize_supports(q: QuantizedGroups, **_) -> str | None:
    if q.dtype not in _TL_DTYPE or q.scale.dtype not in _TL_DTYPE:
        return f"float32, bfloat16 or float16 values and scales only, got {q.dtype}, scale {q.scale.dtype}"
    if q.rows_per_group * q.per_byte > MAX_GROUP_TOKENS:
        return f"group_size {q.group_size} is over {MAX_GROUP_TOKENS} tokens (one group is one tile)"
    return None


dequantize_groups.supports = _dequantize_supports  # type: ignore[attr-defined]
