"""Merge ops: fold tokens into anchors."""

from __future__ import annotations

import math

import torch

from vtc_kernels.dispatch import Tolerance, kernel_op

Tensor = torch.Tensor


def chain_anchors(merge: Tensor) -> Tensor:
    """For chain positions flagged in `merge` (bool [m]), the chain position of their anchor: the nearest
    earlier position that is not merged. A run of consecutive merged positions therefore folds into the
    element just before the run. The first position must not be merged (it has no anchor)."""
    if merge.numel() and bool(merge[0]):
        raise ValueError("the first chain position cannot be merged: it has no predecessor")
    positions = torch.arange(merge.numel(), device=merge.device)
    last_kept = torch.cummax(torch.where(merge, torch.full_like(positions, -1), positions), dim=0).values
    return last_kept[merge]


def mean_into_anchors(x: Tensor, dst: Tensor, src: Tensor) -> Tensor:
    """Fold row src[e] of x [n, ...] into row dst[e], for every e: each destination becomes the plain
    (unweighted) mean of itself and the rows folded into it; every other row is unchanged (the caller drops
    the sources). FrameFusion's arithmetic: index_add_ into the destinations, then one division, in x's dtype
    (`merge_into_anchors`'s rule "mean" on the distinct destinations)."""
    out = x.clone()
    if src.numel() == 0:
        return out
    anchors, assign = torch.unique(dst, return_inverse=True)
    out[anchors] = merge_into_anchors(x[anchors], x[src], assign, rule="mean")
    return out


# --- merge sources into their matched anchors --------------------------------------------------------------------

MERGE_RULES = ("mean", "add_mean", "blend", "weighted_mean")
SUMMATIONS = ("index_add", "one_hot")


def _source_sums(sources: Tensor, assign: Tensor, num_anchors: int, summation: str) -> Tensor:
    """[a, W] sum of the (flattened) sources of each anchor, in sources' dtype: sequential `index_add_` (source
    order) or the one-hot product `one_hot^T @ sources` (the summation order VisionZip's and FastVID's official
    codes get from their matmul)."""
    if summation == "one_hot":
        one_hot = torch.zeros(sources.shape[0], num_anchors, dtype=sources.dtype, device=sources.device)
        one_hot[torch.arange(sources.shape[0], device=sources.device), assign] = 1
        return one_hot.T @ sources
    out = torch.zeros(num_anchors, sources.shape[1], dtype=sources.dtype, device=sources.device)
    return out.index_add_(0, assign, sources)


def check_merge_args(
    anchors: Tensor,
    sources: Tensor,
    assign: Tensor,
    rule: str,
    summation: str,
    source_weight: Tensor | None,
    anchor_weight: Tensor | None,
) -> None:
    """Raise ValueError naming the problem when the arguments of `merge_into_anchors` do not fit together."""
    if rule not in MERGE_RULES or summation not in SUMMATIONS:
        raise ValueError(
            f"merge_into_anchors: rule must be one of {MERGE_RULES} and summation one of {SUMMATIONS}, "
            f"got {rule!r}, {summation!r}"
        )
    if anchors.dim() == 0 or sources.dim() != anchors.dim() or sources.shape[1:] != anchors.shape[1:]:
        raise ValueError(
            f"merge_into_anchors: anchors [a, ...] and sources [m, ...] need the same row shape, got "
            f"{tuple(anchors.shape)} and {tuple(sources.shape)}"
        )
    if sources.dtype != anchors.dtype or not anchors.is_floating_point():
        raise ValueError(
            f"merge_into_anchors: anchors and sources must share a float dtype, got {anchors.dtype}, {sources.dtype}"
        )
    if assign.shape != sources.shape[:1] or assign.is_floating_point() or assign.dtype == torch.bool:
        raise ValueError(
            f"merge_into_anchors: assign must be integers [m] = [{sources.shape[0]}], got {assign.dtype} "
            f"{tuple(assign.shape)}"
        )
    if assign.numel() and bool((assign.min() < 0) | (assign.max() >= anchors.shape[0])):
        raise ValueError(f"merge_into_anchors: assign must index the {anchors.shape[0]} anchors")
    if rule == "weighted_mean":
        if source_weight is None or anchor_weight is None:
            raise ValueError("merge_into_anchors: rule 'weighted_mean' needs source_weight [m] and anchor_weight [a]")
        if source_weight.shape != sources.shape[:1] or anchor_weight.shape != anchors.shape[:1]:
            raise ValueError(
                f"merge_into_anchors: source_weight must be [m] = [{sources.shape[0]}] and anchor_weight [a] = "
                f"[{anchors.shape[0]}], got {tuple(source_weight.shape)}, {tuple(anchor_weight.shape)}"
            )
        if summation != "index_add":
            raise ValueError("merge_into_anchors: rule 'weighted_mean' sums with index_add only")
    elif source_weight is not None or anchor_weight is not None:
        raise ValueError(f"merge_into_anchors: weights belong to rule 'weighted_mean', not {rule!r}")


@kernel_op(
    "merge_into_anchors",
    tolerance=Tolerance.allclose(
        {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (4e-2, 4e-2)},
        note="the kernel sums each anchor's sources in float32 in source order; the half-precision references "
        "round every partial sum (index_add) or the product (one_hot) to their dtype, so their error grows "
        "with the sources per anchor: the bounds hold for values of order 1 and up to 8 sources per anchor",
    ),
    triton="vtc_kernels.triton.merge:merge_into_anchors",
)
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
    """Fold every source row into its anchor: anchors [a, ...], sources [m, ...], assign [m] (anchor row of each
    source, e.g. `best_match`'s assignment). With S_j the sum and c_j the count of anchor j's sources:

      "mean"           (x_j + S_j) / (c_j + 1)                        plain mean (FrameFusion, AOT's nearest merge;
                       with index_add the sources are added onto x_j one by one)
      "add_mean"       x_j + S_j / max(c_j, 1)                        VisionZip's contextual tokens
      "blend"          w x_j + (1 - w) S_j / max(c_j, 1),             FastVID's DTM, w = max(1 / (c_j + 1), beta)
      "weighted_mean"  (a_j x_j + sum w_i x_i) / (a_j + sum w_i)      LifeStream: mass-weighted, computed in
                       (source_weight w [m], anchor_weight a [a])     float32 (float64 stays), cast back

    Arithmetic in the inputs' dtype except "weighted_mean"; S_j by `summation` ("index_add": sequential, in
    source order; "one_hot": one_hot^T @ sources, the official VisionZip / FastVID product). Anchors without
    sources come back unchanged (bit for bit under "weighted_mean"). Returns the merged anchors [a, ...].

    Tolerance (Triton: float32 sums in source order, one rounding): allclose, float32 rtol/atol 1e-5, float16
    5e-3, bfloat16 4e-2 (values of order 1, up to 8 sources per anchor: the half-precision reference rounds
    every partial sum)."""
    check_merge_args(anchors, sources, assign, rule, summation, source_weight, anchor_weight)
    count = anchors.shape[0]
    width = math.prod(anchors.shape[1:])
    flat_anchors, flat_sources = anchors.reshape(count, width), sources.reshape(sources.shape[0], width)
    if rule == "weighted_mean":
        dtype = torch.promote_types(anchors.dtype, torch.float32)
        total = flat_anchors.to(dtype) * anchor_weight.to(dtype)[:, None]
        total.index_add_(0, assign, flat_sources.to(dtype) * source_weight.to(dtype)[:, None])
        mass = anchor_weight.to(dtype).index_add(0, assign, source_weight.to(dtype))
        touched = torch.unique(assign)
        out = flat_anchors.clone()
        out[touched] = (total[touched] / mass[touched, None]).to(anchors.dtype)
        return out.reshape(anchors.shape)
    tally = torch.bincount(assign, minlength=count)[:, None]
    if rule == "mean":
        if summation == "index_add":  # summed onto the anchor itself, as FrameFusion's index_add_ / AOT's scatter_add
            total = flat_anchors.clone().index_add_(0, assign, flat_sources)
        else:
            total = flat_anchors + _source_sums(flat_sources, assign, count, summation)
        return (total / (tally + 1).to(anchors.dtype)).reshape(anchors.shape)
    sums = _source_sums(flat_sources, assign, count, summation)
    counts = tally.to(anchors.dtype)  # what one_hot.sum(0) gives
    if rule == "add_mean":
        out = flat_anchors + sums / counts.clamp(min=1)
    else:
        weight = (1 / (counts + 1)).clamp(min=beta)
        out = weight * flat_anchors + (1 - weight) * (sums / counts.clamp(min=1))
    return out.reshape(anchors.shape)
