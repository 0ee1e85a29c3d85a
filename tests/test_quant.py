"""Group-wise token-axis quantisation (StreamingTOM's OQM store): the tolerance contract, the packing against a
hand unpack, a transcription of the official `_quantize_tensor` / `_dequantize_tensor`, and the group
operations (select, concat, drop_first) against slicing the whole dequantised tensor."""

from __future__ import annotations

import pytest
import torch

from vtc_kernels import QuantizedGroups, dequantize_groups, quantize_groups
from vtc_kernels.quant import concat_groups, unpack_groups


def bound(x: torch.Tensor, q: QuantizedGroups) -> torch.Tensor:
    """The documented tolerance per element: scale / 2 plus float32 rounding, plus the cast back to x's dtype."""
    scale = q.scale.repeat_interleave(q.group_size, dim=-2)
    amax = x.float().abs().amax()
    cast = 0.0 if x.dtype == torch.float32 else torch.finfo(x.dtype).eps * x.float().abs()
    return scale / 2 + 8 * torch.finfo(torch.float32).eps * amax + cast


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_the_tolerance_contract(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(2, 3, 40, 16, generator=g) * torch.linspace(0.01, 30, 16)).to(dtype)
    q = quantize_groups(x, bits=bits, group_size=8)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (2, 3, 40 // (8 // bits), 16)
    assert q.scale.shape == q.minimum.shape == (2, 3, 5, 16) and q.scale.dtype == torch.float32
    assert (q.bits, q.group_size, q.num_tokens, q.num_groups, q.dtype) == (bits, 8, 40, 5, dtype)
    x_hat = dequantize_groups(q)
    assert x_hat.dtype == dtype and x_hat.shape == x.shape
    err = (x.float() - x_hat.float()).abs()
    assert bool((err <= bound(x, q)).all()), float((err - bound(x, q)).max())
    # the bound is not vacuous: the error reaches a good part of scale / 2 somewhere
    assert float((err / q.scale.repeat_interleave(8, dim=-2)).max()) > 0.3
    # codes stay in range, and the extremes of each group are hit
    codes = unpack_groups(q)
    assert int(codes.max()) == 2**bits - 1 and int(codes.min()) == 0


def test_constant_groups_are_exact():
    x = torch.randn(4, 1, 6).repeat_interleave(10, dim=1)  # [4, 10, 6]: every group constant per channel
    x = torch.cat([x, torch.full((4, 10, 6), 3.14159)], dim=1)
    for bits in (2, 4):
        q = quantize_groups(x, bits=bits, group_size=10)
        assert torch.equal(dequantize_groups(q), x)
        assert torch.equal(q.scale, torch.full_like(q.scale, 1e-8))
        assert int(unpack_groups(q).max()) == 0
    # bf16 too (min is one of the group's values, so it survives the casts)
    xb = x.bfloat16()
    assert torch.equal(dequantize_groups(quantize_groups(xb, 4, 10)), xb)


def reference_codes(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """[..., T, C] codes by a plain loop over groups, positions and channels."""
    levels = 2**bits - 1
    lead, t, c = x.shape[:-2], x.shape[-2], x.shape[-1]
    flat = x.float().reshape(-1, t, c)
    out = torch.zeros(flat.shape, dtype=torch.long)
    for b in range(flat.shape[0]):
        for g in range(t // group_size):
            for ch in range(c):
                col = flat[b, g * group_size : (g + 1) * group_size, ch]
                lo, hi = float(col.min()), float(col.max())
                scale = max(torch.tensor((hi - lo) / levels, dtype=torch.float32).item(), 1e-8)
                for i in range(group_size):
                    v = (col[i] - torch.tensor(lo)) / torch.tensor(scale, dtype=torch.float32)
                    out[b, g * group_size + i, ch] = int(torch.round(v.clamp(0, levels)))
    return out.reshape(*lead, t, c)


@pytest.mark.parametrize("bits,group_size", [(2, 4), (4, 4), (4, 6), (2, 6), (2, 5)])
def test_packing_along_tokens_matches_a_hand_unpack(bits, group_size):
    """Low bits first along the tokens, as `_pack_Nbit`; a group that does not fill whole bytes (the official
    code refuses: 2-bit with 6 or 5 tokens, 4-bit with 5) starts on a fresh byte, the rest of its last byte 0."""
    g = torch.Generator().manual_seed(0)
    t = 3 * group_size
    x = torch.randn(2, t, 3, generator=g)
    q = quantize_groups(x, bits=bits, group_size=group_size)
    codes = reference_codes(x, bits, group_size)
    per = 8 // bits
    rows = -(-group_size // per)
    assert q.rows_per_group == rows and q.packed.shape == (2, 3 * rows, 3)
    for b in range(2):
        for ch in range(3):
            for token in range(t):
                group, i = divmod(token, group_size)
                byte = int(q.packed[b, group * rows + i // per, ch])
                value = (byte >> (bits * (i % per))) & ((1 << bits) - 1)
                assert value == int(codes[b, token, ch]), (b, token, ch)
            for group in range(3):  # padding bits are zero
                last = int(q.packed[b, group * rows + rows - 1, ch])
                used = group_size - (rows - 1) * per
                assert last >> (bits * used) == 0
    assert torch.equal(unpack_groups(q).long(), codes)
    assert torch.equal(
        dequantize_groups(q.select([2, 0])),
        torch.cat([dequantize_groups(q)[:, 2 * group_size :], dequantize_groups(q)[:, :group_size]], dim=1),
    )


def official_quantize(tensor: torch.Tensor, bits: int, group_size: int):
    """`OQM._quantize_tensor` + `_pack_Nbit` (streamingtom/modules/oqm.py), transcribed for [B, H, S, D]."""
    levels, pack = 2**bits - 1, 8 // bits
    b, h, s, d = tensor.shape
    groups = s // group_size
    r = tensor.permute(0, 1, 3, 2).contiguous().reshape(b * h * d, groups, group_size)
    mins, maxs = r.min(dim=-1)[0], r.max(dim=-1)[0]
    scales = torch.clamp((maxs - mins) / levels, min=1e-8)
    qt = ((r - mins.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, levels).round_().to(torch.uint8)
    qt = qt.reshape(b, h, d, s).reshape(b, h, d, s // pack, pack)
    packed = (qt << (torch.arange(pack) * bits)).sum(dim=-1).to(torch.uint8)
    scales = scales.reshape(b, h, d, groups).permute(0, 1, 3, 2)
    mins = mins.reshape(b, h, d, groups).permute(0, 1, 3, 2)
    return packed.permute(0, 1, 3, 2).contiguous(), scales, mins


def official_dequantize(packed, scales, mins, s, bits, group_size):
    b, h, _, d = packed.shape
    pack, groups = 8 // bits, s // group_size
    p = packed.permute(0, 1, 3, 2).contiguous()
    shifts = torch.arange(pack) * bits
    unpacked = ((p.unsqueeze(-1).expand(b, h, d, s // pack, pack) >> shifts) & ((1 << bits) - 1)).reshape(b, h, d, s)
    flat = unpacked.reshape(b * h * d, groups, group_size).to(scales.dtype)
    out = flat * scales.permute(0, 1, 3, 2).reshape(b * h * d, groups, 1)
    out = out + mins.permute(0, 1, 3, 2).reshape(b * h * d, groups, 1)
    return out.reshape(b, h, d, s).permute(0, 1, 3, 2).contiguous()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_dtype_none_is_the_official_code(bits, dtype):
    """scale_dtype=None keeps scale / minimum in the cache's dtype: bit-identical to the official store; float32
    (the default) gives the same codes on float32 input."""
    g = torch.Generator().manual_seed(1)
    size = 10 if bits == 4 else 8  # the official code needs whole bytes per group
    kv = (torch.randn(1, 2, 40, 8, generator=g) * 4).to(dtype)
    packed, scales, mins = official_quantize(kv, bits, size)
    q = quantize_groups(kv, bits=bits, group_size=size, scale_dtype=None)
    assert q.scale.dtype == dtype
    assert torch.equal(q.packed, packed) and torch.equal(q.scale, scales) and torch.equal(q.minimum, mins)
    assert torch.equal(dequantize_groups(q), official_dequantize(packed, scales, mins, 40, bits, size))
    if dtype == torch.float32:
        assert torch.equal(quantize_groups(kv, bits=bits, group_size=size).packed, packed)


def test_float16_constant_group_does_not_divide_by_zero():
    """The official 1e-8 floor underflows to 0 in float16 (0 / 0 on a constant group); vtc floors at float16's
    smallest normal number instead, and the default float32 scale never has the problem."""
    x = torch.ones(1, 8, 4, dtype=torch.float16)
    for scale_dtype in (None, torch.float32):
        q = quantize_groups(x, 4, 8, scale_dtype=scale_dtype)
        assert torch.equal(dequantize_groups(q), x) and not bool(torch.isnan(q.scale).any())


def test_select_concat_drop_first_match_slicing_the_whole():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 2, 30, 4, generator=g)
    q = quantize_groups(x, bits=4, group_size=6)  # 5 groups of 6 tokens, 3 packed rows each
    whole = dequantize_groups(q)

    def groups_of(t, idx):
        return torch.cat([t[..., i * 6 : (i + 1) * 6, :] for i in idx], dim=-2)

    for idx in ([3, 0, 4], [2], [1, 1], []):
        part = q.select(torch.tensor(idx, dtype=torch.long))
        assert part.num_tokens == 6 * len(idx) and part.num_groups == len(idx)
        if idx:
            assert torch.equal(dequantize_groups(part), groups_of(whole, idx))
    assert torch.equal(dequantize_groups(q.select([4, 2])), groups_of(whole, [4, 2]))  # a list works too
    for n in range(6):
        rest = q.drop_first(n)
        assert rest.num_groups == 5 - n and rest.num_tokens == 30 - 6 * n
        assert torch.equal(dequantize_groups(rest), whole[..., 6 * n :, :])
        assert rest.packed.data_ptr() != q.packed.data_ptr() or n == 5  # a copy: eviction frees memory
    # quantising pieces and concatenating equals quantising the whole (groups are independent)
    pieces = [quantize_groups(x[..., a:b, :], 4, 6) for a, b in ((0, 12), (12, 18), (18, 30))]
    joined = concat_groups(pieces)
    for name in ("packed", "scale", "minimum"):
        assert torch.equal(getattr(joined, name), getattr(q, name))
    assert joined.num_tokens == 30
    assert torch.equal(dequantize_groups(QuantizedGroups.cat(pieces)), whole)
    assert torch.equal(dequantize_groups(pieces[0].append(pieces[1])), whole[..., :18, :])
    # retrieval then eviction, in either order
    assert torch.equal(dequantize_groups(q.drop_first(2).select([0, 2])), groups_of(whole, [2, 4]))


def test_nbytes():
    x = torch.randn(1, 4, 100, 128, dtype=torch.bfloat16)
    for bits in (2, 4):
        q = quantize_groups(x, bits=bits, group_size=50)
        # 4-bit: 25 bytes per group and channel; 2-bit: 50 values fill 12.5 bytes, each group padded to 13
        packed = 4 * 2 * 128 * (25 if bits == 4 else 13)
        assert q.nbytes == packed + 2 * (4 * 2 * 128) * 4  # float32 scale and minimum per group and channel
        official = quantize_groups(x, bits=bits, group_size=50, scale_dtype=None)
        assert official.nbytes == packed + 2 * (4 * 2 * 128) * 2
    assert q.select([1]).nbytes == q.nbytes // 2 == q.drop_first(1).nbytes


def test_errors_name_the_problem():
    x = torch.randn(2, 30, 4)
    for bits in (1, 3, 8, 4.5, True):
        with pytest.raises(ValueError, match=r"bits must be one of \(2, 4\)"):
            quantize_groups(x, bits=bits, group_size=10)
    with pytest.raises(ValueError, match="30 tokens .* not a multiple of group_size 20"):
        quantize_groups(x, bits=4, group_size=20)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        quantize_groups(x, bits=4, group_size=0)
    with pytest.raises(ValueError, match="tokens on dim -2"):
        quantize_groups(torch.randn(10), bits=4, group_size=10)
    q = quantize_groups(x, 4, 10)
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        q.select([3])
    with pytest.raises(ValueError, match="n_groups"):
        q.drop_first(4)
    with pytest.raises(ValueError, match="bits"):
        concat_groups([q, quantize_groups(x, 2, 10)])
    with pytest.raises(ValueError, match="leading dims"):
        concat_groups([q, quantize_groups(torch.randn(3, 10, 4), 4, 10)])
    with pytest.raises(ValueError, match="nothing to concatenate"):
        concat_groups([])
