"""Random pruning: keep a seeded random subset of each video's visual tokens.

The baseline every compression paper should beat (UniPruneBench finds it strong; VidCom2's tables list it
at 25% and 15% retention). Stage: connect. Survivors keep their original order and positions. The subset
depends only on the seed (`vtc.patch(..., seed=0)`) and the number of tokens, not on the batch.
"""

from __future__ import annotations

import dataclasses

import torch

from vtc.core.hookspecs import hookimpl
from vtc.core.registry import MethodInfo


@dataclasses.dataclass
class RandomParams:
    ratio: float | None = None  # fraction of visual tokens kept; default: the retention, else 0.5

    def __post_init__(self):
        if self.ratio is not None and not 0.0 < float(self.ratio) <= 1.0:
            raise ValueError(f"random: ratio must be in (0, 1], got {self.ratio}")


def kept_count(num_tokens: int, ratio: float) -> int:
    return max(1, min(num_tokens, round(num_tokens * ratio)))


def random_keep(num_tokens: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` distinct token indices drawn uniformly, in ascending order."""
    return torch.sort(torch.randperm(num_tokens, generator=generator)[:count]).values


class RandomPrune:
    def __init__(self, params: RandomParams, retention: float | None = None) -> None:
        self.params = params
        self.ratio = params.ratio if params.ratio is not None else (retention if retention is not None else 0.5)

    def retained_count(self, num_tokens: int, grid, family: str) -> int:
        return kept_count(num_tokens, self.ratio)

    @hookimpl
    def vtc_connect(self, tokens, ctx):
        count = kept_count(len(tokens), self.ratio)
        if count == len(tokens):
            return tokens
        # ctx.generator is seeded by vtc.patch(..., seed=0) afresh for every video: same video, same subset
        return tokens.select(random_keep(len(tokens), count, ctx.generator).to(tokens.embeds.device))


@hookimpl
def vtc_register_methods(registry):
    registry.add(
        MethodInfo(
            name="random",
            factory=RandomPrune,
            params=RandomParams,
            stages=("connect",),
            paper="Random pruning (baseline)",
            summary="keep a seeded random subset of the visual tokens",
            fixed_count=True,
        )
    )
