"""KeepNorm: keep the visual tokens with the largest L2 norm (an example vtc plugin, not a paper).

Stage: connect. Written from docs/write-a-plugin.md alone; `tests/test_plugin_package.py` installs it through
the `vtc` entry-point group and runs vtc's conformance matrix on it.
"""

import dataclasses

import torch

import vtc


@dataclasses.dataclass
class KeepNormParams:
    ratio: float | None = None  # fraction kept; default: the retention


def top_norm(embeds: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` tokens with the largest L2 norm, in original order."""
    return torch.sort(torch.topk(embeds.norm(dim=-1), count).indices).values


class KeepNorm:
    def __init__(self, params: KeepNormParams, retention: float | None):
        self.ratio = params.ratio if params.ratio is not None else (retention or 0.5)

    def retained_count(self, num_tokens: int, grid, family: str) -> int:
        # num_tokens: what earlier methods left of this video; grid: its ORIGINAL (T, H, W) token grid
        return max(1, round(num_tokens * self.ratio))

    @vtc.hookimpl
    def vtc_connect(self, tokens, ctx):
        count = self.retained_count(len(tokens), tokens.grid, ctx.family)
        if count >= len(tokens):
            return tokens  # keep everything: return the input itself
        return tokens.select(top_norm(tokens.embeds, count))


@vtc.hookimpl
def vtc_register_methods(registry):
    registry.add(
        vtc.MethodInfo(
            name="keepnorm",
            factory=KeepNorm,
            params=KeepNormParams,
            stages=("connect",),
            paper="(example)",
            summary="keep the largest-norm tokens",
            fixed_count=True,  # KeepNorm.retained_count gives the exact count
        )
    )
