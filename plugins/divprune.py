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

import dataclasses

import torch

from vtc.core.hookspecs import hookimpl
from vtc.core.registry import MethodInfo
from vtc_kernels.diverse import cosine_distance_matrix, max_min_select

Tensor = torch.Tensor

DEFAULT_RATIO = 0.098  # SUBSET_RATIO in run_Divprune.sh (about 56 of LLaVA-1.5's 576 tokens)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclasses.dataclass
class DivPruneParams:
    ratio: float | None = None  # SUBSET_RATIO (`threshold_ratio`): fraction kept; default: retention, else 0.098
    compute_dtype: str | None = None  # None: the embeddings' dtype (as the official code); e.g. "float32"

    def __post_init__(self):
        if self.ratio is not None and not 0.0 < float(self.ratio) <= 1.0:
            raise ValueError(f"divprune: ratio must be in (0, 1], got {self.ratio}")
        if self.compute_dtype is not None and self.compute_dtype not in DTYPES:
            allowed = ", ".join(sorted(DTYPES))
            raise ValueError(f"divprune: compute_dtype must be None or one of {allowed}, got {self.compute_dtype}")


# --- the algorithm --------------------------------------------------------------------------------------------------


def kept_count(num_tokens: int, ratio: float) -> int:
    """`int(round(ratio * L))` (Python rounds half to even), at least 1 and at most L."""
    return max(1, min(num_tokens, round(ratio * num_tokens)))


def divprune_keep(embeds: Tensor, count: int) -> Tensor:
    """DivPrune on one set of tokens embeds [L, D]: the `count` kept indices, in ascending (original) order."""
    return torch.sort(max_min_select(cosine_distance_matrix(embeds), count)).values


# --- the plugin -------------------------------------------------------------------------------------------------


class DivPrune:
    def __init__(self, params: DivPruneParams, retention: float | None = None) -> None:
        self.params = params
        if params.ratio is not None:
            self.ratio = float(params.ratio)
        else:
            self.ratio = retention if retention is not None else DEFAULT_RATIO

    def retained_count(self, num_tokens: int, grid, family: str) -> int:
        if num_tokens == 0:
            return 0
        return kept_count(num_tokens, self.ratio)

    @hookimpl
    def vtc_connect(self, tokens, ctx):
        n = len(tokens)
        count = self.retained_count(n, tokens.grid, ctx.family)
        if count >= n:
            return tokens
        embeds = tokens.embeds
        if self.params.compute_dtype is not None:
            embeds = embeds.to(DTYPES[self.params.compute_dtype])
        return tokens.select(divprune_keep(embeds, count))


@hookimpl
def vtc_register_methods(registry):
    registry.add(
        MethodInfo(
            name="divprune",
            factory=DivPrune,
            params=DivPruneParams,
            stages=("connect",),
            paper="DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models (CVPR 2025)",
            url="https://arxiv.org/abs/2503.02175",
            summary="greedy max-min diversity: keep the tokens farthest (cosine) from those already kept",
            fixed_count=True,
            position_policy="compact",
        )
    )
