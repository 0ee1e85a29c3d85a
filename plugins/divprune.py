"""DivPrune: "Diversity-based Visual Token Pruning for Large Multimodal Models" (Alvar et al., CVPR 2025).
arXiv: https://arxiv.org/abs/2503.02175. Official code: vbdi/divprune (`LLaVA/llava/model/llava_arch.py`:
`pairwise_cosine_similarity`, `DivPrune`, applied in `prepare_inputs_labels_for_multimodal`).

Keep the most diverse subset of the visual tokens: a greedy Max-Min diversity solution on cosine distances
`1 - cos(x_i, x_j)`. The first token is the one whose nearest neighbour is farthest; each next token is the
one farthest from the tokens already kept (farthest-point sampling). `round(ratio * L)` tokens survive.
Stage: connect (the official code prunes the assembled input embeddings before layer 0: the same tokens).

Faithful to the official code: the distance matrix `1 - (x/|x|)(x/|x|)^T` (no epsilon) in the embeddings'
dtype (`compute_dtype` overrides), the first pick from each column's second-smallest value, ties to the
first index (`argmax`), survivors in their original order. vtc differences: all visual tokens of one video
form one set (the official code prunes one image's token span; a video is one span in LLaVA-NeXT's code
too); a token already kept is never picked again (the official loop could pick it twice when every
remaining token duplicates a kept one); at least one token is kept.
"""

from __future__ import annotations

import torch

import vtc
from vtc_kernels.diverse import cosine_distance_matrix, max_min_select


def divprune_keep(embeds: torch.Tensor, count: int) -> torch.Tensor:
    """DivPrune on one set of tokens embeds [L, D]: the `count` kept indices, in ascending (original) order."""
    return torch.sort(max_min_select(cosine_distance_matrix(embeds), count)).values


@vtc.method(
    "divprune",
    paper="DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models (CVPR 2025)",
    url="https://arxiv.org/abs/2503.02175",
    summary="greedy max-min diversity: keep the tokens farthest (cosine) from those already kept",
)
class DivPrune(vtc.TokenSelector):
    """Max-min diverse subset of the visual tokens (official: vbdi/divprune llava_arch.py::DivPrune)."""

    ratio: float | None = vtc.param(None, range="(0, 1]", doc="SUBSET_RATIO: fraction kept; default: retention")
    compute_dtype: vtc.DType | None = vtc.param(None, doc="None: the embeddings' dtype (as the official code)")

    default_fraction = 0.098  # SUBSET_RATIO in run_Divprune.sh (about 56 of LLaVA-1.5's 576 tokens)
    positions = "compact"

    def choose(self, tokens, count, ctx):
        embeds = tokens.embeds.to(vtc.as_dtype(self.compute_dtype, tokens.embeds.dtype))
        return divprune_keep(embeds, count)
