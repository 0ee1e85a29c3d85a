"""HoliTom: "Holistic Token Merging for Fast Video Large Language Models" (Shao et al., NeurIPS 2025;
https://arxiv.org/abs/2505.21334). Official code: cokeshao/HoliTom (`holitom/llava_arch.py`,
`holitom/modeling_qwen2.py`).

Outer merge (before the LLM): split the video into temporal windows by dynamic programming so that as many
tokens as possible are identical (cosine > T) at the same position across a window; per window, average the
static positions over time and cluster them (DPC-kNN, beta-merge), keep each frame's most attended dynamic
tokens (vision-tower attention). Inner merge (LLM layer k): FastV selection by the last token's attention at
layer k-1, every dropped visual token is first folded into its most similar kept token. Stages: connect, prefill
(`holitom-outer`: the outer merge alone, connect).

Faithful to the official code: the DP segmentation (strict `>` ties, max window 1024), the re-scaled ratio
r' = min(R / ((N - saved) / N), 1), round() for static clusters and ceil() per frame for dynamic tokens (Python
rounding), DPC-kNN with k = min(K, clusters) and centres sorted by index, the beta rule, the output order
[static ; dynamic frame s ; ... ; frame e] per window, the sequential in-place inner update in index order.
vtc differences: the inner merge runs per video of each batch row (the official code supports batch size 1,
one video); LLaVA-OneVision's trailing newline is not a candidate of the inner merge; DPC-kNN noise comes from
the seeded generator; the vision attention is computed in float32; the Qwen and LLaVA-NeXT-Video attention
ports (see docs/methods/holitom.md).
"""

from __future__ import annotations

import dataclasses
import math

import torch

import vtc
from vtc.core.bases import last_token_attention
from vtc.core.geometry import FamilyGeometry
from vtc.core.vision_stats import VisionStat
from vtc_kernels import adjacent_frame_similarity, assign_to_centers, dpc_knn_centers
from vtc_kernels.matching import best_match

Tensor = torch.Tensor

DEFAULT_RETAIN_RATIO = 0.15  # README / eval example: RETAIN_RATIO=0.15 T=0.80 HOLITOM_k=18 HOLITOM_r=0.5
RECEIVED = VisionStat("received", -1)  # SigLIP attentions[-1] (last kept layer), mean attention received


def default_tau(retain_ratio: float) -> float:
    """T of scripts/eval_ov-7b_holitom.sh: 0.65 at RETAIN_RATIO 0.10, 0.80 at 0.15 / 0.20 / 0.25."""
    return 0.65 if retain_ratio <= 0.10 + 1e-9 else 0.80


# --- outer merge: temporal segmentation ---------------------------------------------------------------------------


def frame_similarity(x: Tensor) -> Tensor:
    """x [F, P, D] -> [F-1, P]: cosine of each position with the same position in the next frame (the official
    code L2-normalises first, then takes `cosine_similarity`; computed in the features' dtype)."""
    return adjacent_frame_similarity(x, normalize="eps", formula="torch")


def static_window_counts(sim: Tensor, tau: float) -> Tensor:
    """[F, F] tokens saved by collapsing window [s, e] (e > s): the number of positions whose similarity exceeds
    `tau` at every step s..e-1, times e - s (the official `pruned_static_count`). Zero where e <= s."""
    steps = sim.shape[0]
    frames = steps + 1
    counts = torch.zeros(frames, frames, dtype=torch.float32, device=sim.device)
    if steps == 0:
        return counts
    at = torch.arange(steps, device=sim.device)[:, None]
    # run[t, p]: for how many steps from t on position p stays above tau (its next step at or below, minus t),
    # so position p is static over window [s, s + L] exactly when run[s, p] >= L: no loop over start frames
    below = torch.where(sim > tau, steps, at)
    run = below.flip(0).cummin(dim=0).values.flip(0) - at
    runs = torch.zeros(steps, frames + 1, dtype=torch.long, device=sim.device)
    runs.scatter_add_(1, run, torch.ones_like(run))
    static = runs.flip(1).cumsum(dim=1).flip(1)  # static[s, L]: positions with run[s] >= L
    start, end = torch.triu_indices(frames, frames, offset=1, device=sim.device)
    counts[start, end] = (static[start, end - start] * (end - start)).float()
    return counts


def segment_windows(counts: Tensor, max_window_size: int = 1024) -> tuple[list[tuple[int, int]], float]:
    """Global temporal segmentation by dynamic programming (`select_static_windows`).

    dp[i] = max(dp[i-1], max over window sizes w = 2..min(i+1, max_window_size) of dp[i-w] + counts[i-w+1, i]);
    a size only wins when strictly better (smaller windows, and a single frame, win ties). Returns the windows
    (start, end) in order, single frames as (i, i), and the total tokens saved dp[F-1]."""
    frames = counts.shape[0]
    c = counts.tolist()
    dp = [0.0] * frames
    prev = [0] * frames
    for i in range(frames):
        best = dp[i - 1] if i > 0 else 0.0
        start = i
        for size in range(2, min(i + 1, int(max_window_size)) + 1):
            j = i - size
            value = (dp[j] if j >= 0 else 0.0) + c[j + 1][i]
            if value > best:
                best, start = value, j + 1
        dp[i] = best
        prev[i] = start
    windows = []
    i = frames - 1
    while i >= 0:
        windows.append((prev[i], i))
        i = prev[i] - 1
    return windows[::-1], dp[-1]


def adjusted_ratio(retain_ratio: float, total: int, saved: float) -> float:
    """r' = min(R / ((N - saved) / N), 1): the budget left for what the windows did not collapse."""
    return min(retain_ratio / ((total - saved) / total), 1)


# --- outer merge: clustering and selection ------------------------------------------------------------------------


@dataclasses.dataclass
class Clusters:
    centers: Tensor  # [c] row indices of the centres, ascending
    labels: Tensor  # [m] cluster (index into centers) of every row; a centre owns its cluster
    embeds: Tensor  # [c, D] merged features, computed as the official code does
    keep_weight: Tensor  # [c] linear form of `embeds`: centre weight ...
    member_weight: Tensor  # [m] ... and weight of each non-centre row in its cluster (0 for centres)


def dpc_knn_merge(
    x: Tensor, num_clusters: int, knn: int, beta: float, use_beta: bool, generator: torch.Generator | None
) -> Clusters:
    """`cluster_dpc_knn` (k = min(K, clusters)) + `merge_tokens_by_clustering` on x [m, D]: the top density-peak
    rows become centres (sorted by index), every other row joins its nearest centre, and a centre with members
    becomes beta * centre + (1 - beta) * mean(members) (or the plain mean of centre and members without beta)."""
    m = x.shape[0]
    num_clusters = min(int(num_clusters), m)
    centers, dist = dpc_knn_centers(x, num_clusters, k=min(int(knn), num_clusters), generator=generator)
    centers = torch.sort(centers).values
    labels = assign_to_centers(dist, centers)
    is_center = torch.zeros(m, dtype=torch.bool, device=x.device)
    is_center[centers] = True
    members = torch.bincount(labels[~is_center], minlength=num_clusters)
    sums = torch.zeros(num_clusters, x.shape[1], dtype=torch.float32, device=x.device)
    sums.index_add_(0, labels[~is_center], x[~is_center].float())
    centre = x[centers]
    has = members > 0
    if use_beta:
        mean = (sums / members.clamp(min=1)[:, None]).to(x.dtype)
        merged = beta * centre + (1 - beta) * mean
        keep_weight = 1.0 + has.float() * (beta - 1.0)  # beta when the cluster has members, else 1
        member_weight = (1 - beta) / members.clamp(min=1).float()
    else:
        merged = ((sums + centre.float()) / (members + 1)[:, None]).to(x.dtype)
        keep_weight = 1.0 / (members + 1).float()
        member_weight = keep_weight
    embeds = torch.where(has[:, None], merged, centre)
    per_row = torch.where(is_center, torch.zeros_like(labels, dtype=torch.float32), member_weight[labels])
    return Clusters(centers, labels, embeds, keep_weight, per_row)


def dynamic_budget(num_tokens: int, ratio: float, d: float) -> tuple[int, int]:
    """(dominant, contextual) of a frame's m dynamic tokens: keep = ceil(m r'), dominant = round(keep (1 - D))."""
    keep = math.ceil(num_tokens * ratio)
    dominant = round(keep * (1 - d))
    return dominant, keep - dominant


def static_clusters(num_static: int, ratio: float) -> int:
    """Clusters of a window's m static positions: round(m r') (Python rounds halves to even)."""
    return round(num_static * ratio)


@dataclasses.dataclass
class OuterPlan:
    """Output tokens of the outer merge on a [F, P] grid (flat index = frame * P + position), in LLM order.

    anchors [C]: each output token's anchor (its position / frame in the LLM); embeds [C, D] its features;
    keep_weight [C], and (dst, src, src_weight): the same features as a linear map of the grid tokens;
    score [C]: vision attention of each output (drops in fixed-count mode); key [C] sorts outputs into order.
    """

    anchors: Tensor
    embeds: Tensor
    keep_weight: Tensor
    dst: Tensor
    src: Tensor
    src_weight: Tensor
    score: Tensor
    key: Tensor
    windows: list[tuple[int, int]]
    ratio: float
    saved: float

    def __len__(self) -> int:
        return int(self.anchors.numel())


class _PlanBuilder:
    def __init__(self, frames: int, positions: int, device) -> None:
        self.f, self.p, self.device = frames, positions, device
        self.anchors, self.embeds, self.keep_weight, self.score, self.key = [], [], [], [], []
        self.dst, self.src, self.src_weight = [], [], []
        self.count = 0

    def order_key(self, window: int, section: int, frame: Tensor | int, sub: int, pos: Tensor) -> Tensor:
        return (((window * 2 + section) * self.f + frame) * 2 + sub) * self.p + pos

    def add(self, anchors, embeds, keep_weight, score, key, dst=None, src=None, src_weight=None) -> None:
        n = int(anchors.numel())
        self.anchors.append(anchors)
        self.embeds.append(embeds)
        self.keep_weight.append(keep_weight.float())
        self.score.append(score.float())
        self.key.append(key)
        if dst is not None and dst.numel():
            self.dst.append(dst + self.count)
            self.src.append(src)
            self.src_weight.append(src_weight.float())
        self.count += n

    def build(self, dim: int, dtype, windows, ratio, saved) -> OuterPlan:
        def cat(parts, empty):
            return torch.cat(parts) if parts else empty

        long = torch.zeros(0, dtype=torch.long, device=self.device)
        flt = torch.zeros(0, dtype=torch.float32, device=self.device)
        plan = OuterPlan(
            anchors=cat(self.anchors, long),
            embeds=cat(self.embeds, torch.zeros(0, dim, dtype=dtype, device=self.device)),
            keep_weight=cat(self.keep_weight, flt),
            dst=cat(self.dst, long),
            src=cat(self.src, long),
            src_weight=cat(self.src_weight, flt),
            score=cat(self.score, flt),
            key=cat(self.key, long),
            windows=windows,
            ratio=ratio,
            saved=saved,
        )
        return sort_plan(plan)


def _outputs(plan: OuterPlan, index: Tensor) -> dict[str, Tensor]:
    """The per-output fields of `plan` at `index` (an order or a mask); the merge edges are the caller's."""
    return {name: getattr(plan, name)[index] for name in ("anchors", "embeds", "keep_weight", "score", "key")}


def sort_plan(plan: OuterPlan) -> OuterPlan:
    """Put the outputs in `key` order (already the case unless outputs were added or dropped)."""
    order = torch.sort(plan.key, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return dataclasses.replace(plan, **_outputs(plan, order), dst=rank[plan.dst] if plan.dst.numel() else plan.dst)


def _dynamic_frame(
    builder: _PlanBuilder,
    window: int,
    frame: int,
    x: Tensor,
    attn: Tensor,
    pos: Tensor,
    ratio: float,
    d: float,
    knn: int,
    beta: float,
    use_beta: bool,
    generator,
) -> None:
    """`merge_tokens_by_attention_density` on one frame's dynamic positions `pos`: the top ceil(m r')(1 - D)
    by vision attention (kept in position order), then DPC-kNN clusters of the rest when D > 0."""
    m = int(pos.numel())
    dominant, contextual = dynamic_budget(m, ratio, d)
    feats, scores = x[frame, pos], attn[frame, pos]
    base = frame * builder.p
    chosen = torch.zeros(m, dtype=torch.bool, device=pos.device)
    if dominant > 0:
        chosen[torch.topk(scores, dominant).indices] = True
        idx = torch.nonzero(chosen).flatten()
        builder.add(
            base + pos[idx],
            feats[idx],
            torch.ones(idx.numel(), device=pos.device),
            scores[idx],
            builder.order_key(window, 1, frame, 0, pos[idx]),
        )
    if contextual > 0:
        rest = torch.nonzero(~chosen).flatten()
        cl = dpc_knn_merge(feats[rest], contextual, knn, beta, use_beta, generator)
        members = torch.nonzero(cl.member_weight > 0).flatten()
        builder.add(
            base + pos[rest[cl.centers]],
            cl.embeds,
            cl.keep_weight,
            scores[rest[cl.centers]],
            builder.order_key(window, 1, frame, 1, pos[rest[cl.centers]]),
            dst=cl.labels[members],
            src=base + pos[rest[members]],
            src_weight=cl.member_weight[members],
        )


def outer_merge(
    x: Tensor,
    attn: Tensor,
    retain_ratio: float,
    tau: float,
    beta: float = 0.6,
    d: float = 0.0,
    knn: int = 7,
    max_window_size: int = 1024,
    use_beta: bool = True,
    generator: torch.Generator | None = None,
) -> OuterPlan:
    """HoliTom's outer merge on one video: x [F, P, D] pooled tokens, attn [F, P] vision attention on that grid.

    Segments the frames (DP), re-scales the ratio, and per window emits [static clusters ; dynamic tokens of
    frame s ; ... ; frame e] (`prepare_inputs_labels_for_multimodal` + `holitom`, one_token models)."""
    frames, positions, dim = x.shape
    sim = frame_similarity(x) if frames > 1 else x.new_zeros(0, positions)
    windows, saved = segment_windows(static_window_counts(sim, tau), max_window_size)
    ratio = adjusted_ratio(retain_ratio, frames * positions, saved)
    builder = _PlanBuilder(frames, positions, x.device)
    everything = torch.arange(positions, device=x.device)
    for w, (s, e) in enumerate(windows):
        if s == e:
            _dynamic_frame(builder, w, s, x, attn, everything, ratio, d, knn, beta, use_beta, generator)
            continue
        static = torch.all(sim[s:e] > tau, dim=0)
        dyn_pos = torch.nonzero(~static).flatten()
        for f in range(s, e + 1):  # the official code merges the dynamic tokens first, then the static ones
            _dynamic_frame(builder, w, f, x, attn, dyn_pos, ratio, d, knn, beta, use_beta, generator)
        st_pos = torch.nonzero(static).flatten()
        num = static_clusters(int(st_pos.numel()), ratio)
        if num <= 0:
            continue
        size = e - s + 1
        cl = dpc_knn_merge(x[s : e + 1, st_pos].mean(dim=0), num, knn, beta, use_beta, generator)
        centre_pos = st_pos[cl.centers]
        # linear form: every frame of the window at the centre's position, and at each member's position
        later = torch.arange(s + 1, e + 1, device=x.device)
        dst = [torch.arange(num, device=x.device).repeat_interleave(size - 1)]
        src = [(later[None, :] * positions + centre_pos[:, None]).flatten()]
        weight = [(cl.keep_weight / size).repeat_interleave(size - 1)]
        members = torch.nonzero(cl.member_weight > 0).flatten()
        window_frames = torch.arange(s, e + 1, device=x.device)
        dst.append(cl.labels[members].repeat_interleave(size))
        src.append((window_frames[None, :] * positions + st_pos[members][:, None]).flatten())
        weight.append((cl.member_weight[members] / size).repeat_interleave(size))
        builder.add(
            s * positions + centre_pos,
            cl.embeds,
            cl.keep_weight / size,
            attn[s : e + 1, centre_pos].float().mean(dim=0),
            builder.order_key(w, 0, s, 0, centre_pos),
            dst=torch.cat(dst),
            src=torch.cat(src),
            src_weight=torch.cat(weight),
        )
    return builder.build(dim, x.dtype, windows, ratio, saved)


def reconcile_plan(plan: OuterPlan, target: int, x: Tensor, attn: Tensor, windows: list[tuple[int, int]]) -> OuterPlan:
    """Fixed-count mode: exactly `target` outputs. Too many: drop the outputs with the lowest vision attention
    (a static cluster scores the mean attention of its centre over the window). Too few (r' capped at 1 on a very
    static video): add the most attended grid tokens that anchor no output, as plain tokens among the dynamic
    tokens of their frame."""
    count = len(plan)
    if count == target:
        return plan
    if count > target:
        keep = torch.zeros(count, dtype=torch.bool, device=plan.anchors.device)
        keep[torch.topk(plan.score, target).indices] = True
        new_index = torch.cumsum(keep.long(), 0) - 1
        edge = keep[plan.dst] if plan.dst.numel() else plan.dst.bool()
        return dataclasses.replace(
            plan,
            **_outputs(plan, keep),
            dst=new_index[plan.dst[edge]],
            src=plan.src[edge],
            src_weight=plan.src_weight[edge],
        )
    frames, positions, _ = x.shape
    flat_attn = attn.reshape(-1).float().clone()
    flat_attn[plan.anchors] = float("-inf")
    added = torch.topk(flat_attn, target - count).indices
    frame, pos = added // positions, added % positions
    window_of = torch.zeros(frames, dtype=torch.long, device=added.device)
    for w, (s, e) in enumerate(windows):
        window_of[s : e + 1] = w
    key = (((window_of[frame] * 2 + 1) * frames + frame) * 2) * positions + pos
    plan = dataclasses.replace(
        plan,
        anchors=torch.cat([plan.anchors, added]),
        embeds=torch.cat([plan.embeds, x.reshape(-1, x.shape[-1])[added]]),
        keep_weight=torch.cat([plan.keep_weight, torch.ones(added.numel(), device=added.device)]),
        score=torch.cat([plan.score, attn.reshape(-1).float()[added]]),
        key=torch.cat([plan.key, key]),
    )
    return sort_plan(plan)


def attention_on_grid(received: Tensor, geometry: FamilyGeometry, size: tuple[int, int]) -> Tensor:
    """Vision attention [F, L] -> [F, H * W] on the LLM token grid, pooled the way the model pools its features:
    SigLIP (LLaVA-OneVision) bilinearly, as the official `get_2dPool` pools the attention; CLIP (LLaVA-NeXT-Video,
    CLS dropped) with the model's own 2x2 pooler (a vtc port); Qwen statistics are already on the grid."""
    return geometry.to_token_grid(received.float(), size)


# --- inner merge ---------------------------------------------------------------------------------------------------


def inner_kept_count(num_visual: int, r: float) -> int:
    """round(N (1 - r)) visual tokens survive layer k (at least one while there is any)."""
    if num_visual == 0:
        return 0
    return max(1, round(num_visual * (1 - r)))


def inner_merge(hidden: Tensor, scores: Tensor, slots: Tensor, num_keep: int) -> tuple[Tensor, Tensor, Tensor]:
    """The layer-k merge on one video: hidden [n, D], scores [n] (last-token attention, head mean), slots [m].

    Keeps the top `num_keep` slots by score; every other slot (ascending) is folded into its most cosine-similar
    kept slot (similarity of the hidden states before any update, in their dtype) by the official sequential
    in-place rule h[t] = (h[t] + h[s]) / 2. Returns (new hidden [n, D], kept slots (score order), dropped slots)."""
    top = slots[torch.topk(scores[slots].float(), num_keep).indices]
    dropped_mask = torch.ones(slots.numel(), dtype=torch.bool, device=slots.device)
    dropped_mask[torch.isin(slots, top)] = False
    rest = slots[dropped_mask]
    out = hidden.clone()
    if rest.numel() == 0 or top.numel() == 0:
        return out, top, rest
    # (a @ b^T) / (|a| |b|^T), first kept slot on ties (the official torch.max(dim=-1).indices)
    target = top[best_match(hidden[rest], hidden[top], normalize="none", formula="ratio")[0]]
    # the sources are never updated, so the k-th source of every target can be folded in one step
    order = torch.sort(target, stable=True).indices
    sorted_target = target[order]
    first = torch.searchsorted(sorted_target, sorted_target, right=False)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device) - first
    for step in range(int(rank.max()) + 1):
        pick = rank == step
        t, s = target[pick], rest[pick]
        out[t] = (out[t] + hidden[s]) / 2
    return out, top, rest


# --- the methods ---------------------------------------------------------------------------------------------------


@vtc.method(
    "holitom-outer",
    paper="HoliTom: Holistic Token Merging for Fast Video Large Language Models (NeurIPS 2025)",
    url="https://arxiv.org/abs/2505.21334",
    summary="HoliTom's outer merge only (the paper's 'w/o M': no merge inside the LLM), for serving",
    retention_note="retention is RETAIN_RATIO; a very static video keeps fewer unless fixed_count=True "
    "(a server turns it on); k, r and bidirectional_layer are unused",
    exempt={
        "ordered_positions": "official output order: static clusters, then each frame",
        "retention": "adaptive count unless fixed_count=True (checked instead)",
    },
)
class HoliTomOuter(vtc.TokenMerger):
    """HoliTom's outer merge (official `holitom/llava_arch.py`: `prepare_inputs_labels_for_multimodal` + `holitom`).
    It takes the inner merge's parameters too, unused, so that a holitom configuration serves unchanged."""

    temporal = True  # temporal segments and merges across frames: videos only

    retain_ratio: float | None = vtc.param(
        None, range="(0, 1]", doc="RETAIN_RATIO: outer-merge budget (default: the retention, else 0.15)"
    )
    tau: float | None = vtc.param(
        None,
        range="[-1, 1]",
        doc="T: static threshold on consecutive-frame cosine (default 0.65 at R <= 0.10, else 0.80)",
    )
    k: int = vtc.param(
        18, range="[1, inf)", doc="HOLITOM_k: the inner merge runs before layer k, with the attention of layer k-1"
    )
    r: float | None = vtc.param(
        None, range="[0, 1)", doc="HOLITOM_r: fraction of visual tokens merged away at layer k (0.5; 0 = 'w/o M')"
    )
    beta: float = vtc.param(0.6, range="[0, 1]", doc="BETA: weight of a cluster centre against the mean of its members")
    d: float = vtc.param(
        0.0, range="[0, 1]", doc="D: share of each frame's dynamic budget given to contextual (DPC-kNN) tokens"
    )
    knn: int = vtc.param(
        7, range="[1, inf)", doc="K: neighbours of the DPC-kNN density, capped by the number of clusters"
    )
    max_window_size: int = vtc.param(
        1024, range="[1, inf)", doc="MAX_WINDOW_SIZE: longest temporal window of the DP segmentation"
    )
    use_beta: bool = vtc.param(True, doc="NO_BETA unset; False = plain mean of centre and members")
    fixed_count: bool = vtc.param(False, doc="reconcile to round(N * R) tokens before the LLM (serving contract)")
    bidirectional_layer: bool = vtc.param(False, doc="the official SDPA run: layer k-1 attends without its causal mask")

    positions = "compact"
    whole_frames = True

    def retain(self) -> float:
        """R (RETAIN_RATIO): the parameter, else the retention, else 0.15."""
        if self.retain_ratio is not None:
            return self.retain_ratio
        return float(self.retention) if self.retention is not None else DEFAULT_RETAIN_RATIO

    def static_tau(self) -> float:
        """T: the parameter, else the scripts' value for R."""
        return self.tau if self.tau is not None else default_tau(self.retain())

    def inner_ratio(self) -> float:
        """r of the merge inside the LLM: none here."""
        return 0.0

    def outer_active(self) -> bool:
        return self.retain() < 1.0

    def outer_target(self, num_tokens: int) -> int:
        return max(1, min(num_tokens, round(num_tokens * self.retain())))

    def retained_count(self, num_tokens, grid, family):
        """Exact count at the last layer when it does not depend on the content (fixed_count, or no outer merge)."""
        if self.outer_active() and not self.fixed_count:
            return None
        outer = self.outer_target(num_tokens) if self.outer_active() else num_tokens
        r = self.inner_ratio()
        return inner_kept_count(outer, r) if r > 0 else outer

    def vision_stats(self, family):
        return [RECEIVED] if self.outer_active() else []

    def plan(self, tokens, ctx):
        n = len(tokens)
        if not self.outer_active() or n == 0:
            return None
        frames, idx = tokens.whole_frames(self.card.name)
        _, h, w = tokens.grid
        received = ctx.vision.get(RECEIVED)
        if received is None:
            raise RuntimeError(f"{self.card.name}: the vision-tower attention was not captured")
        attn = attention_on_grid(received, ctx.geometry, (h, w))[frames.to(received.device)].to(tokens.embeds.device)
        x = tokens.embeds[idx]
        plan = outer_merge(
            x,
            attn,
            self.retain(),
            self.static_tau(),
            beta=self.beta,
            d=self.d,
            knn=self.knn,
            max_window_size=self.max_window_size,
            use_beta=self.use_beta,
            generator=ctx.generator,
        )
        if self.fixed_count:
            plan = reconcile_plan(plan, self.outer_target(n), x, attn, plan.windows)
        ctx.report(plan=plan)
        flat = idx.reshape(-1)
        if (
            len(plan) == n
            and plan.src.numel() == 0
            and torch.equal(flat[plan.anchors], torch.arange(n, device=flat.device))
        ):
            return None
        return vtc.Merge(flat[plan.anchors], plan.dst, flat[plan.src], plan.src_weight, plan.keep_weight, plan.embeds)


@vtc.method(
    "holitom",
    paper="HoliTom: Holistic Token Merging for Fast Video Large Language Models (NeurIPS 2025)",
    url="https://arxiv.org/abs/2505.21334",
    summary="DP temporal windows, static tokens averaged and clustered, top-attention dynamic tokens; "
    "similarity merge at LLM layer k",
    retention_note="retention is RETAIN_RATIO, the share of visual tokens entering the LLM (the paper's "
    "tables), at most: a very static video keeps fewer (fixed_count=True tops up); from layer k on the "
    "inner merge keeps round(N (1 - r)) of them (r = 0.5)",
    test_params={"k": 2},
    exempt={
        "ordered_positions": "official output order: static clusters, then each frame",
        "retention": "adaptive count: when static windows collapse more than 1 - r of the tokens the LLM sees "
        "fewer than r; fixed_count=True (checked instead) tops up to exactly r",
    },
)
class HoliTom(HoliTomOuter, vtc.LayerPruner):
    """The outer merge, then the inner merge (official `holitom/modeling_qwen2.py`): FastV's schedule at layer k
    (the last token's attention at layer k-1 ranks), whose prune step first folds every dropped visual token into
    its most similar kept one."""

    retention_reference = "llm_input"  # RETAIN_RATIO counts the tokens entering the LLM (the paper's tables)

    def inner_ratio(self) -> float:
        """r: the parameter, else 0.5 (0 when the outer merge keeps every token: no inner merge either)."""
        if self.r is not None:
            return self.r
        return 0.0 if self.retain() >= 1.0 else 0.5

    def prune_layer(self):
        return self.k

    def skip(self):
        return self.inner_ratio() <= 0

    def depth_error(self, num_layers):
        return (
            f"holitom: k={self.k} but the language model has only {num_layers} layers "
            "(the inner merge runs before layer k)"
        )

    def request(self, llm, ctx):
        super().request(llm, ctx)  # output_attentions=True (eager) at layer k-1
        if self.bidirectional_layer:  # the official SDPA run: layer k-1 without its causal mask
            llm.attend_bidirectionally()

    def prune(self, llm, ctx):
        scores = last_token_attention(llm, self.k - 1)
        layout = llm.layout
        hidden = llm.hidden.clone()
        keep = layout.valid.clone()
        for b in range(hidden.shape[0]):
            total = 0
            for slots in layout.video_slots(b).values():
                num_keep = inner_kept_count(int(slots.numel()), self.inner_ratio())
                hidden[b], _, dropped = inner_merge(hidden[b], scores[b].to(hidden.device), slots, num_keep)
                keep[b, dropped.to(keep.device)] = False
                total += num_keep
            ctx.report(kept=total)  # visual tokens of this batch row from layer k on
        llm.replace_hidden(hidden)
        llm.keep(keep, prune_cache=self.prune_cache)
