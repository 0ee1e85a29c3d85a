"""Token similarity ops: cosine in the input dtype, same-patch similarity across frames."""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# similarity given to the first token of every chain (it has no predecessor); FrameFusion's IGNORE_TOKEN
NO_PREDECESSOR = -2.0


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine similarity, computed in the inputs' dtype as sum(a*b) / (|a| |b|) (FrameFusion's form;
    no epsilon, so zero vectors give NaN like the original)."""
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def adjacent_frame_similarity(x: Tensor) -> Tensor:
    """x [T, P, D] (frames x tokens per frame) -> [T-1, P]: cosine between frame t and t+1 at each patch."""
    return cosine(x[:-1], x[1:])


def chain_order(chain_key: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
    """Order the slots in `candidates` (1-D indices) by (chain key, slot index).

    Returns (order, sorted_keys): order[i] is the slot at chain position i. With key = spatial patch, the
    order visits every spatial position's temporal chain in turn, earliest frame first."""
    keys = chain_key[candidates]
    # stable sort by key keeps increasing slot order inside a chain
    perm = torch.sort(keys, stable=True).indices
    return candidates[perm], keys[perm]


def chain_similarity(x: Tensor, order: Tensor, sorted_keys: Tensor) -> Tensor:
    """Cosine similarity of each chain element with its predecessor in the same chain.

    x [n, D] token features, order [m] slots in chain order, sorted_keys [m] their chain keys.
    Returns [m]; the first element of every chain gets NO_PREDECESSOR."""
    m = order.numel()
    sim = torch.full((m,), NO_PREDECESSOR, dtype=x.dtype, device=x.device)
    if m > 1:
        inner = cosine(x[order[:-1]], x[order[1:]])
        same_chain = sorted_keys[:-1] == sorted_keys[1:]
        sim[1:] = torch.where(same_chain, inner, torch.full_like(inner, NO_PREDECESSOR))
    return sim
