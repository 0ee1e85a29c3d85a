"""Random pruning: keep a seeded random subset of each video's visual tokens.

The baseline every compression paper should beat (UniPruneBench finds it strong; VidCom2's tables list it
at 25% and 15% retention). Stage: connect. Survivors keep their original order and positions. The subset
depends only on the seed (`vtc.patch(..., seed=0)`) and the number of tokens, not on the batch.
"""

from __future__ import annotations

import torch

import vtc


def random_keep(num_tokens: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` distinct token indices drawn uniformly, in ascending order."""
    return torch.sort(torch.randperm(num_tokens, generator=generator)[:count]).values


@vtc.method(
    "random",
    paper="Random pruning (baseline)",
    summary="keep a seeded random subset of the visual tokens",
)
class RandomPrune(vtc.TokenSelector):
    """A seeded random subset, in original order."""

    ratio: float | None = vtc.param(None, range="(0, 1]", doc="fraction kept; default: the retention, else 0.5")

    def choose(self, tokens, count, ctx):
        # ctx.generator is seeded by vtc.patch(..., seed=0) afresh for every video: same video, same subset
        return random_keep(len(tokens), count, ctx.generator).to(tokens.embeds.device)
