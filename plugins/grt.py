"""GRT: Gated Residual Tokenization, from "Dense Video Understanding with Gated Residual Tokenization" (DIVE with
GRT; NEU / Princeton / UMD, 2025). arXiv: https://arxiv.org/abs/2509.14199. Official code:
Hai-chao-Zhang/DenseVideoUnderstand (read at 251ba39a94b94cc1d2b7203321c7f205dd529a88):
`lmms_eval/models/llava_hf.py` (`GatedSiglipVisionEmbeddings`: the Hugging Face LLaVA-OneVision release, model
`llava_hf`), `lmms_eval/models/llava_ov_dense_video.py` (`GatedVisionEmbeddings`, `_vision_merge_hook`,
`_scene_token_merge`, `_frame_type_key_mask`, `_get_motion_scores_for_scene_merge`, `_apply_scene_merge_packing`,
`_patch_packed_prune_pooling`: the LLaVA-NeXT research wrapper, model `llava_onevision_dense`),
`lmms_eval/models/qwen2_5_vl.py` (`GatedQwenVisionPatchEmbed`), `densevideo_qwen_dual_plugin/models/
qwen2_5_vl_dual_route.py` (`DualRouteGatedQwenVisionPatchEmbed`, `RouteFloorGatedQwenVisionPatchEmbed`; the
`..._floor.py` module only re-exports), `configs/densevideo/grt_hf_route31_full_models.yaml`,
`grt_highmotion_historical.yaml`, `grt_qwen7_floor_cap48_full_models.yaml`.

Two stages. (1) Gated tokenisation, in place of the vision tower's patch embedding: the frames of one video are
cut into patch vectors (`F.unfold`, the Conv2d's (C, p, p) order; on Qwen2.5-VL the processor's (C, tp, p, p)
tubes); frame 0 is projected whole; in frame t > 0 a patch is re-projected only when its dissimilarity (L2, or
1 - SSIM over the patch's values) to a reference patch exceeds a threshold, otherwise the embedding of the
previous frame at that position is reused. Reference: the previous frame (research wrapper) or the raw patch that
produced the currently cached embedding, updated only when re-projected (HF release and Qwen2.5-VL; the
threshold then bounds the drift of a reused embedding). No token is removed: the tower still runs on every
token, only the patch projection (~0.15% of the SigLIP tower's FLOPs) is skipped, so stage 1 is numerically a
substitution of stale patches. The per-patch dissimilarity divided by its frame's maximum is the motion score.
(2) Scene packing (research wrapper only), as a forward hook on the projector (output [F, N, D], before LLaVA's
2-D pooling): key frames = frame 0 and every frame with more than `scene_cut_factor * N` re-projected patches;
each pair of consecutive key frames whose "JSD" of softmax(lm_head(mean frame feature)) is below a threshold is
"matched" and the later one stops being a key frame; every frame then keeps k = max(min_tokens, ceil(N * ratio))
tokens, the top-k by score (kept key frames: feature norm / max + 1; other frames: motion score), in index
order; as the grid is gone, LLaVA's bilinear 2-D pooling is replaced by a linear 1-D resize of the packed
sequence to ceil(k / stride^2) tokens. So the LLM gets ceil(k / 4) tokens a frame (92 on a 27 x 27 grid at the
defaults, against 196): a count fixed by the grid and the parameters, known before the encoder runs (unless
`require_semantic_match`, which skips packing for a video without any matched pair).

The functions work on one video at a time ([T, N, P] patches, [T, N, D] features). Faithful to the
official code: the SSIM constants (k1 = 0.01, k2 = 0.03, range = max(max - min of either patch, 1), denominator
clamped at 1e-12, 1 - SSIM clamped to [0, 2], in float32), L2 in the patches' dtype (LLaVA paths) or float32
(`upcast`, the Qwen path), the strict `diff > threshold`, both reference rules, the refresh interval (frames with
t % interval == 0 fully re-projected, scores still computed), the motion score (diff / max over the frame,
clamped at 1e-12; 1e-6 on Qwen; frame 0 all ones), `policy="all"` / threshold < 0 (everything recomputed, scores
ones), the key frames, the official "JSD" (below), the matching (a NaN counts as a match, as `dist >= thr` is
then false), k, the scores and the 1-D pooling (linear `interpolate`, or `avg_pool1d` / `max_pool1d` with
`ceil_mode`). The official "JSD" is 0.5 * (KL(m || p) + KL(m || q)), m = (p + q) / 2 (`F.kl_div(p.log(), m)` is
KL(m || p)), not the Jensen-Shannon divergence; `jensen_shannon` is the real one, `divergence="jsd"`.

vtc differences: the gate returns, per patch, whether it is re-projected and the frame index of its reference
and of its source (the raw patch its embedding comes from), so a caller copies embeddings, or equivalently (the
projection is linear) pixel patches before the tower, by `gather_sources`; the official module copies
embeddings frame by frame. The refresh interval and both reference rules are offered for both metrics (the
official code has the refresh only in the HF release, the previous-frame rule only in the research wrapper).
Top-k ties (e.g. static patches, motion score exactly 0) go to the lower index (stable sort); the official
`topk(sorted=False)` leaves them to the kernel. The matching calls the head once per key frame (the official
code twice: for each frame of each pair; the same logits), then compares all pairs at once. Not implemented: the
research wrapper's ablation gates (`random`, `uniform`, `codec`: the last one's `keep[:, mask].fill_` writes into a
copy and has no effect) and codec I-frame key frames; the prompt routers (regexes on DIVE's subtitle / OCR questions
that switch gating off for every other prompt).

The method (`GRT`, "grt", a `vtc.TowerMerger`): stage 1 at the "embedded" point of vtc's block-by-block tower (the
patch embedding plus position embedding, before the first block): every non-re-projected patch takes the row of
its source frame at the same cell, which equals the official copy-then-add-position (on CLIP also after the
per-token `pre_layrnorm`); the tower then runs on every token, so stage 1 changes values and saves no compute in
vtc. Stage 2 in the connect hook on the pre-pool features (`ctx.prepool`), each frame's ceil(k / 4) tokens placed
on the first cells of its LLM grid (positions are compact, as LLaVA's). Defaults: the research wrapper's (the only
configuration with both stages). Method-level vtc differences: the divergence in float32 (the official fp16
softmax over the vocabulary underflows into NaN / inf "matches"); `retention` sets k (`retention_keep`), and
retention 1.0 turns both stages off (vtc's identity); `require_semantic_match` and `keep_ratio=None` (counts that
depend on the content) are not offered; LLaVA-NeXT-Video (CLIP + class token, 2 x 2 pooling before the projector)
is vtc's extension; the Qwen families are refused (their official route is stage 1 only, prompt-routed).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

import vtc
from vtc.core.geometry import default_geometry

Tensor = torch.Tensor

METRICS = ("l2", "ssim")
REFERENCES = ("previous", "cached")  # research wrapper / HF release and Qwen2.5-VL
POLICIES = ("motion", "all")
DIVERGENCES = ("official", "jsd")
POOL_MODES = ("bilinear", "average", "max")

SSIM_K1 = 0.01  # c1 = (k1 * range)^2
SSIM_K2 = 0.03  # c2 = (k2 * range)^2
SSIM_MIN_RANGE = 1.0  # range = max(max - min of either patch, 1)
SSIM_DENOMINATOR_EPS = 1e-12
SCORE_EPS = 1e-12  # motion-score denominator clamp (both LLaVA paths, and the packing scores)
QWEN_SCORE_EPS = 1e-6  # the Qwen2.5-VL path's clamp


@dataclass(frozen=True)
class GRTConfig:
    """One official configuration. `source` names the code default or the published profile it comes from."""

    source: str
    gate_metric: str  # "l2" | "ssim"
    gate_threshold: float  # re-project a patch iff dissimilarity > threshold; < 0: everything
    gate_reference: str  # "previous" | "cached"
    refresh_interval: int = 0  # frames t % interval == 0 (t > 0) fully re-projected; 0: never
    upcast: bool = False  # L2 in float32 (Qwen) instead of the patches' dtype (LLaVA paths)
    score_eps: float = SCORE_EPS
    min_keep_ratio: float | None = None  # Qwen route floor: below it, the whole request is re-projected natively
    scene_pack: bool = False  # stage 2 (research wrapper only)
    scene_cut_factor: float = 0.8
    jsd_threshold: float = 0.4
    keep_ratio: float | None = 0.5
    min_tokens: int = 16
    require_semantic_match: bool = False
    pool_stride: int = 2
    pool_mode: str = "bilinear"
    frames: int = 32  # max_frames_num / max_num_frames
    frame_fps: float | None = None  # dense_frame_fps (research wrapper): frames = round(duration * fps), capped


# `llava_onevision_dense.__init__` defaults (llava_ov_dense_video.py); LLaVA-NeXT code base, fp16 model.
RESEARCH_WRAPPER = GRTConfig(
    source="research wrapper defaults (llava_onevision_dense)",
    gate_metric="l2",
    gate_threshold=0.3,
    gate_reference="previous",
    scene_pack=True,
    frame_fps=2.0,
)
# configs/densevideo/grt_highmotion_historical.yaml: the 1,000-item High-Motion preview run (LLaVA-OV-0.5B).
HIGHMOTION_HISTORICAL = GRTConfig(
    source="published profile grt_highmotion_historical (research wrapper, llava-onevision-qwen2-0.5b-ov)",
    gate_metric="ssim",
    gate_threshold=0.05,
    gate_reference="previous",
    scene_pack=True,
    jsd_threshold=0.02,
    require_semantic_match=True,
    frames=8,
    frame_fps=1.0,
)
# `GatedSiglipVisionEmbeddings` / `LlavaHf.__init__` defaults (llava_hf.py): stage 1 only.
HF_RELEASE = GRTConfig(
    source="HF release defaults (llava_hf, GatedSiglipVisionEmbeddings)",
    gate_metric="ssim",
    gate_threshold=0.01,
    gate_reference="cached",
)
# configs/densevideo/grt_hf_route31_full_models.yaml, the GRT row (llava-onevision-qwen2-0.5b-ov-hf, bf16,
# max_image_size=384, linear_consistent projection; the prompt router gates only OCR questions).
HF_ROUTE31 = GRTConfig(
    source="published profile grt_hf_route31 (llava_hf, llava-onevision-qwen2-0.5b-ov-hf)",
    gate_metric="ssim",
    gate_threshold=0.001,
    gate_reference="cached",
    frames=8,
)
# `Qwen2_5_VL.__init__` / `GatedQwenVisionPatchEmbed` defaults (qwen2_5_vl.py): L2 over float32 tubes.
QWEN = GRTConfig(
    source="Qwen2.5-VL wrapper defaults (qwen2_5_vl, GatedQwenVisionPatchEmbed)",
    gate_metric="l2",
    gate_threshold=0.3,
    gate_reference="cached",
    upcast=True,
    score_eps=QWEN_SCORE_EPS,
)
# configs/densevideo/grt_qwen7_floor_cap48_full_models.yaml (Qwen2.5-VL-7B, 8 frames, max_image_size=384): the
# subtitle and OCR routes of qwen2_5_vl_dual_route_floor (any other prompt: no gating).
QWEN_FLOOR_SUBTITLE = GRTConfig(
    source="published profile grt_qwen7_floor_cap48, subtitle route",
    gate_metric="l2",
    gate_threshold=3.0,
    gate_reference="cached",
    upcast=True,
    score_eps=QWEN_SCORE_EPS,
    min_keep_ratio=0.80,
    frames=8,
)
QWEN_FLOOR_OCR = GRTConfig(
    source="published profile grt_qwen7_floor_cap48, OCR route",
    gate_metric="l2",
    gate_threshold=30.0,
    gate_reference="cached",
    upcast=True,
    score_eps=QWEN_SCORE_EPS,
    min_keep_ratio=0.55,
    frames=8,
)


# --- stage 1: the gate -------------------------------------------------------------------------------------------


def unfold_patches(frames: Tensor, patch: int) -> Tensor:
    """Frames [T, C, H, W] -> patch vectors [T, N, C*p*p], N = (H // p) * (W // p) in raster order, each vector in
    the Conv2d weight's (C, p, p) order (`weight.flatten(1)`), as both LLaVA paths build them (`F.unfold`)."""
    return F.unfold(frames.contiguous(), kernel_size=patch, stride=patch).transpose(1, 2).contiguous()


def ssim_dissimilarity(current: Tensor, reference: Tensor) -> Tensor:
    """1 - SSIM of every pair of patch vectors (last dimension), in float32, clamped to [0, 2] (the official
    `_patch_ssim_dissimilarity`, identical in both LLaVA files): one window per patch, population statistics,
    c1 = (0.01 * range)^2, c2 = (0.03 * range)^2, range = max(max - min of either patch, 1)."""
    x, y = current.float(), reference.float()
    mean_x, mean_y = x.mean(dim=-1), y.mean(dim=-1)
    dev_x, dev_y = x - mean_x.unsqueeze(-1), y - mean_y.unsqueeze(-1)
    var_x, var_y = (dev_x * dev_x).mean(dim=-1), (dev_y * dev_y).mean(dim=-1)
    cov = (dev_x * dev_y).mean(dim=-1)
    spread = torch.maximum(x.amax(dim=-1) - x.amin(dim=-1), y.amax(dim=-1) - y.amin(dim=-1))
    spread = spread.clamp_min(SSIM_MIN_RANGE)
    c1, c2 = (SSIM_K1 * spread) ** 2, (SSIM_K2 * spread) ** 2
    luminance_structure = (2 * mean_x * mean_y + c1) * (2 * cov + c2)
    normaliser = (mean_x.square() + mean_y.square() + c1) * (var_x + var_y + c2)
    return (1.0 - luminance_structure / normaliser.clamp_min(SSIM_DENOMINATOR_EPS)).clamp(min=0.0, max=2.0)


def l2_dissimilarity(current: Tensor, reference: Tensor, upcast: bool = False) -> Tensor:
    """Euclidean distance of patch vectors (last dimension): in the inputs' dtype (both LLaVA paths compare in the
    patch embedding's dtype), or in float32 with `upcast` (the Qwen2.5-VL path)."""
    if upcast:
        return (current.float() - reference.float()).norm(dim=-1)
    return (current - reference).norm(dim=-1)


def patch_dissimilarity(current: Tensor, reference: Tensor, metric: str = "l2", upcast: bool = False) -> Tensor:
    """The gate's metric: `l2_dissimilarity` or `ssim_dissimilarity` (always float32)."""
    if metric == "ssim":
        return ssim_dissimilarity(current, reference)
    if metric == "l2":
        return l2_dissimilarity(current, reference, upcast)
    raise ValueError(f"grt: unknown metric {metric!r}; expected one of {', '.join(METRICS)}")


def normalise_rows(values: Tensor, eps: float = SCORE_EPS) -> Tensor:
    """`values / max(values over the last dimension, eps)` in float32: the official motion score of one frame's
    dissimilarities (and the packing's renormalisation of motion scores and feature norms)."""
    values = values.float()
    return values / values.amax(dim=-1, keepdim=True).clamp_min(eps)


def motion_scores(diff: Tensor, eps: float = SCORE_EPS) -> Tensor:
    """[T, N] dissimilarities (frame t against its reference) -> the official motion scores [T, N] float32: frame 0
    all ones, frame t > 0 `normalise_rows(diff[t], eps)` (`last_diff_score_flat` of both LLaVA modules; Qwen:
    `eps=QWEN_SCORE_EPS`)."""
    return torch.cat([torch.ones_like(diff[:1], dtype=torch.float32), normalise_rows(diff[1:], eps)])


class Gate(NamedTuple):
    """The gate over one video's T frames of N patches.

    keep       [T, N] bool: the patch is projected anew (frame 0: all).
    diff       [T, N] float: its dissimilarity to `reference` (float32 but for L2 in a half dtype; frame 0 and
               `policy="all"`: zeros).
    score      [T, N] float32: the motion score, `diff` / the frame's maximum (frame 0 and `policy="all"`: ones).
    reference  [T, N] long: the frame whose raw patch `diff` compares with (frame 0: 0).
    source     [T, N] long: the frame whose raw patch the embedding comes from (t where `keep`, else the previous
               frame's source); `gather_sources(x, source)` gives every patch its embedding (or its pixels).
    refreshed  [T] bool: frames forced whole by the refresh interval."""

    keep: Tensor
    diff: Tensor
    score: Tensor
    reference: Tensor
    source: Tensor
    refreshed: Tensor


def gate_patches(
    patches: Tensor,
    threshold: float,
    metric: str = "l2",
    reference: str = "previous",
    refresh_interval: int = 0,
    policy: str = "motion",
    upcast: bool = False,
    score_eps: float = SCORE_EPS,
) -> Gate:
    """The GRT gate on one video's patch vectors [T, N, P] (`unfold_patches`; Qwen: the processor's tubes).

    Frame 0 is projected whole. Frame t > 0: `diff = patch_dissimilarity(patch_t, ref)`, re-projected iff
    `diff > threshold` (strict). `reference="previous"`: ref = the raw patch of frame t - 1 (research wrapper
    `GatedVisionEmbeddings.forward`); `"cached"`: ref = the raw patch whose projection is the cached embedding,
    replaced only when the patch is re-projected (HF `GatedSiglipVisionEmbeddings.forward`, Qwen
    `GatedQwenVisionPatchEmbed.forward`). `refresh_interval` > 0 re-projects frames t % interval == 0 whole (HF
    release; their diff and score are still computed and, with `"cached"`, every reference moves to them).
    `policy="all"` or `threshold < 0`: every patch of every frame is projected (the official native paths).
    Official arguments: `GRTConfig` (`gate_metric`, `gate_threshold`, `gate_reference`, `refresh_interval`,
    `upcast`, `score_eps`)."""
    if metric not in METRICS:
        raise ValueError(f"grt: unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    if reference not in REFERENCES:
        raise ValueError(f"grt: unknown reference {reference!r}; expected one of {', '.join(REFERENCES)}")
    if policy not in POLICIES:
        raise ValueError(f"grt: unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    if patches.dim() != 3:
        raise ValueError(f"grt: patches must be [T, N, P], got {tuple(patches.shape)}")
    frames, count, _ = patches.shape
    device = patches.device
    steps = torch.arange(frames, device=device)
    refreshed = torch.zeros(frames, dtype=torch.bool, device=device)
    if refresh_interval > 0:
        refreshed[1:] = steps[1:] % refresh_interval == 0
    previous = (steps - 1).clamp_min(0)[:, None].expand(frames, count)
    if policy == "all" or threshold < 0 or frames <= 1:
        keep = torch.ones(frames, count, dtype=torch.bool, device=device)
        ones = torch.ones(frames, count, dtype=torch.float32, device=device)
        zeros = torch.zeros(frames, count, dtype=torch.float32, device=device)
        return Gate(keep, zeros, ones, previous.clone(), steps[:, None].expand(frames, count).clone(), refreshed)

    if reference == "previous":
        diff = patch_dissimilarity(patches[1:], patches[:-1], metric, upcast)  # [T - 1, N], all steps at once
        keep = torch.cat([torch.ones(1, count, dtype=torch.bool, device=device), diff > threshold])
        keep[refreshed] = True
        # the source is the last frame <= t that re-projected the patch (frame 0 re-projects every patch)
        source = torch.where(keep, steps[:, None], 0).cummax(dim=0).values
        diff = torch.cat([diff.new_zeros(1, count), diff])
        return Gate(keep, diff, motion_scores(diff, score_eps), previous.clone(), source, refreshed)

    # cached: sequential over frames, the reference moves only where a patch is re-projected
    keep = torch.ones(frames, count, dtype=torch.bool, device=device)
    score = torch.ones(frames, count, dtype=torch.float32, device=device)
    refs = torch.zeros(frames, count, dtype=torch.long, device=device)
    source = torch.zeros(frames, count, dtype=torch.long, device=device)
    diffs = []
    cached, cached_at = patches[0], source[0]
    for t in range(1, frames):
        diff = patch_dissimilarity(patches[t], cached, metric, upcast)
        chosen = torch.ones_like(diff, dtype=torch.bool) if refreshed[t] else diff > threshold
        keep[t], score[t], refs[t] = chosen, normalise_rows(diff, score_eps), cached_at
        diffs.append(diff)
        cached = torch.where(chosen.unsqueeze(-1), patches[t], cached)
        cached_at = torch.where(chosen, t, cached_at)
        source[t] = cached_at
    diff = torch.cat([diffs[0].new_zeros(1, count), torch.stack(diffs)])
    return Gate(keep, diff, score, refs, source, refreshed)


def gather_sources(values: Tensor, source: Tensor) -> Tensor:
    """[T, N, D] values of every frame (embeddings, or raw patches) -> [T, N, D] with patch (t, n) taken from frame
    `source[t, n]`: the official reuse of the cached embedding. As the patch projection is linear (plus bias),
    gathering raw patches and projecting all of them equals projecting the kept ones and copying (to rounding)."""
    return values.gather(0, source.unsqueeze(-1).expand(-1, -1, values.shape[-1]))


def gated_patch_embeddings(patches: Tensor, gate: Gate, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The official embedding computation without position embeddings: `F.linear(patch, weight, bias)` for the
    kept patches only (`weight` = the patch Conv's weight flattened to [D, P]), every other patch the embedding of
    its source. [T, N, P] -> [T, N, D] in the linear's output dtype. (The HF release projects frame 0, and with
    `native_on_full` any fully kept frame, with the Conv2d itself: equal to a few ulps.)"""
    frames, count, _ = patches.shape
    projected = F.linear(patches[gate.keep], weight, bias)
    out = projected.new_zeros(frames, count, projected.shape[-1])
    out[gate.keep] = projected
    return gather_sources(out, gate.source)


def keep_floor(gate: Gate, min_keep_ratio: float | None) -> Gate:
    """The Qwen route floor (`RouteFloorGatedQwenVisionPatchEmbed.forward`): when the planned fraction of
    re-projected patches (frame 0 included) is strictly below `min_keep_ratio`, everything is projected natively
    (keep all, scores ones, sources the frames themselves). The official fraction is over the whole request (all
    its videos); here over the patches of this gate."""
    if min_keep_ratio is None or gate.keep.numel() == 0:
        return gate
    if gate.keep.sum().item() / gate.keep.numel() >= min_keep_ratio:
        return gate
    frames, count = gate.keep.shape
    steps = torch.arange(frames, device=gate.keep.device)[:, None].expand(frames, count)
    return Gate(
        torch.ones_like(gate.keep),
        gate.diff,
        torch.ones_like(gate.score),
        gate.reference,
        steps.clone(),
        gate.refreshed,
    )


# --- stage 2: key frames, the semantic test, packing, 1-D pooling -------------------------------------------------


def key_frames(keep: Tensor, scene_cut_factor: float = 0.8) -> Tensor:
    """[T, N] re-projection mask -> [T] bool key frames: frame 0 and every frame with more than
    `scene_cut_factor * N` re-projected patches (the official `_frame_type_key_mask` without codec frame types)."""
    frames, count = keep.shape
    key = keep.sum(dim=1) > scene_cut_factor * count
    if frames:
        key[0] = True
    return key


def official_divergence(p: Tensor, q: Tensor) -> Tensor:
    """The official `jsd(p, q)` of `_scene_token_merge` over the last dimension: 0.5 * (KL(m || p) + KL(m || q)),
    m = (p + q) / 2, in the inputs' dtype, as `F.kl_div(x.log(), m, reduction="sum")` computes it (m log m -
    m log x, element by element): zero iff p == q, unbounded, and NaN when an entry is 0 in both p and q (0 * -inf;
    e.g. fp16 softmax over a large vocabulary underflows), +inf when an entry is 0 in one of them only."""
    m = 0.5 * (p + q)
    entropy_m = torch.xlogy(m, m)
    return 0.5 * ((entropy_m - m * p.log()).sum(dim=-1) + (entropy_m - m * q.log()).sum(dim=-1))


def jensen_shannon(p: Tensor, q: Tensor) -> Tensor:
    """The Jensen-Shannon divergence 0.5 * (KL(p || m) + KL(q || m)) over the last dimension, in float32 (natural
    log, in [0, ln 2]; zero entries contribute 0). Not the official quantity (`official_divergence`)."""
    p, q = p.float(), q.float()
    m = 0.5 * (p + q)
    log_m = m.log()
    kl_p = (torch.xlogy(p, p) - torch.where(p > 0, p * log_m, 0.0)).sum(dim=-1)
    kl_q = (torch.xlogy(q, q) - torch.where(q > 0, q * log_m, 0.0)).sum(dim=-1)
    return 0.5 * (kl_p + kl_q)


def frame_divergence(logits_a: Tensor, logits_b: Tensor, divergence: str = "official") -> Tensor:
    """Divergence of softmax(logits_a) and softmax(logits_b) over the last dimension (softmax in the logits'
    dtype, as the official code applies it to `lm_head`'s output)."""
    p, q = F.softmax(logits_a, dim=-1), F.softmax(logits_b, dim=-1)
    if divergence == "official":
        return official_divergence(p, q)
    if divergence == "jsd":
        return jensen_shannon(p, q)
    raise ValueError(f"grt: unknown divergence {divergence!r}; expected one of {', '.join(DIVERGENCES)}")


class SceneMatch(NamedTuple):
    """The semantic test over one video's key frames.

    kept_key    [T] bool: key frames still key (frame b of a matched pair (a, b) is not).
    divergence  [T] float32: at each key frame b but the first, its divergence to the previous key frame a
                (zeros elsewhere; NaN / inf as the official quantity gives them).
    compared    [T] bool: where `divergence` is defined.
    matched     bool: at least one pair matched (the official `_last_scene_merge_has_semantic_match`)."""

    kept_key: Tensor
    divergence: Tensor
    compared: Tensor
    matched: bool


def match_key_frames(
    features: Tensor,
    key: Tensor,
    head: Callable[[Tensor], Tensor],
    threshold: float = 0.4,
    divergence: str = "official",
) -> SceneMatch:
    """`_scene_token_merge`: the projected features [T, N, D] are averaged over tokens ([T, D], in their dtype);
    each pair of consecutive key frames (a, b) is compared by `frame_divergence(head(mean_a), head(mean_b))`
    (`head`: the LLM's `lm_head`); the pair is matched unless divergence >= threshold (so a NaN matches), and a
    matched b loses its key status. The official code also averages the two frame means into slot a, which is
    never read again (pairs are consecutive: a is not compared after (a, b)); no feature changes."""
    frames = features.shape[0]
    kept = key.clone()
    values = torch.zeros(frames, dtype=torch.float32, device=features.device)
    compared = torch.zeros(frames, dtype=torch.bool, device=features.device)
    positions = key.nonzero().flatten()
    if positions.numel() < 2:
        return SceneMatch(kept, values, compared, False)
    means = features.mean(dim=1)
    # one head call per frame on a 1-D vector, as the official code: a batched call may round rows differently,
    # and identical frames must give identical logits (divergence exactly 0)
    logits = torch.stack([head(means[i]) for i in positions.tolist()])
    found = frame_divergence(logits[:-1], logits[1:], divergence)
    hit = ~(found >= threshold)
    later = positions[1:]
    kept[later[hit]] = False
    values[later] = found.float()
    compared[later] = True
    return SceneMatch(kept, values, compared, bool(hit.any()))


def packed_count(num_tokens: int, keep_ratio: float, min_tokens: int = 16) -> int:
    """Tokens kept per frame by the scene packing: k = max(min_tokens, ceil(N * ratio)) within [1, N], ratio
    clamped to [0, 1] (`_apply_scene_merge_packing`). k == N means no packing (LLaVA's 2-D pooling follows)."""
    ratio = min(max(float(keep_ratio), 0.0), 1.0)
    k = max(int(min_tokens), int(math.ceil(num_tokens * ratio)))
    return min(max(k, 1), num_tokens)


def pack_scores(motion: Tensor, features: Tensor, kept_key: Tensor, eps: float = SCORE_EPS) -> Tensor:
    """[T, N] packing scores: the motion score renormalised per frame (`_get_motion_scores_for_scene_merge`), and
    for kept key frames the feature norm / the frame's maximum norm + 1 (every key-frame token outranks every
    motion score: `_apply_scene_merge_packing`)."""
    motion = normalise_rows(motion, eps)
    semantic = normalise_rows(features.float().norm(dim=-1), eps)
    return torch.where(kept_key.unsqueeze(-1), semantic + 1.0, motion)


def pack_indices(scores: Tensor, k: int) -> Tensor:
    """[T, N] scores -> [T, k] indices of each frame's k highest scores, ascending (ties: the lower index)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=-1).values


def gather_tokens(features: Tensor, indices: Tensor) -> Tensor:
    """[T, N, D] features, [T, k] indices -> [T, k, D]."""
    return features.gather(1, indices.unsqueeze(-1).expand(-1, -1, features.shape[-1]))


def pool_packed(features: Tensor, stride: int = 2, mode: str = "bilinear") -> Tensor:
    """The official `packed_aware_get_2d_pool` on packed frames [T, k, D] (k != the grid size): the sequence is
    resized to ceil(k / stride^2) tokens, `bilinear` by a linear `F.interpolate` (align_corners=False), `average`
    / `max` by `avg_pool1d` / `max_pool1d` (kernel = stride = stride^2, ceil_mode). stride <= 1 or k <= 1: as is."""
    if mode not in POOL_MODES:
        raise ValueError(f"grt: unknown pool mode {mode!r}; expected one of {', '.join(POOL_MODES)}")
    step = max(int(stride), 1)
    tokens = features.shape[1]
    if step <= 1 or tokens <= 1:
        return features
    window = step * step
    target = max(math.ceil(tokens / window), 1)
    seq = features.transpose(1, 2).contiguous()
    if mode == "bilinear":
        seq = F.interpolate(seq, size=target, mode="linear", align_corners=False)
    elif mode == "average":
        seq = F.avg_pool1d(seq, kernel_size=window, stride=window, ceil_mode=True)
    else:
        seq = F.max_pool1d(seq, kernel_size=window, stride=window, ceil_mode=True)
    if seq.shape[-1] != target:
        seq = F.interpolate(seq, size=target, mode="linear", align_corners=False)
    return seq.transpose(1, 2).contiguous()


def tokens_per_frame(
    grid_h: int,
    grid_w: int,
    keep_ratio: float | None = 0.5,
    min_tokens: int = 16,
    stride: int = 2,
    mode: str = "bilinear",
) -> int:
    """LLM tokens per frame on LLaVA-OneVision with the scene packing (research wrapper), before the one newline a
    video: k < N: ceil(k / stride^2) (`pool_packed`); k == N (or `keep_ratio=None`: no packing, as the HF
    release): LLaVA's 2-D pooling, ceil(h / s) * ceil(w / s) for bilinear, floor for average / max pooling.
    27 x 27 at the defaults: 92 (unpacked: 196)."""
    count = grid_h * grid_w
    step = max(int(stride), 1)
    k = count if keep_ratio is None else packed_count(count, keep_ratio, min_tokens)
    if k < count:
        return k if step <= 1 or k <= 1 else max(math.ceil(k / (step * step)), 1)
    if step <= 1:
        return count
    if mode == "bilinear":
        return math.ceil(grid_h / step) * math.ceil(grid_w / step)
    return (grid_h // step) * (grid_w // step)


class ScenePack(NamedTuple):
    """Stage 2 on one video. `features` [T, k, D] (the input when not packed), `indices` [T, k] (None when not
    packed), `key` / `kept_key` [T] bool, `match` the semantic test."""

    features: Tensor
    indices: Tensor | None
    key: Tensor
    kept_key: Tensor
    match: SceneMatch


def scene_pack(
    features: Tensor,
    keep: Tensor,
    motion: Tensor,
    head: Callable[[Tensor], Tensor],
    scene_cut_factor: float = 0.8,
    jsd_threshold: float = 0.4,
    keep_ratio: float | None = 0.5,
    min_tokens: int = 16,
    require_semantic_match: bool = False,
    divergence: str = "official",
    count: int | None = None,
) -> ScenePack:
    """The research wrapper's `_vision_merge_hook` (scene merge on, pruning off) on one video's projected features
    [T, N, D], its gate's `keep` and motion `score` [T, N]: `key_frames`, `match_key_frames`, then every frame
    keeps `packed_count` tokens by `pack_scores` (`pack_indices`, `gather_tokens`). No packing when k == N or, with
    `require_semantic_match`, when no pair matched. `keep_ratio=None` (`scene_merge_keep_ratio=None`): the
    fraction of frames not matched away (the official `_last_merge_ratio`, which `_scene_token_merge` has just set:
    1 with fewer than two key frames). `count`: k itself, within [1, N] (vtc's retention mapping, `retention_keep`),
    instead of `packed_count(N, keep_ratio, min_tokens)`."""
    key = key_frames(keep, scene_cut_factor)
    match = match_key_frames(features, key, head, jsd_threshold, divergence)
    frames, tokens, _ = features.shape
    if count is not None:
        k = min(max(int(count), 1), tokens)
    else:
        if keep_ratio is None:
            removed = int((key & ~match.kept_key).sum().item())
            keep_ratio = (frames - removed) / frames if match.compared.any() else 1.0
        k = packed_count(tokens, keep_ratio, min_tokens)
    if (require_semantic_match and not match.matched) or k >= tokens:
        return ScenePack(features, None, key, match.kept_key, match)
    indices = pack_indices(pack_scores(motion, features, match.kept_key), k)
    return ScenePack(gather_tokens(features, indices), indices, key, match.kept_key, match)


# --- the method ---------------------------------------------------------------------------------------------------

POOL_STRIDE = 2  # LLaVA's `mm_spatial_pool_stride`: the packed sequence shrinks by stride^2 = 4


def retention_keep(patches: int, cells: int, retention: float, min_tokens: int = 16, stride: int = POOL_STRIDE) -> int:
    """vtc's retention mapping: k (patches a frame keeps before the 1-D pooling) for a frame of `patches` patches
    whose LLaVA pooling gives `cells` tokens (729 -> 196, 576 -> 144), so that the LLM sees the count nearest to
    `retention * cells` a frame. A packed frame gives ceil(k / stride^2) tokens, so k = stride^2 * round(r * cells)
    (at least `min_tokens`, the official floor); it gives at most ceil((N - 1) / stride^2) (182 of 196 on
    LLaVA-OneVision), and a target between that and the whole frame goes to the nearer of the two (k = N: no
    packing, LLaVA's own pooling; a tie to the whole frame, keeping more). k >= N means no packing."""
    window = stride * stride
    target = retention * cells
    most = math.ceil((patches - 1) / window)
    if target >= most:
        return patches if cells - target <= target - most else min(patches - 1, window * most)
    return min(max(window * max(round(target), 1), int(min_tokens)), patches)


def upcast_logits(head: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """The LM head with float32 logits, so the matching's softmax and divergence run in float32 (vtc; the official
    fp16 softmax over the vocabulary underflows to zeros, and its divergence to NaN / inf)."""
    return lambda mean: head(mean).float()


def published_patch_grid(family: str, cells: tuple[int, int]) -> tuple[int, int] | None:
    """The tower's patch grid per frame of a `family` model whose LLM grid is `cells` (h, w): the published
    checkpoints' (27 x 27 SigLIP, 24 x 24 CLIP) when they pool to that grid, else None (another resolution: the
    count is known once the model runs)."""
    geometry = default_geometry(family)
    if geometry.patch_grid is None or geometry.token_grid_size() != tuple(cells):
        return None
    return geometry.patch_grid


@vtc.method(
    "grt",
    paper="Dense Video Understanding with Gated Residual Tokenization (arXiv 2025)",
    url="https://arxiv.org/abs/2509.14199",
    summary="stage 1 at the vision tower's patch embedding: a patch that barely changed since the previous frame "
    "reuses its cached embedding (values only: no token is removed); stage 2 after the projector: key frames (mostly "
    "re-projected) matched by the LM head's output distribution, every frame's top-k tokens by motion / feature norm "
    "packed and pooled 1-D",
    retention_note="the LLM sees ceil(k / 4) tokens a frame (k patches packed, then LLaVA's 2x2 pooling done 1-D): "
    "k = 4 round(r * 196) on LLaVA-OneVision (r * 144 on LLaVA-NeXT-Video), one token a frame at a time, at least "
    "4 a frame (min_tokens_per_frame = 16 patches); on LLaVA-OneVision a packed frame gives at most 182 tokens, so r "
    "above 182/196 gives the nearer of 182 and all 196 (no packing); keep_ratio (the official "
    "scene_merge_keep_ratio) overrides the retention; retention 1.0 turns both stages off",
)
class GRT(vtc.TowerMerger):
    """GRT (official: Hai-chao-Zhang/DenseVideoUnderstand) on LLaVA's SigLIP / CLIP towers. Stage 1, gated
    tokenisation, at the tower's "embedded" point: per video, the gate compares every patch with its reference
    (`gate_patches` on the raw patches the patch embedding received) and a patch not re-projected takes the hidden
    state of its source frame's token at the same cell. It changes values only and saves almost no compute: the
    official code skips the patch projection of those patches (a Conv2d of ~0.15% of the tower's FLOPs), every token
    still runs through the tower. Stage 2, scene packing, in the connect hook on the projected pre-pool grid: key
    frames, their semantic matching, k tokens a frame by score, the 1-D pooling to ceil(k / 4) tokens. Defaults: the
    research wrapper's (`llava_onevision_dense`, the configuration with both stages); the HF release's stage 1 is
    `gate_reference="cached", gate_metric="ssim", gate_threshold=0.01` (with `keep_ratio=1.0`: no packing)."""

    temporal = True  # the gate reuses the previous frame's tokens, scenes pack frames: videos only

    gate_metric: str = vtc.param(
        RESEARCH_WRAPPER.gate_metric, choices=METRICS, doc="gate_metric: l2 (research wrapper) or ssim (1 - SSIM)"
    )
    gate_threshold: float = vtc.param(
        RESEARCH_WRAPPER.gate_threshold,
        doc="gate_diff_threshold: a patch is re-projected iff its dissimilarity exceeds it (HF release: 0.01 with "
        "ssim); negative: every patch (stage 1 off)",
    )
    gate_reference: str = vtc.param(
        RESEARCH_WRAPPER.gate_reference,
        choices=REFERENCES,
        doc="previous: the previous frame's patch (research wrapper); cached: the patch that produced the reused "
        "embedding (HF release: bounds the drift)",
    )
    refresh_interval: int = vtc.param(
        0, range="[0, inf)", doc="gate_refresh_interval_frames: frames t % interval == 0 re-projected whole; 0: never"
    )
    keep_ratio: float | None = vtc.param(
        None,
        range="(0, 1]",
        doc="scene_merge_keep_ratio: k = max(min_tokens_per_frame, ceil(N * ratio)) patches a frame before the "
        "pooling (1: no packing); None: from the retention, else the official 0.5",
    )
    min_tokens_per_frame: int = vtc.param(
        RESEARCH_WRAPPER.min_tokens, range="[1, inf)", doc="scene_merge_min_tokens_per_frame: the floor of k"
    )
    scene_cut_factor: float = vtc.param(
        RESEARCH_WRAPPER.scene_cut_factor,
        range="[0, 1]",
        doc="a frame with more than this share of re-projected patches is a key frame",
    )
    jsd_threshold: float = vtc.param(
        RESEARCH_WRAPPER.jsd_threshold,
        range="[0, inf)",
        doc="merge_jsd_threshold: consecutive key frames closer than this are matched (the later one stops being key)",
    )
    divergence: str = vtc.param(
        "official",
        choices=DIVERGENCES,
        doc="official: the code's 0.5 (KL(m||p) + KL(m||q)); jsd: the Jensen-Shannon divergence (both in float32)",
    )

    requires: ClassVar[frozenset[str]] = frozenset({"tower_blocks", "prepool"})
    prepool: ClassVar[bool] = True  # stage 2 packs the projected grid before LLaVA's pooling
    whole_frames: ClassVar[bool] = True  # ... every cell of every frame, scored by stage 1's gate
    reads_lm_head: ClassVar[bool] = True  # ... and matches key frames by the LM head's output distribution
    positions: ClassVar[str] = "compact"  # the official LLaVA code concatenates the packed tokens

    # --- configuration ---------------------------------------------------------------------------------------
    @property
    def keeps_everything(self) -> bool:
        """vtc's identity: a retention of 1.0 and no keep_ratio of its own. Both stages are off: stage 1 would
        still swap stale patches into the tower at any token count."""
        return self.keep_ratio is None and self.retention is not None and self.retention >= 1.0

    @property
    def gates(self) -> bool:
        """Stage 1 runs (a negative threshold is the official native path: every patch projected)."""
        return self.gate_threshold >= 0 and not self.keeps_everything

    def kept_per_frame(self, patches: int, cells: int) -> int:
        """k for a frame of `patches` patches pooled by the model to `cells` tokens (k >= patches: no packing)."""
        if self.keep_ratio is not None:
            return packed_count(patches, self.keep_ratio, self.min_tokens_per_frame)
        if self.retention is None:
            return packed_count(patches, RESEARCH_WRAPPER.keep_ratio, self.min_tokens_per_frame)
        if self.retention >= 1.0:
            return patches
        k = retention_keep(patches, cells, self.retention, self.min_tokens_per_frame)
        floor = math.ceil(self.min_tokens_per_frame / POOL_STRIDE**2)
        warned = self.__dict__.setdefault("_warned", set())
        if k < patches and round(self.retention * cells) < floor and cells not in warned:
            warned.add(cells)
            warnings.warn(
                f"grt: retention {self.retention:.3g} asks for {self.retention * cells:.1f} of {cells} tokens a frame, "
                f"below the {floor} a frame keeps at min_tokens_per_frame={self.min_tokens_per_frame}; keeping {floor}",
                RuntimeWarning,
                stacklevel=2,
            )
        return k

    def frame_tokens(self, patches: int, cells: int) -> int:
        """LLM tokens a frame: ceil(k / 4) when packed, else the model's own pooled `cells`."""
        k = self.kept_per_frame(patches, cells)
        return cells if k >= patches else math.ceil(k / POOL_STRIDE**2)

    def retained_count(self, num_tokens, grid, family):
        t, h, w = (int(v) for v in grid)
        if self.keeps_everything:
            return num_tokens
        patch_grid = published_patch_grid(family, (h, w))
        if num_tokens != t * h * w or patch_grid is None:
            return None
        return t * self.frame_tokens(patch_grid[0] * patch_grid[1], h * w)

    # --- stage 1: the gate at the patch embedding -------------------------------------------------------------
    def changes_tower(self, grid):
        return self.gates and grid[0] > 1

    def encode_block(self, tokens, ctx):
        if tokens.point != "embedded" or not self.changes_tower(tokens.grid):
            return tokens
        frames, h, w = tokens.grid
        patch = torch.nonzero(tokens.cell >= 0).flatten()  # a CLIP class token is no patch: it stays
        cells = torch.arange(frames * h * w, device=patch.device)
        if patch.numel() != cells.numel() or not torch.equal(tokens.cell[patch], cells):
            raise ValueError(
                "grt gates every patch of every frame at the patch embedding, but a tower method before it changed the "
                f"tokens there ({patch.numel()} patches of a {frames}x{h}x{w} grid); put grt first among the tower "
                "methods"
            )
        hidden = tokens.hidden[patch, 0].view(frames, h * w, -1)
        gate = gate_patches(
            tokens.pixels[patch, 0].view(frames, h * w, -1),
            self.gate_threshold,
            self.gate_metric,
            self.gate_reference,
            self.refresh_interval,
        )
        recomputed = gate.keep.sum(dim=1)
        ctx.state[ctx.video_index] = {"keep": gate.keep, "score": gate.score, "recomputed": recomputed}
        ctx.report(recomputed=recomputed.tolist())
        if bool(gate.keep.all()):
            return tokens
        out = tokens.hidden.clone()
        out[patch, 0] = gather_sources(hidden, gate.source).flatten(0, 1)
        return tokens.with_hidden(out)

    # --- stage 2: scene packing and the 1-D pooling -----------------------------------------------------------
    def gate_record(self, ctx, frames: int, patches: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Stage 1's (keep [T, N], motion score [T, N]) of this video; without a gate (a negative threshold, one
        frame) the official native path's: every patch re-projected, scores ones."""
        state = ctx.state.get(ctx.video_index)
        if state is None:
            if self.gates and frames > 1:
                raise RuntimeError(
                    "grt: its connect stage found no stage 1 record for this video (the vision tower ran without "
                    "vtc's encode stage: pass pixel_values_videos, not precomputed features)"
                )
            ones = torch.ones(frames, patches, device=device)
            return ones.bool(), ones
        if tuple(state["keep"].shape) != (frames, patches):
            raise RuntimeError(
                f"grt: stage 1 gated {tuple(state['keep'].shape)} patches, the pre-pool grid is {(frames, patches)}"
            )
        return state["keep"].to(device), state["score"].to(device)

    def connect(self, tokens, ctx):
        if self.keeps_everything:
            return tokens
        if ctx.prepool is None:
            raise RuntimeError("grt: stage 2 packs the features before LLaVA's pooling, but none were captured")
        t, h, w = tokens.grid
        frames, rows, cols, _ = ctx.prepool.shape
        patches = rows * cols
        k = self.kept_per_frame(patches, h * w)
        if k >= patches:
            return tokens  # the official "no packing": LLaVA's own pooling of stage 1's features
        if frames != t or not tokens.is_full_grid:
            raise RuntimeError(f"grt: expected every token of the video's {t} frames, got {len(tokens)} tokens")
        features = ctx.prepool.reshape(frames, patches, -1)
        keep, score = self.gate_record(ctx, frames, patches, features.device)
        project = ctx.project or (lambda x: x)  # LLaVA-NeXT-Video pools CLIP features before its projector
        head = ctx.model.get_output_embeddings()
        mode = ctx.geometry.pooling if ctx.geometry is not None else "bilinear"
        with torch.no_grad():
            packed = scene_pack(
                project(features),
                keep,
                score,
                upcast_logits(head),
                self.scene_cut_factor,
                self.jsd_threshold,
                min_tokens=self.min_tokens_per_frame,
                divergence=self.divergence,
                count=k,
            )
            pooled = project(pool_packed(gather_tokens(features, packed.indices), POOL_STRIDE, mode))
        per_frame = pooled.shape[1]
        # frame f's tokens on the first cells of its LLM grid, in packed order (positions are compact: order only)
        cells = torch.arange(frames)[:, None] * (h * w) + torch.arange(per_frame)
        out = tokens.select(cells.flatten().to(tokens.embeds.device))
        out.embeds = pooled.reshape(-1, pooled.shape[-1]).to(tokens.embeds.device, tokens.embeds.dtype)
        ctx.report(
            key_frames=packed.key.nonzero().flatten().tolist(),
            matched_away=(packed.key & ~packed.kept_key).nonzero().flatten().tolist(),
            tokens_per_frame=per_frame,
        )
        return out
