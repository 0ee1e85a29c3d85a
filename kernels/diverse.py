"""Diverse subset selection: greedy Max-Min (farthest-point) selection on a distance matrix, as DivPrune runs
it on cosine distances. Segmented: one launch serves a batch of padded matrices."""

from __future__ import annotations

import torch

from vtc_kernels.dispatch import Tolerance, kernel_op
from vtc_kernels.segments import square_segments

Tensor = torch.Tensor


@kernel_op(
    "cosine_distance_matrix",
    tolerance=Tolerance.allclose(
        {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3)},
        note="no Triton kernel: one normalisation and one matmul, which a fused kernel would not beat",
    ),
)
def cosine_distance_matrix(x: Tensor) -> Tensor:
    """[L, D] -> [L, L] (or [S, L, D] -> [S, L, L]) matrix of 1 - cos(x_i, x_j), in x's dtype: rows divided
    by their norm (no epsilon, as DivPrune's official code: a zero row gives NaN), one matmul.

    Tolerance contract: none to keep, the op has no Triton kernel (one normalisation and one matmul); the
    stated bounds are what a kernel would have to meet."""
    if x.dim() not in (2, 3):
        raise ValueError(f"cosine_distance_matrix: x must be [L, D] or [S, L, D], got shape {tuple(x.shape)}")
    unit = x / x.norm(dim=-1, keepdim=True)
    return 1.0 - unit @ unit.transpose(-1, -2)


def segment_counts(count: int | Tensor, lengths: Tensor, op: str) -> Tensor:
    """Per-segment pick counts [S] (int64) from an int, a 0-d or an [S] integer tensor, each clamped to
    [0, its segment's length]."""
    if isinstance(count, Tensor):
        if count.is_floating_point() or count.dtype == torch.bool or count.dim() > 1:
            got = f"{count.dtype} {tuple(count.shape)}"
            raise ValueError(f"{op}: count must be an int or an integer tensor [S], got {got}")
        if count.dim() == 1 and count.shape[0] != lengths.shape[0]:
            raise ValueError(f"{op}: count has {count.shape[0]} entries for {lengths.shape[0]} segments")
        counts = count.to(device=lengths.device, dtype=torch.long).expand(lengths.shape)
    else:
        counts = torch.full(lengths.shape, int(count), dtype=torch.long, device=lengths.device)
    return torch.minimum(counts.clamp_min(0), lengths)


@kernel_op(
    "max_min_select",
    tolerance=Tolerance.exact(
        note="indices; min and max do not round and bf16/fp16 -> fp32 is exact, so the kernel makes the same "
        "comparisons; argmax ties go to the first index on both; distances must be finite (NaN/inf unspecified)"
    ),
    triton="vtc_kernels.triton.diverse:max_min_select",
)
def max_min_select(dist: Tensor, count: int | Tensor, lengths: Tensor | None = None) -> Tensor:
    """Greedy Max-Min diversity selection, in pick order.

    dist [L, L] and an int count -> picks [count]; or dist [S, L, L] padded (segment s is the top-left
    lengths[s] x lengths[s] block; lengths default to L) with count an int or an integer tensor [S] ->
    picks [S, max count], each row padded with -1 past its segment's count. Counts are clamped to
    [0, segment length].

    Pick 1: the column j whose second-smallest dist[:, j] (the smallest is the self-distance) is largest;
    a one-token segment picks 0. Pick i > 1: among the tokens not yet picked, the one whose minimum of
    dist[s, j] over picked s is largest. Ties go to the first index (`argmax`); a token is never picked
    twice. The running minimum equals DivPrune's official `torch.min(dist[picked], dim=0)` exactly (min
    does not round).

    Tolerance contract (Triton vs this reference): exact, on finite distances in float32, bfloat16 or float16.
    """
    dist, lengths, single = square_segments(dist, lengths, "max_min_select")
    counts = segment_counts(count, lengths, "max_min_select")
    segments, size = dist.shape[:2]
    width = int(counts.max()) if segments else 0
    picks = torch.full((segments, width), -1, dtype=torch.long, device=dist.device)
    if width > 0:
        seg = torch.arange(segments, device=dist.device)
        valid = torch.arange(size, device=dist.device)[None, :] < lengths[:, None]  # [S, L] token exists
        if size >= 2:
            # padded rows sort last, so row 1 of the two smallest is each column's second-smallest distance
            column = dist.masked_fill(~valid[:, :, None], float("inf"))
            second = torch.topk(column, 2, dim=1, largest=False).values[:, 1]
        else:
            second = torch.full((segments, size), float("inf"), dtype=dist.dtype, device=dist.device)
        pick = torch.argmax(second.masked_fill(~valid, float("-inf")), dim=1)
        picks[:, 0] = torch.where(counts > 0, pick, -1)
        unavailable = ~valid
        unavailable[seg, pick] = True
        nearest = dist[seg, pick]  # min distance of every token to its segment's picked set
        for i in range(1, width):
            pick = torch.argmax(nearest.masked_fill(unavailable, float("-inf")), dim=1)
            picks[:, i] = torch.where(counts > i, pick, -1)
            unavailable[seg, pick] = True
            nearest = torch.minimum(nearest, dist[seg, pick])
    return picks[0] if single else picks
