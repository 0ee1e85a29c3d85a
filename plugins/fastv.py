"""FastV: "An Image is Worth 1/2 Tokens After Layer 2" (Chen et al., ECCV 2024). pkunlp-icler/FastV.

After layer K-1 the attention of the last prompt token, averaged over heads, ranks the visual tokens; from
layer K on only the top (1 - R) of them are kept (positions unchanged, KV cache of layers < K stays full).
Stage: prefill.

Defaults follow the paper: K = 2, R = 50% dropped. `retention` maps to R = 1 - retention, the way the video
papers' tables (VidCom2, HoliTom) compare FastV at a matched retention. The kept count is
round(N * (1 - R)), as the official HF implementation computes it.
"""

from __future__ import annotations

import torch

import vtc
from vtc.core.bases import last_token_attention
from vtc_kernels.select import segmented_topk


def kept_count(num_visual: int, ratio: float) -> int:
    return round(num_visual * (1 - ratio))


def fastv_keep(
    scores: torch.Tensor, visual: torch.Tensor, valid: torch.Tensor, ratio: float, item: torch.Tensor | None = None
) -> torch.Tensor:
    """Keep mask [B, n]: every non-visual token, plus the top round(N_vis * (1 - ratio)) visual tokens of each
    row by `scores` [B, n] (head-averaged attention of the last prompt token). `item` [B, n] (the layout's media
    item of each token): each video or image of a row gets its own budget, round(N_item * (1 - ratio))."""
    keep = valid & ~visual
    candidates = visual & valid
    if item is None:
        item = torch.zeros_like(candidates, dtype=torch.long)
    pool = torch.nonzero(candidates.flatten()).flatten()  # row after row, item after item: one segment each
    segment = torch.arange(candidates.shape[0], device=candidates.device)[:, None] * (int(item.max()) + 2) + item + 1
    segment = segment.flatten()[pool]
    order = torch.argsort(segment, stable=True)
    pool = pool[order]
    _, per_segment = torch.unique_consecutive(segment[order], return_counts=True)
    offsets = torch.cat([per_segment.new_zeros(1), torch.cumsum(per_segment, 0)])
    budgets = torch.tensor([kept_count(n, ratio) for n in per_segment.tolist()])
    kept = segmented_topk(scores.float().flatten()[pool.to(scores.device)], offsets, budgets)
    keep.view(-1)[pool[kept.to(pool.device)]] = True
    return keep


@vtc.method(
    "fastv",
    paper="An Image is Worth 1/2 Tokens After Layer 2 (ECCV 2024)",
    url="https://arxiv.org/abs/2403.06764",
    summary="drop low-attention visual tokens after layer K (last-token attention)",
)
class FastV(vtc.LayerPruner):
    """Rank by the last token's attention at layer K-1, keep the top (1 - R) from layer K on."""

    k: int = vtc.param(2, range="[1, inf)", doc="K: prune before layer K, using the attention of layer K-1")
    ratio: float | None = vtc.param(None, range="[0, 1)", doc="R: fraction dropped; default 1 - retention, else 0.5")

    def dropped(self) -> float:
        if self.ratio is not None:
            return self.ratio
        return 1.0 - self.retention if self.retention is not None else 0.5

    def retained_count(self, num_tokens, grid, family):
        """Visual tokens at the last layer (every layer from K on keeps them; layers < K see all)."""
        return kept_count(num_tokens, self.dropped())

    def prune_layer(self):
        return self.k

    def skip(self):
        return self.dropped() == 0.0

    def keep_mask(self, llm, ctx):
        layout = llm.layout
        scores = last_token_attention(llm, self.k - 1)
        return fastv_keep(scores, layout.visual, layout.valid, self.dropped(), layout.video)
