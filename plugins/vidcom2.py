"""VidCom²: "Video Compression Commander: Plug-and-Play Inference Acceleration for Video Large Language
Models" (Liu et al., EMNLP 2025). arXiv: https://arxiv.org/abs/2505.14454. Official code:
xuyang-liu16/VidCom2 (`token_compressor/vidcom2/vidcom2.py`, adapters in `token_compressor/models/`).

Score every token by its multi-scale Gaussian similarity to the video centre and to its frame centre, on the
lowest-variance half of the channels; frames least like the video get a larger share of the budget (softmax
at temperature 0.01 around the ratio R); each frame keeps its k_f most distinct (lowest-score) tokens.
Stage: connect (post-projector, post-pool features; no attention, no question).

Faithful to the official code: channel selection by population variance over all tokens, `F.normalize` on
the selected channels, centres that are not re-normalised, bandwidths 2^-3..2^1, `k_f = max(1, round(s_f t_f))`,
ascending indices within each frame, scores in the embeddings' dtype (`compute_dtype` overrides). vtc
differences: R = 1 keeps every token (the official budget formula would still drop 1/F of the tokens of
the frames the softmax does not favour); frames are grouped by `tokens.frame`, so a video an earlier plugin
already thinned works (frame centres and budgets use each frame's own token count); `fixed_count=True` turns
on vLLM's exact count `max(T, min(int(N R), N))`, reconciled by score.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import vtc
from vtc.core.tokens import frame_groups
from vtc_kernels import reconcile_count
from vtc_kernels.select import segmented_topk

Tensor = torch.Tensor

DEFAULT_RATIO = 0.25  # R_RATIO / base_scale in the official scripts
ALPHAS = (0.125, 0.25, 0.5, 1.0, 2.0)  # [2**k for k in range(-3, 2)]


# --- the algorithm, on one video's tokens -------------------------------------------------------------------------


def low_variance_channels(x: Tensor, ratio: float = 0.5) -> Tensor:
    """Indices of the int(D * ratio) channels with the lowest population variance over the tokens of x [N, D]."""
    variances = x.var(dim=0, unbiased=False)
    return torch.topk(variances, k=int(x.shape[-1] * ratio), largest=False).indices


def multi_scale_gaussian(x: Tensor, centre: Tensor, alphas=ALPHAS) -> Tensor:
    """sum over alpha of exp(-|x - c|^2 / (2 alpha)), row-wise: x [n, C], centre [C] or [n, C] -> [n]."""
    dist_sq = ((x - centre) ** 2).sum(dim=-1)
    total = torch.zeros_like(dist_sq)
    for a in alphas:
        total = total + torch.exp(-dist_sq / (2 * a))
    return total


def gaussian_scores(x: Tensor, groups: list[Tensor], alphas=ALPHAS) -> tuple[Tensor, Tensor]:
    """Similarity of every token of x [N, C] (already channel-selected) to the video centre and to its frame's
    centre, after L2-normalising the tokens (centres are plain means, not re-normalised). Returns ([N], [N])."""
    xn = F.normalize(x, dim=-1)
    video_score = multi_scale_gaussian(xn, xn.mean(dim=0), alphas)
    frame_score = torch.empty_like(video_score)
    for idx in groups:
        members = xn[idx]
        frame_score[idx] = multi_scale_gaussian(members, members.mean(dim=0), alphas)
    return video_score, frame_score


def frame_scales(uniqueness: Tensor, ratio: float, temperature: float = 0.01) -> Tensor:
    """Per-frame keep fractions s_f = min(1, R (1 + p_f - mean p)), p = softmax((u - max u) / temperature)."""
    probs = torch.softmax((uniqueness - uniqueness.max()) / temperature, dim=0)
    return (ratio * (1 + probs - probs.mean())).clamp(max=1.0)


def frame_budgets(scales: Tensor, counts: list[int]) -> Tensor:
    """k_f = max(1, round(s_f * t_f)), rounding half to even in the scales' dtype: t_f multiplies as a Python
    int, as the official `(scales * tpf).round().long().clamp(min=1)` does (a bf16 tensor of counts would
    not hold t_f = 729 exactly); at most t_f."""
    if len(set(counts)) == 1:
        products = scales * counts[0]
    else:
        products = torch.stack([scales[f] * c for f, c in enumerate(counts)])
    budgets = products.round().long().clamp(min=1)
    # a low-precision product can round past t_f (bf16: 1.0 * 731 -> 732), where the official topk would fail
    return torch.minimum(budgets, torch.tensor(counts, device=budgets.device))


@dataclasses.dataclass
class VidCom2Plan:
    """What VidCom² decided for one video."""

    keep: Tensor  # kept token indices, ascending
    scores: Tensor  # [N] V + Fm (lower = more distinct = kept first)
    frames: list[Tensor]  # token indices of each frame present
    budgets: list[int]  # k_f per frame (before any fixed-count reconciliation)


def vidcom2_plan(
    embeds: Tensor,
    frame: Tensor,
    ratio: float = DEFAULT_RATIO,
    channel_ratio: float = 0.5,
    temperature: float = 0.01,
    alphas=ALPHAS,
    target: int | None = None,
) -> VidCom2Plan:
    """VidCom² on one video: embeds [N, D] post-projector features, frame [N] temporal index of each token.

    With `target`, the per-frame selection is reconciled to exactly `target` tokens: the kept tokens with the
    highest scores are dropped, or the dropped ones with the lowest scores added (vLLM's VidCom2)."""
    groups = frame_groups(frame)  # tokens of each frame, in their current order
    x = embeds[:, low_variance_channels(embeds, channel_ratio)]
    video_score, frame_score = gaussian_scores(x, groups, alphas)
    uniqueness = torch.stack([-video_score[idx].mean() for idx in groups])
    counts = [int(idx.numel()) for idx in groups]
    budgets = frame_budgets(frame_scales(uniqueness, ratio, temperature), counts).tolist()
    scores = video_score + frame_score
    keep = torch.zeros(embeds.shape[0], dtype=torch.bool, device=embeds.device)
    if groups:  # one segment per frame, each in its tokens' order
        order = torch.cat(groups)
        offsets = torch.tensor([0, *counts], device=order.device).cumsum(0)
        keep[order[segmented_topk(scores[order], offsets, torch.tensor(budgets), largest=False)]] = True
    if target is not None:
        keep = reconcile_count(keep, -scores, target)
    return VidCom2Plan(torch.nonzero(keep).flatten(), scores, groups, budgets)


def fixed_target(num_tokens: int, num_frames: int, ratio: float) -> int:
    """vLLM's VidCom2 count: max(num_frames, min(int(total * R), total)), capped at the tokens present."""
    return max(min(num_frames, num_tokens), min(int(num_tokens * ratio), num_tokens))


# --- the method ------------------------------------------------------------------------------------------------


@vtc.method(
    "vidcom2",
    paper="Video Compression Commander: Plug-and-Play Inference Acceleration for Video LLMs (EMNLP 2025)",
    url="https://arxiv.org/abs/2505.14454",
    summary="per-frame budgets by frame uniqueness; keep the tokens least like the video and frame centres",
)
class VidCom2(vtc.Method):
    """Frame-uniqueness budgets, then the most distinct tokens of each frame (official: xuyang-liu16/VidCom2
    token_compressor/vidcom2/vidcom2.py::vidcom2_compression).

    Not a `TokenSelector`: the count is adaptive unless `fixed_count`, and every video reports its budgets,
    also when nothing is dropped."""

    ratio: float | None = vtc.param(
        None, range="(0, 1]", doc="R (R_RATIO): mean fraction kept per frame; default: retention"
    )
    channel_ratio: float = vtc.param(
        0.5, range="(0, 1]", doc="`select_low_var_channels(ratio=0.5)`: fraction of (lowest-variance) channels scored"
    )
    temperature: float = vtc.param(0.01, range="(0, inf)", doc="`compute_scales(temp)`: softmax temperature of budgets")
    alphas: tuple[float, ...] = vtc.param(ALPHAS, doc="Gaussian bandwidths alpha of `_multi_scale_gaussian` (positive)")
    fixed_count: bool = vtc.param(False, doc="exact count max(T, min(int(N R), N)) (vLLM's VidCom2)")
    compute_dtype: vtc.DType | None = vtc.param(None, doc="None: the embeddings' dtype (as the official code)")

    positions = "compact"

    def validate(self):
        try:
            alphas = tuple(float(a) for a in self.alphas)
        except (TypeError, ValueError):
            alphas = ()
        if not alphas or any(not a > 0 for a in alphas):
            raise ValueError(f"vidcom2: alphas must be positive numbers, got {self.alphas}")
        self.alphas = alphas

    def fraction(self) -> float:
        """R: the `ratio` parameter, else this method's share of the retention, else 0.25."""
        if self.ratio is not None:
            return self.ratio
        return self.retention if self.retention is not None else DEFAULT_RATIO

    def retained_count(self, num_tokens, grid, family):
        ratio = self.fraction()
        if ratio >= 1.0:
            return num_tokens
        if self.fixed_count:
            return fixed_target(num_tokens, int(grid[0]), ratio)
        return None  # per-frame rounding makes the total depend on the content

    def connect(self, tokens, ctx):
        n = len(tokens)
        ratio = self.fraction()
        if ratio >= 1.0 or n == 0:
            ctx.report(budgets=torch.unique(tokens.frame, return_counts=True)[1].tolist())
            return tokens
        embeds = tokens.embeds.to(vtc.as_dtype(self.compute_dtype, tokens.embeds.dtype))
        target = self.retained_count(n, tokens.grid, ctx.family) if self.fixed_count else None
        plan = vidcom2_plan(
            embeds,
            tokens.frame,
            ratio,
            channel_ratio=self.channel_ratio,
            temperature=self.temperature,
            alphas=self.alphas,
            target=target,
        )
        ctx.report(budgets=plan.budgets, plan=plan)  # per-frame budgets k_f (adaptive mode keeps sum(k_f))
        if plan.keep.numel() == n:
            return tokens
        return tokens.select(plan.keep)
