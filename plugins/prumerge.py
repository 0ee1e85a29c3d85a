"""LLaVA-PruMerge / PruMerge+: "LLaVA-PruMerge: Adaptive Token Reduction for Efficient Large Multimodal Models"
(Shang, Cai, Xu, Lee and Yan, ICCV 2025). arXiv: https://arxiv.org/abs/2403.15388. Official code:
42Shawn/LLaVA-PruMerge at 097c0411, `llava/model/multimodal_encoder/clip_encoder.py` (`outlier_dectection`,
`token_prune_merge_advanced` = PruMerge, `token_prune_merge_advanced_plus` = PruMerge+, which `forward` calls).

Per image (here: per frame): the CLS query's attention over the patches at CLIP's last layer decides what stays.
The number of tokens is adaptive: the fraction of attention values above `Q3 + 1.5 IQR` (interquartile-range
outliers) is the ratio, and the top `int(n ratio)` tokens by attention are kept. PruMerge+ adds the tokens of a
spatially uniform grid `arange(0, n - 1, int(int(1 / ratio) / 3))` not already kept. Every kept token then absorbs
its 32 most key-similar tokens (cosine of the layer's keys, among all other tokens), weighted by their attention:
`x_i + sum_j a_j x_j`; one more token, `sum_j a_j x_j` over the pruned tokens, is appended.
Stage: connect (the official code runs on the CLIP features before the projector).

By tower (docs/methods/prumerge-plus.md): CLIP (LLaVA-NeXT-Video) the official single-head, full-width CLS
attention of the tower's last layer, recovered exactly from the per-head CLS rows vtc captures (the softmax of the
head sum of log-probabilities over sqrt(heads)); towers without CLS (SigLIP, Qwen, InternViT) the attention each
token receives at the last layer (mean over queries, as VisPruner's SigLIP tower and the LightCompress Qwen ports
read it). Maps are pooled onto the token grid like the features and rescaled to the mass the patch row carries.

Where vtc differs:
- `retention` (or `tokens_per_frame`) gives each frame a fixed budget K = round(retention * n): the IQR rule still
  picks the attention tokens (at most K - 1), the rest of K - 1 is spread evenly over the other tokens in raster
  order, plus the remainder token. Without either, the official adaptive count (content-dependent).
- Keys are vtc's head-mean keys (the official code takes the cosine of the full-width keys, all heads
  concatenated), pooled onto the token grid.
- Features: LLaVA-NeXT-Video merges the CLIP features before the projector (official), the other families merge
  the LLM tokens. The merge is computed in float32.
- The remainder token sits at the pruned token of highest attention (its position on M-RoPE families).
- A frame with no outliers (ratio 0, where the official code divides by zero) keeps its top token; a stride below
  1 is 1; fewer than 33 tokens in a frame merge all the others.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

import vtc
from vtc.core.bases import fraction_count
from vtc.core.geometry import FamilyGeometry, default_geometry
from vtc.core.tokens import prepool_blocks
from vtc.core.vision_stats import VisionStat

Tensor = torch.Tensor

NEIGHBORS = 32  # topk(cos_sim_matrix, k=int(32))
IQR_FENCE = 1.5  # upper_bound = Q3 + 1.5 * IQR
STRIDE_DIVISOR = 3  # arange(0, 575, int(step_length / 3))
REDUCTION_RATIO = 1 / 8  # the `reduction_ratio` default (used when if_adaptive=False)
CLIP_LAST_LAYER = 23  # hooks on layers[23] of CLIP ViT-L/14 (the layer after LLaVA's feature layer -2)


# --- the algorithm, on one frame ----------------------------------------------------------------------------------


def outlier_ratio(attention: Tensor, fence: float = IQR_FENCE) -> float:
    """`outlier_dectection`: the fraction of the values of `attention` [n] above Q3 + fence * IQR (numpy's
    percentiles of the float32 values, as the official code)."""
    values = attention.detach().to(torch.float32).cpu().numpy().flatten()
    q1 = np.percentile(values, 25)
    q3 = np.percentile(values, 75)
    upper = q3 + fence * (q3 - q1)
    return len(np.where(values > upper)[0]) / len(values)


def spatial_grid(important: Tensor, num_tokens: int, ratio: float, divisor: int = STRIDE_DIVISOR) -> Tensor:
    """PruMerge+'s extra tokens: `arange(0, n - 1, int(int(1 / ratio) / divisor))` without those in `important`
    (a stride below 1 is 1)."""
    stride = max(1, int(int(1 / ratio) / divisor))
    grid = torch.arange(0, num_tokens - 1, stride, device=important.device)
    return grid[~torch.isin(grid, important)]


def spread_evenly(candidates: Tensor, count: int) -> Tensor:
    """`count` of `candidates` (in their order) at even spacing, the first one included."""
    if count <= 0:
        return candidates[:0]
    return candidates[(torch.arange(count, device=candidates.device) * candidates.numel()) // count]


def select_tokens(
    attention: Tensor,
    budget: int | None = None,
    *,
    plus: bool = True,
    ratio: float | None = None,
    fence: float = IQR_FENCE,
    divisor: int = STRIDE_DIVISOR,
    remainder: bool = True,
) -> tuple[Tensor, int, float]:
    """The kept tokens of one frame, in the official output order: (indices, attention-picked count, ratio).

    attention [n]; ratio: None for the IQR outlier fraction (`if_adaptive`), else the given reduction ratio.
    budget None: the official count, `int(n ratio)` by attention (at least one), plus PruMerge+'s grid. budget K: K
    tokens counting the remainder token when `remainder` (K >= 2): the attention-picked ones (at most K - 1), then
    the rest of the budget spread evenly over the other tokens (PruMerge+; PruMerge gives it all to attention)."""
    n = attention.numel()
    if ratio is None:
        ratio = outlier_ratio(attention, fence)
    if budget is None:
        effective = ratio if ratio > 0 else 1 / n
        count = min(n, max(1, int(n * effective)))
        important = torch.topk(attention, count).indices
        if not plus:
            return important, count, ratio
        return torch.cat([important, spatial_grid(important, n, effective, divisor)]), count, ratio
    slots = budget - (1 if remainder and budget >= 2 else 0)
    count = min(slots, max(1, int(n * ratio))) if plus else slots
    important = torch.topk(attention, count).indices
    rest = torch.ones(n, dtype=torch.bool, device=attention.device)
    rest[important] = False
    spatial = spread_evenly(torch.nonzero(rest).flatten(), slots - count)
    return torch.cat([important, spatial]), count, ratio


@dataclasses.dataclass
class MergePlan:
    """What one frame becomes: row r of the output is `keep_weight[r] x[keep[r]] + weights[r] @ x`."""

    keep: Tensor  # [K] token indices: the kept tokens (selection order), then the remainder's anchor
    keep_weight: Tensor  # [K] 1 for kept tokens; the anchor's attention for the remainder token
    weights: Tensor  # [K, n] attention weights of the tokens merged into each output
    remainder: bool  # the last row is the remainder token


def merge_plan(attention: Tensor, keys: Tensor, kept: Tensor, neighbors: int = NEIGHBORS, remainder: bool = True):
    """PruMerge's merge for one frame: each kept token takes `a_j x_j` of its `neighbors` most key-similar tokens
    among all the others (kept or pruned; cosine of L2-normalised keys); with `remainder` (and a pruned token left)
    one more output `sum_{pruned} a_j x_j`, anchored at the pruned token of highest attention (first on ties).

    attention [n], keys [n, d], kept [k] -> `MergePlan` (float32)."""
    n, k = attention.numel(), kept.numel()
    a = attention.float()
    normalized = F.normalize(keys.float(), p=2, dim=-1)
    rows = torch.arange(k, device=kept.device)
    weights = torch.zeros(k, n, device=a.device)
    if n > 1:
        similarity = normalized[kept] @ normalized.T  # [k, n]
        similarity[rows, kept] = -math.inf  # a token is not its own neighbour
        nearest = torch.topk(similarity, min(neighbors, n - 1), dim=1).indices
        weights.scatter_(1, nearest, a[nearest])
    keep, keep_weight = kept, torch.ones(k, device=a.device)
    pruned = torch.ones(n, dtype=torch.bool, device=a.device)
    pruned[kept] = False
    if not (remainder and bool(pruned.any())):
        return MergePlan(keep, keep_weight, weights, False)
    candidates = torch.nonzero(pruned).flatten()
    anchor = candidates[torch.argmax(a[candidates])]
    row = torch.where(pruned, a, torch.zeros_like(a))
    row[anchor] = 0.0  # the anchor enters through keep_weight
    return MergePlan(
        torch.cat([keep, anchor.view(1)]),
        torch.cat([keep_weight, a[anchor].view(1)]),
        torch.cat([weights, row[None]]),
        True,
    )


def merged_features(x: Tensor, plan: MergePlan) -> Tensor:
    """x [n, ...] -> [K, ...]: `keep_weight x[keep] + weights @ x`, in float32, cast back to x's dtype."""
    flat = x.reshape(x.shape[0], -1).float()
    out = plan.keep_weight[:, None] * flat[plan.keep] + plan.weights @ flat
    return out.to(x.dtype).reshape(plan.keep.numel(), *x.shape[1:])


# --- what each tower gives ----------------------------------------------------------------------------------------


def vision_layer(geometry: FamilyGeometry, layer: int | None) -> int:
    """The official layer: CLIP's last (layers[23], one after LLaVA's feature layer), else the feature layer."""
    if layer is not None:
        return layer
    return CLIP_LAST_LAYER if geometry.cls_tokens else -1


def vision_stats_for(geometry: FamilyGeometry, layer: int | None = None) -> list[VisionStat]:
    at = vision_layer(geometry, layer)
    return [VisionStat("cls" if geometry.cls_tokens else "received", at), VisionStat("keys", at)]


def single_head_cls(cls_rows: Tensor) -> Tensor:
    """The official CLS row `softmax(q k^T C^-0.5)[0]` with q, k full width (all heads, C = heads * d), from the
    per-head rows `softmax(q_h k_h^T d^-0.5)[0]` [F, heads, L]: log p_h is the head's logit up to a constant, and
    q k^T C^-0.5 = sum_h q_h k_h^T d^-0.5 / sqrt(heads)."""
    heads = cls_rows.shape[1]
    log_probs = cls_rows.float().clamp_min(torch.finfo(torch.float32).tiny).log()
    return torch.softmax(log_probs.sum(dim=1) / math.sqrt(heads), dim=-1)


def token_attention(values: Tensor, geometry: FamilyGeometry, size: tuple[int, int]) -> Tensor:
    """[F, H*W]: each token's attention weight `a` on the token grid. CLIP: the single-head CLS row ([F, heads, L]
    per-head rows in), its patch columns pooled like the features and rescaled to their total (a 2 x 2 average
    becomes the block's sum). Other towers: the received attention ([F, L]) as a distribution over the frame's
    tokens (it sums to 1 over keys when averaged over queries)."""
    if values.dim() == 3:
        row = single_head_cls(values)
        total = row[:, geometry.cls_tokens :].sum(dim=-1, keepdim=True)
    else:
        row = values.float()
        total = torch.ones(row.shape[0], 1, device=row.device)
    pooled = geometry.to_token_grid(row, size)
    return pooled / pooled.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) * total


# --- the method ---------------------------------------------------------------------------------------------------


@vtc.method(
    "prumerge-plus",
    paper="LLaVA-PruMerge: Adaptive Token Reduction for Efficient Large Multimodal Models (ICCV 2025)",
    url="https://arxiv.org/abs/2403.15388",
    summary="per frame: IQR-outlier CLS-attention tokens + a uniform spatial grid; pruned tokens merged into them",
    retention_note="per frame: K = round(retention * n) with the remainder token; without retention the official "
    "adaptive (IQR outlier) count",
    exempt={"ordered_positions": "official order on LLaVA: per frame, attention-picked, spatial, remainder token"},
    test_params={"attention_layer": -1},
)
class PruMergePlus(vtc.Method):
    """PruMerge+ (plus=True, official default) or PruMerge (plus=False), per frame (official: 42Shawn/LLaVA-PruMerge
    clip_encoder.py::token_prune_merge_advanced_plus / token_prune_merge_advanced)."""

    plus: bool = vtc.param(True, doc="PruMerge+: add the spatially uniform tokens; False: PruMerge")
    adaptive: bool = vtc.param(True, doc="if_adaptive: the attention share is the IQR outlier fraction of the frame")
    reduction_ratio: float = vtc.param(
        REDUCTION_RATIO, range="(0, 1]", doc="reduction_ratio: the attention share when adaptive=False"
    )
    iqr_fence: float = vtc.param(IQR_FENCE, range="[0, inf)", doc="outliers lie above Q3 + iqr_fence * IQR")
    stride_divisor: int = vtc.param(
        STRIDE_DIVISOR, range="[1, inf)", doc="PruMerge+ grid stride int(int(1 / ratio) / divisor)"
    )
    neighbors: int = vtc.param(NEIGHBORS, range="[1, inf)", doc="k: key-similar tokens merged into each kept token")
    remainder_token: bool = vtc.param(True, doc="append sum_j a_j x_j over the pruned tokens (official)")
    tokens_per_frame: int | None = vtc.param(
        None, range="[1, inf)", doc="K per frame (remainder token included); default round(retention * n)"
    )
    attention_layer: int | None = vtc.param(
        None, doc="vision layer of attention and keys; None: 23 on CLIP (official layers[23]), -1 (feature layer) else"
    )
    merge_before_projector: bool = vtc.param(
        True, doc="LLaVA-NeXT-Video: merge CLIP features before the projector (official); False: LLM tokens"
    )

    positions = "compact"  # the official tower returns the reduced sequence; LLaVA builds inputs_embeds from it
    prepool = True  # LLaVA-NeXT-Video merges CLIP features before the projector

    def vision_stats(self, family):
        return vision_stats_for(default_geometry(family), self.attention_layer)

    def frame_budget(self, num_patches: int) -> int | None:
        """K for a frame of `num_patches` tokens; None for the official adaptive count."""
        if self.tokens_per_frame is not None:
            return min(self.tokens_per_frame, num_patches)
        if self.retention is None:
            return None
        return fraction_count(num_patches, self.retention)

    def retained_count(self, num_tokens, grid, family):
        t, h, w = grid
        budget = self.frame_budget(h * w)
        if budget is None or num_tokens != t * h * w:
            return None  # the IQR count, or frames an earlier method thinned: content-dependent
        return t * budget

    def connect(self, tokens, ctx):
        t, h, w = tokens.grid
        budget = self.frame_budget(h * w)
        if len(tokens) == 0 or (budget is not None and budget >= h * w):
            return tokens
        geometry = ctx.geometry
        stats = vision_stats_for(geometry, self.attention_layer)
        missing = [s for s in stats if s not in ctx.vision]
        if missing:
            raise RuntimeError(
                f"prumerge-plus: the vision-tower statistics {missing} were not captured on {ctx.family}"
            )
        device = tokens.embeds.device
        attention = token_attention(ctx.vision[stats[0]], geometry, (h, w)).to(device)
        keys = geometry.to_token_grid(ctx.vision[stats[1]].float(), (h, w)).to(device)
        blocks = prepool_blocks(tokens, ctx) if self.merge_before_projector else None
        source = blocks if blocks is not None else tokens.embeds
        mrope = tokens.positions.dim() == 2
        patch = tokens.patch
        keep, keep_weight, src, maps, embeds, weight = [], [], [], [], [], []
        counts, picked, ratios = [], [], []
        for idx in tokens.frame_groups("patch"):
            if budget is not None and idx.numel() <= budget:  # thinned below K by an earlier method: kept whole
                keep.append(idx)
                keep_weight.append(torch.ones(idx.numel(), device=device))
                src.append(idx[:0])
                maps.append(torch.zeros(idx.numel(), 0, device=device))
                embeds.append(tokens.embeds[idx])
                weight.append(tokens.weight[idx].float())
                continue
            f, cells = int(tokens.frame[idx[0]]), patch[idx]
            a = attention[f, cells]
            kept, important, ratio = select_tokens(
                a,
                budget,
                plus=self.plus,
                ratio=None if self.adaptive else self.reduction_ratio,
                fence=self.iqr_fence,
                divisor=self.stride_divisor,
                remainder=self.remainder_token,
            )
            plan = merge_plan(a, keys[f, cells], kept, self.neighbors, self.remainder_token and budget != 1)
            if mrope:  # positions are kept (M-RoPE): the tokens stay in their original order
                order = torch.argsort(plan.keep)
                plan = MergePlan(plan.keep[order], plan.keep_weight[order], plan.weights[order], plan.remainder)
            features = merged_features(source[idx], plan)
            if blocks is not None:  # CLIP blocks: the model's pooler and projector
                features = ctx.pool(features).reshape(plan.keep.numel(), -1)
            keep.append(idx[plan.keep])
            keep_weight.append(plan.keep_weight)
            src.append(idx)
            maps.append(plan.weights)
            embeds.append(features.to(tokens.embeds.dtype))
            weight.append(merged_weight(tokens.weight[idx], plan))
            counts.append(plan.keep.numel())
            picked.append(important)
            ratios.append(ratio)
        ctx.report(frame_counts=counts, attention_picked=picked, ratios=ratios)
        out = tokens.merge_dense(torch.cat(keep), torch.cat(keep_weight), torch.cat(src), maps, torch.cat(embeds))
        out.weight = torch.cat(weight).to(out.weight.dtype)
        return out


def merged_weight(weight: Tensor, plan: MergePlan) -> Tensor:
    """Original tokens each output stands for: its own, plus every pruned token (other than the anchor) counted once,
    for the output that gives it the largest weight (first on ties)."""
    out = weight[plan.keep].float().clone()
    pruned = torch.ones(weight.numel(), dtype=torch.bool, device=weight.device)
    pruned[plan.keep] = False
    fed = pruned & (plan.weights > 0).any(dim=0)
    if bool(fed.any()):
        out.index_add_(0, plan.weights[:, fed].argmax(dim=0), weight[fed].float())
    return out
