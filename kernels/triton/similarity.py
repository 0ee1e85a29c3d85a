"""Triton kernels of `vtc_kernels.similarity`: one kernel computes every official cosine variant of row pairs
from three float32 sums (a.b, |a|^2, |b|^2), reading each row once; the adjacent-frame op reads frame t and
t + step straight from x (no shifted copies), and its segmented form maps output rows to pairs through an index
of first frames."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from vtc_kernels.similarity import FORMULAS, NORMALIZE, adjacent_pair_frames, check_step, check_variant
from vtc_kernels.triton.rounding import round_to_bfloat16

Tensor = torch.Tensor

F_NORMALIZE_EPS = 1e-12  # F.normalize's default
COSINE_EPS = 1e-8  # F.cosine_similarity's default
MAX_TILE = 4096  # elements of one (rows x channels) tile


@triton.jit
def _cosine_rows_kernel(
    a_ptr,
    b_ptr,
    first_ptr,
    out_ptr,
    n_rows,
    positions,
    dim,
    eps_normalize,
    eps_cosine,
    NORMALIZE: tl.constexpr,  # 0 none, 1 eps, 2 exact
    FORMULA: tl.constexpr,  # 0 torch, 1 ratio, 2 dot
    HAS_FIRST: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    if HAS_FIRST:
        # output row = (pair, position); the pair's first frame comes from the index
        pair = rows // positions
        frame = tl.load(first_ptr + pair, mask=row_ok, other=0).to(tl.int64)
        src = frame * positions + (rows % positions)
    else:
        src = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    sq_a = tl.zeros([BLOCK_R], dtype=tl.float32)
    sq_b = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, dim, BLOCK_D):
        c = start + cols
        mask = row_ok[:, None] & (c < dim)[None, :]
        offs = src[:, None] * dim + c[None, :]
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(a * b, axis=1)
        sq_a += tl.sum(a * a, axis=1)
        sq_b += tl.sum(b * b, axis=1)
    norm_a = tl.sqrt_rn(sq_a)
    norm_b = tl.sqrt_rn(sq_b)
    # normalising first divides a by d_a: the dot and the norms of the normalised rows follow
    if NORMALIZE == 1:
        d_a = tl.maximum(norm_a, eps_normalize)
        d_b = tl.maximum(norm_b, eps_normalize)
        dot = dot / (d_a * d_b)
        norm_a = norm_a / d_a
        norm_b = norm_b / d_b
    elif NORMALIZE == 2:
        dot = dot / (norm_a * norm_b)  # no epsilon: a zero row gives 0 / 0 = NaN, as the reference
        norm_a = norm_a / norm_a
        norm_b = norm_b / norm_b
    if FORMULA == 0:
        # F.cosine_similarity divides each row by max(|row|, eps) before the dot
        out = dot / (tl.maximum(norm_a, eps_cosine) * tl.maximum(norm_b, eps_cosine))
    elif FORMULA == 1:
        out = dot / (norm_a * norm_b)
    else:
        out = dot
    if OUT_BF16:
        out = round_to_bfloat16(out)  # ties to even on the interpreter too (its own cast truncates)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def _eps_in(dtype: torch.dtype, eps: float) -> float:
    """The epsilon the reference's clamp sees in `dtype` (float16 rounds 1e-8 and 1e-12 to 0)."""
    return float(torch.tensor(eps, dtype=dtype))


def _launch(
    a: Tensor, b: Tensor, out: Tensor, first: Tensor | None, positions: int, normalize: str, formula: str
) -> Tensor:
    n_rows = out.numel()
    dim = a.shape[-1]
    if n_rows == 0:
        return out
    block_d = min(triton.next_power_of_2(dim), MAX_TILE)
    block_r = max(1, min(MAX_TILE // block_d, triton.next_power_of_2(n_rows)))
    grid = (triton.cdiv(n_rows, block_r),)
    _cosine_rows_kernel[grid](
        a,
        b,
        first if first is not None else out,
        out,
        n_rows,
        max(positions, 1),
        dim,
        _eps_in(out.dtype, F_NORMALIZE_EPS),
        _eps_in(out.dtype, COSINE_EPS),
        NORMALIZE=NORMALIZE.index(normalize),
        FORMULA=FORMULAS.index(formula),
        HAS_FIRST=first is not None,
        OUT_BF16=out.dtype == torch.bfloat16,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return out


def _check_rows(*tensors: Tensor) -> str | None:
    for t in tensors:
        if not t.is_floating_point():
            return f"floating-point inputs only, got {t.dtype}"
        if t.shape[-1] == 0:
            return "an empty feature dimension"
    return None


def frame_cosine(a: Tensor, b: Tensor, normalize: str = "none", formula: str = "ratio") -> Tensor:
    """Triton `vtc_kernels.similarity.frame_cosine` (same signature and contract)."""
    check_variant(normalize, formula)
    reason = frame_cosine.supports(a, b)
    if reason is not None:
        raise ValueError(f"frame_cosine: {reason}")
    dtype = torch.result_type(a, b)
    shape = torch.broadcast_shapes(a.shape, b.shape)
    # broadcasting materialises here (reshape copies only broadcast or non-contiguous inputs)
    a2 = a.to(dtype).expand(shape).reshape(-1, shape[-1])
    b2 = b.to(dtype).expand(shape).reshape(-1, shape[-1])
    out = torch.empty(shape[:-1], dtype=dtype, device=a.device)
    return _launch(a2.contiguous(), b2.contiguous(), out, None, 1, normalize, formula)


def _frame_cosine_supports(a: Tensor, b: Tensor, *args, **kwargs) -> str | None:
    if a.device != b.device:
        return f"a and b on different devices ({a.device}, {b.device})"
    if a.dim() == 0 or b.dim() == 0:
        return "0-d inputs (cosine runs along the last dimension)"
    return _check_rows(a, b)


frame_cosine.supports = _frame_cosine_supports  # type: ignore[attr-defined]


def adjacent_frame_similarity(
    x: Tensor,
    step: int = 1,
    normalize: str = "none",
    formula: str = "ratio",
    frame_offsets: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """Triton `vtc_kernels.similarity.adjacent_frame_similarity` (same signature and contract)."""
    step = check_step(step)
    check_variant(normalize, formula)
    reason = adjacent_frame_similarity.supports(x)
    if reason is not None:
        raise ValueError(f"adjacent_frame_similarity: {reason}")
    frames = x.shape[0]
    rest = x.shape[1:]
    positions = rest[:-1].numel()
    flat = x.contiguous()
    if frame_offsets is None:
        pairs = max(frames - step, 0)
        out = torch.empty(pairs, *rest[:-1], dtype=x.dtype, device=x.device)
        if pairs == 0:
            return out
        # frame t + step is the same buffer shifted by step frames
        return _launch(flat[:-step], flat[step:], out, None, positions, normalize, formula)
    first = adjacent_pair_frames(frame_offsets, step, frames, x.device)
    out = torch.empty(first.numel(), *rest[:-1], dtype=x.dtype, device=x.device)
    if first.numel() == 0:
        return out
    return _launch(flat, flat[step:], out, first, positions, normalize, formula)


def _adjacent_supports(x: Tensor, *args, **kwargs) -> str | None:
    if x.dim() < 2:
        return f"x must be [T, ..., D] (frames first, features last), got shape {tuple(x.shape)}"
    return _check_rows(x)


adjacent_frame_similarity.supports = _adjacent_supports  # type: ignore[attr-defined]
