"""Merge ops: fold tokens into anchors."""

from __future__ import annotations

import torch

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
    the sources). FrameFusion's arithmetic: index_add_ into the destinations, then one division, in x's dtype."""
    out = x.clone()
    if src.numel() == 0:
        return out
    out.index_add_(0, dst, x[src])
    anchors, counts = torch.unique(dst, return_counts=True)
    out[anchors] /= (counts + 1).to(out.dtype).view(-1, *([1] * (x.dim() - 1)))
    return out
