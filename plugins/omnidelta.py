"""OmniDelta: "Skill-Driven Budget Allocation for Token Compression" in omni-modal LLMs (about July 2026; abstract
only, no public code). The reading implemented here is the spec's: shared/specs/from-abstracts.md §6 (its formulas
are marked [OPEN] there: written for vtc, not the authors').

OmniDelta allocates a fixed retained-token budget before an existing pruner prunes: across modalities (audio vs
video) by the question's demand on "skill pools", then within a modality over its units (audio segments, video
frames) by local complexity and temporal redundancy. The families vtc serves have no audio, so, as the spec says for
video-only hosts, only the intra-modal part applies:

1. B = round(rho * N) tokens for the item (at least one per frame, at most N);
2. per frame u: complexity c_u = 1 - mean pairwise cosine of its tokens, redundancy r_u = cos(mean_u, mean_{u-1})
   (0 for the first frame), score s_u = c_u * (1 - r_u) + 1e-3;
3. budgets b_u proportional to N_u * s_u (the uniform split when every score is equal), capped at N_u with the
   overflow redistributed, at least 1, rounded by largest remainders to exactly B;
4. each frame keeps its b_u tokens with the lowest VidCom² score (Gaussian similarity to the video and frame
   centres on the low-variance channels: the spec's default pruner), in their original order.

Stage: connect, one item at a time, a fixed count per item. An image is a one-frame item: the whole budget goes to
its frame (steps 2-3 are moot) and VidCom²'s token score prunes it. The inter-modal shift and its skill pools, and a
shift between the items of one prompt, are not implemented (no audio here; vtc's connect stage sees one item at a
time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import vtc
from vtc.core.tokens import frame_groups
from vtc_kernels.select import segmented_topk
from vtc_plugins.vidcom2 import ALPHAS, gaussian_scores, low_variance_channels

Tensor = torch.Tensor

DEFAULT_RHO = 0.25  # the abstract's headline retention
SCORE_FLOOR = 1e-3


# --- the algorithm, on one item's tokens --------------------------------------------------------------------------


def item_budget(num_tokens: int, num_frames: int, rho: float) -> int:
    """B = round(rho * N), at least one token per frame, at most N."""
    return min(num_tokens, max(num_frames, round(rho * num_tokens)))


def frame_complexity(x: Tensor) -> Tensor:
    """1 - mean cosine similarity over the distinct token pairs of one frame, x [n, D] (0 for a one-token frame)."""
    n = x.shape[0]
    if n < 2:
        return x.new_zeros(())
    xn = F.normalize(x.float(), dim=-1)
    sim = xn @ xn.T
    return 1 - (sim.sum() - sim.diagonal().sum()) / (n * (n - 1))


def frame_scores(embeds: Tensor, groups: list[Tensor]) -> Tensor:
    """s_u = c_u * (1 - r_u) + 1e-3 per frame (groups: token indices of each frame, in frame order)."""
    means = torch.stack([embeds[idx].float().mean(dim=0) for idx in groups])
    redundancy = torch.zeros(len(groups), device=embeds.device)
    if len(groups) > 1:
        redundancy[1:] = F.cosine_similarity(means[1:], means[:-1], dim=-1)
    complexity = torch.stack([frame_complexity(embeds[idx]) for idx in groups])
    return complexity * (1 - redundancy) + SCORE_FLOOR


def allocate_budgets(counts: list[int], weights: Tensor, total: int) -> list[int]:
    """Integer budgets b_u in [1, counts[u]] summing to `total` (len(counts) <= total <= sum(counts)), proportional
    to `weights` where no bound binds: b_u = clamp(lambda * w_u, 1, counts[u]) with lambda found by bisection so
    that they sum to `total` (the overflow of a capped frame goes to the others), then largest remainders (ties: the
    earlier frame) round to the exact total."""
    n = len(counts)
    if not n <= total <= sum(counts):
        raise ValueError(f"a budget of {total} tokens cannot give {n} frames of {counts} tokens one to all of each")
    cap = torch.tensor(counts, dtype=torch.float64)
    w = weights.detach().double().cpu().clamp(min=1e-12)  # a zero weight still rises with lambda: every cap reachable

    def spread(lam: float) -> Tensor:
        return (lam * w).clamp(min=1.0).minimum(cap)

    low, high = 0.0, float((cap / w).max())
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if float(spread(mid).sum()) < total else (low, mid)
    value = spread(high)
    base = value.floor().clamp(min=1).minimum(cap)
    deficit = total - int(base.sum())
    remainder = (value - base).masked_fill(base >= cap, -1.0)
    order = sorted(range(n), key=lambda u: (-float(remainder[u]), u))
    for u in order[: max(deficit, 0)]:
        base[u] += 1
    return [int(b) for b in base]


def omnidelta_keep(
    embeds: Tensor, frame: Tensor, rho: float, channel_ratio: float = 0.5, alphas=ALPHAS
) -> tuple[Tensor, list[int]]:
    """(kept token indices ascending, per-frame budgets) for one item: embeds [N, D], frame [N]."""
    groups = frame_groups(frame)
    counts = [int(idx.numel()) for idx in groups]
    total = item_budget(embeds.shape[0], len(groups), rho)
    budgets = allocate_budgets(counts, frame_scores(embeds, groups) * torch.tensor(counts), total)
    x = embeds[:, low_variance_channels(embeds, channel_ratio)]
    video_score, frame_score = gaussian_scores(x, groups, alphas)
    scores = video_score + frame_score  # lower = more distinct = kept first (VidCom²)
    order = torch.cat(groups)
    offsets = torch.tensor([0, *counts], device=order.device).cumsum(0)
    kept = order[segmented_topk(scores[order], offsets, torch.tensor(budgets), largest=False)]
    return torch.sort(kept).values, budgets


# --- the method ------------------------------------------------------------------------------------------------


@vtc.method(
    "omnidelta",
    paper="OmniDelta: Skill-Driven Budget Allocation for Token Compression (abstract only)",
    url="",
    summary="per item: frame budgets by local complexity x (1 - redundancy with the previous frame), each frame "
    "pruned to its budget by VidCom²'s token score (the intra-modal part; no audio here)",
    retention_note="at least one token per frame",
)
class OmniDelta(vtc.TokenSelector):
    """Intra-modal budget allocation over frames, then VidCom²'s token score per frame (spec: from-abstracts §6)."""

    rho: float | None = vtc.param(
        None, range="(0, 1]", doc="rho: fraction of the item's tokens kept; default retention, else 0.25"
    )
    channel_ratio: float = vtc.param(
        0.5, range="(0, 1]", doc="VidCom²'s pruner: fraction of low-variance channels scored"
    )

    def fraction(self) -> float:
        if self.rho is not None:
            return self.rho
        return self.retention if self.retention is not None else DEFAULT_RHO

    def retained_count(self, num_tokens, grid, family):
        t, h, w = grid
        if num_tokens != t * h * w:
            return None  # an earlier method thinned the item: how many frames remain depends on the content
        return item_budget(num_tokens, t, self.fraction())

    def choose(self, tokens, count, ctx):
        if self.fraction() >= 1.0 or len(tokens) == 0:
            return torch.arange(len(tokens), device=tokens.embeds.device)
        keep, budgets = omnidelta_keep(tokens.embeds, tokens.frame, self.fraction(), self.channel_ratio)
        ctx.report(budgets=budgets)
        return keep
