"""vtc_kernels.quant ops as kernel ops: the reference's codes against a plain per-(group, channel) loop, its
properties, and the Triton kernels against the reference (codes, scales and minima exact; dequantised values
within the stated bounds). tests/test_quant.py holds the reference's own tests (official code, layout)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernel_checks import DEVICE, assert_kernel_matches, both_backends, needs_triton
from vtc_kernels.quant import dequantize_groups, quantize_groups, unpack_groups


def loop_codes(x: torch.Tensor, bits: int, group_size: int) -> list[list[int]]:
    """Codes of x [T, C] (float32 scale), one (group, channel) at a time in float32 scalars, round half to even."""
    levels = 2**bits - 1
    t, c = x.shape
    codes = [[0] * c for _ in range(t)]
    for g in range(t // group_size):
        for ch in range(c):
            column = x[g * group_size : (g + 1) * group_size, ch].float()
            low, high = column.min(), column.max()
            scale = torch.clamp((high - low) / levels, min=1e-8)
            for i, v in enumerate(column):
                step = float(torch.clamp((v - low) / scale, 0, levels))
                codes[g * group_size + i][ch] = round(step)  # Python's round: half to even
    return codes


@pytest.mark.parametrize(("bits", "group_size"), [(4, 5), (2, 6), (2, 3)])
def test_reference_codes_match_the_loop(bits, group_size):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * group_size, 3, generator=g)
    x[:group_size, 0] = 0.5  # a constant group: every code 0
    q = quantize_groups(x, bits, group_size)
    assert unpack_groups(q).tolist() == loop_codes(x, bits, group_size)


@settings(max_examples=25, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    group_size=st.integers(1, 7),
    groups=st.integers(0, 3),
    channels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_reference_properties(bits, group_size, groups, channels, seed):
    """Codes in range; every (group, channel) uses code 0 at its minimum and the top code at its maximum; the
    reconstruction is within half a step; quantising the reconstruction again gives the same codes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, groups * group_size, channels, generator=g)
    q = quantize_groups(x, bits, group_size)
    codes = unpack_groups(q).long()
    assert codes.shape == x.shape and (codes.numel() == 0 or int(codes.max()) <= 2**bits - 1)
    x_hat = dequantize_groups(q)
    grouped = codes.reshape(2, groups, group_size, channels)
    varies = (q.scale > 1e-8)[:, :, None, :].expand_as(grouped)
    assert bool((grouped.amin(dim=2) == 0).all())
    assert bool((grouped.amax(dim=2)[varies[:, :, 0]] == 2**bits - 1).all())
    step = q.scale.repeat_interleave(group_size, dim=1)
    assert bool(((x - x_hat).abs() <= step / 2 + 1e-6).all())
    assert torch.equal(unpack_groups(quantize_groups(x_hat, bits, group_size)), codes.to(torch.uint8))


# --- Triton against the reference (tiny: the CPU runs Triton's interpreter) --------------------------------------


def tie_input(bits: int, group_size: int, channels: int, dtype: torch.dtype) -> torch.Tensor:
    """Two groups: the first spans [0, 2^bits - 1] so the step is 1 and x.5 values are exact ties (half to even),
    with a constant channel; the second random."""
    levels = 2**bits - 1
    g = torch.Generator().manual_seed(bits * 10 + group_size)
    x = torch.randn(2 * group_size, channels, generator=g) * 3
    ramp = torch.tensor([0.0, float(levels), 0.5, 1.5, 2.5, levels - 0.5, 1.25][:group_size])
    x[: ramp.numel(), 0] = ramp
    x[:group_size, 1] = 2.0
    return x.to(dtype)


@needs_triton
@pytest.mark.parametrize(
    ("bits", "group_size", "dtype"),
    [(4, 7, torch.float32), (2, 6, torch.float32), (4, 7, torch.bfloat16), (2, 5, torch.float16)],
)
def test_triton_quantize_is_exact_and_dequantize_close(bits, group_size, dtype):
    """Group sizes that are not a multiple of 8 // bits pad each group to whole bytes."""
    x = tie_input(bits, group_size, 5, dtype).to(DEVICE)
    q, _ = assert_kernel_matches(quantize_groups, x, bits, group_size)
    codes = unpack_groups(q)[:group_size, 0].tolist()
    assert codes[:4] == [0, 2**bits - 1, 0, 2][:group_size] and codes[4:5] == [2][: max(group_size - 4, 0)]
    out, _ = assert_kernel_matches(dequantize_groups, q)
    assert out.dtype == dtype


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_quantize_in_the_cache_dtype(dtype):
    """scale_dtype=None: the official arithmetic in bf16 / fp16, one rounding per op; float16's floor on a constant
    group."""
    x = tie_input(4, 4, 3, dtype).reshape(2, 4, 3).to(DEVICE)  # leading dim 2, one group each
    q, _ = assert_kernel_matches(quantize_groups, x, 4, 4, scale_dtype=None)
    assert q.scale.dtype == dtype
    assert_kernel_matches(dequantize_groups, q)


@needs_triton
def test_triton_quantize_without_groups_and_with_leading_dims():
    empty = torch.zeros(2, 0, 3).to(DEVICE)
    expected, actual = both_backends(quantize_groups, empty, 4, 5)
    assert actual.packed.shape == expected.packed.shape == (2, 0, 3)
    x = torch.randn(2, 1, 4, 3).to(DEVICE)
    assert_kernel_matches(quantize_groups, x, 2, 4)


def test_bad_arguments_are_named_by_both_backends():
    from vtc_kernels.dispatch import triton_available, use_backend

    backends = ["torch"] + (["triton"] if triton_available() else [])
    x = torch.randn(10, 3)
    for backend in backends:
        with use_backend(backend):
            with pytest.raises(ValueError, match="bits must be one of"):
                quantize_groups(x, bits=3, group_size=5)
            with pytest.raises(ValueError, match="not a multiple of group_size"):
                quantize_groups(x, bits=4, group_size=4)
