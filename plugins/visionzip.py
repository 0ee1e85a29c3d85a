"""VisionZip: "VisionZip: Longer is Better but Not Necessary in Vision Language Models" (Yang et al., CVPR 2025).
arXiv: https://arxiv.org/abs/2412.04467. Official code: dvlab-research/VisionZip (`visionzip/main.py`,
`visionzip/clip_encoder.py`, `visionzip/utils.py`, `visionzip/llava_arch.py`); the SigLIP / video port the
video papers compare against: cokeshao/HoliTom (`visionzip/llava_arch.py`,
`LLaVA-NeXT/llava/model/multimodal_encoder/siglip_encoder.py`).

Per frame, keep the `dominant` tokens that receive the most vision-tower attention, then fold the rest into
`contextual` targets spaced uniformly over the remaining tokens: every other remaining token joins the target
whose vision key (head-mean) is most cosine-similar, and the target becomes `h_t + mean(members)`.
Stage: connect (one frame at a time, a fixed count per frame).

Attention and keys by family: LLaVA-OneVision follows the SigLIP video port (last layer's mean received
attention and head-mean keys, both bilinearly resized 27x27 -> 14x14 like the features); LLaVA-NeXT-Video the
official CLIP form (the CLS row, summed over heads, and the keys, 2x2-averaged like the features; the merge
happens on the CLIP features before the projector, as the official CLIP tower does); Qwen-VL families (no CLS)
the received attention and keys of the last vision block on the LLM token grid. Order: LLaVA families get the
port's order, per frame [dominant (spatial order); contextual (target order)], with renumbered positions;
Qwen families keep M-RoPE positions, so tokens stay in their original order.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import vtc
from vtc.core.geometry import FamilyGeometry, default_geometry
from vtc.core.tokens import prepool_blocks
from vtc.core.vision_stats import VisionStat
from vtc_kernels.matching import best_match
from vtc_kernels.merge import merge_into_anchors

Tensor = torch.Tensor

DOMINANT_RATIO = 54 / 64  # DOMINANT_RATIO of the port (the README's 54 dominant + 10 contextual of LLaVA-1.5)
PORT_DEFAULT_TOKENS = 50  # SPATIAL_TOKENS default of the port, per 196-token LLaVA-OneVision frame
PORT_FRAME_TOKENS = 196


# --- the algorithm, on one frame ---------------------------------------------------------------------------------


def frame_tokens(num_patches: int, retention: float | None) -> int:
    """S for a frame of `num_patches` tokens: ceil(retention * n) (10/15/20 % of 196 -> 20/30/40, the port's
    SPATIAL_TOKENS); with no retention the port's default density, 50 of 196."""
    fraction = retention if retention is not None else PORT_DEFAULT_TOKENS / PORT_FRAME_TOKENS
    return max(1, min(num_patches, math.ceil(round(num_patches * fraction, 9))))


def split_counts(tokens: int, dominant_ratio: float = DOMINANT_RATIO) -> tuple[int, int]:
    """(dominant, contextual) = (int(S * ratio), S - dominant), as the port computes them."""
    dominant = int(tokens * dominant_ratio)
    return dominant, tokens - dominant


@dataclasses.dataclass
class FramePlan:
    """VisionZip's choice for one frame; indices are positions in the frame's token list."""

    dominant: Tensor  # [k] ascending (the official masked_select order)
    targets: Tensor  # [c] contextual targets, in target order
    members: Tensor  # [m] remaining tokens merged into a target
    assign: Tensor  # [m] target slot (0..c-1) of each member


def select_frame(attention: Tensor, metric: Tensor, dominant: int, contextual: int) -> FramePlan:
    """One frame: attention [n] (score of each token), metric [n, d] (head-mean keys).

    Dominant = top-`dominant` attention; the rest, in their original order, get `contextual` targets at
    arange(0, n_rem, max(1, n_rem // contextual))[:contextual]; every other remaining token is assigned to the
    target with the largest cosine similarity of the metric (first one on ties)."""
    n = attention.shape[0]
    device = attention.device
    rest = torch.ones(n, dtype=torch.bool, device=device)
    rest[torch.topk(attention, dominant).indices] = False
    dom = torch.nonzero(~rest).flatten()
    remaining = torch.nonzero(rest).flatten()
    empty = remaining[:0]
    if contextual == 0 or remaining.numel() == 0:
        return FramePlan(dom, empty, empty, empty)
    metric = metric[remaining]
    step = max(1, remaining.numel() // contextual)
    target_pos = torch.arange(0, remaining.numel(), step, device=device)[:contextual]
    is_target = torch.zeros(remaining.numel(), dtype=torch.bool, device=device)
    is_target[target_pos] = True
    member_pos = torch.nonzero(~is_target).flatten()
    assign = best_match(metric[member_pos], metric[target_pos], normalize="exact")[0]  # x / ||x||, then argmax
    return FramePlan(dom, remaining[target_pos], remaining[member_pos], assign)


def contextual_features(targets: Tensor, members: Tensor, assign: Tensor) -> Tensor:
    """h_t + mean of the members assigned to t (an empty cluster adds 0): targets [c, ...], members [m, ...]."""
    return merge_into_anchors(targets, members, assign, rule="add_mean", summation="one_hot")  # the port's bmm


# --- attention maps on the LLM token grid -------------------------------------------------------------------------


def vision_stats_for(geometry: FamilyGeometry) -> list[VisionStat]:
    """CLIP towers (a CLS token): the official CLS row; SigLIP and Qwen towers: the attention each token receives."""
    if geometry.cls_tokens:
        return [VisionStat("cls", -1), VisionStat("keys", -1)]
    return [VisionStat("received", -1), VisionStat("keys", -1)]


def token_grid_maps(vision: dict, geometry: FamilyGeometry, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(attention [F, H*W], metric [F, H*W, d]) on the token grid, from the captured vision statistics, pooled
    the way the model pools its features."""
    keys = vision[VisionStat("keys", -1)].float()
    if geometry.cls_tokens:  # official CLIP form: CLS row summed over heads (its own CLS column dropped below)
        attention = vision[VisionStat("cls", -1)].float().sum(dim=1)
    else:  # SigLIP port / Qwen: attention received, mean over queries (as attentions[-1].mean(1).mean(1))
        received = vision[VisionStat("received", -1)].float()
        attention = received / received.shape[-1]
    return geometry.to_token_grid(attention, size), geometry.to_token_grid(keys, size)


# --- the method -------------------------------------------------------------------------------------------------


@vtc.method(
    "visionzip",
    paper="VisionZip: Longer is Better but Not Necessary in Vision Language Models (CVPR 2025)",
    url="https://arxiv.org/abs/2412.04467",
    summary="per frame: top vision-attention tokens + key-similarity merges into uniform targets",
    retention_note="per frame: S = ceil(retention * tokens per frame), so at most one token per frame above",
    exempt={"ordered_positions": "official order on LLaVA: per frame, dominant tokens then contextual ones"},
)
class VisionZip(vtc.TokenMerger):
    """Per frame, dominant tokens by vision attention + contextual merges (official: dvlab-research/VisionZip
    visionzip/clip_encoder.py; the video port: cokeshao/HoliTom visionzip/llava_arch.py)."""

    tokens_per_frame: int | None = vtc.param(
        None, range="[1, inf)", doc="S (SPATIAL_TOKENS): kept per frame; default ceil(retention * n)"
    )
    dominant_ratio: float = vtc.param(
        DOMINANT_RATIO, range="[0, 1]", doc="DOMINANT_RATIO: dominant = int(S * ratio), contextual = S - dominant"
    )
    dominant: int | None = vtc.param(
        None, range="[0, inf)", doc="official `dominant` per frame (no CLS token here); needs `contextual` too"
    )
    contextual: int | None = vtc.param(None, range="[0, inf)", doc="official `contextual` per frame; needs `dominant`")
    merge_before_projector: bool = vtc.param(
        True, doc="LLaVA-NeXT-Video: merge CLIP features before the projector (official)"
    )

    positions = "compact"
    prepool = True  # LLaVA-NeXT-Video merges CLIP features before the projector (other families ignore it)

    def validate(self):
        if (self.dominant is None) != (self.contextual is None):
            raise ValueError("visionzip: give both dominant and contextual (tokens per frame), or neither")
        if self.dominant is not None:
            if self.tokens_per_frame is not None:
                raise ValueError("visionzip: give tokens_per_frame or dominant + contextual, not both")
            if self.dominant + self.contextual < 1:
                raise ValueError(
                    f"visionzip: dominant and contextual must be >= 0 with a positive sum, got "
                    f"{self.dominant} and {self.contextual}"
                )

    def vision_stats(self, family):
        return vision_stats_for(default_geometry(family))

    def counts(self, num_patches: int) -> tuple[int, int]:
        """(dominant, contextual) per frame of `num_patches` tokens."""
        if self.dominant is not None:
            return self.dominant, self.contextual
        tokens = (
            self.tokens_per_frame if self.tokens_per_frame is not None else frame_tokens(num_patches, self.retention)
        )
        return split_counts(tokens, self.dominant_ratio)

    def retained_count(self, num_tokens, grid, family):
        t, h, w = grid
        if num_tokens != t * h * w:
            return None  # an earlier method thinned the frames: per-frame caps make it content-dependent
        return t * min(sum(self.counts(h * w)), h * w)

    def plan(self, tokens, ctx):
        t, h, w = tokens.grid
        dominant, contextual = self.counts(h * w)
        n = len(tokens)
        if dominant + contextual >= h * w or n == 0:
            return None
        attention, metric = token_grid_maps(ctx.vision, ctx.geometry, (h, w))
        patch = tokens.patch
        device = tokens.embeds.device
        attention, metric = attention.to(device), metric.to(device)
        blocks = self._prepool_blocks(tokens, ctx)

        keep, new_embeds, dst, src, src_weight = [], [], [], [], []
        for idx in tokens.frame_groups("patch"):
            f = int(tokens.frame[idx[0]])
            if idx.numel() <= dominant + contextual:  # a frame an earlier method thinned below S: keep it whole
                keep.append(idx)
                new_embeds.append(tokens.embeds[idx])
                continue
            chosen = select_frame(attention[f, patch[idx]], metric[f, patch[idx]], dominant, contextual)
            targets, members = idx[chosen.targets], idx[chosen.members]
            if blocks is not None:  # CLIP features: merge, then the model's pooling and projector
                merged = contextual_features(blocks[targets], blocks[members], chosen.assign)
                ctx_embeds = ctx.pool(merged).reshape(targets.numel(), -1).to(tokens.embeds.dtype)
            else:
                ctx_embeds = contextual_features(tokens.embeds[targets], tokens.embeds[members], chosen.assign)
            base = sum(k.numel() for k in keep) + chosen.dominant.numel()
            counts = torch.bincount(chosen.assign, minlength=targets.numel()).clamp(min=1)
            keep += [idx[chosen.dominant], targets]
            new_embeds += [tokens.embeds[idx[chosen.dominant]], ctx_embeds]
            dst.append(base + chosen.assign)
            src.append(members)
            src_weight.append(1.0 / counts[chosen.assign].float())
        keep_idx = torch.cat(keep)
        embeds = torch.cat(new_embeds)
        dst_idx = torch.cat(dst) if dst else keep_idx[:0]
        src_idx = torch.cat(src) if src else keep_idx[:0]
        weights = torch.cat(src_weight) if src_weight else torch.zeros(0, device=device)
        if tokens.positions.dim() == 2:  # M-RoPE (Qwen): positions are kept, so keep the original order
            order = torch.argsort(tokens.frame[keep_idx] * h * w + patch[keep_idx])
            rank = torch.empty_like(order)
            rank[order] = torch.arange(order.numel(), device=order.device)
            keep_idx, embeds, dst_idx = keep_idx[order], embeds[order], rank[dst_idx]
        return vtc.Merge(keep_idx, dst_idx, src_idx, weights, embeds=embeds)

    def _prepool_blocks(self, tokens, ctx) -> Tensor | None:
        """Per token, its block of CLIP features before the pooler (`vtc.core.tokens.prepool_blocks`), when the
        official CLIP merge applies; else None (merge the LLM tokens instead)."""
        return prepool_blocks(tokens, ctx) if self.merge_before_projector else None
