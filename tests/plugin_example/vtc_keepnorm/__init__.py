"""KeepNorm: keep the visual tokens with the largest L2 norm (an example vtc plugin, not a paper).

Stage: connect. Written from docs/write-a-plugin.md alone; `tests/test_plugin_package.py` installs it through
the `vtc` entry-point group and runs vtc's conformance matrix on it.
"""

import torch

import vtc


def top_norm(embeds: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` tokens with the largest L2 norm."""
    return torch.topk(embeds.norm(dim=-1), count).indices


@vtc.method("keepnorm", paper="(example)", summary="keep the largest-norm tokens")
class KeepNorm(vtc.TokenSelector):
    """Keep the tokens with the largest L2 norm, in their original order."""

    ratio: float | None = vtc.param(None, range="(0, 1]", doc="fraction kept; default: the retention")

    def choose(self, tokens, count, ctx):
        return top_norm(tokens.embeds, count)
