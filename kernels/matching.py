"""Bipartite soft matching (the ToMe paper's merge step), re-implemented from the paper's description."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def bipartite_soft_matching(metric: Tensor, r: int, protected: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Match r tokens of set A (even positions) to their most similar token of set B (odd positions).

    metric [n, C]; the first `protected` tokens (e.g. a CLS token) are never merged. Returns
    (src, dst, unmerged): A tokens merged away, the B token each merges into, A tokens kept. Similarity is
    cosine; the r A-tokens with the highest best-match similarity are merged (ToMe: r <= |A| - protected).
    """
    m = metric / metric.norm(dim=-1, keepdim=True)
    a_idx = torch.arange(0, metric.shape[0], 2, device=metric.device)
    b_idx = torch.arange(1, metric.shape[0], 2, device=metric.device)
    scores = m[a_idx] @ m[b_idx].T
    if protected:
        scores[a_idx < protected] = -torch.inf
    r = max(0, min(int(r), a_idx.numel() - int((a_idx < protected).sum())))
    best, best_b = scores.max(dim=-1)
    order = torch.argsort(best, descending=True)
    merged, kept = order[:r], order[r:]
    return a_idx[merged], b_idx[best_b[merged]], torch.sort(a_idx[kept]).values
