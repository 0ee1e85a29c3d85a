"""PruneVid: "Visual Token Pruning for Efficient Video Large Language Models" (Huang, Zhou, Han; ACL 2025).
arXiv: https://arxiv.org/abs/2412.16117. Official code: Visual-AI/PruneVid (PLLaVA only;
`models/pllava/modeling_pllava.py`, `models/pllava/elastic_cache.py::VTPWindowCache`, `models/pllava/llama.py`).

Idea: (1) cut the video into temporal windows (DPC-kNN over frame descriptors, made contiguous), and in each
window average the tokens that do not change over time ("static") into one token per position and cluster
them, and cluster each frame's remaining ("dynamic") tokens; (2) inside the LLM, after layer `selected_layer`,
keep per window the fraction alpha of static tokens and, per frame, of dynamic tokens that receive the most
attention from the text after the video, pruning the hidden states and the KV cache of layers 0..selected_layer.

Stages: connect (stage 1) and prefill (stage 2). Stage 1 records per token, in `tokens.tags`, the window, the
static/dynamic flag and the frame of dynamic tokens; stage 2 reads them back as `llm.layout.tags`. Stage 2 is
FastV's schedule (`vtc.LayerPruner`, K = selected_layer + 1) with PruneVid's scores and per-group quotas.

Faithful to the official code: DPC-kNN as in `cluster_dpc_knn` (distances / sqrt(C), k = 7, density noise
U(0, 1e-6), centres by score, nearest-centre assignment read from the centres' rows), `refine_clusters`
(longest run per cluster, other runs and singleton clusters relabelled to the longer neighbouring run, ties to
the left), the static test (mean off-diagonal pairwise cosine > tau), the "> 14 tokens" clustering rule with
`int(count * cluster_ratio)` clusters whose means are the new tokens (cluster index order), the sequence
`[static ; dynamic frame 1 ; ... ; frame W]` per window; stage 2 scores tokens with the map the official LLaMA
returns at `selected_layer` (softmax of q k^T *before RoPE*, no causal mask), max over heads and over the text
after the video, keeps `int(size * alpha)` per static group and per frame, and keeps positions. See
docs/methods/prunevid.md for every place vtc differs (port to five families, small-video guards, retention
mapping, fixed-count mode).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
import torch.nn.functional as F

import vtc
from vtc_kernels import dpc_knn_centers, reconcile_count
from vtc_kernels.select import segmented_topk

Tensor = torch.Tensor

DEFAULT_ALPHA = 0.4  # alphas=(0.4) in scripts/eval.sh
README_RETAINED = 0.162  # README: PLLaVA keeps 16.2 % of the visual tokens at the defaults
STAGE1_NOMINAL = README_RETAINED / DEFAULT_ALPHA  # ~ fraction left by stage 1 in that setting (0.405)
MIN_CLUSTER_TOKENS = 14  # merge_frames_dynamic clusters a group only when it has more than 14 tokens

TAG_WINDOW = "prunevid_window"  # window index within the video
TAG_STATIC = "prunevid_static"  # 1 static (window mean), 0 dynamic
TAG_FRAME = "prunevid_frame"  # frame of a dynamic token (-1 for static tokens)
TAG_BUDGET = "prunevid_budget"  # tokens stage 2 aims to keep for this video (only with a retention / fixed count)


# --- stage 1: temporal windows ---------------------------------------------------------------------------------


def dpc_knn_cluster(
    x: Tensor, num_clusters: int, k: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """PruneVid's `cluster_dpc_knn` on the rows of x [n, C] -> (labels [n], centres [m]).

    Scores come from `vtc_kernels.dpc_knn_scores` (TCFormer's density peaks, identical arithmetic, noise from
    `generator`); centres are the top-`num_clusters` scores (cluster id = rank). Each row joins the centre whose
    *row* of the distance matrix is nearest (`dist[centres].argmin(0)`, as the official `index_points`
    gather does; `cdist` is not exactly symmetric), and centres own their cluster.
    """
    centres, dist = dpc_knn_centers(x, max(0, int(num_clusters)), k, generator)
    labels = dist[centres].argmin(dim=0)
    labels[centres] = torch.arange(centres.numel(), device=labels.device)
    return labels, centres


def cluster_means(x: Tensor, labels: Tensor, num_clusters: int) -> Tensor:
    """Mean of the rows of x [n, C] per cluster (`compute_cluster_vectors`: one-hot matmul in x's dtype, then a
    division by the member count; an empty cluster gives zeros)."""
    onehot = F.one_hot(labels, num_classes=num_clusters).to(x.dtype)  # [n, m]
    sums = onehot.transpose(0, 1) @ x
    counts = onehot.sum(dim=0)
    means = sums / counts.clamp(min=1).unsqueeze(-1)
    return means.masked_fill((counts == 0).unsqueeze(-1), 0)


def _runs(labels: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal values: (start, end exclusive, value)."""
    out = []
    start = 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            out.append((start, i, labels[start]))
            start = i
    return out


def refine_clusters(labels: Sequence[int] | Tensor) -> list[int]:
    """Make temporal clusters contiguous (`refine_clusters`, one video).

    Every cluster keeps only its longest run(s) of consecutive frames; its other runs, and every run of a
    cluster whose longest run is a single frame, become unassigned. Then, left to right, each unassigned
    stretch joins the neighbour (left or right) whose adjacent run is longer, the left one on ties, cluster 0
    when it has no neighbour. Runs are measured on the labels as reassigned so far.
    """
    labels = [int(v) for v in (labels.tolist() if isinstance(labels, Tensor) else labels)]
    n = len(labels)
    out = list(labels)
    longest: dict[int, int] = {}
    for start, end, value in _runs(labels):
        longest[value] = max(longest.get(value, 0), end - start)
    for start, end, value in _runs(labels):
        if longest[value] == 1 or end - start < longest[value]:
            out[start:end] = [-1] * (end - start)
    i = 0
    while i < n:
        if out[i] != -1:
            i += 1
            continue
        j = i
        while j < n and out[j] == -1:
            j += 1
        left = right = None
        left_len = right_len = 0
        if i > 0:
            left = out[i - 1]
            a = i - 1
            while a >= 0 and out[a] == left:
                a -= 1
            left_len = i - 1 - a
        if j < n:
            right = out[j]
            b = j
            while b < n and out[b] == right:
                b += 1
            right_len = b - j
        if right_len > left_len:
            new = right
        elif left is not None:
            new = left
        else:
            new = right if right is not None else 0
        out[i:j] = [new] * (j - i)
        i = j
    return out


def segment_lengths(labels: Sequence[int]) -> list[int]:
    """Lengths of the runs of equal labels, in temporal order (the window sizes)."""
    return [end - start for start, end, _ in _runs(list(labels))]


def temporal_windows(
    descriptors: Tensor, segment_ratio: float, k: int, generator: torch.Generator | None = None
) -> list[int]:
    """Window sizes for frame descriptors [T, C]: DPC-kNN into int(T * ratio) clusters (at least 1), made
    contiguous by `refine_clusters`."""
    t = descriptors.shape[0]
    labels, _ = dpc_knn_cluster(descriptors, max(1, int(t * segment_ratio)), k, generator)
    return segment_lengths(refine_clusters(labels))


def static_scores(frames: Tensor) -> Tensor:
    """Mean off-diagonal pairwise cosine similarity over the W frames of a window, per position.

    frames [W, L, C] -> [L]: (sum_{w,t} cos(f_w,l, f_t,l) - W) / (W (W - 1)), computed as the official code
    does (normalise, all pairs, sum over t, minus 1, sum over w). W = 1 gives NaN (0 / 0), i.e. not static.
    """
    w = frames.shape[0]
    normed = F.normalize(frames, p=2, dim=-1)
    sim = torch.einsum("wlc,tlc->wtl", normed, normed)
    total = (sim.sum(dim=1) - 1).sum(dim=0)
    if w == 1:
        return torch.full_like(total, float("nan"))
    return total / (w * (w - 1))


# --- stage 1: the merge plan -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Stage1Plan:
    """Output tokens of stage 1 for one video, in the order the LLM sees them.

    anchors [M]: input token whose position / grid coordinates the output token takes; values [M, C]: the
    output features (computed as the official code does); (dst, src, src_weight, keep_weight): the same means as
    a weighted merge (for side features); window / static / frame [M]: the tags stage 2 needs; window_sizes,
    static_sizes, dynamic_sizes: per window (frames, static tokens, dynamic tokens), as the official code
    records them.
    """

    anchors: Tensor
    values: Tensor
    dst: Tensor
    src: Tensor
    src_weight: Tensor
    keep_weight: Tensor
    window: Tensor
    static: Tensor
    frame: Tensor
    window_sizes: list[int]
    static_sizes: list[int]
    dynamic_sizes: list[int]

    @property
    def count(self) -> int:
        return int(self.anchors.numel())


class _PlanBuilder:
    def __init__(self) -> None:
        self.anchors: list[int] = []
        self.values: list[Tensor] = []
        self.members: list[tuple[Tensor, float]] = []  # members of each output token and their weight
        self.window: list[int] = []
        self.static: list[int] = []
        self.frame: list[int] = []

    def add(self, anchor: int, value: Tensor, members: Tensor, weight: float, window: int, static: bool, frame: int):
        self.anchors.append(int(anchor))
        self.values.append(value)
        self.members.append((members, weight))
        self.window.append(window)
        self.static.append(int(static))
        self.frame.append(frame)

    def build(self, embeds: Tensor, sizes: tuple[list[int], list[int], list[int]]) -> Stage1Plan:
        device = embeds.device
        as_long = dict(dtype=torch.long, device=device)
        anchors = torch.tensor(self.anchors, **as_long)
        weights = torch.tensor([w for _, w in self.members], dtype=torch.float32, device=device)
        if self.members:
            members = torch.cat([m for m, _ in self.members])
            owner = torch.repeat_interleave(
                torch.arange(len(self.members), device=device),
                torch.tensor([m.numel() for m, _ in self.members], **as_long),
            )
        else:
            members = owner = torch.zeros(0, **as_long)
        other = members != anchors[owner]  # every anchor is one of its own members
        return Stage1Plan(
            anchors=anchors,
            values=torch.stack(self.values) if self.values else embeds[:0],
            dst=owner[other],
            src=members[other],
            src_weight=weights[owner[other]],
            keep_weight=weights,
            window=torch.tensor(self.window, **as_long),
            static=torch.tensor(self.static, **as_long),
            frame=torch.tensor(self.frame, **as_long),
            window_sizes=sizes[0],
            static_sizes=sizes[1],
            dynamic_sizes=sizes[2],
        )


def _common_positions(patch_lists: list[Tensor]) -> list[Tensor]:
    """For frames whose tokens sit at patches `patch_lists[w]` (sorted), the indices (into each frame's list)
    of the patches present in every frame: all of them on a full grid."""
    first = patch_lists[0]
    if all(p.numel() == first.numel() and torch.equal(p, first) for p in patch_lists[1:]):
        return [torch.arange(first.numel(), device=first.device) for _ in patch_lists]
    common = set(first.tolist())
    for p in patch_lists[1:]:
        common &= set(p.tolist())
    keep = torch.tensor(sorted(common), dtype=torch.long, device=first.device)
    return [torch.nonzero(torch.isin(p, keep)).flatten() for p in patch_lists]


def _cluster_group(
    builder: _PlanBuilder,
    features: Tensor,
    members: Tensor,
    anchors: Tensor,
    cluster_ratio: float,
    k: int,
    generator: torch.Generator | None,
    cluster: bool,
    window: int,
    static: bool,
    frame: int,
) -> int:
    """Add one group's output tokens: `features` [P, C] (one per position), `members` [R, P] the input tokens
    each position stands for (R frames for static positions, 1 for dynamic tokens), `anchors` [P]. A group of
    more than 14 positions becomes int(P * cluster_ratio) DPC-kNN cluster means (cluster index order)."""
    p = features.shape[0]
    rows = members.shape[0]
    if cluster and p > MIN_CLUSTER_TOKENS:
        m = max(1, int(p * cluster_ratio))
        labels, centres = dpc_knn_cluster(features, m, k, generator)
        means = cluster_means(features, labels, m)
        for c in range(m):
            inside = labels == c
            count = int(inside.sum())
            builder.add(
                anchors[centres[c]],
                means[c],
                members[:, inside].flatten(),
                1.0 / (rows * count),
                window,
                static,
                frame,
            )
        return m
    for i in range(p):
        builder.add(anchors[i], features[i], members[:, i], 1.0 / rows, window, static, frame)
    return p


def prunevid_stage1(
    embeds: Tensor,
    frame: Tensor,
    patch: Tensor,
    tau: float = 0.8,
    temporal_segment_ratio: float = 0.25,
    cluster_ratio: float = 0.5,
    k: int = 7,
    generator: torch.Generator | None = None,
    merge_static: bool = True,
    cluster: bool = True,
) -> Stage1Plan:
    """PruneVid's `merge_frames_dynamic` on one video's tokens (embeds [N, C], frame / patch [N]).

    Frames are the distinct values of `frame` (in order), each frame's tokens taken in patch order. Windows come
    from `temporal_windows` on the per-frame token means. In a window of W frames, the positions present in
    every frame whose `static_scores` exceed tau are static: their mean over the window is one token each
    (clustered when more than 14); each frame's other tokens are its dynamic tokens (clustered when more than
    14). `merge_static=False` / `cluster=False` switch those steps off (vtc's relaxation, see PruneVid).
    """
    frames = torch.unique(frame)
    per_frame = []
    for f in frames.tolist():
        idx = torch.nonzero(frame == f).flatten()
        per_frame.append(idx[torch.argsort(patch[idx], stable=True)])
    descriptors = torch.stack([embeds[idx].mean(dim=0) for idx in per_frame])
    sizes = temporal_windows(descriptors, temporal_segment_ratio, k, generator)

    builder = _PlanBuilder()
    static_sizes, dynamic_sizes = [], []
    start = 0
    for w_id, size in enumerate(sizes):
        window_idx = per_frame[start : start + size]
        common = _common_positions([patch[idx] for idx in window_idx])
        aligned = torch.stack([idx[c] for idx, c in zip(window_idx, common)])  # [W, P] token indices
        if merge_static and aligned.shape[1] > 0:
            is_static = static_scores(embeds[aligned]) > tau
        else:
            is_static = torch.zeros(aligned.shape[1], dtype=torch.bool, device=embeds.device)
        static_idx = aligned[:, is_static]  # [W, S]
        static_feat = embeds[static_idx].mean(dim=0)  # [S, C]: the mean over the window
        static_sizes.append(
            _cluster_group(
                builder,
                static_feat,
                static_idx,
                static_idx[0],
                cluster_ratio,
                k,
                generator,
                cluster,
                w_id,
                True,
                -1,
            )
        )
        dynamic = 0
        for idx in window_idx:
            dyn = idx[~torch.isin(idx, static_idx.flatten())]  # the frame's other tokens, in patch order
            dynamic += _cluster_group(
                builder,
                embeds[dyn],
                dyn[None],
                dyn,
                cluster_ratio,
                k,
                generator,
                cluster,
                w_id,
                False,
                int(frame[idx[0]]),
            )
        dynamic_sizes.append(dynamic)
        start += size
    return builder.build(embeds, (sizes, static_sizes, dynamic_sizes))


# --- stage 2 ---------------------------------------------------------------------------------------------------


def text_rows(visual: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Query rows of the text after the video: per batch row, the slots after its last visual token up to its
    last real token -> (rows [B, R], rows_valid [B, R]); short rows repeat their last slot (marked invalid)."""
    bsz, n = valid.shape
    slot = torch.arange(n, device=valid.device)[None].expand(bsz, -1)
    last = torch.where(valid, slot, -1).max(dim=1).values
    first = torch.where(visual & valid, slot, -1).max(dim=1).values + 1
    counts = (last - first + 1).clamp(min=0)
    width = max(1, int(counts.max()))
    offsets = torch.arange(width, device=valid.device)[None]
    rows = torch.minimum(first[:, None] + offsets, last[:, None]).clamp(min=0)
    return rows, offsets < counts[:, None]


def text_attention_scores(query: Tensor, key: Tensor, rows: Tensor, rows_valid: Tensor, key_valid: Tensor) -> Tensor:
    """PruneVid's token scores from the attention map its LLaMA returns at `selected_layer` during prefill.

    query [B, H, R, d] (the text rows), key [B, Hkv, n, d]: projections *before* RoPE (the official eager
    attention returns `softmax(q k^T / sqrt(d))` computed before the rotary embedding and without the causal
    mask); softmax over every real key (`key_valid` [B, n]: padding excluded) in float32, cast back to the model
    dtype; then the max over heads and over the valid query rows -> [B, n].
    """
    heads, dim = query.shape[1], query.shape[-1]
    if key.shape[1] != heads:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
    logits = (query @ key.transpose(-1, -2)) / math.sqrt(dim)
    logits = logits.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = probs * rows_valid[:, None, :, None].to(probs.dtype)
    return probs.amax(dim=1).amax(dim=1)


def group_quota(size: int, alpha: float | None, budget: int | None, total: int) -> int:
    """Tokens a static group / frame keeps: int(size * alpha) (official), or, when alpha is None, size * budget
    // total: alpha = budget / total in exact rational arithmetic."""
    if alpha is not None:
        return int(size * alpha)
    return size if budget >= total else size * budget // total


def stage2_keep(
    scores: Tensor,
    slots: Tensor,
    window: Tensor,
    static: Tensor,
    frame: Tensor,
    alpha: float | None,
    budget: int | None = None,
    fixed: bool = False,
) -> Tensor:
    """Which of one video's visual `slots` survive stage 2 (`VTPWindowCache.process_attention`).

    scores [n] (max over heads and text queries); window / static / frame [n] the stage-1 tags. Per window: the
    top int(static_size * alpha) static tokens and, per frame, the top int(count * alpha) dynamic tokens.
    `budget`: the video's target count; with alpha None, alpha = budget / (video's tokens). `fixed`: reconcile
    to exactly min(budget, tokens) by score. Returns a bool mask over `slots`.
    """
    keep = torch.zeros(slots.numel(), dtype=torch.bool, device=slots.device)
    total = slots.numel()
    s_scores = scores[slots]
    win, stat, frm = window[slots], static[slots], frame[slots]
    pool = torch.nonzero((stat == 1) | (stat == 0)).flatten()
    if pool.numel():
        # one group per window's static tokens and per (window, frame) of its dynamic tokens; members in slot order
        keys = torch.stack([win[pool], stat[pool], torch.where(stat[pool] == 1, 0, frm[pool])], dim=1)
        group = torch.unique(keys, dim=0, return_inverse=True)[1]
        order = pool[torch.sort(group, stable=True).indices]
        sizes = torch.bincount(group)
        offsets = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])
        quotas = torch.tensor([group_quota(n, alpha, budget, total) for n in sizes.tolist()])
        keep[order[segmented_topk(s_scores[order], offsets, quotas)]] = True
    if fixed and budget is not None:
        keep = reconcile_count(keep, s_scores, min(budget, total))
    return keep


def position_free_scores(llm) -> Tensor:
    """The official map at this layer (call at its "layer_start"): the query rows of the text after the video
    against every key, before RoPE and without the causal mask (`llm.projections`) -> [B, n]."""
    layout = llm.layout
    rows, rows_valid = text_rows(layout.visual, layout.valid)
    query, key = llm.projections(rows)
    device = query.device
    return text_attention_scores(query, key, rows, rows_valid.to(device), layout.valid.to(device))


def stage2_mask(scores: Tensor, layout, alpha: float | None, fixed: bool) -> Tensor:
    """Keep mask [B, n] of stage 2: `stage2_keep` on every video stage 1 tagged (its budget from the tags);
    text, padding and untagged videos are left alone."""
    tags = layout.tags
    keep = layout.valid.clone()
    for b in range(keep.shape[0]):
        for slots in layout.video_slots(b).values():
            if bool((tags[TAG_WINDOW][b, slots] < 0).any()):
                continue  # a video stage 1 did not tag: left alone
            budget = int(tags[TAG_BUDGET][b, slots[0]]) if TAG_BUDGET in tags else None
            keep[b, slots] = stage2_keep(
                scores[b],
                slots,
                tags[TAG_WINDOW][b],
                tags[TAG_STATIC][b],
                tags[TAG_FRAME][b],
                alpha,
                budget,
                fixed=fixed,
            )
    return keep


# --- the method ------------------------------------------------------------------------------------------------


@vtc.method(
    "prunevid",
    paper="PruneVid: Visual Token Pruning for Efficient Video Large Language Models (ACL 2025)",
    url="https://arxiv.org/abs/2412.16117",
    summary="merge static tokens per temporal window and cluster the rest, then prune by text attention "
    "at layer 10 (hidden states and KV cache)",
    retention_note="retention is the share left after the layer-M prune (alpha = budget / tokens per "
    "group, rounded down per group); stage 1 alone leaves more",
    test_params={"selected_layer": 2},
    exempt={"ordered_positions": "official output order: static tokens, then each frame"},
)
class PruneVid(vtc.LayerPruner):
    """Stage 1 in connect (`merge_frames_dynamic`), stage 2 a LayerPruner after layer selected_layer
    (`VTPWindowCache.process_attention`)."""

    temporal = True  # stage 1 merges static tokens across frames: videos only

    selected_layer: int = vtc.param(
        10, range="[0, inf)", doc="selected_layer: attention of this LLM layer ranks tokens; prune after it"
    )
    alpha: float | None = vtc.param(
        None, range="(0, 1]", doc="alpha: kept fraction per static group / frame; None = 0.4, or from retention"
    )
    tau: float = vtc.param(0.8, doc="tau: static if the mean pairwise cosine over the window exceeds it")
    temporal_segment_ratio: float = vtc.param(
        0.25, range="(0, 1]", doc="temporal_segment_ratio: int(T * ratio) DPC-kNN frame clusters"
    )
    cluster_ratio: float = vtc.param(
        0.5, range="(0, 1]", doc="cluster_ratio: a group of > 14 tokens becomes int(count * ratio) cluster means"
    )
    k: int = vtc.param(
        7, range="[1, inf)", doc="k: nearest neighbours of the DPC-kNN density (k=7 in merge_frames_dynamic)"
    )
    fixed_count: bool = vtc.param(
        False, doc="vtc: keep exactly retained_count() tokens (reconciled by attention score)"
    )
    causal_scores: bool = vtc.param(
        False,
        doc="vtc option: rank with the layer's real attention (RoPE, causal) instead of the official "
        "position-free, non-causal map (see text_attention_scores)",
    )

    positions = "compact"
    attention_rows = "after_visual"  # causal_scores: the text after the video
    prune_cache = True  # the official cache drops the pruned tokens at every layer up to selected_layer

    def identity(self) -> bool:
        """Retention 1.0 without an explicit alpha keeps everything (both stages off)."""
        return self.alpha is None and self.retention is not None and self.retention >= 1.0

    def group_alpha(self) -> float | None:
        """alpha of stage 2: the parameter; None with a retention (derived per video from the budget
        round(retention * N)); else 0.4."""
        if self.alpha is not None:
            return self.alpha
        return None if self.retention is not None else DEFAULT_ALPHA

    def target(self) -> float:
        """The budget, as a fraction of the tokens reaching stage 1: the retention; with an explicit or the
        default alpha, what fixed_count reconciles to (alpha x the README's stage-1 share)."""
        if self.alpha is not None:
            return self.alpha * STAGE1_NOMINAL
        return float(self.retention) if self.retention is not None else README_RETAINED

    def _uses_budget(self) -> bool:
        return self.group_alpha() is None or self.fixed_count

    def _budget(self, num_tokens: int) -> int:
        return min(num_tokens, max(1, round(self.target() * num_tokens)))

    def retained_count(self, num_tokens, grid, family):
        if self.identity():
            return num_tokens
        if self.fixed_count:
            return self._budget(num_tokens)
        return None  # windows, static masks and per-group floors depend on the content

    # stage 1
    def connect(self, tokens, ctx):
        n = len(tokens)
        if self.identity() or n == 0:
            return tokens
        budget = self._budget(n) if self._uses_budget() else None
        generator = ctx.generator
        state = generator.get_state() if generator is not None else None
        # the official stage 1, relaxed only when it leaves fewer tokens than the budget stage 2 must keep
        for merge_static, cluster in ((True, True), (True, False), (False, False)):
            if state is not None:
                generator.set_state(state)
            plan = prunevid_stage1(
                tokens.embeds,
                tokens.frame,
                tokens.patch,
                tau=self.tau,
                temporal_segment_ratio=self.temporal_segment_ratio,
                cluster_ratio=self.cluster_ratio,
                k=self.k,
                generator=generator,
                merge_static=merge_static,
                cluster=cluster,
            )
            if budget is None or plan.count >= budget:
                break
        ctx.report(plan=plan)
        out = tokens.merge(plan.anchors, plan.dst, plan.src, plan.src_weight, plan.keep_weight, embeds=plan.values)
        out.tags[TAG_WINDOW] = plan.window
        out.tags[TAG_STATIC] = plan.static
        out.tags[TAG_FRAME] = plan.frame
        if budget is not None:
            out.tags[TAG_BUDGET] = torch.full_like(plan.window, budget)
        return out

    # stage 2: FastV's schedule at K = selected_layer + 1, on the videos stage 1 tagged
    def prune_layer(self):
        return self.selected_layer + 1

    def skip(self):
        return self.identity()

    def depth_error(self, num_layers):
        layer = self.selected_layer
        return (
            f"prunevid: selected_layer={layer} needs a language model with more than {layer + 1} layers "
            f"(the prune happens before layer selected_layer + 1); this one has {num_layers}"
        )

    def request(self, llm, ctx):
        if TAG_WINDOW not in llm.layout.tags:
            return
        if self.causal_scores:
            super().request(llm, ctx)
        else:
            ctx.state["scores"] = position_free_scores(llm)

    def prune(self, llm, ctx):
        if TAG_WINDOW in llm.layout.tags:
            super().prune(llm, ctx)

    def keep_mask(self, llm, ctx):
        if self.causal_scores:
            scores = llm.attention(self.selected_layer).amax(dim=1).amax(dim=1)  # max over heads, then text queries
        else:
            scores = ctx.state.pop("scores")
        layout = llm.layout
        keep = stage2_mask(scores, layout, self.group_alpha(), self.fixed_count)
        for kept in (keep & layout.visual).sum(dim=1).tolist():
            ctx.report(kept=kept)  # visual tokens of each batch row from layer selected_layer + 1 on
        return keep
