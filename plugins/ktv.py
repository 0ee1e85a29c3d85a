"""KTV: "Keyframes and Key Tokens Selection for Efficient Training-Free Video LLMs" (AAAI 2026, arXiv 2602.03615).
Official code: hktk07/KTV (`keyframe_select_new.py`, `cluster_keyframe_and_order.py::video_frame_clustering` and
`cluster`, `run_inference_multiple_choice_qa.py`, `ktv/llava/model/llava_arch.py::encode_images`,
`ktv/llava/model/multimodal_encoder/clip_encoder.py::token_prune`).

Stage 1, keyframes (sample; question-agnostic): up to 5,400 frames uniformly, DINOv2 `pooler_output` features,
k-means with K clusters (k-means++, 10 inits, seed 0), the frame nearest each centroid; when two centroids pick the
same frame, K uniform frames instead. The frames go to the model in temporal order.
Per-frame budgets (question-aware): CLIP ranks the keyframes by their similarity to the question (a question of
more than 40 words is cut to words 10..49), and each rank has a token budget from the official tables (6 frames
at 504 tokens: 144 for the best frame, 72 for the five others).
Stage 2, key tokens (connect): per frame, `s = alpha * minmax(I) + (1 - alpha) * (1 - minmax(Rd))` with `I` the
CLS query's pre-softmax attention logits at the vision tower's last layer and `Rd` each token's mean cosine
similarity to the frame's other tokens; the frame keeps its budget of highest scores, in spatial order.
`ktv-keyframes` is stage 1 alone (no budgets, no tokens removed), to compose with any connect method.

Where vtc differs (docs/methods/ktv.md):
- `retention` is the fraction of visual tokens the LLM sees: the total `round(retention * N)` is shared between the
  frames in the proportions of the official table (504 / 936 / 1872 tokens over 6 or 12 frames; extended to other
  frame counts); without a retention the official table's own fraction of a 576-token frame applies.
- The official host feeds each frame as one 576-token LLaVA-1.6 image; vtc selects on the LLM token grid of the
  family (LLaVA-NeXT-Video: 12 x 12 after the 2 x 2 pooler), with `I` and the features pooled the way the model
  pools. `I` is recovered exactly (up to the affine map min-max removes) from the captured CLS attention row:
  the head mean of log-probabilities. Towers without a CLS token (SigLIP, Qwen, InternViT): `I` is the mean
  attention each token receives at the last vision layer (the HoliTom / StreamingTOM reading).
- `Rd` is computed on the vision features the projector receives where the family offers them (LLaVA), else on the
  LLM tokens (Qwen's merger output, InternVL's projector output).
- Min-max of a constant gives zeros (the official code divides by zero); with no question, or with the ordering
  off, every frame gets the same budget (the official run without a keyframe order).
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction
from typing import Any, Sequence

import numpy as np
import torch

import vtc
from vtc.core.bases import fraction_count
from vtc.core.families import get_family
from vtc.core.geometry import default_geometry
from vtc.core.vision_stats import VisionStat
from vtc.media.encoders import clip_encoder, frame_features, image_encoder, similarity_logits

Tensor = torch.Tensor

MAX_CANDIDATES = 5400  # keyframe_select_new.py: target_frames
OFFICIAL_FRAME_TOKENS = 576  # one 336-px LLaVA-1.6 image with --image_aspect_ratio resize
CLIP_LAST_LAYER = 23  # token_prune: layers[23] of CLIP ViT-L/14 (the layer after LLaVA's feature layer -2)
LONG_QUESTION_WORDS = 40  # cluster(): a longer question is cut to words[10:50] for CLIP
FEATURES = VisionStat("features", -1)


# --- stage 1: keyframes -------------------------------------------------------------------------------------------


def candidate_frames(total: int, limit: int = MAX_CANDIDATES) -> list[int]:
    """The frames the clustering sees: all of them up to `limit`, else `linspace(0, total - 1, limit)` truncated
    (`get_frame_indices`)."""
    if total < 1:
        raise ValueError(f"the video has no frames (total={total})")
    if total <= limit:
        return list(range(total))
    return np.linspace(0, total - 1, limit, dtype=int).tolist()


def uniform_keyframes(total: int, count: int) -> list[int]:
    """The fallback when the clustering's picks collide: `int` of `linspace(0, total, count, endpoint=False)`."""
    return [int(v) for v in np.linspace(0, float(total), count, endpoint=False)]


def kmeans_picks(features: np.ndarray, count: int) -> tuple[list[int], np.ndarray]:
    """K-means of the frame features ([n, D]; `KMeans(count, init="k-means++", n_init=10, random_state=0)`) and,
    for each centroid in turn, the row nearest to it (Euclidean; the first on ties). Returns the picks (rows, in
    centroid order, possibly repeated) and each row's distance to its nearest centroid."""
    try:
        from sklearn.cluster import KMeans
        from sklearn.exceptions import ConvergenceWarning
    except ImportError as err:
        raise ImportError("ktv clusters frames with scikit-learn's KMeans: pip install 'vtc[samplers]'") from err
    x = np.asarray(features)
    if x.ndim != 2 or len(x) < count:
        raise ValueError(f"k-means of {count} clusters needs at least {count} feature rows [n, D], got {x.shape}")
    with warnings.catch_warnings():
        # fewer distinct frames than clusters: the picks collide and the caller falls back to uniform frames
        warnings.simplefilter("ignore", ConvergenceWarning)
        kmeans = KMeans(n_clusters=count, init="k-means++", n_init=10, random_state=0).fit(x)
    distances = np.linalg.norm(x[None, :, :] - kmeans.cluster_centers_[:, None, :], axis=2)  # [K, n]
    return [int(i) for i in distances.argmin(axis=1)], distances.min(axis=0)


def keyframes(
    features: np.ndarray, candidates: Sequence[int], total: int, count: int
) -> tuple[list[int], bool, np.ndarray | None]:
    """KTV's keyframes of a video of `total` frames from the candidates' features: the candidate nearest each
    k-means centroid, or `uniform_keyframes` when two centroids pick the same frame (or there are fewer candidates
    than keyframes, which k-means cannot cluster). Returns (frames sorted, whether the uniform fallback was taken,
    each candidate's distance to its nearest centroid or None without clustering)."""
    if count < 1:
        raise ValueError(f"number of keyframes must be at least 1, got {count}")
    if len(candidates) != len(features):
        raise ValueError(f"{len(features)} feature rows for {len(candidates)} candidate frames")
    if len(candidates) < count:
        return uniform_keyframes(total, count), True, None
    picks, distance = kmeans_picks(features, count)
    frames = [int(candidates[p]) for p in picks]
    if len(set(frames)) != count:
        return uniform_keyframes(total, count), True, distance
    return sorted(frames), False, distance


# --- per-frame budgets ----------------------------------------------------------------------------------------------


def ordering_text(question: str) -> str:
    """The text CLIP compares the keyframes with: the question, or words 10..49 of it when it has more than 40
    (words split on single spaces, as the official `prompt.split(' ')`)."""
    words = question.split(" ")
    return " ".join(words[10:50]) if len(words) > LONG_QUESTION_WORDS else question


def frame_ranks(similarity: Sequence[float]) -> list[int]:
    """Rank of each frame (0 = the most similar to the question): positions in the descending order of the
    similarities (`topk` over all frames; ties keep the earlier frame first)."""
    order = np.argsort(-np.asarray(similarity, dtype=np.float64), kind="stable")
    ranks = np.empty(len(order), dtype=int)
    ranks[order] = np.arange(len(order))
    return ranks.tolist()


def rank_units(count: int, tokens_num: int) -> list[int]:
    """Relative budgets by rank for `count` frames, the shape of the official tables extended to any count: with
    n = max(1, round(count / 6)), at 504 tokens the n best frames get 2 and the others 1; at 936 / 1872 the n best
    get 4, the n worst 1 and the others 2 (6 frames: 2,1,1,1,1,1 and 4,2,2,2,2,1, as the official tables)."""
    top = max(1, round(count / 6))
    top = min(top, count)
    if tokens_num == 504:
        return [2] * top + [1] * (count - top)
    bottom = min(top, count - top)
    return [4] * top + [2] * (count - top - bottom) + [1] * bottom


def rank_budgets(count: int, tokens_num: int = 504) -> list[int]:
    """Tokens per rank on 576-token frames: the official tables of `encode_images` (6 frames: 504 -> 144 + 5 x 72,
    936 -> 288 + 4 x 144 + 72, 1872 -> 576 + 4 x 288 + 144; 12 frames, whatever `tokens_num`: 2 x 288 + 8 x 144 +
    2 x 72), and for other frame counts `tokens_num` shared by `rank_units`, at most 576 a frame."""
    if count == 12:
        return [288] * 2 + [144] * 8 + [72] * 2
    units = rank_units(count, tokens_num)
    return apportion(tokens_num, units, [OFFICIAL_FRAME_TOKENS] * count)


def apportion(total: int, weights: Sequence[float], caps: Sequence[int]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders; ties to the larger weight, then the earlier
    entry), each entry at most its cap (what a cap cuts goes to the others); all weights 0 share equally. The total
    is at most `sum(caps)`."""
    if len(weights) != len(caps):
        raise ValueError(f"{len(weights)} weights for {len(caps)} caps")
    if any(w < 0 for w in weights):
        raise ValueError(f"budget weights must be >= 0, got {list(weights)}")
    counts = [0] * len(caps)
    remaining = min(int(total), int(sum(caps)))
    open_ = [i for i, c in enumerate(caps) if c > 0]
    while remaining > 0 and open_:
        w = [Fraction(weights[i]) for i in open_]
        if sum(w) == 0:
            w = [Fraction(1)] * len(open_)
        raw = [remaining * x / sum(w) for x in w]
        capped = [i for i, r in zip(open_, raw) if r >= caps[i]]
        if capped:
            for i in capped:
                counts[i] = caps[i]
                remaining -= caps[i]
            open_ = [i for i in open_ if i not in capped]
            continue
        share = [math.floor(r) for r in raw]
        order = sorted(range(len(open_)), key=lambda j: (-(raw[j] - share[j]), -w[j], open_[j]))
        for j in order[: remaining - sum(share)]:
            share[j] += 1
        for i, s in zip(open_, share):
            counts[i] = s
        remaining = 0
    return counts


def grid_weights(frame_weights: Sequence[float], grid_frames: int) -> list[float]:
    """Per-frame weights on the model's temporal grid: one each where the grid has a slot per frame; Qwen models
    put `ceil(K / T)` consecutive frames in one temporal patch, which gets their sum (the processor's padding
    repeats a frame, counted once). Any other layout: equal weights."""
    k = len(frame_weights)
    if k == grid_frames:
        return [float(w) for w in frame_weights]
    group = math.ceil(k / grid_frames) if grid_frames else 0
    if not group or math.ceil(k / group) != grid_frames:
        return [1.0] * grid_frames
    return [float(sum(frame_weights[i * group : (i + 1) * group])) for i in range(grid_frames)]


# --- stage 2: key tokens ------------------------------------------------------------------------------------------


def minmax(x: Tensor) -> Tensor:
    """(x - min) / (max - min); zeros when x is constant (the official code divides by zero)."""
    low, high = x.min(), x.max()
    if not bool(high > low):
        return torch.zeros_like(x)
    return (x - low) / (high - low)


def redundancy(features: Tensor) -> Tensor:
    """Rd [n]: each token's mean cosine similarity to the other n - 1 tokens of its frame (features [n, D])."""
    n = features.shape[0]
    if n < 2:
        return torch.zeros(n, dtype=torch.float32, device=features.device)
    x = torch.nn.functional.normalize(features.float(), dim=-1)
    sim = x @ x.T
    return (sim.sum(dim=1) - sim.diagonal()) / (n - 1)


def key_token_scores(importance: Tensor, features: Tensor, alpha: float) -> Tensor:
    """s = alpha * minmax(I) + (1 - alpha) * (1 - minmax(Rd)) for one frame: importance [n], features [n, D]."""
    return alpha * minmax(importance.float()) + (1 - alpha) * (1 - minmax(redundancy(features)))


def select_key_tokens(importance: Tensor, features: Tensor, alpha: float, budget: int) -> Tensor:
    """The `budget` highest-scoring tokens of one frame, ascending (`topk`, then sorted)."""
    scores = key_token_scores(importance, features, alpha)
    budget = max(0, min(int(budget), scores.numel()))
    return torch.sort(torch.topk(scores, budget).indices).values


def cls_logits(cls_attention: Tensor) -> Tensor:
    """The CLS query's pre-softmax logits [F, L] up to a per-frame affine map, from its attention row
    [F, heads, L]: the head mean of log-probabilities. The official `q @ k.T * C ** -0.5` over all heads is the head
    sum of the per-head logits (times a constant), and each head's softmax only subtracts its logsumexp, a constant
    over keys, so min-max of either gives the same values."""
    probs = cls_attention.float().clamp_min(torch.finfo(torch.float32).tiny)
    return probs.log().mean(dim=1)


# --- the methods ------------------------------------------------------------------------------------------------


TEST_PARAMS = {"encoder": "vtc-tiny-dinov2", "clip": "vtc-tiny-clip", "clip_pretrained": None, "attention_layer": -1}
POSITIONS_EXEMPTION = (
    "the keyframes are other frames than the reference's uniform ones, so the same frame content sits at other "
    "positions; tests/test_ktv.py checks the positions on the reference frames"
)
KEYFRAME_DOC = "https://arxiv.org/abs/2602.03615"
PAPER = "KTV: Keyframes and Key Tokens Selection for Efficient Training-Free Video LLMs (AAAI 2026)"


@vtc.method(
    "ktv-keyframes",
    paper=PAPER,
    url=KEYFRAME_DOC,
    summary="KTV's question-agnostic keyframes: k-means of DINOv2 frame features, the frame nearest each centroid",
)
class KTVKeyframes(vtc.FrameSampler):
    """KTV stage 1: K keyframes by k-means of DINOv2 `pooler_output` over up to 5,400 uniform candidates."""

    num_frames: int = vtc.param(6, range="[1, inf)", doc="K, keyframes handed to the processor (6 at 504 tokens)")
    max_candidates: int = vtc.param(MAX_CANDIDATES, range="[1, inf)", doc="frames clustered (uniform, all if fewer)")
    encoder: Any = vtc.param(
        "facebook/dinov2-large", doc="DINOv2 (its pooler_output): hub name, local directory or encoder object"
    )

    def keyframe_choice(self, video, ctx) -> vtc.FrameChoice:
        """The keyframes, with every candidate scored by minus its distance to the nearest centroid."""
        count = int(ctx.num_frames or self.num_frames)
        candidates = candidate_frames(video.num_frames, self.max_candidates)
        dino = image_encoder(self.encoder, pooling="pooler", param=f"{self.card.name}.encoder")
        feats = frame_features(dino, video, candidates).float().numpy()
        frames, fallback, distance = keyframes(feats, candidates, video.num_frames, count)
        ctx.state.update(frames=frames, fallback=fallback)
        ctx.report(fallback=fallback)  # handle.stats().frames[k].reports
        scores = None if distance is None else (-distance).tolist()
        return vtc.FrameChoice(frames, candidates=candidates, scores=scores)

    def sample(self, video, ctx):
        return self.keyframe_choice(video, ctx)


@vtc.method(
    "ktv",
    paper=PAPER,
    url=KEYFRAME_DOC,
    summary="k-means keyframes (DINOv2), CLIP-ranked per-frame budgets, key tokens by CLS attention and redundancy",
    test_params=TEST_PARAMS,
    exempt={
        "original_positions": POSITIONS_EXEMPTION,
        "ordered_positions": POSITIONS_EXEMPTION,
    },
)
class KTV(KTVKeyframes, vtc.TokenSelector):
    """KTV: keyframes (sample), then per frame the tokens of highest importance and lowest redundancy (connect)."""

    alpha: float = vtc.param(0.2, range="[0, 1]", doc="--rate: weight of importance against (1 - redundancy)")
    tokens_num: int = vtc.param(
        504, choices=(504, 936, 1872), doc="--tokens_num: the official table that shapes the per-frame budgets"
    )
    order: bool = vtc.param(True, doc="rank the keyframes against the question with CLIP (False: equal budgets)")
    clip: Any = vtc.param("ViT-L-14", doc="open_clip architecture ranking the keyframes, or an encoder object")
    clip_pretrained: str | None = vtc.param("openai", doc="open_clip weights tag or a local checkpoint file")
    importance: str = vtc.param(
        "auto",
        choices=("auto", "cls", "received"),
        doc="I: 'cls' (CLS logits, official), 'received' (mean attention received); auto: cls where there is a CLS",
    )
    attention_layer: int | None = vtc.param(
        None, doc="vision layer of I; None: 23 on CLIP towers (the official layers[23]), -1 (the feature layer) else"
    )

    reduces_tokens = True  # a sampler that also selects tokens (FrameSampler's default: False)
    query_aware = True  # the budgets follow the question's CLIP ranking
    positions = "compact"  # the official host concatenates the kept tokens of each frame
    whole_frames = True  # redundancy compares every token of a frame

    # sample ---------------------------------------------------------------------------------------------------
    def sample(self, video, ctx):
        choice = self.keyframe_choice(video, ctx)
        ranks = None
        if self.order and ctx.question:
            clip = clip_encoder(self.clip, self.clip_pretrained, param="ktv.clip")
            text = clip.encode_text([ordering_text(ctx.question)])[0]
            similarity = similarity_logits(clip, text, frame_features(clip, video, choice.indices))
            ranks = frame_ranks(similarity.tolist())
            ctx.report(similarity=similarity.tolist())
        ctx.state.update(ranks=ranks)
        ctx.report(ranks=ranks)
        return choice

    # connect --------------------------------------------------------------------------------------------------
    def fraction(self) -> float:
        """`retention`, or the official table's own share of 576-token frames (504 of 6 x 576: 14.6 %)."""
        if self.retention is not None:
            return float(self.retention)
        return sum(rank_budgets(self.num_frames, self.tokens_num)) / (OFFICIAL_FRAME_TOKENS * self.num_frames)

    def retained_count(self, num_tokens, grid, family):
        return fraction_count(num_tokens, self.fraction())

    def importance_stat(self, family: str) -> VisionStat:
        geometry = default_geometry(family)
        kind = self.importance if self.importance != "auto" else ("cls" if geometry.cls_tokens else "received")
        layer = self.attention_layer
        if layer is None:
            layer = CLIP_LAST_LAYER if geometry.cls_tokens else -1
        return VisionStat(kind, layer)

    def vision_stats(self, family):
        stats = [self.importance_stat(family)]
        if FEATURES.kind in get_family(family).vision_stats and default_geometry(family).has_prepool_grid:
            stats.append(FEATURES)  # Rd on the features the projector receives (LLaVA)
        return stats

    def frame_budgets(self, count: int, grid_frames: int, caps: Sequence[int], prepared: dict) -> list[int]:
        """Tokens per grid frame: `count` shared by the ranks' official budgets (equal shares without ranks)."""
        ranks = prepared.get("ranks")
        if ranks:
            table = rank_budgets(len(ranks), self.tokens_num)
            weights = grid_weights([table[r] for r in ranks], grid_frames)
        else:
            weights = [1.0] * grid_frames
        return apportion(count, weights, caps)

    def choose(self, tokens, count, ctx):
        t, h, w = tokens.grid
        stat = self.importance_stat(ctx.family)
        if stat not in ctx.vision:
            raise RuntimeError(f"ktv: the vision-tower statistic {stat} was not captured on {ctx.family}")
        device = tokens.embeds.device
        values = ctx.vision[stat].float()
        if stat.kind == "cls":
            values = cls_logits(values)
        importance = ctx.geometry.to_token_grid(values, (h, w)).to(device)  # [T, H*W]
        features = ctx.vision.get(FEATURES)
        if features is not None:
            features = ctx.geometry.to_token_grid(features.float(), (h, w)).to(device)  # [T, H*W, D]
        groups = tokens.frame_groups("patch")
        frames = [int(tokens.frame[idx[0]]) for idx in groups]
        caps = [0] * t
        for f, idx in zip(frames, groups):
            caps[f] = idx.numel()
        budgets = self.frame_budgets(count, t, caps, ctx.prepared)
        keep = []
        patch = tokens.patch
        for f, idx in zip(frames, groups):
            cells = patch[idx]
            feats = features[f, cells] if features is not None else tokens.embeds[idx]
            keep.append(idx[select_key_tokens(importance[f, cells], feats, self.alpha, budgets[f])])
        ctx.report(budgets=budgets, ranks=ctx.prepared.get("ranks"))
        return torch.cat(keep)
