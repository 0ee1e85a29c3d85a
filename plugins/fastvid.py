"""FastVID: "FastVID: Dynamic Density Pruning for Fast Video Large Language Models" (Shen et al., NeurIPS 2025).
arXiv: https://arxiv.org/abs/2503.11187. Official code: LunarShen/FastVID (LLaVA-OneVision:
`fastvid_llavaonevision/LLaVA-NeXT/llava/model/language_model/modeling_qwen2.py`, `llava/model/llava_arch.py`,
`llava/model/multimodal_encoder/siglip_encoder.py`; Qwen2.5-VL:
`fastvid_qwen25vl/lmms-eval/lmms_eval/models/qwenvlutils/modeling_qwen2_5_vl.py`).

DySeg cuts the video where consecutive frame-level features differ most (the c-1 lowest similarities, plus every
similarity below tau). STPrune then keeps, per frame, the most salient tokens (ATS: vision-attention top-k) and
a set of density-peak anchors (DTM: DPC-kNN, k = 4) placed on every p-th frame of a segment (counted from its
end); every other token of the segment is merged into its most cosine-similar anchor with
`anchor <- w anchor + (1 - w) mean(assigned)`, `w = max(1 / (count + 1), beta)`. Positions are kept.
Stage: connect (the official code runs inside the LLM forward, before layer 0, on the input embeddings).

Two official versions, both implemented: the LLaVA-OneVision parallel version (fixed salient / context split
per frame, anchors merge the non-salient tokens of their segment) for the LLaVA families, and the Qwen2.5-VL
version (budgets per segment, sub-segments cut at similarity < DySeg_ignore, per-frame caps, merging every
non-retained token of the segment) for the Qwen families. HF LLaVA towers have no SigLIP MAP head, so on LLaVA
the salience is the last layer's mean received attention (bilinearly resized to 14x14 like the official MAP
probe attention; LLaVA-NeXT-Video: the CLS row, head-mean, 2x2-averaged) and the frame feature is the mean of
the frame's tokens (as the Qwen2.5-VL version computes it). Adaptive count by default; `fixed_count=True`
keeps exactly sum over frames of int(n r), topped up / trimmed by salience.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from vtc.core.hookspecs import hookimpl
from vtc.core.registry import MethodInfo
from vtc.core.vision_stats import VisionStat
from vtc_kernels import dpc_knn_scores, reconcile_count

Tensor = torch.Tensor

VERSIONS = ("auto", "llava", "qwen2_5_vl")
# official script defaults per version: retention_ratio r and DySeg_tau
DEFAULT_RATIO = {"llava": 0.10, "qwen2_5_vl": 0.27}
DEFAULT_TAU = {"llava": 0.9, "qwen2_5_vl": 0.84}


@dataclasses.dataclass
class FastVIDParams:
    retention_ratio: float | None = None  # r: per-frame budget int(n r); default retention, else 0.10 LLaVA / 0.27 Qwen
    dyseg_c: int = 8  # c (DySeg_c): the c-1 lowest adjacent-frame similarities always cut
    dyseg_tau: float | None = None  # tau (DySeg_tau): also cut below tau; None = 0.9 LLaVA, 0.84 Qwen2.5-VL
    dyseg_ignore: float = 0.95  # DySeg_ignore (Qwen2.5-VL version): sub-segment cut inside a segment
    stprune_d: float = 0.4  # d (STPrune_d): fraction of the budget given to context (merged) tokens
    dtm_p: int = 4  # p (DTM_p): anchor frames every p frames of a segment, from its end
    dtm_beta: float = 0.6  # beta (DTM_beta): lower bound of the anchor's weight in the merge
    knn: int = 4  # k of the DPC-kNN density (hard-coded 4 in the official code)
    version: str = "auto"  # "llava" (LLaVA-OV parallel), "qwen2_5_vl", or "auto" (LLaVA families / Qwen families)
    fixed_count: bool = False  # keep exactly sum_f int(n_f r) tokens, reconciled by salience (serving)

    def __post_init__(self):
        if self.retention_ratio is not None and not 0.0 < float(self.retention_ratio) <= 1.0:
            raise ValueError(f"fastvid: retention_ratio must be in (0, 1], got {self.retention_ratio}")
        if int(self.dyseg_c) < 1:
            raise ValueError(f"fastvid: dyseg_c must be >= 1, got {self.dyseg_c}")
        if self.dyseg_tau is not None and not -1.0 <= float(self.dyseg_tau) <= 1.0:
            raise ValueError(f"fastvid: dyseg_tau (a cosine similarity) must be in [-1, 1], got {self.dyseg_tau}")
        if not -1.0 <= float(self.dyseg_ignore) <= 1.0:
            raise ValueError(f"fastvid: dyseg_ignore (a cosine similarity) must be in [-1, 1], got {self.dyseg_ignore}")
        if not 0.0 <= float(self.stprune_d) <= 1.0:
            raise ValueError(f"fastvid: stprune_d must be in [0, 1], got {self.stprune_d}")
        if int(self.dtm_p) < 1:
            raise ValueError(f"fastvid: dtm_p must be >= 1, got {self.dtm_p}")
        if not 0.0 <= float(self.dtm_beta) <= 1.0:
            raise ValueError(f"fastvid: dtm_beta must be in [0, 1], got {self.dtm_beta}")
        if int(self.knn) < 1:
            raise ValueError(f"fastvid: knn must be >= 1, got {self.knn}")
        if self.version not in VERSIONS:
            raise ValueError(f"fastvid: version must be one of {', '.join(VERSIONS)}, got {self.version!r}")


# --- DySeg --------------------------------------------------------------------------------------------------------


def normalize_rows(x: Tensor) -> Tensor:
    """x / ||x|| row-wise, in x's dtype (as the official code)."""
    return x / x.norm(dim=-1, keepdim=True)


def adjacent_similarity(normalized: Tensor) -> Tensor:
    """Cosine similarity of consecutive rows of L2-normalised features [F, D] -> [F - 1]."""
    return (normalized[:-1] * normalized[1:]).sum(dim=1)


def sizes_from_cuts(cuts: list[int], length: int) -> list[int]:
    """Segment lengths when the sequence is cut after each (sorted, unique) index in `cuts`."""
    bounds = [-1] + cuts + [length - 1]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def dyseg(normalized: Tensor, c: int, tau: float) -> list[int]:
    """DySeg segment lengths: cut after frame t for the c-1 smallest similarities s_t and every s_t < tau."""
    frames = normalized.shape[0]
    if frames <= 1:
        return [frames]
    sim = adjacent_similarity(normalized)
    lowest = torch.topk(sim, min(c - 1, frames - 1), largest=False).indices
    below = torch.nonzero(sim < tau).flatten()
    cuts = torch.unique(torch.cat([lowest, below])).tolist()  # sorted
    return sizes_from_cuts(cuts, frames)


# --- budgets ------------------------------------------------------------------------------------------------------


def llava_frame_budget(num_tokens: int, r: float, d: float) -> tuple[int, int]:
    """(salient, context) per frame: R = int(n r), salient = R - int(R d), context = R - salient."""
    retain = int(num_tokens * r)
    salient = retain - int(retain * d)
    return salient, retain - salient


def llava_anchor_quotas(sizes: list[int], context: list[int], p: int) -> list[int]:
    """Context tokens of each frame: a segment of length l pools sum(context) over its frames and gives
    sum // ceil(l / p) to the frames at l-1, l-1-p, ... (counted from the segment end), 0 to the others."""
    quotas = [0] * sum(sizes)
    offset = 0
    for length in sizes:
        pooled = sum(context[offset : offset + length])
        anchors = (length + p - 1) // p
        for i in range(length):
            if (length - 1 - i) % p == 0:
                quotas[offset + i] = pooled // anchors
        offset += length
    return quotas


def qwen25_segment_quotas(
    retain: list[int], frame_tokens: list[int], sub_sizes: list[int], d: float, p: int
) -> tuple[list[int], list[int]]:
    """(salient, context) per frame of one segment in the Qwen2.5-VL version.

    retain: int(n_f r) per frame; frame_tokens: n_f; sub_sizes: the segment's sub-segments (DySeg_ignore).
    seg_ctx = max(int(sum(retain) d), 1), seg_sal = sum(retain) - seg_ctx. One frame: (seg_sal, seg_ctx). Several:
    only the last frame of each sub-segment keeps tokens; salient quota spread evenly over the sub-segments
    (remainder first), context over every p-th sub-segment counted from the end (remainder to the last), each
    capped at n // 2, the salient quota then capped at n - context."""
    seg_retain = sum(retain)
    seg_ctx = max(int(seg_retain * d), 1)
    seg_sal = seg_retain - seg_ctx
    if len(retain) == 1:
        return [max(seg_sal, 0)], [seg_ctx]
    count = len(sub_sizes)
    sal_sub = [seg_sal // count + (1 if i < seg_sal % count else 0) for i in range(count)]
    holders = (count + p - 1) // p
    ctx_hold = [seg_ctx // holders + (1 if j < seg_ctx % holders else 0) for j in range(holders)]
    ctx_sub, j = [], 0
    for i in range(count):
        if i % p == 0:
            ctx_sub.append(ctx_hold[j])
            j += 1
        else:
            ctx_sub.append(0)
    ctx_sub.reverse()
    salient, context = [], []
    frame = 0
    for i, size in enumerate(sub_sizes):
        salient += [0] * (size - 1)
        context += [0] * (size - 1)
        frame += size - 1
        n = frame_tokens[frame]
        if ctx_sub[i] == 0:
            salient.append(max(0, min(sal_sub[i], n)))
            context.append(0)
        else:
            context.append(min(ctx_sub[i], n // 2))
            salient.append(max(0, min(sal_sub[i], n - context[-1])))
        frame += 1
    return salient, context


# --- DTM merge ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Merge:
    """One DTM merge: `members` (token indices) folded into `anchors` (token indices)."""

    anchors: Tensor  # [a]
    members: Tensor  # [m]
    assign: Tensor  # [m] anchor slot of each member
    counts: Tensor  # [a] members per anchor
    weight: Tensor  # [a] w = max(1 / (count + 1), beta)
    embeds: Tensor  # [a, D] merged anchor features


def dtm_merge(anchors: Tensor, members: Tensor, beta: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """anchors [a, D], members [m, D] (same dtype; computed in it, as the official code).

    Each member joins its most cosine-similar anchor; anchor <- w anchor + (1 - w) mean(members),
    w = clamp(1 / (count + 1), min=beta), mean over max(count, 1). Returns (new [a, D], assign, counts, w)."""
    sim = normalize_rows(members) @ normalize_rows(anchors).T
    assign = sim.argmax(dim=1) if members.shape[0] else torch.zeros(0, dtype=torch.long, device=members.device)
    one_hot = torch.zeros(members.shape[0], anchors.shape[0], dtype=members.dtype, device=members.device)
    one_hot[torch.arange(members.shape[0], device=members.device), assign] = 1
    counts = one_hot.sum(dim=0).unsqueeze(-1)
    weight = (1 / (counts + 1)).clamp(min=beta)
    aggregated = (one_hot.T @ members) / counts.clamp(min=1)
    return weight * anchors + (1 - weight) * aggregated, assign, counts.squeeze(-1), weight.squeeze(-1)


def make_merge(embeds: Tensor, anchors: Tensor, members: Tensor, beta: float) -> Merge:
    new, assign, counts, weight = dtm_merge(embeds[anchors], embeds[members], beta)
    return Merge(anchors, members, assign, counts, weight, new)


def density_anchors(
    embeds: Tensor, candidates: Tensor, count: int, k: int, generator, in_order: bool = False
) -> Tensor:
    """The `count` candidates (token indices) with the highest DPC-kNN score: in score order (LLaVA version), or
    in the candidates' order with `in_order` (the Qwen2.5-VL version sorts `sampled_indexs`)."""
    scores, _ = dpc_knn_scores(embeds[candidates], k, generator)
    top = torch.topk(scores, min(count, candidates.numel())).indices
    return candidates[torch.sort(top).values if in_order else top]


@dataclasses.dataclass
class FastVIDPlan:
    segments: list[int]  # DySeg segment lengths
    salient: Tensor  # token indices kept unchanged (ATS)
    merges: list[Merge]  # DTM merges (their anchors are kept)
    salient_per_frame: list[int]
    context_per_frame: list[int]

    @property
    def kept(self) -> int:
        return int(self.salient.numel()) + sum(int(m.anchors.numel()) for m in self.merges)


def _top_salient(salience: Tensor, idx: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """(top-`count` tokens of a frame by salience, the frame's other tokens in their original order)."""
    rest = torch.ones(idx.numel(), dtype=torch.bool, device=idx.device)
    rest[torch.topk(salience[idx], min(max(count, 0), idx.numel())).indices] = False
    return idx[~rest], idx[rest]


def fastvid_llava(
    embeds: Tensor,
    frames: list[Tensor],
    salience: Tensor,
    global_features: Tensor,
    r: float,
    c: int = 8,
    tau: float = 0.9,
    d: float = 0.4,
    p: int = 4,
    beta: float = 0.6,
    k: int = 4,
    generator: torch.Generator | None = None,
) -> FastVIDPlan:
    """The LLaVA-OneVision parallel version on one video.

    embeds [N, D]; frames: token indices of each frame (spatial order); salience [N]; global_features [F, D]."""
    sizes = dyseg(normalize_rows(global_features), c, tau)
    budgets = [llava_frame_budget(int(idx.numel()), r, d) for idx in frames]
    context = [b[1] for b in budgets]
    quotas = llava_anchor_quotas(sizes, context, p)
    salient, filtered = [], []
    for idx, (sal, _) in zip(frames, budgets):
        top, rest = _top_salient(salience, idx, sal)
        salient.append(top)
        filtered.append(rest)
    merges: list[Merge] = []
    # single-frame segments (and any anchor frame whose quota equals the per-frame context, as the official
    # `frm_context_num_list == frame_context_num` mask selects them): anchors merge their own frame
    for f, quota in enumerate(quotas):
        if quota == context[f] and quota > 0 and filtered[f].numel():
            anchors = density_anchors(embeds, filtered[f], quota, k, generator)
            merges.append(make_merge(embeds, anchors, filtered[f], beta))
    # multi-frame segments: each anchor frame merges the non-salient tokens of every frame of the segment
    offset = 0
    for length in sizes:
        seg = range(offset, offset + length)
        if length > 1:
            members = torch.cat([filtered[f] for f in seg])
            for f in seg:
                if quotas[f] > context[f] and filtered[f].numel():
                    anchors = density_anchors(embeds, filtered[f], quotas[f], k, generator)
                    merges.append(make_merge(embeds, anchors, members, beta))
        offset += length
    return FastVIDPlan(sizes, torch.cat(salient), merges, [b[0] for b in budgets], quotas)


def fastvid_qwen25(
    embeds: Tensor,
    frames: list[Tensor],
    salience: Tensor,
    global_features: Tensor,
    r: float,
    c: int = 8,
    tau: float = 0.84,
    ignore: float = 0.95,
    d: float = 0.4,
    p: int = 4,
    beta: float = 0.6,
    k: int = 4,
    generator: torch.Generator | None = None,
) -> FastVIDPlan:
    """The Qwen2.5-VL version on one video (same inputs as `fastvid_llava`)."""
    normalized = normalize_rows(global_features)
    sizes = dyseg(normalized, c, tau)
    salient_all: list[Tensor] = []
    merges: list[Merge] = []
    sal_frames: list[int] = []
    ctx_frames: list[int] = []
    offset = 0
    for length in sizes:
        seg_frames = frames[offset : offset + length]
        tokens = [int(idx.numel()) for idx in seg_frames]
        retain = [int(n * r) for n in tokens]
        if length == 1:
            sub_sizes = [1]
        else:
            sim = adjacent_similarity(normalized[offset : offset + length])
            sub_sizes = sizes_from_cuts(torch.nonzero(sim < ignore).flatten().tolist(), length)
        sal, ctx = qwen25_segment_quotas(retain, tokens, sub_sizes, d, p)
        seg_salient, seg_context = [], []
        for idx, s, cq in zip(seg_frames, sal, ctx):
            top, rest = _top_salient(salience, idx, s)
            seg_salient.append(top)
            if cq > 0 and rest.numel():
                seg_context.append(density_anchors(embeds, rest, cq, k, generator, in_order=True))
        salient = torch.cat(seg_salient)
        everything = torch.cat(seg_frames)
        for anchors in seg_context:
            retained = torch.isin(everything, torch.cat([salient, anchors]))
            merges.append(make_merge(embeds, anchors, everything[~retained], beta))
        salient_all.append(salient)
        sal_frames += sal
        ctx_frames += ctx
        offset += length
    return FastVIDPlan(sizes, torch.cat(salient_all), merges, sal_frames, ctx_frames)


# --- salience maps on the LLM token grid --------------------------------------------------------------------------


def salience_stat(family: str) -> VisionStat:
    if family.startswith("qwen"):
        return VisionStat("mean_query", -1)  # FastVID's own Qwen2.5-VL score (last, full-attention block)
    if family == "llava_next_video":
        return VisionStat("cls", -1)
    return VisionStat("received", -1)


def salience_map(vision: dict, family: str, size: tuple[int, int]) -> Tensor:
    """Per-frame salience [F, H*W] on the token grid."""
    h, w = size
    stat = vision[salience_stat(family)].float()
    if family.startswith("qwen"):
        return stat
    if family == "llava_next_video":  # CLS query (the CLIP analogue of the MAP probe), head mean, CLS column dropped
        stat, mode = stat.mean(dim=1)[:, 1:], "average"
    else:  # mean attention received (mean over queries), resized like the official MAP attention
        stat, mode = stat / stat.shape[-1], "bilinear"
    frames, length = stat.shape
    side = int(round(length**0.5))
    grid = stat.reshape(frames, 1, side, side)
    if side != h or side != w:
        if mode == "bilinear":
            grid = F.interpolate(grid, size=[h, w], mode="bilinear")
        else:
            grid = F.avg_pool2d(grid, side // h)
    return grid.reshape(frames, h * w)


# --- the plugin ---------------------------------------------------------------------------------------------------


def frame_groups(frame: Tensor, patch: Tensor, per_frame: int) -> list[Tensor]:
    """Token indices of each frame present, frames ascending, tokens in spatial (patch) order."""
    order = torch.argsort(frame * per_frame + patch)
    counts = torch.unique_consecutive(frame[order], return_counts=True)[1]
    return list(torch.split(order, counts.tolist()))


def fixed_target(num_tokens: int, grid, r: float) -> int:
    """The fixed count: sum over frames of int(n r) = T int(H W r) on an untouched grid, int(N r) otherwise."""
    t, h, w = grid
    if r >= 1.0:
        return num_tokens
    target = t * int(h * w * r) if num_tokens == t * h * w else int(num_tokens * r)
    return max(1, min(num_tokens, target))


def assemble(tokens, plan: FastVIDPlan, salience: Tensor, target: int | None, per_frame: int):
    """The VideoTokens FastVID hands the LLM: salient tokens and merged anchors in their original order (with
    `target`, reconciled to exactly that many by salience: unkept tokens added as they are, or the least salient
    kept ones dropped)."""
    n = len(tokens)
    device = tokens.embeds.device
    keep_mask = torch.zeros(n, dtype=torch.bool, device=device)
    keep_mask[plan.salient] = True
    for m in plan.merges:
        keep_mask[m.anchors] = True
    if target is not None:
        keep_mask = reconcile_count(keep_mask, salience, target)
    keep = torch.nonzero(keep_mask).flatten()
    keep = keep[torch.argsort(tokens.frame[keep] * per_frame + tokens.patch[keep])]
    slot = torch.full((n,), -1, dtype=torch.long, device=device)
    slot[keep] = torch.arange(keep.numel(), device=device)
    embeds = tokens.embeds[keep].clone()
    keep_weight = torch.ones(keep.numel(), device=device)
    dst, src, src_weight = [], [], []
    for m in plan.merges:
        alive = slot[m.anchors] >= 0
        if not bool(alive.any()):
            continue
        anchor_slot = slot[m.anchors]
        embeds[anchor_slot[alive]] = m.embeds[alive]
        keep_weight[anchor_slot[alive]] = m.weight[alive].float()
        share = (1 - m.weight.float()) / m.counts.float().clamp(min=1)  # per anchor: weight of each member
        member_slot = anchor_slot[m.assign]
        valid = member_slot >= 0
        own = valid & (m.members == m.anchors[m.assign])  # an anchor assigned to itself (LLaVA version)
        keep_weight.index_add_(0, member_slot[own], share[m.assign[own]])
        other = valid & ~own
        dst.append(member_slot[other])
        src.append(m.members[other])
        src_weight.append(share[m.assign[other]])
    empty = keep[:0]
    return tokens.merge(
        keep,
        torch.cat(dst) if dst else empty,
        torch.cat(src) if src else empty,
        torch.cat(src_weight) if src_weight else torch.zeros(0, device=device),
        keep_weight,
        embeds=embeds,
    )


class FastVID:
    def __init__(self, params: FastVIDParams, retention: float | None = None) -> None:
        self.params = params
        self.retention = retention
        self.family: str | None = None  # learned at patch time (vision_stats) or from ctx
        self.last_kept: list[int] = []  # tokens kept per video at the last forward (adaptive count)
        self.last_plans: list[FastVIDPlan] = []

    def vision_stats(self, family: str) -> list[VisionStat]:
        self.family = family
        return [salience_stat(family)]

    def version(self, family: str | None = None) -> str | None:
        if self.params.version != "auto":
            return self.params.version
        family = family or self.family
        if family is None:
            return None
        return "llava" if family.startswith("llava") else "qwen2_5_vl"

    def ratio(self, version: str | None) -> float | None:
        if self.params.retention_ratio is not None:
            return float(self.params.retention_ratio)
        if self.retention is not None:
            return float(self.retention)
        return DEFAULT_RATIO[version] if version is not None else None

    def retained_count(self, num_tokens: int, grid) -> int | None:
        r = self.ratio(self.version())
        if r is None:
            return None
        if r >= 1.0:
            return num_tokens
        return fixed_target(num_tokens, grid, r) if self.params.fixed_count else None

    def _record(self, ctx, kept: int, plan: FastVIDPlan | None) -> None:
        if getattr(ctx, "video_index", 0) == 0:  # the first video of a new forward
            self.last_kept, self.last_plans = [], []
        self.last_kept.append(kept)
        if plan is not None:
            self.last_plans.append(plan)

    @hookimpl
    def vtc_connect(self, tokens, ctx):
        family = ctx.family or self.family or ""
        version = self.version(family)
        r = self.ratio(version)
        n = len(tokens)
        if r >= 1.0 or n == 0:  # every token kept as it is
            self._record(ctx, n, None)
            return tokens
        p = self.params
        t, h, w = tokens.grid
        patch = tokens.patch
        device = tokens.embeds.device
        frames = frame_groups(tokens.frame, patch, h * w)
        grid_salience = salience_map(ctx.vision, family, (h, w)).to(device)
        salience = grid_salience[tokens.frame, patch]
        # frame-level feature: mean of the frame's tokens, in the model dtype (Qwen2.5-VL version; on LLaVA it
        # stands in for the SigLIP MAP-head output the HF tower does not have)
        global_features = torch.stack([tokens.embeds[idx].mean(dim=0) for idx in frames])
        tau = float(p.dyseg_tau) if p.dyseg_tau is not None else DEFAULT_TAU[version]
        common = dict(c=int(p.dyseg_c), tau=tau, d=float(p.stprune_d), p=int(p.dtm_p), beta=float(p.dtm_beta))
        if version == "llava":
            plan = fastvid_llava(
                tokens.embeds, frames, salience, global_features, r, k=int(p.knn), generator=ctx.generator, **common
            )
        else:
            plan = fastvid_qwen25(
                tokens.embeds,
                frames,
                salience,
                global_features,
                r,
                ignore=float(p.dyseg_ignore),
                k=int(p.knn),
                generator=ctx.generator,
                **common,
            )
        target = fixed_target(n, tokens.grid, r) if p.fixed_count else None
        out = assemble(tokens, plan, salience, target, h * w)
        self._record(ctx, len(out), plan)
        return out


@hookimpl
def vtc_register_methods(registry):
    registry.add(
        MethodInfo(
            name="fastvid",
            factory=FastVID,
            params=FastVIDParams,
            stages=("connect",),
            paper="FastVID: Dynamic Density Pruning for Fast Video Large Language Models (NeurIPS 2025)",
            url="https://arxiv.org/abs/2503.11187",
            summary="segment by frame similarity; keep salient tokens, merge the rest into density-peak anchors",
            fixed_count=True,
            position_policy="keep",
        )
    )
