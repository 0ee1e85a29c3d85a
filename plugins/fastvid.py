"""FastVID: "FastVID: Dynamic Density Pruning for Fast Video Large Language Models" (Shen et al., NeurIPS 2025).
arXiv: https://arxiv.org/abs/2503.11187. Official code: LunarShen/FastVID (LLaVA-OneVision:
`fastvid_llavaonevision/LLaVA-NeXT/llava/model/language_model/modeling_qwen2.py`, `llava/model/llava_arch.py`,
`llava/model/multimodal_encoder/siglip_encoder.py`; LLaVA-Video: the same files under `fastvid_llavavideo/`;
Qwen2.5-VL: `fastvid_qwen25vl/lmms-eval/lmms_eval/models/qwenvlutils/modeling_qwen2_5_vl.py`).

DySeg cuts the video where consecutive frame-level features differ most (the c-1 lowest similarities, plus every
similarity below tau). STPrune then keeps, per frame, the most salient tokens (ATS: vision-attention top-k) and
a set of density-peak anchors (DTM: DPC-kNN, k = 4) placed on every p-th frame of a segment (counted from its
end); every other token of the segment is merged into its most cosine-similar anchor with
`anchor <- w anchor + (1 - w) mean(assigned)`, `w = max(1 / (count + 1), beta)`. Positions are kept.
Stage: connect (the official code runs inside the LLM forward, before layer 0, on the input embeddings).

Three official versions, all implemented: the LLaVA-OneVision parallel version (fixed salient / context split
per frame, anchors merge the non-salient tokens of their segment; `version="llava"`, the default on the LLaVA
families), the LLaVA-Video sequential version (segment budgets spread over every frame of the segment, merging
every non-retained token of the segment; `version="llava_video"`, chosen by hand: LLaVA-Video checkpoints load
in the LLaVA-OneVision HF class) and the Qwen2.5-VL version (as LLaVA-Video, plus sub-segments cut at
similarity < DySeg_ignore and per-frame caps; the default on the Qwen families).

Salience and frame feature. The official LLaVA code reads both from SigLIP's attention-pooling (MAP) head, which
HF builds LLaVA-OneVision's tower without (`vision_use_head=False`). With `head="google/siglip-so400m-patch14-384"`
(or a local SigLIP checkpoint) vtc loads that head and its `post_layernorm` from the checkpoint, as the official
`SigLipVisionAbstract` does, and runs them on the tower output the projector receives (the vision statistic
`VisionStat("features", -1)`): the probe's head-averaged attention over the 27 x 27 patches, pooled to the token
grid like the features, is the salience; the pooled output (after the MLP residual) is the frame feature.
Without `head` (the fallback) the salience is the last layer's mean received attention (resized the same way;
LLaVA-NeXT-Video: the CLS row, head-mean, 2x2-averaged) and the frame feature is the mean of the frame's tokens
(as the Qwen2.5-VL version computes it). Adaptive count by default; `fixed_count=True` keeps exactly sum over
frames of int(n r), topped up / trimmed by salience.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Callable, ClassVar

import torch

import vtc
from vtc.core.geometry import FamilyGeometry, default_geometry
from vtc.core.loading import load_pretrained
from vtc.core.vision_stats import VisionStat
from vtc_kernels import adjacent_frame_similarity, dpc_knn_scores, reconcile_count
from vtc_kernels.matching import best_match
from vtc_kernels.merge import merge_into_anchors

Tensor = torch.Tensor

# what the head reads: the feature layer's hidden states [F, L, D_vision], the tensor the projector receives
# (`hidden_states[vision_feature_layer]`, before `post_layernorm`)
FEATURES = VisionStat("features", -1)
HEAD_FAMILIES = "llava_onevision (LLaVA-OneVision and LLaVA-Video checkpoints: SigLIP towers without a CLS token)"


# --- DySeg --------------------------------------------------------------------------------------------------------


def normalize_rows(x: Tensor) -> Tensor:
    """x / ||x|| row-wise, in x's dtype (as the official code)."""
    return x / x.norm(dim=-1, keepdim=True)


def adjacent_similarity(normalized: Tensor, frame_offsets: Tensor | None = None) -> Tensor:
    """Cosine similarity of consecutive rows of L2-normalised features [F, D] -> [F - 1]; with `frame_offsets`
    ([S + 1] bounds of consecutive segments) only pairs inside a segment, segment after segment."""
    return adjacent_frame_similarity(normalized, formula="dot", frame_offsets=frame_offsets)


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


def spread(total: int, count: int) -> list[int]:
    """`total` split over `count` slots as evenly as possible, the remainder to the first slots."""
    return [total // count + (1 if i < total % count else 0) for i in range(count)]


def every_pth_from_end(amounts: list[int], count: int, p: int) -> list[int]:
    """`amounts` (one per holder) placed on slots count-1, count-1-p, ... (the first amount on the last slot),
    0 elsewhere: the official loop fills slots 0, p, 2p, ... in order, then reverses the list."""
    out, j = [], 0
    for i in range(count):
        if i % p == 0:
            out.append(amounts[j])
            j += 1
        else:
            out.append(0)
    out.reverse()
    return out


def llava_video_segment_quotas(retain: list[int], d: float, p: int) -> tuple[list[int], list[int]]:
    """(salient, context) per frame of one segment in the LLaVA-Video version.

    retain: int(n_f r) per frame. seg_ctx = int(sum(retain) d) (no floor of 1), seg_sal = sum(retain) - seg_ctx.
    One frame: (seg_sal, seg_ctx). Several: the salient quota spread evenly over every frame (remainder first),
    the context quota over the frames l-1, l-1-p, ... (ceil(l / p) of them, remainder to the last); no caps."""
    seg_retain = sum(retain)
    seg_ctx = int(seg_retain * d)
    seg_sal = seg_retain - seg_ctx
    length = len(retain)
    if length == 1:
        return [seg_sal], [seg_ctx]
    holders = (length + p - 1) // p
    return spread(seg_sal, length), every_pth_from_end(spread(seg_ctx, holders), length, p)


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
    sal_sub = spread(seg_sal, count)
    ctx_sub = every_pth_from_end(spread(seg_ctx, (count + p - 1) // p), count, p)
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
    assign = best_match(members, anchors, normalize="exact")[0]  # normalize_rows, then argmax
    counts = torch.bincount(assign, minlength=anchors.shape[0]).to(members.dtype)  # what one_hot.sum(0) gives
    weight = (1 / (counts + 1)).clamp(min=beta)
    merged = merge_into_anchors(anchors, members, assign, rule="blend", beta=beta, summation="one_hot")
    return merged, assign, counts, weight


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


def parallel_stprune(
    embeds: Tensor,
    frames: list[Tensor],
    salience: Tensor,
    sizes: list[int],
    r: float,
    d: float,
    p: int,
    beta: float,
    k: int,
    generator: torch.Generator | None,
) -> FastVIDPlan:
    """STPrune of the LLaVA-OneVision parallel version on the DySeg segments `sizes`.

    Per frame a fixed salient / context split (`llava_frame_budget`); a segment's context budget goes to its anchor
    frames (`llava_anchor_quotas`), whose density anchors (in score order) merge the non-salient tokens of the whole
    segment (a single-frame segment: of the frame)."""
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


def sequential_stprune(
    embeds: Tensor,
    frames: list[Tensor],
    salience: Tensor,
    sizes: list[int],
    quotas,
    beta: float,
    k: int,
    generator: torch.Generator | None,
) -> FastVIDPlan:
    """STPrune of the sequential versions (LLaVA-Video, Qwen2.5-VL) on the DySeg segments `sizes`.

    `quotas(segment, seg_frames)` gives a segment's (salient, context) per frame. Per frame: the top-salient
    tokens, then density anchors (sorted by index) among the rest; each anchor set absorbs every token of the
    segment that is neither salient nor one of its own anchors."""
    salient_all: list[Tensor] = []
    merges: list[Merge] = []
    sal_frames: list[int] = []
    ctx_frames: list[int] = []
    offset = 0
    for segment, length in enumerate(sizes):
        seg_frames = frames[offset : offset + length]
        sal, ctx = quotas(segment, seg_frames)
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


def sub_segments(normalized: Tensor, sizes: list[int], ignore: float) -> list[list[int]]:
    """The Qwen2.5-VL version's sub-segments: each DySeg segment cut again after every adjacent-frame similarity
    below DySeg_ignore (one call for every segment's similarities: segment s, first frame f, has its length - 1
    pairs from f - s on)."""
    bounds = [0] + list(itertools.accumulate(sizes))
    seg_sim = adjacent_similarity(normalized, torch.tensor(bounds, device=normalized.device))
    out, pair = [], 0
    for length in sizes:
        if length == 1:
            out.append([1])
        else:
            sim = seg_sim[pair : pair + length - 1]
            out.append(sizes_from_cuts(torch.nonzero(sim < ignore).flatten().tolist(), length))
        pair += length - 1
    return out


def _llava_video_quotas(retain, frame_tokens, sub_sizes, d, p):
    return llava_video_segment_quotas(retain, d, p)  # every frame its own holder: no sub-segments, no caps


# --- the official versions ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Version:
    """What differs between FastVID's official versions; DySeg, the DTM merge and the rest are shared.

    ratio, tau: the official scripts' retention_ratio r and DySeg_tau.
    parallel: STPrune with a fixed salient / context split per frame whose anchor frames merge their segment
        (LLaVA-OneVision, `parallel_stprune`); else the sequential STPrune (`sequential_stprune`) with `quotas`.
    quotas: the sequential versions' segment rule, (retain, frame_tokens, sub_sizes, d, p) -> (salient, context)
        per frame of the segment.
    sub_segments: segments are cut again at DySeg_ignore, and `quotas` gets the sub-segment sizes (Qwen2.5-VL).
    """

    name: str
    ratio: float
    tau: float
    parallel: bool = False
    quotas: Callable[..., tuple[list[int], list[int]]] | None = None
    sub_segments: bool = False


VERSIONS = {
    "llava": Version("llava", ratio=0.10, tau=0.9, parallel=True),
    "llava_video": Version("llava_video", ratio=0.10, tau=0.9, quotas=_llava_video_quotas),
    "qwen2_5_vl": Version("qwen2_5_vl", ratio=0.27, tau=0.84, quotas=qwen25_segment_quotas, sub_segments=True),
}


def fastvid_plan(
    version: Version,
    embeds: Tensor,
    frames: list[Tensor],
    salience: Tensor,
    global_features: Tensor,
    r: float,
    *,
    c: int = 8,
    tau: float | None = None,
    ignore: float = 0.95,
    d: float = 0.4,
    p: int = 4,
    beta: float = 0.6,
    k: int = 4,
    generator: torch.Generator | None = None,
) -> FastVIDPlan:
    """FastVID in the official `version` on one video: DySeg on the frame features, then STPrune and DTM.

    embeds [N, D]; frames: token indices of each frame (spatial order); salience [N]; global_features [F, D];
    r: retention_ratio (int(n r) tokens per frame); c, tau: DySeg_c, DySeg_tau (None: the version's); ignore:
    DySeg_ignore (versions with sub-segments); d: STPrune_d; p: DTM_p; beta: DTM_beta; k: the DPC-kNN k."""
    normalized = normalize_rows(global_features)
    sizes = dyseg(normalized, c, version.tau if tau is None else tau)
    if version.parallel:
        return parallel_stprune(embeds, frames, salience, sizes, r, d, p, beta, k, generator)
    subs = sub_segments(normalized, sizes, ignore) if version.sub_segments else None

    def quotas(segment: int, seg_frames: list[Tensor]) -> tuple[list[int], list[int]]:
        tokens = [int(idx.numel()) for idx in seg_frames]
        return version.quotas([int(n * r) for n in tokens], tokens, subs[segment] if subs else None, d, p)

    return sequential_stprune(embeds, frames, salience, sizes, quotas, beta, k, generator)


# --- salience maps on the LLM token grid --------------------------------------------------------------------------


def salience_stat(geometry: FamilyGeometry) -> VisionStat:
    if not geometry.has_prepool_grid:
        return VisionStat("mean_query", -1)  # FastVID's own Qwen2.5-VL score (last, full-attention block)
    if geometry.cls_tokens:
        return VisionStat("cls", -1)  # CLIP: the CLS query, the closest analogue of the SigLIP MAP probe
    return VisionStat("received", -1)


def salience_map(vision: dict, geometry: FamilyGeometry, size: tuple[int, int]) -> Tensor:
    """Per-frame salience [F, H*W] on the token grid."""
    stat = vision[salience_stat(geometry)].float()
    if not geometry.has_prepool_grid:
        return stat
    if geometry.cls_tokens:  # CLS query (the CLIP analogue of the MAP probe), head mean
        stat = stat.mean(dim=1)
    else:  # mean attention received (mean over queries), resized like the official MAP attention
        stat = stat / stat.shape[-1]
    return geometry.to_token_grid(stat, size)


# --- SigLIP's attention-pooling (MAP) head -----------------------------------------------------------------------


def head_applies(geometry: FamilyGeometry) -> bool:
    """SigLIP's MAP head fits towers whose patch grid the model pools and that have no CLS token (LLaVA-OneVision
    and LLaVA-Video checkpoints); CLIP towers (LLaVA-NeXT-Video) and Qwen towers have no such head."""
    return geometry.has_prepool_grid and not geometry.cls_tokens


def map_head_outputs(post_layernorm: torch.nn.Module, head: torch.nn.Module, features: Tensor) -> tuple[Tensor, Tensor]:
    """SigLIP's MAP head on tower features [F, L, D], as the official `SigLipVisionAbstract`: `post_layernorm`,
    then the head's steps with the probe's attention weights kept (HF's head discards them), in the features' dtype.

    Returns (pooled [F, D]: the probe's output after the MLP residual, `hidden[:, 0]`; weights [F, L]: its attention
    over the L tokens, softmax per head then mean over heads, `need_weights=True, average_attn_weights=True`)."""
    x = post_layernorm(features)
    probe = head.probe.repeat(x.shape[0], 1, 1)
    out, weights = head.attention(probe, x, x, need_weights=True, average_attn_weights=True)
    pooled = out + head.mlp(head.layernorm(out))
    return pooled[:, 0], weights[:, 0]


def load_map_head(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(post_layernorm, MAP head) of the SigLIP checkpoint `name` (hub name or local path), in float32 (cast to the
    features' dtype on use); the rest of the tower is dropped. A SiglipModel checkpoint (vision + text) loads too:
    transformers reports its text weights as unexpected."""
    try:
        model, info = load_pretrained("siglip_vision", name, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - every loading failure gets the same clear message
        raise ValueError(
            f"fastvid: could not load the SigLIP MAP head from head={name!r} ({type(err).__name__}: {err}); pass a "
            "SigLIP checkpoint name or local path, e.g. 'google/siglip-so400m-patch14-384'"
        ) from err
    vision = getattr(model, "vision_model", model)  # older transformers wrap the tower in `vision_model`
    head = getattr(vision, "head", None)
    if head is None or not hasattr(head, "probe") or not hasattr(vision, "post_layernorm"):
        raise ValueError(
            f"fastvid: head={name!r} has no SigLIP attention-pooling head (its config has vision_use_head=False, or "
            "it is not a SigLIP vision checkpoint); use the base SigLIP checkpoint, e.g. "
            "'google/siglip-so400m-patch14-384'"
        )
    missing = sorted(k for k in info.get("missing_keys", ()) if {"head", "post_layernorm"} & set(k.split(".")))
    if missing:
        raise ValueError(f"fastvid: head={name!r} lacks the weights {missing} (they would be random)")
    modules = (vision.post_layernorm, head)
    for module in modules:
        module.requires_grad_(False).eval()
    return modules


class MAPHead:
    """`post_layernorm` + MAP head of a SigLIP checkpoint, run in the dtype and on the device of the features."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.post_layernorm, self.head = load_map_head(name)
        self._cast: dict[tuple, tuple[torch.nn.Module, torch.nn.Module]] = {}

    @property
    def width(self) -> int:
        return int(self.head.probe.shape[-1])

    def __call__(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """features [F, L, D] -> (pooled [F, D], weights [F, L]) (`map_head_outputs`)."""
        if features.shape[-1] != self.width:
            raise ValueError(
                f"fastvid: the MAP head of head={self.name!r} is {self.width} wide but the vision tower's features "
                f"are {features.shape[-1]}; use the SigLIP checkpoint the model's tower comes from"
            )
        key = (features.device, features.dtype)
        if key not in self._cast:
            self._cast[key] = tuple(
                copy.deepcopy(m).to(device=features.device, dtype=features.dtype)
                for m in (self.post_layernorm, self.head)
            )
        with torch.no_grad():
            return map_head_outputs(*self._cast[key], features)


# --- the method ---------------------------------------------------------------------------------------------------


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


@vtc.method(
    "fastvid",
    paper="FastVID: Dynamic Density Pruning for Fast Video Large Language Models (NeurIPS 2025)",
    url="https://arxiv.org/abs/2503.11187",
    summary="segment by frame similarity; keep salient tokens, merge the rest into density-peak anchors",
    retention_note="adaptive: each frame keeps int(n * retention), the DySeg/DTM quotas round down, so a "
    "few tokens per segment below retention; fixed_count=True keeps exactly sum(int(n * retention))",
)
class FastVID(vtc.Method):
    """DySeg + STPrune + DTM in the official version of the family (official: LunarShen/FastVID)."""

    temporal = True  # DySeg cuts the video into segments of frames: videos only

    retention_ratio: float | None = vtc.param(
        None, range="(0, 1]", doc="r: per-frame budget int(n r); default retention, else 0.10 LLaVA / 0.27 Qwen"
    )
    dyseg_c: int = vtc.param(8, range="[1, inf)", doc="c (DySeg_c): the c-1 lowest adjacent-frame similarities cut")
    dyseg_tau: float | None = vtc.param(
        None, range="[-1, 1]", doc="tau (DySeg_tau): also cut below tau; None = 0.9 LLaVA, 0.84 Qwen2.5-VL"
    )
    dyseg_ignore: float = vtc.param(
        0.95, range="[-1, 1]", doc="DySeg_ignore (Qwen2.5-VL version): sub-segment cut inside a segment"
    )
    stprune_d: float = vtc.param(0.4, range="[0, 1]", doc="d (STPrune_d): fraction of the budget given to context")
    dtm_p: int = vtc.param(
        4, range="[1, inf)", doc="p (DTM_p): anchor frames every p frames of a segment, from its end"
    )
    dtm_beta: float = vtc.param(0.6, range="[0, 1]", doc="beta (DTM_beta): lower bound of the anchor's merge weight")
    knn: int = vtc.param(4, range="[1, inf)", doc="k of the DPC-kNN density (hard-coded 4 in the official code)")
    version: str = vtc.param(
        "auto",
        choices=("auto", *VERSIONS),
        doc='"llava" (LLaVA-OV parallel), "llava_video", "qwen2_5_vl"; "auto": llava / qwen2_5_vl by family',
    )
    fixed_count: bool = vtc.param(False, doc="keep exactly sum_f int(n_f r) tokens, reconciled by salience (serving)")
    head: str | None = vtc.param(
        None, doc="SigLIP checkpoint (hub name or path) whose MAP head gives salience + frame feature"
    )

    # Families: FastVID reads the tower's statistics on the LLM token grid, through Qwen's 2x2 merge units (the
    # "mean_query" statistic) or a pooled patch grid ("received" / "cls"); `vision_stats` asks for the one the
    # family has, and a family offering neither (InternVL) is refused by its statistics, so `card.families` omits it.

    _head: ClassVar[MAPHead | None] = None  # the MAP head of `head`, loaded once (at vtc.patch or first use)

    def validate(self):
        if self.head is not None and not self.head.strip():
            raise ValueError(f"fastvid: head must be a SigLIP checkpoint name or path, got {self.head!r}")

    def vision_stats(self, family: str) -> list[VisionStat]:
        geometry = default_geometry(family)
        if self.head is None:
            return [salience_stat(geometry)]
        self.check_head_family(geometry)
        self.map_head()  # load now, so a checkpoint that does not load fails at vtc.patch
        return [FEATURES]

    def check_head_family(self, geometry: FamilyGeometry) -> None:
        if not head_applies(geometry):
            raise ValueError(
                f"fastvid: head={self.head!r} (SigLIP's attention-pooling head) applies to {HEAD_FAMILIES}, "
                f"not to {geometry.family}; drop head= (the salience is then the vision tower's attention and the "
                "frame feature the mean of the frame's tokens)"
            )

    def map_head(self) -> MAPHead:
        """The MAP head of `head`, loaded on first use and kept by this method object."""
        if self._head is None:
            self._head = MAPHead(str(self.head))
        return self._head

    def head_outputs(self, ctx, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """(salience [F, H*W] on the token grid, frame features [F, D_vision]) from the MAP head: the probe's
        attention over the patch grid, pooled as the model pools its features (LLaVA-OneVision: bilinear 27x27 ->
        14x14, the official `get_attn_2dPool`), and the pooled output."""
        geometry = ctx.geometry
        self.check_head_family(geometry)
        features = ctx.vision.get(FEATURES)
        if features is None:
            raise RuntimeError(
                "fastvid: head= reads VisionStat('features', -1) from ctx.vision, but this context has none"
            )
        pooled, weights = self.map_head()(features)
        salience = geometry.pool_grid(geometry.patch_map(weights), size)  # in the features' dtype, as official
        return salience.float(), pooled

    def version_for(self, family: str) -> Version:
        """The LLaVA-OneVision parallel version on families that pool a tower patch grid, else the Qwen2.5-VL one;
        the `version` parameter overrides it ("llava_video" only by hand)."""
        if self.version != "auto":
            return VERSIONS[self.version]
        return VERSIONS["llava" if default_geometry(family).has_prepool_grid else "qwen2_5_vl"]

    def ratio(self, version: Version) -> float:
        if self.retention_ratio is not None:
            return float(self.retention_ratio)
        if self.retention is not None:
            return float(self.retention)
        return version.ratio

    def retained_count(self, num_tokens: int, grid, family: str) -> int | None:
        r = self.ratio(self.version_for(family))
        if r >= 1.0:
            return num_tokens
        return fixed_target(num_tokens, grid, r) if self.fixed_count else None

    def connect(self, tokens, ctx):
        version = self.version_for(ctx.family)
        r = self.ratio(version)
        n = len(tokens)
        if r >= 1.0 or n == 0:  # every token kept as it is
            return tokens
        t, h, w = tokens.grid
        patch = tokens.patch
        device = tokens.embeds.device
        frames = tokens.frame_groups("patch")
        if self.head is not None:
            # the official salience and frame feature: SigLIP's MAP head on the tower output
            grid_salience, frame_features = self.head_outputs(ctx, (h, w))
            present = torch.stack([tokens.frame[idx[0]] for idx in frames]).to(frame_features.device)
            global_features = frame_features[present]
        else:
            # fallback: the tower's attention, and the mean of the frame's tokens in the model dtype (the
            # Qwen2.5-VL version's frame feature)
            grid_salience = salience_map(ctx.vision, ctx.geometry, (h, w))
            global_features = torch.stack([tokens.embeds[idx].mean(dim=0) for idx in frames])
        salience = grid_salience.to(device)[tokens.frame, patch]
        plan = fastvid_plan(
            version,
            tokens.embeds,
            frames,
            salience,
            global_features,
            r,
            c=self.dyseg_c,
            tau=self.dyseg_tau,
            ignore=self.dyseg_ignore,
            d=self.stprune_d,
            p=self.dtm_p,
            beta=self.dtm_beta,
            k=self.knn,
            generator=ctx.generator,
        )
        target = fixed_target(n, tokens.grid, r) if self.fixed_count else None
        ctx.report(plan=plan)
        return assemble(tokens, plan, salience, target, h * w)
