"""Bipartite matching: each source token finds its most cosine-similar destination token (per segment: a
frame's or a video's sources match only that segment's destinations), as VisionZip, FastVID, LifeStream and
HoliTom assign the tokens they merge. The merge that follows is `vtc_kernels.merge.merge_into_anchors`.

The official codes take the cosine in different ways, and bit-faithful ports must keep the difference:
  normalize "exact" (x / ||x||, no epsilon: VisionZip, FastVID) | "eps" (`F.normalize`, eps 1e-12: LifeStream) |
      "none";
  formula "dot" (normalised sources @ normalised destinations^T) | "ratio" ((a @ b^T) / (|a| |b|^T), the norms'
      outer product first: HoliTom's inner merge).
Everything is computed in the inputs' dtype (cast before the call to compute in another, as LifeStream does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vtc_kernels.dispatch import Tolerance, kernel_op
from vtc_kernels.select import check_offsets

Tensor = torch.Tensor

NORMALIZE = ("exact", "eps", "none")
FORMULAS = ("dot", "ratio")

# |best - second best| above which the Triton kernel's assignment equals the reference's (units of the
# similarity; for normalize="none" with formula="dot", of |a| |b|): float32 rounding of a D-term dot product
# computed in another order, and for half types the reference's own rounding of normalised inputs and output
ASSIGNMENT_GAP = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _similarity(src: Tensor, dst: Tensor, normalize: str, formula: str) -> Tensor:
    """[n_src, n_dst] similarity, written as the plugins' official expressions (bit-identical to them)."""
    if normalize == "exact":
        src, dst = src / src.norm(dim=-1, keepdim=True), dst / dst.norm(dim=-1, keepdim=True)
    elif normalize == "eps":
        src, dst = F.normalize(src, dim=-1), F.normalize(dst, dim=-1)
    if formula == "ratio":
        return (src @ dst.T) / (torch.norm(src, dim=-1, keepdim=True) * torch.norm(dst, dim=-1, keepdim=True).T)
    return src @ dst.T


def check_match_args(
    src: Tensor, dst: Tensor, normalize: str, formula: str, src_offsets: Tensor | None, dst_offsets: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(src_offsets, dst_offsets) as int64 [S + 1] (one segment holding everything when both are None), after
    checking the arguments; raises ValueError naming the problem."""
    if normalize not in NORMALIZE or formula not in FORMULAS:
        raise ValueError(
            f"best_match: normalize must be one of {NORMALIZE} and formula one of {FORMULAS}, "
            f"got {normalize!r}, {formula!r}"
        )
    for name, x in (("src", src), ("dst", dst)):
        if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"best_match: {name} must be a floating-point tensor [n, D], got {got}")
    if src.shape[1] != dst.shape[1] or src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError(
            f"best_match: src and dst must share D, dtype and device, got {tuple(src.shape)} {src.dtype} "
            f"{src.device} and {tuple(dst.shape)} {dst.dtype} {dst.device}"
        )
    if (src_offsets is None) != (dst_offsets is None):
        raise ValueError("best_match: give both src_offsets and dst_offsets (one segment each), or neither")
    device = src.device
    if src_offsets is None:
        src_offsets = torch.tensor([0, src.shape[0]], dtype=torch.long, device=device)
        dst_offsets = torch.tensor([0, dst.shape[0]], dtype=torch.long, device=device)
    else:
        src_offsets = check_offsets(src_offsets, src.shape[0], "best_match (src_offsets)", device)
        dst_offsets = check_offsets(dst_offsets, dst.shape[0], "best_match (dst_offsets)", device)
        if src_offsets.numel() != dst_offsets.numel():
            raise ValueError(
                f"best_match: src_offsets and dst_offsets must describe the same number of segments, got "
                f"{src_offsets.numel() - 1} and {dst_offsets.numel() - 1}"
            )
    orphans = (src_offsets.diff() > 0) & (dst_offsets.diff() == 0)
    if bool(orphans.any()):
        raise ValueError(
            f"best_match: segments {torch.nonzero(orphans).flatten().tolist()[:8]} have sources but no destination "
            "to match them to"
        )
    return src_offsets, dst_offsets


@kernel_op(
    "best_match",
    tolerance=Tolerance.allclose(
        {torch.float32: (1e-4, 1e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)},
        note="similarity allclose within these bounds; assignment exact wherever the reference's best similarity "
        "beats the second best by more than ASSIGNMENT_GAP (float32 1e-4, float16 1e-2, bfloat16 3e-2); exact "
        "ties go to the first destination in both; NaN similarities rank as +inf (a zero vector under 'exact'/"
        "'ratio' gives NaN, matched to the segment's first destination, as torch.argmax)",
    ),
    triton="vtc_kernels.triton.matching:best_match",
)
def best_match(
    src: Tensor,
    dst: Tensor,
    normalize: str = "exact",
    formula: str = "dot",
    src_offsets: Tensor | None = None,
    dst_offsets: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Each source row's most similar destination row: src [n_src, D], dst [n_dst, D] (same dtype, computed in it).

    With src_offsets / dst_offsets ([S + 1] each), segment s's sources src[src_offsets[s]:src_offsets[s+1]] match
    only its destinations dst[dst_offsets[s]:dst_offsets[s+1]] (a segment with sources needs a destination).
    `normalize` / `formula` pick the official variant (module docstring). Returns (assignment [n_src] int64, the
    GLOBAL destination row; best similarity [n_src] in the inputs' dtype); ties go to the first destination
    (`argmax`).

    The reference is the per-segment expression the plugins wrote (similarity matrix, argmax), bit-identical to
    it. Tolerance (Triton, which never builds the matrix): best similarity allclose (float32 rtol 1e-4 / atol
    1e-5, float16 5e-3 / 5e-3, bfloat16 3e-2 / 3e-2); assignment exact where the reference's best beats the
    second best by more than ASSIGNMENT_GAP (else either of the near-equal destinations)."""
    src_offsets, dst_offsets = check_match_args(src, dst, normalize, formula, src_offsets, dst_offsets)
    assign = torch.zeros(src.shape[0], dtype=torch.long, device=src.device)
    best = torch.zeros(src.shape[0], dtype=src.dtype, device=src.device)
    bounds = zip(
        src_offsets[:-1].tolist(), src_offsets[1:].tolist(), dst_offsets[:-1].tolist(), dst_offsets[1:].tolist()
    )
    for s0, s1, d0, d1 in bounds:
        if s1 == s0:
            continue
        sim = _similarity(src[s0:s1], dst[d0:d1], normalize, formula)
        local = sim.argmax(dim=1)
        assign[s0:s1] = local + d0
        best[s0:s1] = sim.gather(1, local[:, None]).squeeze(1)
    return assign, best
