"""Group-wise low-bit quantisation along the token axis: StreamingTOM's OQM store (`streamingtom/modules/oqm.py`,
`_quantize_tensor` / `_pack_Nbit` / `_unpack_Nbit` / `_dequantize_tensor`).

x [..., T, C] (tokens on dim -2, e.g. a KV cache [B, heads, T, d]) is cut into groups of `group_size` consecutive
tokens. For every group and every (leading index, channel) an asymmetric min-max quantiser of `bits` bits:

    scale = max((max - min) / (2^bits - 1), 1e-8)
    q     = clamp(round((x - min) / scale), 0, 2^bits - 1)          stored as uint8, 8 // bits values per byte
    x̂     = q * scale + min

Packing runs ALONG THE TOKEN AXIS, as the official code: byte j of a (leading index, channel) holds tokens
j * p ... j * p + p - 1 (p = 8 // bits), token j * p + i in bits [i * bits, (i + 1) * bits). So `packed` is
[..., T // p, C], `scale` and `minimum` are [..., T // group_size, C], and one group is `group_size // p`
consecutive packed rows. The official code asserts `group_size % pack_size == 0`, so it cannot run 2-bit with
its 50-token groups; vtc then pads each group to whole bytes (ceil(group_size / p) rows per group, the unused
high bits of a group's last byte zero), which leaves the layout identical wherever the official code runs.

dtype of `scale` / `minimum` (and of the arithmetic): float32 by default (`scale_dtype=torch.float32`). The
official code keeps them in the cache's dtype (bf16 / fp16); `scale_dtype=None` does that. float32 is the
default because (1) it makes the tolerance contract below hold (a bf16 scale and minimum carry 8 mantissa bits,
so the reconstruction can miss by much more than scale / 2), (2) the official 1e-8 floor underflows to 0 in
float16, where the official code divides 0 by 0 on constant groups (NaN, then an undefined uint8 cast); with
`scale_dtype=None` in float16 the floor becomes float16's smallest normal number instead. The cost is memory:
per group and channel 8 bytes of scale + minimum instead of 4 (4-bit, 50-token groups: 33 bytes instead of 29,
against 100 bytes of bf16), see `QuantizedGroups.nbytes`.

Tolerance contract (default float32 scale / minimum): every element satisfies

    |x - x̂| <= scale / 2 + (a few float32 ulps of the group's largest magnitude)

before x̂ is cast back to x's dtype; the cast adds at most half an ulp of x̂ in that dtype (bf16: |x̂| * 2^-8).
A constant group (max == min) is reconstructed exactly (q = 0, x̂ = min). The same order of operations as the
official code: subtract, divide, clamp to [0, 2^bits - 1], round half to even (clamping first or rounding first
give the same integer, the bounds being integers).

`quantize_groups` and `dequantize_groups` are kernel ops (`vtc_kernels.dispatch`; Triton kernels in
`vtc_kernels.triton.quant`, one program per (leading index, group) and tile of channels). Contract of the
kernels against this reference, for finite inputs:
  quantize_groups    exact: packed codes, scale and minimum equal element by element, for every scale dtype
                     (the kernel repeats the reference's operations: IEEE division, clamp, round half to even,
                     and with a bfloat16 / float16 scale one rounding to that dtype after every op);
  dequantize_groups  allclose, float32 (rtol 1e-6, atol 1e-6), bfloat16 (rtol 8e-3, atol 1e-5), float16
                     (rtol 1e-3, atol 1e-6): the kernel rounds q * scale and + min separately like the
                     reference (no fused multiply-add), so it is exact wherever the compiler keeps the two
                     roundings (the tests see no difference); the bounds allow one ulp of float32 on values of
                     magnitude up to ~8, and one ulp of the output dtype after the final cast.
NaN or infinite inputs are outside the contract (the reference casts NaN codes to uint8, which is undefined).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from vtc_kernels.dispatch import Tolerance, kernel_op

Tensor = torch.Tensor

ALLOWED_BITS = (2, 4)
SCALE_FLOOR = 1e-8  # official `torch.clamp(scales, min=1e-8)`


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or int(bits) != bits or int(bits) not in ALLOWED_BITS:
        raise ValueError(f"quantize_groups: bits must be one of {ALLOWED_BITS}, got {bits!r}")
    return int(bits)


@dataclasses.dataclass
class QuantizedGroups:
    """Tokens [..., T, C] quantised in groups of `group_size` along T (see the module docstring).

    packed   uint8 [..., num_groups * rows_per_group, C]: 8 // bits token values per byte, packed along the
             token axis (T // (8 // bits) rows when group_size is a multiple of 8 // bits)
    scale    [..., T // group_size, C]: step of each (group, leading index, channel), float32 unless quantised
             with `scale_dtype=None`
    minimum  [..., T // group_size, C]: the group's minimum, same dtype as `scale`
    bits, group_size: the quantiser; num_tokens: T; dtype: the dtype `dequantize_groups` returns (the input's)
    """

    packed: Tensor
    scale: Tensor
    minimum: Tensor
    bits: int
    group_size: int
    num_tokens: int
    dtype: torch.dtype

    @property
    def per_byte(self) -> int:
        """Token values stored in one byte (8 // bits)."""
        return 8 // self.bits

    @property
    def num_groups(self) -> int:
        return self.num_tokens // self.group_size

    @property
    def rows_per_group(self) -> int:
        """Packed rows (along dim -2) of one group: ceil(group_size / (8 // bits))."""
        return -(-self.group_size // self.per_byte)

    @property
    def nbytes(self) -> int:
        """Bytes held: packed values plus scales plus minima."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.minimum))

    def select(self, group_indices: Tensor | Sequence[int]) -> "QuantizedGroups":
        """The groups at `group_indices` (1-D, in that order; a group may repeat), e.g. the groups a retrieval
        picked. New tensors (gathered), so the result does not keep the whole store alive."""
        idx = torch.as_tensor(group_indices, dtype=torch.long, device=self.packed.device).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_groups):
            raise IndexError(
                f"QuantizedGroups.select: group indices must be in [0, {self.num_groups}), "
                f"got [{int(idx.min())}, {int(idx.max())}]"
            )
        rows = (idx[:, None] * self.rows_per_group + torch.arange(self.rows_per_group, device=idx.device)).reshape(-1)
        return dataclasses.replace(
            self,
            packed=self.packed.index_select(-2, rows),
            scale=self.scale.index_select(-2, idx),
            minimum=self.minimum.index_select(-2, idx),
            num_tokens=int(idx.numel()) * self.group_size,
        )

    def drop_first(self, n_groups: int) -> "QuantizedGroups":
        """Evict the oldest `n_groups` groups (0 <= n_groups <= num_groups). The kept part is copied, so the
        evicted memory is really released once the old object is dropped."""
        n = int(n_groups)
        if not 0 <= n <= self.num_groups:
            raise ValueError(f"QuantizedGroups.drop_first: n_groups must be in [0, {self.num_groups}], got {n_groups}")
        return dataclasses.replace(
            self,
            packed=self.packed[..., n * self.rows_per_group :, :].clone(),
            scale=self.scale[..., n:, :].clone(),
            minimum=self.minimum[..., n:, :].clone(),
            num_tokens=self.num_tokens - n * self.group_size,
        )

    def append(self, other: "QuantizedGroups") -> "QuantizedGroups":
        """These groups followed by `other`'s (`concat_groups([self, other])`)."""
        return concat_groups([self, other])

    @classmethod
    def cat(cls, parts: Sequence["QuantizedGroups"]) -> "QuantizedGroups":
        """`concat_groups(parts)`."""
        return concat_groups(parts)


def concat_groups(parts: Sequence[QuantizedGroups]) -> QuantizedGroups:
    """The groups of `parts`, in order (same bits, group_size, dtypes, leading dims and channels)."""
    parts = list(parts)
    if not parts:
        raise ValueError("concat_groups: nothing to concatenate (give at least one QuantizedGroups)")
    first = parts[0]
    for p in parts[1:]:
        mismatch = [
            name
            for name, a, b in (
                ("bits", p.bits, first.bits),
                ("group_size", p.group_size, first.group_size),
                ("dtype", p.dtype, first.dtype),
                ("scale dtype", p.scale.dtype, first.scale.dtype),
                (
                    "leading dims / channels",
                    (p.scale.shape[:-2], p.scale.shape[-1]),
                    (first.scale.shape[:-2], first.scale.shape[-1]),
                ),
            )
            if a != b
        ]
        if mismatch:
            raise ValueError(f"concat_groups: the parts differ in {', '.join(mismatch)}")
    if len(parts) == 1:
        return first
    return dataclasses.replace(
        first,
        packed=torch.cat([p.packed for p in parts], dim=-2),
        scale=torch.cat([p.scale for p in parts], dim=-2),
        minimum=torch.cat([p.minimum for p in parts], dim=-2),
        num_tokens=sum(p.num_tokens for p in parts),
    )


@kernel_op(
    "quantize_groups",
    tolerance=Tolerance.exact("codes, scales and minima equal element by element (finite inputs)"),
    triton="vtc_kernels.triton.quant:quantize_groups",
)
def quantize_groups(
    x: Tensor, bits: int = 4, group_size: int = 50, scale_dtype: torch.dtype | None = torch.float32
) -> QuantizedGroups:
    """Quantise x [..., T, C] in groups of `group_size` tokens along dim -2 (T a multiple of group_size) to `bits`
    bits (2 or 4), min-max per (group, leading index, channel); see the module docstring for the formula, the
    packing and the tolerance contract. `scale_dtype`: dtype of scale / minimum and of the arithmetic (float32;
    None = x's dtype, as the official code)."""
    bits = _check_bits(bits)
    per = 8 // bits
    group_size = int(group_size)
    if group_size < 1:
        raise ValueError(f"quantize_groups: group_size must be >= 1, got {group_size}")
    if x.dim() < 2:
        raise ValueError(f"quantize_groups: x must be [..., T, C] (tokens on dim -2), got shape {tuple(x.shape)}")
    *lead, t, c = x.shape
    if t % group_size:
        raise ValueError(f"quantize_groups: {t} tokens (dim -2 of x) is not a multiple of group_size {group_size}")
    groups = t // group_size
    levels = 2**bits - 1
    work = x.dtype if scale_dtype is None else scale_dtype
    floor = max(SCALE_FLOOR, torch.finfo(work).tiny) if work == torch.float16 else SCALE_FLOOR
    xs = x.to(work).reshape(*lead, groups, group_size, c)
    if groups:
        minimum = xs.amin(dim=-2)
        maximum = xs.amax(dim=-2)
    else:
        minimum = maximum = xs.new_zeros(*lead, 0, c)
    scale = ((maximum - minimum) / levels).clamp(min=floor)
    q = ((xs - minimum[..., None, :]) / scale[..., None, :]).clamp(0, levels).round().to(torch.uint8)
    rows = -(-group_size // per)
    if rows * per != group_size:  # pad each group to whole bytes (zero codes)
        q = torch.cat([q, q.new_zeros(*lead, groups, rows * per - group_size, c)], dim=-2)
    q = q.reshape(*lead, groups * rows, per, c)
    packed = q[..., 0, :].clone()
    for i in range(1, per):
        packed |= q[..., i, :] << (i * bits)
    return QuantizedGroups(packed, scale, minimum, bits, group_size, t, x.dtype)


def unpack_groups(q: QuantizedGroups) -> Tensor:
    """The integer codes [..., T, C] (uint8, each in [0, 2^bits - 1])."""
    per, bits = q.per_byte, q.bits
    mask = (1 << bits) - 1
    parts = [(q.packed >> (i * bits)) & mask for i in range(per)]
    stacked = torch.stack(parts, dim=-2)  # [..., groups * rows, per, C]
    lead, c = q.packed.shape[:-2], q.packed.shape[-1]
    codes = stacked.reshape(*lead, q.num_groups, q.rows_per_group * per, c)[..., : q.group_size, :]
    return codes.reshape(*lead, q.num_tokens, c)


@kernel_op(
    "dequantize_groups",
    tolerance=Tolerance.allclose(
        {torch.float32: (1e-6, 1e-6), torch.bfloat16: (8e-3, 1e-5), torch.float16: (1e-3, 1e-6)},
        note="q * scale and + min rounded separately as the reference (no FMA); exact in the tests",
    ),
    triton="vtc_kernels.triton.quant:dequantize_groups",
)
def dequantize_groups(q: QuantizedGroups) -> Tensor:
    """x̂ = q * scale + min, [..., T, C] in the original dtype (computed in the scale's dtype, then cast).

    Tolerance contract (Triton vs this reference): allclose, fp32 (rtol 1e-6, atol 1e-6), bf16 (8e-3, 1e-5),
    fp16 (1e-3, 1e-6); the kernel rounds the product and the sum separately (no FMA), as torch does."""
    codes = unpack_groups(q)
    c = codes.shape[-1]
    codes = codes.reshape(*codes.shape[:-2], q.num_groups, q.group_size, c).to(q.scale.dtype)
    out = codes * q.scale[..., None, :] + q.minimum[..., None, :]
    return out.reshape(*out.shape[:-3], q.num_tokens, c).to(q.dtype)
