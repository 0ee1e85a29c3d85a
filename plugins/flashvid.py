"""FlashVID: "Efficient Video Large Language Models via Training-free Tree-based Spatiotemporal Token Merging"
(Fan et al., ICLR 2026, oral). arXiv: https://arxiv.org/abs/2602.08024. Official code: Fanziyang-v/FlashVID at
commit 1d37422c (2026-02-12): `flashvid/utils.py` (`flashvid_compression`, `segment_compression`, `segment`,
`additional_segment`, `dpc_knn`, `spatiotemporal_compression`, `fastv_prune`), `flashvid/token_selection.py`,
`flashvid/__init__.py` (wrapper defaults), `flashvid/siglip_encoder.py`, `flashvid/llava_arch.py`,
`flashvid/modeling_qwen2.py`, `flashvid/modeling_qwen2_5_vl.py`, `flashvid/modeling_qwen3_vl.py`, `scripts/*.sh`.

The idea. At the connector, per video: DySeg cuts the frames where the cosine of consecutive mean frame features
drops below 0.9 (plus the lowest transitions, up to `min_segment_num` segments). Every frame keeps a budget
B = ceil(N R e) (R the retention ratio, e = 1.25): ceil(alpha B) tokens by ADTS, a max-min diversity
(farthest-point) selection on cosine distances scaled by the attention each token receives in the vision tower
(and, in v2, by its relevance to the segment's frames); the other B - ceil(alpha B) per frame by TSTM: each
remaining token of frame t joins its most similar remaining token of frame t - 1 at any position when the cosine
exceeds 0.8, the trees collapse to their mean at the root (earliest frame), and DPC-kNN clusters the roots of
each frame down to the budget. Inside the LLM, FastV-style: at layer K the last prompt token's attention at layer
K - 1 keeps ceil(V r) of the V visual tokens (K = 20, r = 0.3; Qwen3-VL 28 / 0.1). With e = 1.25 the mean over the
official models' layers is exactly R ((20 x 1.25 R + 8 x 1.25 R x 0.3) / 28 = R), so `retention` is R and is
measured over the layers (`layer_mean`).
Stages: connect (ADTS + TSTM) + prefill (the layer-K pruning). Positions: survivors and merged tokens keep the
position of their anchor (ADTS token, tree root or cluster centre), as the official Qwen code; LLaVA renumbers
(`compact`), as the official LLaVA code rebuilds `inputs_embeds`; the in-LLM pruning keeps positions.

Where vtc differs (each one named on docs/methods/flashvid.md):
- a tree becomes the mean of its tokens: the official loop adds a merged token's sum to its parent but counts it as
  one token (`assigned_one_hot.sum(0)`, the children's counts dropped), so a root is its tree's sum / (1 + its
  direct children), not the "average merging" the code names; `official_tree_sum=True` reproduces it;
- single-frame segments: the official code feeds every token of the frame, ADTS picks included, to the DPC-kNN
  merge, so a cluster centred on an ADTS pick gives a second output at the same index (Qwen: two tokens written to
  one slot); vtc merges the frame's other tokens, as the multi-frame path does (same count);
- complementary cuts never repeat a cut (the official top-k over similarities with cut transitions set to 1.0 can
  pick one again, giving an empty segment), and ADTS v2 never picks a token twice (it relies on a zero
  self-distance, which fails with duplicate tokens or negative event relevance);
- a budget B >= N keeps every token (the official code fails there: R e > 1), and R = 1 turns both stages off;
- Qwen3-VL: the `<|vision_start|>` / `<|vision_end|>` markers stay (the official code drops every one of them
  from the sequence, evidently by accident: it removes them with the video tokens it compresses);
- the in-LLM pruning ranks each video of each batch row (official: batch 1, one video); DPC-kNN noise comes from
  the seeded `ctx.generator`; attention statistics are float32 (official: the model dtype); LLaVA-Video loads in
  HF's LLaVA-OneVision class (one newline after the video, not one per frame inside the pruned span).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

import vtc
from vtc.core.bases import last_token_attention
from vtc.core.geometry import FamilyGeometry, default_geometry
from vtc.core.vision_stats import VisionStat
from vtc_kernels import assign_to_centers, best_match, cosine_distance_matrix, dpc_knn_centers, max_min_select
from vtc_kernels.select import segmented_topk
from vtc_plugins.fastvid import adjacent_similarity, normalize_rows, sizes_from_cuts

Tensor = torch.Tensor

SELECTIONS = ("attn_div", "attn_div_v2", "attn", "div")  # official `TokenSelectionMethod`: ADTS, ADTS v2, ablations
# the official scripts' settings, by the kind of host they were run on: Qwen-VL (M-RoPE: scripts/qwen2_5_vl.sh,
# qwen3_vl.sh) and LLaVA (1-D RoPE: scripts/llava_ov.sh, llava_vid.sh); a family takes the values of its kind
OFFICIAL_CONNECT = {
    "mrope": {"token_selection_method": "attn_div", "min_segment_num": 4},
    "rope": {"token_selection_method": "attn_div_v2", "min_segment_num": 8},
}
# (pruning_layer K, llm_retention_ratio r): scripts/qwen3_vl.sh moves them for Qwen3-VL-8B's 36 layers
OFFICIAL_LLM_STAGE = {"qwen3_vl": (28, 0.1)}
DEFAULT_LLM_STAGE = (20, 0.3)
DEFAULT_RETENTION_RATIO = 0.25  # the flashvid() wrapper's default (the scripts sweep 0.10 / 0.15 / 0.20 / 0.25)


# --- DySeg ---------------------------------------------------------------------------------------------------------


def segment_lengths(
    frame_features: Tensor, threshold: float, min_segments: int, complementary: bool = True
) -> list[int]:
    """DySeg (official `segment` + `additional_segment`): frame_features [F, D] (the mean of each frame's tokens, in
    the model dtype). Cut after frame t where cos(f_t, f_t+1) < threshold; with fewer than `min_segments` segments
    and `complementary`, also cut at the lowest remaining transitions (never one already cut). Returns the
    segment lengths."""
    frames = frame_features.shape[0]
    if frames <= 1:
        return [frames]
    sim = adjacent_similarity(normalize_rows(frame_features))
    cut = sim < threshold
    cuts = torch.nonzero(cut).flatten()
    missing = min_segments - (cuts.numel() + 1)
    if missing > 0 and complementary:
        # official: sim[cut] = 1.0 and topk(k=min(missing, F - 1)), which can pick a cut again (an empty segment)
        free = int((~cut).sum())
        extra = torch.topk(sim.masked_fill(cut, float("inf")), min(missing, free), largest=False).indices
        cuts = torch.cat([cuts, extra])
    return sizes_from_cuts(sorted(cuts.tolist()), frames)


# --- budgets -------------------------------------------------------------------------------------------------------


def frame_budget(num_tokens: int, retention_ratio: float, expansion: float, alpha: float) -> tuple[int, int]:
    """(ADTS, TSTM) tokens per frame, the official expressions in Python floats: B = ceil(N R e),
    ceil(B alpha) selected, B - ceil(B alpha) merged."""
    budget = math.ceil(num_tokens * retention_ratio * expansion)
    selected = math.ceil(budget * alpha)
    return selected, budget - selected


def llm_kept_count(num_visual: int, ratio: float) -> int:
    """Visual tokens kept from layer K on: ceil(V r), the official Python-float expression."""
    return math.ceil(num_visual * ratio)


# --- ADTS ----------------------------------------------------------------------------------------------------------


def calibrated_distances(features: Tensor, attention: Tensor, method: str) -> Tensor:
    """The distance matrices ADTS maximises the minimum of, per frame: features [S, N, D], attention [S, N] ->
    [S, N, N] float32. `div`: 1 - cos; `attn_div` (v1): times 1e6 a_j (column j scaled by the attention token j
    receives); `attn_div_v2`: times also e_j = mean_c <x_j, p_c>, p_c the mean feature of frame c of the segment
    (un-normalised dot products: event relevance)."""
    x = features.float()
    dist = cosine_distance_matrix(x)
    if method == "div":
        return dist
    dist = dist * (attention.float() * 1e6).unsqueeze(1)
    if method == "attn_div_v2":
        relevance = torch.einsum("b n d, c d -> b c n", x, x.mean(1)).mean(1)
        dist = dist * relevance.unsqueeze(1)
    return dist


def select_tokens(features: Tensor, attention: Tensor, count: int, method: str) -> Tensor:
    """[S, count] ascending token indices per frame: the top `count` by attention (`attn`), or the greedy max-min
    selection on `calibrated_distances` (first pick: the largest second-smallest column entry; never a token
    twice; ties to the first index)."""
    if method == "attn":
        return torch.topk(attention, count, dim=-1).indices.sort(dim=-1).values
    picks = max_min_select(calibrated_distances(features, attention, method), count)
    return picks.sort(dim=-1).values


# --- TSTM ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Trees:
    """TSTM on one segment of F frames x N tokens.

    roots:    [F, N] bool, the merged tokens that stay (tree roots; never an ADTS token)
    root_of:  [F, N] long, flat index (frame * N + token) of each merged token's root, -1 for ADTS tokens
    size:     [F, N] long, tokens in the tree of each root (0 elsewhere)
    divisor:  [F, N] what each root's sum was divided by: its tree's size (the mean), or with `official_sum` one
              plus its direct children
    features: [F, N, D] the tree's token at every root (model dtype; other rows are scratch)
    """

    roots: Tensor
    root_of: Tensor
    size: Tensor
    divisor: Tensor
    features: Tensor


def tree_merge(
    features: Tensor, selected: Tensor, threshold: float, lower_bound: int, official_sum: bool = False
) -> Trees:
    """TSTM (official `spatiotemporal_compression`) on one segment: features [F, N, D], selected [F, N] bool (ADTS
    picks, which take no part). Each other token of frame t >= 1 finds its most cosine-similar other token of frame
    t - 1 (any position) and joins it when the similarity exceeds `threshold`; if fewer than `lower_bound` tokens
    (ADTS picks included) would stay, the threshold becomes the value that merges at most F N - lower_bound of them.
    Trees sum from the last frame back, in the features' dtype (the official loop), and each root divides its
    tree's sum by the tree's size: the mean ("average merging"). `official_sum`: by one plus its direct children,
    as the official code does (it adds each merged token's sum to its parent, but only 1 to the parent's count, so
    a chain over k frames becomes its sum / 2)."""
    frames, n, _ = features.shape
    free = ~selected
    dtype = features.dtype
    # parent of every free token of frames 1.. among the free tokens of the frame before (official: ADTS rows and
    # columns at -1, frame 0 padded with -1)
    sims = torch.full((frames, n), -1.0, dtype=dtype, device=features.device)
    parent = torch.full((frames, n), -1, dtype=torch.long, device=features.device)
    if frames > 1:
        counts = free.sum(dim=1)
        src_offsets = torch.cat([counts.new_zeros(1), counts[1:].cumsum(0)])
        dst_offsets = torch.cat([counts.new_zeros(1), counts[:-1].cumsum(0)])
        prev_index = torch.nonzero(free[:-1])[:, 1]  # frame-local index of every destination row
        assign, best = best_match(
            features[1:][free[1:]], features[:-1][free[:-1]], "exact", "dot", src_offsets, dst_offsets
        )
        sims[1:][free[1:]] = best
        parent[1:][free[1:]] = prev_index[assign]
    merge = sims > threshold
    if int((~merge).sum()) < lower_bound:
        soft = sims.view(-1).topk(k=frames * n - lower_bound).values[-1]
        soft = max(soft, -1.0 + 1e-6)  # the official Python max of a 0-d tensor and a float
        merge = sims > soft
    # the official backward aggregation, frame by frame, in the features' dtype
    x = features.clone()
    counts = torch.ones(frames, n, dtype=dtype, device=features.device)
    divisor = torch.zeros(frames, n, dtype=dtype, device=features.device)
    for t in range(frames - 1, -1, -1):
        stay = ~merge[t]
        x[t][stay] = x[t][stay] / counts[t][stay].unsqueeze(-1)
        divisor[t][stay] = counts[t][stay]
        counts[t][stay] = 1
        if bool(merge[t].any()):
            one_hot = F.one_hot(parent[t][merge[t]], num_classes=n).to(dtype)
            x[t - 1] += torch.einsum("m n, m d -> n d", one_hot, x[t][merge[t]])
            # official: one_hot.sum(0), one per direct child; the mean needs each child's own count
            counts[t - 1] += one_hot.sum(dim=0) if official_sum else one_hot.T @ counts[t][merge[t]]
            counts[t][merge[t]] = 0
    # tree membership: a merged token's root is its parent's root (frames in order)
    flat = torch.arange(frames * n, device=features.device).view(frames, n)
    root_of = torch.where(free, flat, -1)
    for t in range(1, frames):
        joined = merge[t]
        root_of[t][joined] = root_of[t - 1][parent[t][joined]]
    roots = free & ~merge
    size = torch.bincount(root_of[free], minlength=frames * n).view(frames, n)
    return Trees(roots, root_of, size, divisor.masked_fill(~roots, 0), x)


def cluster_counts(roots_per_frame: list[int], target: int, exact: bool) -> list[int] | None:
    """Clusters per frame when `target` tokens must stand for the roots (None: no clustering, ratio >= 1).
    Official: ceil(n_f ratio), ratio = target / sum(n) in Python floats (a segment can keep a few more than
    `target`). `exact` (fixed-count mode): the exact ceil(n_f target / sum(n)), then one cluster less, repeatedly,
    where a frame exceeds its share n_f target / sum(n) the most (never below one cluster per frame with roots;
    ties to the first frame): exactly `target` in all (`target` >= the frames, as F_s B_tstm is)."""
    current = sum(roots_per_frame)
    ratio = target / current
    if ratio >= 1.0:
        return None
    if not exact:
        return [math.ceil(n * ratio) for n in roots_per_frame]
    counts = [-(-n * target // current) for n in roots_per_frame]
    for _ in range(sum(counts) - target):
        over = [(c * current - n * target, -f) for f, (c, n) in enumerate(zip(counts, roots_per_frame)) if c > 1]
        counts[-max(over)[1]] -= 1
    return counts


def dpc_merge(x: Tensor, num_clusters: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """The official DPC-kNN merge of one frame's roots x [n, D] into `num_clusters` tokens: k = min(clusters, 7),
    centres in score order, every root to its nearest centre (centres own theirs), cluster token = plain mean (the
    one-hot product, in x's dtype). Returns (tokens [c, D], centres [c] into x, labels [n])."""
    centres, dist = dpc_knn_centers(x, num_clusters, min(num_clusters, 7), generator)
    labels = assign_to_centers(dist, centres)
    one_hot = F.one_hot(labels, num_classes=num_clusters).to(x.dtype)
    tokens = torch.einsum("n c, n d -> c d", one_hot, x) / one_hot.sum(dim=0).unsqueeze(-1)
    return tokens, centres, labels


# --- one video -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FlashVIDPlan:
    """What the connect stage does to one video of F frames x N tokens (flat index = frame * N + token).

    anchors [K]: flat index of each output token (an ADTS pick, a tree root or a cluster centre), ascending: the
        order and positions the LLM sees; embeds [K, D]: the output features (official arithmetic);
    keep_weight [K], src [M], dst [M], src_weight [M]: the same outputs as a linear map of the input tokens
        (output j = keep_weight[j] x[anchors[j]] + sum of src_weight[e] x[src[e]] over dst[e] = j);
    segments: DySeg segment lengths; selected: the ADTS picks (flat, ascending); per_frame: (ADTS, TSTM) budget.
    """

    anchors: Tensor
    embeds: Tensor
    keep_weight: Tensor
    src: Tensor
    dst: Tensor
    src_weight: Tensor
    segments: list[int]
    selected: Tensor
    per_frame: tuple[int, int]

    def __len__(self) -> int:
        return int(self.anchors.numel())


def segment_plan(
    features: Tensor,
    attention: Tensor,
    offset: int,
    selected_count: int,
    merged_count: int,
    method: str,
    threshold: float,
    exact: bool,
    official_sum: bool,
    generator: torch.Generator | None,
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]], Tensor]:
    """ADTS + TSTM + DPC-kNN on one segment (official `segment_compression`): features [S, N, D], attention
    [S, N]; `offset` is the flat index of the segment's first token. Returns, as lists of parts: output anchors
    (flat), output features, [for every input token an output stands for: its flat index, its output's anchor, its
    coefficient]; and the ADTS picks (flat)."""
    frames, n, _ = features.shape
    device = features.device
    flat = offset + torch.arange(frames * n, device=device).view(frames, n)
    anchors, embeds, members, owners, coefs = [], [], [], [], []
    selected = torch.zeros(frames, n, dtype=torch.bool, device=device)
    if selected_count > 0:
        picks = select_tokens(features, attention, selected_count, method)
        selected.scatter_(1, picks, True)
        anchors.append(flat.gather(1, picks).view(-1))
        embeds.append(features.gather(1, picks.unsqueeze(-1).expand(-1, -1, features.shape[-1])).flatten(0, 1))
        members.append(anchors[-1])
        owners.append(anchors[-1])
        coefs.append(torch.ones(anchors[-1].numel(), device=device))
    picked = flat[selected]
    target = merged_count * frames
    if target == 0:
        return anchors, embeds, [members, owners, coefs], picked
    free = ~selected
    if frames > 1:
        lower_bound = (selected_count + merged_count) * frames
        trees = tree_merge(features, selected, threshold, lower_bound, official_sum)
        roots, root_of, divisor, x = trees.roots, trees.root_of, trees.divisor, trees.features
    else:  # one frame: every other token is its own root (official: every token of the frame, ADTS picks included)
        roots, root_of, divisor, x = free, torch.where(free, flat - offset, -1), free.to(features.dtype), features
    counts = cluster_counts(roots.sum(dim=1).tolist(), target, exact)
    node = flat[free]  # every merged token of the segment, and its root (local flat)
    node_root = root_of[free]
    root_divisor = divisor.view(-1).float()
    out_of_root = torch.full((frames * n,), -1, dtype=torch.long, device=device)  # output anchor of each root
    coef_of_root = torch.zeros(frames * n, device=device)  # 1 / (roots in its cluster)
    for t in range(frames):
        idx = torch.nonzero(roots[t]).flatten()
        if idx.numel() == 0:
            continue
        local = t * n + idx
        if counts is None:  # as many roots as the budget: each root is an output
            anchors.append(offset + local)
            embeds.append(x[t][idx])
            out_of_root[local] = offset + local
            coef_of_root[local] = 1.0
            continue
        tokens, centres, labels = dpc_merge(x[t][idx], counts[t], generator)
        anchors.append(offset + local[centres])
        embeds.append(tokens)
        out_of_root[local] = offset + local[centres][labels]
        coef_of_root[local] = 1.0 / torch.bincount(labels, minlength=counts[t]).float()[labels]
    alive = out_of_root[node_root] >= 0
    members.append(node[alive])
    owners.append(out_of_root[node_root][alive])
    coefs.append(coef_of_root[node_root][alive] / root_divisor[node_root][alive])
    return anchors, embeds, [members, owners, coefs], picked


def flashvid_plan(
    features: Tensor,
    attention: Tensor,
    *,
    retention_ratio: float,
    expansion: float = 1.25,
    alpha: float = 0.7,
    token_selection_method: str = "attn_div_v2",
    temporal_threshold: float = 0.8,
    do_segment: bool = True,
    segment_threshold: float = 0.9,
    min_segment_num: int = 8,
    complementary_segment: bool = True,
    exact: bool = False,
    official_tree_sum: bool = False,
    generator: torch.Generator | None = None,
) -> FlashVIDPlan | None:
    """FlashVID's connect stage on one video (official `flashvid_compression`): features [F, N, D] (the tokens of
    every frame, in grid order, model dtype), attention [F, N] (what each token receives in the vision tower).
    Returns None when the budget keeps every token (B >= N). `exact`: every segment keeps exactly F_s B tokens;
    `official_tree_sum`: the official tree divisor (`tree_merge`)."""
    frames, n, dim = features.shape
    selected_count, merged_count = frame_budget(n, retention_ratio, expansion, alpha)
    if selected_count + merged_count >= n:
        return None
    if do_segment:
        segments = segment_lengths(features.mean(1), segment_threshold, min_segment_num, complementary_segment)
    else:
        segments = [frames]
    anchors, embeds, members, owners, coefs, picked = [], [], [], [], [], []
    start = 0
    for length in segments:
        a, e, (m, o, c), p = segment_plan(
            features[start : start + length],
            attention[start : start + length],
            start * n,
            selected_count,
            merged_count,
            token_selection_method,
            temporal_threshold,
            exact,
            official_tree_sum,
            generator,
        )
        anchors += a
        embeds += e
        members += m
        owners += o
        coefs += c
        picked.append(p)
        start += length
    anchors_all = torch.cat(anchors)
    order = torch.argsort(anchors_all)
    anchors_all = anchors_all[order]
    embeds_all = torch.cat(embeds)[order]
    member, owner, coef = torch.cat(members), torch.cat(owners), torch.cat(coefs)
    slot = torch.full((frames * n,), -1, dtype=torch.long, device=features.device)
    slot[anchors_all] = torch.arange(anchors_all.numel(), device=features.device)
    own = member == owner
    keep_weight = torch.zeros(anchors_all.numel(), device=features.device)
    keep_weight[slot[member[own]]] = coef[own]
    return FlashVIDPlan(
        anchors=anchors_all,
        embeds=embeds_all,
        keep_weight=keep_weight,
        src=member[~own],
        dst=slot[owner[~own]],
        src_weight=coef[~own],
        segments=segments,
        selected=torch.sort(torch.cat(picked)).values,
        per_frame=(selected_count, merged_count),
    )


# --- the attention a token receives in the vision tower ------------------------------------------------------------


def attention_stat(geometry: FamilyGeometry) -> VisionStat:
    """SigLIP (LLaVA-OneVision / Video) and the Qwen towers: the last feature layer's attention each token receives
    (official: `attentions[-1].mean(1).mean(1)`); CLIP (LLaVA-NeXT-Video, not in the official code): the CLS row,
    which the paper's name "[CLS] attention" means and VisionZip, the code's model, reads on CLIP."""
    return VisionStat("cls", -1) if geometry.cls_tokens else VisionStat("received", -1)


def frame_attention(vision: dict, geometry: FamilyGeometry, size: tuple[int, int]) -> Tensor:
    """[F, H*W] per-frame token scores on the LLM token grid (float32): received attention / number of keys (the
    mean over queries), or the CLS row averaged over heads; pooled as the model pools its features (official
    `get_2dPool` on the attention). On the Qwen towers the merge unit's four patches are averaged."""
    stat = attention_stat(geometry)
    values = vision.get(stat)
    if values is None:
        raise RuntimeError(f"flashvid: the vision-tower statistic {stat} was not captured")
    values = values.float()
    values = values.mean(dim=1) if stat.kind == "cls" else values / values.shape[-1]
    return geometry.to_token_grid(values, size)


# --- the method ----------------------------------------------------------------------------------------------------


@vtc.method(
    "flashvid",
    paper="FlashVID: Efficient Video Large Language Models via Training-free Tree-based Spatiotemporal Token "
    "Merging (ICLR 2026)",
    url="https://arxiv.org/abs/2602.08024",
    summary="DySeg segments; per frame attention-weighted max-min diverse tokens + spatiotemporal trees merged "
    "and DPC-clustered; FastV-style pruning at LLM layer K",
    retention_note="retention is R, the mean fraction of visual tokens over the LLM layers on the official models "
    "(28 layers, K = 20, r = 0.3; Qwen3-VL 36 / 28 / 0.1): the connector keeps about ceil(1.25 R N) per frame, "
    "layer K keeps ceil(0.3 of them); adaptive (a few more per segment) unless fixed_count=True",
    # tiny models: K inside their 4 layers; random-weight frames all look like scene cuts, so DySeg cuts only
    # complementarily, into two segments, and the trees run
    test_params={"pruning_layer": 2, "segment_threshold": -1.0, "min_segment_num": 2},
    exempt={
        "retention": "retention is the mean over the layers of the official depths (expansion 1.25 pays for "
        "K = 20 of 28 layers); on 4-layer test models with K = 2 the mean is lower; tests/test_flashvid.py checks "
        "it on a 28-layer model",
        "retention_fixed": "as retention",
    },
)
class FlashVID(vtc.LayerPruner):
    """DySeg + ADTS + TSTM at the connector, FastV at LLM layer K (official: Fanziyang-v/FlashVID)."""

    retention_ratio: float | None = vtc.param(
        None, range="(0, 1]", doc="R: mean retention over the layers; default: the retention, else 0.25"
    )
    do_segment: bool = vtc.param(True, doc="DySeg; False: the whole video is one segment")
    segment_threshold: float = vtc.param(0.9, range="[-1, 1]", doc="DySeg: cut where consecutive frames' cos < it")
    min_segment_num: int | None = vtc.param(
        None, range="[1, inf)", doc="DySeg: at least this many segments; None = 8 LLaVA, 4 Qwen (scripts)"
    )
    complementary_segment: bool = vtc.param(True, doc="DySeg: add cuts at the lowest transitions up to min_segment_num")
    token_selection_method: str = vtc.param(
        "auto",
        choices=("auto", *SELECTIONS),
        doc='ADTS: "attn_div_v2" (LLaVA scripts), "attn_div" (v1, Qwen scripts), "attn", "div"; "auto" by family',
    )
    alpha: float = vtc.param(0.7, range="[0, 1]", doc="alpha: share of each frame's budget selected by ADTS")
    temporal_threshold: float = vtc.param(
        0.8, range="(-1, 1)", doc="tau_T: TSTM joins a token to its parent above this cosine"
    )
    expansion: float = vtc.param(
        1.25, range="(0, inf)", doc="e: the connector keeps B = ceil(N R e) per frame (pays for the layer-K pruning)"
    )
    pruning_layer: int | None = vtc.param(
        None, range="[1, inf)", doc="K: prune before layer K by layer K-1's attention; None = 20 (Qwen3-VL 28)"
    )
    llm_retention_ratio: float | None = vtc.param(
        None, range="(0, 1]", doc="r: layer K keeps ceil(V r) visual tokens; None = 0.3 (Qwen3-VL 0.1)"
    )
    fixed_count: bool = vtc.param(
        False, doc="every segment keeps exactly F_s B tokens (clusters split exactly, not ceil per frame)"
    )
    official_tree_sum: bool = vtc.param(
        False, doc="True: a tree's sum / (1 + its root's direct children), as the official code; default: its mean"
    )

    positions = "compact"  # LLaVA: the official code rebuilds inputs_embeds (Qwen always keeps its positions)
    whole_frames = True
    temporal = True  # segments and trees across frames: videos only
    retention_reference = "layer_mean"

    # --- parameters ---------------------------------------------------------------------------------------------
    def ratio(self) -> float:
        """R: the parameter, else the retention, else 0.25 (the wrapper's default)."""
        if self.retention_ratio is not None:
            return float(self.retention_ratio)
        return float(self.retention) if self.retention is not None else DEFAULT_RETENTION_RATIO

    def connect_settings(self, family: str) -> dict:
        """token_selection_method and min_segment_num: the parameters, else the official scripts' for the family."""
        official = OFFICIAL_CONNECT["mrope" if default_geometry(family).mrope else "rope"]
        method = self.token_selection_method
        return {
            "token_selection_method": official["token_selection_method"] if method == "auto" else method,
            "min_segment_num": official["min_segment_num"] if self.min_segment_num is None else self.min_segment_num,
        }

    def llm_stage(self, family: str | None) -> tuple[int, float]:
        """(K, r): the parameters, else the official scripts' for the family."""
        k, r = OFFICIAL_LLM_STAGE.get(family, DEFAULT_LLM_STAGE)
        return (
            k if self.pruning_layer is None else self.pruning_layer,
            r if self.llm_retention_ratio is None else float(self.llm_retention_ratio),
        )

    def prunes_in_llm(self, family: str | None) -> bool:
        """The layer-K pruning runs unless R = 1 (nothing is compressed) or r = 1."""
        return self.ratio() < 1.0 and self.llm_stage(family)[1] < 1.0

    def frame_tokens(self, num_tokens: int) -> int:
        """Tokens a frame of `num_tokens` keeps at the connector: B, or all of them when B >= N."""
        selected, merged = frame_budget(num_tokens, self.ratio(), self.expansion, self.alpha)
        return min(num_tokens, selected + merged)

    def retained_count(self, num_tokens, grid, family):
        """With fixed_count (or R = 1): T B at the connector, ceil(T B r) from layer K on; else None (adaptive)."""
        _, h, w = grid
        if self.ratio() >= 1.0:
            return num_tokens
        if not self.fixed_count or num_tokens % (h * w):
            return None
        connect = num_tokens // (h * w) * self.frame_tokens(h * w)  # whole frames (a sampler may drop frames)
        return llm_kept_count(connect, self.llm_stage(family)[1]) if self.prunes_in_llm(family) else connect

    def vision_stats(self, family):
        return [attention_stat(default_geometry(family))] if self.ratio() < 1.0 else []

    # --- connect ------------------------------------------------------------------------------------------------
    def connect(self, tokens, ctx):
        if getattr(ctx, "media", "video") == "image":
            raise ValueError(
                f"{self.card.name} applies to videos only (it cuts a video into segments and merges tokens across "
                "frames); an image has one frame"
            )
        n = len(tokens)
        _, h, w = tokens.grid
        if n == 0 or self.ratio() >= 1.0 or self.frame_tokens(h * w) >= h * w:
            return tokens
        frames, idx = tokens.whole_frames(self.card.name)
        attention = frame_attention(ctx.vision, ctx.geometry, (h, w))
        attention = attention[frames.to(attention.device)].to(tokens.embeds.device)
        settings = self.connect_settings(ctx.family)
        plan = flashvid_plan(
            tokens.embeds[idx],
            attention,
            retention_ratio=self.ratio(),
            expansion=self.expansion,
            alpha=self.alpha,
            temporal_threshold=self.temporal_threshold,
            do_segment=self.do_segment,
            segment_threshold=self.segment_threshold,
            complementary_segment=self.complementary_segment,
            exact=self.fixed_count,
            official_tree_sum=self.official_tree_sum,
            generator=ctx.generator,
            **settings,
        )
        if plan is None:
            return tokens
        ctx.report(plan=plan)
        flat = idx.reshape(-1)
        keep = flat[plan.anchors]
        merged = tokens.merge(keep, plan.dst, flat[plan.src], plan.src_weight, plan.keep_weight, embeds=plan.embeds)
        # side features (Qwen3-VL DeepStack) of the anchor itself, as the official `deepstack_visual_embed[keep]`
        return dataclasses.replace(merged, extras={name: t[keep] for name, t in tokens.extras.items()})

    # --- prefill: FastV at layer K ------------------------------------------------------------------------------
    def prefill(self, llm, ctx):
        """FastV's schedule (`vtc.LayerPruner`) with this family's K and r (`llm_stage`): the attention rows of
        layer K - 1, then `prune` at the start of layer K."""
        if llm.point != "layer_start" or not self.prunes_in_llm(llm.family):
            return
        k, _ = self.llm_stage(llm.family)
        if k >= llm.num_layers:
            raise ValueError(
                f"flashvid: pruning_layer={k} but the language model has only {llm.num_layers} layers (the in-LLM "
                f"pruning runs before layer K, ranked by layer K - 1); pass pruning_layer < {llm.num_layers}"
            )
        if llm.layer == k - 1:
            self.request(llm, ctx)
        elif llm.layer == k:
            self.prune(llm, ctx)

    def prune(self, llm, ctx):
        """Each video of each row keeps its top ceil(V r) visual tokens by the last prompt token's head-mean
        attention at layer K - 1 (official `fastv_prune`: topk, positions gathered)."""
        k, r = self.llm_stage(llm.family)
        scores = last_token_attention(llm, k - 1).float()
        layout = llm.layout
        keep = layout.valid.clone()
        pool, sizes, budgets, rows = [], [], [], []
        for b in range(keep.shape[0]):
            for slots in layout.video_slots(b).values():
                pool.append(b * keep.shape[1] + slots)
                sizes.append(int(slots.numel()))
                budgets.append(llm_kept_count(int(slots.numel()), r))
                rows.append(b)
        if pool:
            flat = torch.cat(pool)
            offsets = torch.tensor([0, *sizes], device=flat.device).cumsum(0)
            kept = segmented_topk(scores.flatten()[flat.to(scores.device)], offsets, torch.tensor(budgets))
            keep.view(-1)[flat] = False
            keep.view(-1)[flat[kept.to(flat.device)]] = True
        for b in range(keep.shape[0]):
            ctx.report(kept=sum(n for n, row in zip(budgets, rows) if row == b))
        llm.keep(keep)
