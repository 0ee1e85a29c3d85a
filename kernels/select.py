"""Selection ops: top-k keep (with deterministic order) and exact-count reconciliation."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def topk_indices(scores: Tensor, k: int, largest: bool = True, sort_indices: bool = True) -> Tensor:
    """Indices of the k best scores; ascending index order when `sort_indices` (original token order),
    else score order (as `torch.topk` returns them)."""
    k = max(0, min(int(k), scores.numel()))
    idx = torch.topk(scores, k, largest=largest).indices
    return torch.sort(idx).values if sort_indices else idx


def topk_mask(scores: Tensor, k: int, candidates: Tensor | None = None, largest: bool = True) -> Tensor:
    """Bool mask of the k best entries of `scores`, among `candidates` (bool mask) when given."""
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if candidates is None:
        mask[topk_indices(scores, k, largest)] = True
        return mask
    pool = torch.nonzero(candidates).flatten()
    mask[pool[topk_indices(scores[pool], k, largest)]] = True
    return mask


def reconcile_count(keep: Tensor, scores: Tensor, target: int) -> Tensor:
    """Make a keep mask hold exactly `target` entries: drop the lowest-scored kept entries, or add the
    highest-scored dropped ones. This is how every fixed-count mode turns an adaptive selection into the
    count promised by `retained_count` (the serving contract)."""
    keep = keep.clone()
    count = int(keep.sum())
    target = max(0, min(int(target), keep.numel()))
    if count > target:
        kept = torch.nonzero(keep).flatten()
        drop = kept[torch.topk(scores[kept].float(), count - target, largest=False).indices]
        keep[drop] = False
    elif count < target:
        dropped = torch.nonzero(~keep).flatten()
        add = dropped[torch.topk(scores[dropped].float(), target - count).indices]
        keep[add] = True
    return keep
