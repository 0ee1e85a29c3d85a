"""FastV: "An Image is Worth 1/2 Tokens After Layer 2" (Chen et al., ECCV 2024). pkunlp-icler/FastV.

After layer K-1 the attention of the last prompt token, averaged over heads, ranks the visual tokens; from
layer K on only the top (1 - R) of them are kept (positions unchanged, KV cache of layers < K stays full).
Stage: prefill.

Defaults follow the paper: K = 2, R = 50% dropped. `retention` maps to R = 1 - retention, the way the video
papers' tables (VidCom2, HoliTom) compare FastV at a matched retention. The kept count is
round(N * (1 - R)), as the official HF implementation computes it.
"""

from __future__ import annotations

import dataclasses

import torch

from vtc.core.hookspecs import hookimpl
from vtc.core.registry import MethodInfo
from vtc_kernels.select import segmented_topk


@dataclasses.dataclass
class FastVParams:
    k: int = 2  # K: prune before layer K, using the attention of layer K-1
    ratio: float | None = None  # R: fraction of visual tokens dropped (default: 1 - retention, else 0.5)

    def __post_init__(self):
        if int(self.k) < 1:
            raise ValueError(f"fastv: k must be >= 1 (attention of layer k-1 ranks the tokens), got {self.k}")
        if self.ratio is not None and not 0.0 <= float(self.ratio) < 1.0:
            raise ValueError(f"fastv: ratio (fraction dropped) must be in [0, 1), got {self.ratio}")


def kept_count(num_visual: int, ratio: float) -> int:
    return round(num_visual * (1 - ratio))


def fastv_keep(scores: torch.Tensor, visual: torch.Tensor, valid: torch.Tensor, ratio: float) -> torch.Tensor:
    """Keep mask [B, n]: every non-visual token, plus the top round(N_vis * (1 - ratio)) visual tokens of each
    row by `scores` [B, n] (head-averaged attention of the last prompt token)."""
    keep = valid & ~visual
    candidates = visual & valid
    pool = torch.nonzero(candidates.flatten()).flatten()  # row after row: one segment per batch row
    per_row = candidates.sum(dim=1)
    offsets = torch.cat([per_row.new_zeros(1), torch.cumsum(per_row, 0)])
    budgets = torch.tensor([kept_count(n, ratio) for n in per_row.tolist()])
    kept = segmented_topk(scores.float().flatten()[pool.to(scores.device)], offsets, budgets)
    keep.view(-1)[pool[kept.to(pool.device)]] = True
    return keep


class FastV:
    def __init__(self, params: FastVParams, retention: float | None = None) -> None:
        self.params = params
        if params.ratio is not None:
            self.ratio = float(params.ratio)
        else:
            self.ratio = 1.0 - retention if retention is not None else 0.5

    def retained_count(self, num_tokens: int, grid, family: str) -> int:
        """Visual tokens at the last layer (every layer from K on keeps them; layers < K see all)."""
        return kept_count(num_tokens, self.ratio)

    @hookimpl
    def vtc_prefill(self, state, ctx):
        k = int(self.params.k)
        if state.point != "layer_start" or self.ratio == 0.0:
            return
        if k >= state.num_layers:
            raise ValueError(f"fastv: k={k} but the language model has only {state.num_layers} layers")
        if state.layer == k - 1:
            state.request_attention(num_rows=1, upcast=True)  # what output_attentions=True (eager) returns
        elif state.layer == k:
            scores = state.attention(k - 1).mean(dim=1)[:, -1]  # [B, n]: last prompt token, head mean
            layout = state.layout
            state.keep(fastv_keep(scores, layout.visual, layout.valid, self.ratio))


@hookimpl
def vtc_register_methods(registry):
    registry.add(
        MethodInfo(
            name="fastv",
            factory=FastV,
            params=FastVParams,
            stages=("prefill",),
            paper="An Image is Worth 1/2 Tokens After Layer 2 (ECCV 2024)",
            url="https://arxiv.org/abs/2403.06764",
            summary="drop low-attention visual tokens after layer K (last-token attention)",
            fixed_count=True,
            retention_reference="last_layer",
            owns=frozenset({"llm_token_schedule"}),
            query_aware=True,
        )
    )
