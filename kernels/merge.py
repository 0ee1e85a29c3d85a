"""Merge ops: fold tokens into anchors (plain or weighted means)."""

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


def chain_merge_mean(x: Tensor, order: Tensor, merge: Tensor) -> tuple[Tensor, Tensor]:
    """Merge runs of chain elements into their anchors with a plain (unweighted) mean.

    x [n, D]; order [m] slots in chain order; merge bool [m]. Returns (x_new [n, D], keep bool [n]):
    each anchor becomes (x_anchor + sum of its run) / (run length + 1), merged slots are dropped.
    The arithmetic is FrameFusion's: index_add_ into the anchors, then one division."""
    anchors = order[chain_anchors(merge)]
    members = order[merge]
    out = x.clone()
    out.index_add_(0, anchors, x[members])
    unique, counts = torch.unique(anchors, return_counts=True)
    out[unique] /= (counts + 1).to(out.dtype).view(-1, *([1] * (x.dim() - 1)))
    keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    keep[members] = False
    return out, keep


def scatter_mean(x: Tensor, index: Tensor, num_groups: int, weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Weighted mean of the rows of x [n, D] per group `index` [n] -> ([num_groups, D], group weight [num_groups]).
    Empty groups give zeros."""
    w = torch.ones(x.shape[0], dtype=x.dtype, device=x.device) if weight is None else weight.to(x.dtype)
    total = x.new_zeros(num_groups, *x.shape[1:]).index_add_(0, index, x * w.view(-1, *([1] * (x.dim() - 1))))
    mass = x.new_zeros(num_groups).index_add_(0, index, w)
    return total / mass.clamp(min=torch.finfo(x.dtype).tiny).view(-1, *([1] * (x.dim() - 1))), mass
