"""Token similarity ops: cosine in the variants the official codes compute, same-patch similarity across frames.

The official codes differ in how they take a cosine, and bit-faithful ports must keep the difference:
  normalize "none" | "eps" (`F.normalize`, eps 1e-12: HoliTom, DyCoke's first pass) | "exact" (x / ||x||, no
      epsilon: FastVID);
  formula "torch" (`F.cosine_similarity`, eps 1e-8: HoliTom, DyCoke) | "ratio" (sum(a b) / (|a| |b|), no epsilon:
      FrameFusion) | "dot" (sum(a b) of already normalised inputs: FastVID).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

# similarity given to the first token of every chain (it has no predecessor); FrameFusion's IGNORE_TOKEN
NO_PREDECESSOR = -2.0
NORMALIZE = ("none", "eps", "exact")
FORMULAS = ("torch", "ratio", "dot")


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine similarity, computed in the inputs' dtype as sum(a*b) / (|a| |b|) (FrameFusion's form;
    no epsilon, so zero vectors give NaN like the original)."""
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def frame_cosine(a: Tensor, b: Tensor, normalize: str = "none", formula: str = "ratio") -> Tensor:
    """Cosine of a and b along the last dimension, in the variant an official code computes (see the module
    docstring), in the inputs' dtype."""
    if normalize not in NORMALIZE or formula not in FORMULAS:
        raise ValueError(f"normalize must be one of {NORMALIZE} and formula one of {FORMULAS}")
    if normalize == "eps":
        a, b = F.normalize(a, p=2, dim=-1), F.normalize(b, p=2, dim=-1)
    elif normalize == "exact":
        a, b = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
    if formula == "torch":
        return F.cosine_similarity(a, b, dim=-1)
    if formula == "dot":
        return (a * b).sum(dim=-1)
    return cosine(a, b)


def adjacent_frame_similarity(x: Tensor, step: int = 1, normalize: str = "none", formula: str = "ratio") -> Tensor:
    """x [T, ...] (frames first) -> [T - step, ...]: `frame_cosine` of frame t with frame t + step, at each
    position (x [T, P, D] -> [T - step, P]; frame-level features [T, D] -> [T - step])."""
    return frame_cosine(x[:-step], x[step:], normalize, formula)


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
