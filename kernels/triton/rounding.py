"""Rounding helpers shared by the Triton kernels.

`round_to_bfloat16` rounds float32 to the nearest bfloat16 (ties to even), returned as float32. A plain
`.to(tl.bfloat16)` already does that on GPUs, but Triton's CPU interpreter truncates instead, so a kernel that
must match torch's bfloat16 arithmetic (one rounding per op) rounds with this first; the later cast of an
exactly representable value is then exact under both.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_bfloat16(x):
    bits = x.to(tl.uint32, bitcast=True)
    # add half an ulp of bfloat16 (minus one when the kept lowest bit is even: ties to even), drop 16 bits
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    rounded = bits.to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)  # NaN stays NaN (the addition could carry a NaN payload into inf)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 x rounded to DTYPE (float32, float16 or bfloat16; ties to even), as float32."""
    if DTYPE == tl.bfloat16:
        return round_to_bfloat16(x)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
