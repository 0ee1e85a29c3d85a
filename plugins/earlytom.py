"""EarlyTom: "Early Token Compression Completes Fast Video Understanding" (Wang, Jin, Lu, Li, Chen, Liu, Wang;
CVPR 2026). arXiv: https://arxiv.org/abs/2605.30010. Official code: viridisGreen/EarlyTom, read at
b90932217325d986d11364c5d31466ab1812caa1: `LLaVA-NeXT/llava/model/multimodal_encoder/siglip_encoder.py`
(`SigLipEncoder.__init__` env settings L377-383, `compression` L388-451, `coarse_segment` L456-497,
`fine_segment` L502-548, the encoder forward with WRAPPER=earlytom L585-639, `SigLipVisionTower.load_model` /
`forward` L805-845), `earlytom/llava_arch.py` (`encode_images_multi` L27-32, `cluster_dpc_knn` L35-57,
`merge_tokens_by_clustering` L60-110, `merge_tokens_by_attention_frame` L132-170, `merge_tokens_by_local_window`
L173-242, `spatial_compression` L245-289, `divided_static_dynamic` L291-334, `prepare_inputs_labels_for_multimodal`
L337-419 and L563-635), `earlytom/main.py`, `earlytom/modeling_qwen2.py` (`Qwen2Model_earlytom.forward`
L213-305), `LLaVA-NeXT/llava/model/llava_arch.py::get_2dPool` L189-208, and the scripts (`scripts/ov/*earlytom*`,
`scripts/llava-vid/eval_vid-7b_earlytom.sh`, `scripts/eval_qwen2_5_vl.sh`).

Stage I (inside SigLIP; the vision tower has its last layer deleted, 26 layers, indices 0-25): after layer l of
PRUNE_LAYERS, on the layer output [T, 729, 1152] (after the MLP residual, not between attention and MLP), the
frames are segmented by a streaming rule (reference = first frame of the current group, running similarity
sim <- EMA * mean_token_cosine(reference, frame_i) + (1 - EMA) * sim, reset to 1 at a cut; cut when sim < T or when
the group would reach M frames, so a group holds at most M - 1 frames). Groups of 1-2 frames stay; in a longer
group the first and last frames stay and the middle frames are mixed pairwise (`fine_segment`): adjacent middle
frames i, i+1 of mean cosine s_i are replaced by w * f_i + (1 - w) * f_{i+1}, w = s_i / (s_i + s_{i+1}), when
s_i > tau_group = mean_cosine(first, last) and s_i > s_{i+1}; the last middle pair mixes when s > tau with w = 1.
The layer's attention map [T, 16, 729, 729] is mixed with the same weights. The reduced stack runs through the
remaining layers. At the last prune layer the reduced stack is segmented again ("refinement"); those groups go to
Stage II together with that layer's mixed attention.
Stage II (connector): features = last kept layer output -> projector -> 2-D pool (OneVision: bilinear 27x27 ->
14x14); attention = the last prune layer's map averaged over heads and queries, pooled alike. The retention is
rescaled, r' = min(r * T0 / T_reduced, 1). Per refined group: groups of 1-2 frames keep ceil(196 r') tokens per
frame by attention (top-k, index order; with D > 0 part of the budget becomes DPC-kNN cluster tokens); longer
groups treat first and last frames the same way and keep max(1, round(196 r')) tokens per middle frame, one per
contiguous window of the flattened token sequence (the window's most attended token). Order per group:
[first frame ; middle frames ; last frame]. OneVision appends one newline token after the video.
Stage III (optional, INNER_k / INNER_r set): at LLM layer k (prefill), keep round(V (1 - r)) visual tokens by the
last token's layer-(k-1) attention; every other visual token is folded into its most cosine-similar kept token by
a running pairwise average (h <- (h + x) / 2, in index order); kept tokens keep their original position ids.

This module holds the algorithm as pure tensor functions only (the method class is added on the encode-stage
interface); `DEFAULTS` and `SCRIPT_SETTINGS` hold the official defaults and the per-task settings.

Faithful to the official code, bit for bit on the same dtype (same torch ops in the same order; see
tests/test_earlytom.py): the streaming segmentation with its Python-float start sim = 1.0, the `(i - start + 1) >= M`
cap, the refinement's un-normalised reference after a cut; `coarse_segment` / `fine_segment` including their
quirks (the last middle frame never survives on its own: it is dropped, or "mixed" with weight 0 when the last
pair mixes with w = 1; exact ties s_i == s_{i+1} never mix; a single middle frame is kept as is; `merging` is
accepted by the official assert and runs as `mixing`); the attention reduction `mean(dim=(1, 2))`; `get_2dPool`;
r' = min(r / ((N - reduced) / N), 1); ceil / round (Python rounding) of the per-frame budgets; top-k + boolean
mask (index order) for dominant tokens; DPC-kNN (k = min(K, clusters), float32 cdist / sqrt(C), U(0, 1e-6) density
noise from the global RNG unless a generator is given, centres sorted by index, the beta rule); the local-window
split (the first N mod W windows one token longer), the resample / pad to exactly round(N r') tokens; the
token order; the inner merge's top-k, cosine, first-max partner and sequential halving.

vtc differences:
- Segmentations are returned as a `FramePlan` (per output frame: which input frames, with which weights); the
  official code only returns the mixed tensors. `plan.apply` gives the official tensors; `plan.matrix()` and
  `frame_fate` expose every original frame's fate (kept, mixed with weights, or dropped).
- The D > 0 branch is the intended one: the official `merge_tokens_by_attention_frame` crashes for D > 0
  (`pos.masked_select(mask.unsqueeze(-1))` broadcasts [B, S] against [B, S, 1]) and for D = 1 (`torch.empty((-1,
  C))`); the scripts never set D, so the official runs use D = 0 (all tokens dominant).
- `select_dominant` returns tokens in the features' dtype (the official D = 0 path concatenates with a float32
  empty tensor, promoting to float32, and casts back to the pixel dtype: lossless for bf16 / fp16 features).
- The token selections also return each token's (frame, position) so vtc can track it.
- `inner_merge` is functional (the official updates the hidden states in place) and vectorised by rounds (every
  kept token receives its k-th source in round k), which performs the same float operations per token.
- The LLaVA-Video "grid" newline path (`add_newline_token` in `spatial_compression`) is not reproduced: there the
  official code passes 2-D tensors to a function written for [B, n, C], which puts a newline after every token
  and, in groups of >= 3 frames, keeps only the first frame's tokens; vtc uses the one_token order everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

import vtc

Tensor = torch.Tensor

# --- defaults and per-task settings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class EarlyTomDefaults:
    """The official defaults (environment variables and their fallbacks in the code)."""

    retain_ratio: float = 0.1  # RETAIN_RATIO, llava_arch.py L375
    tau: float = 0.6  # T, siglip_encoder.py L381 (llava_arch.py L376 reads T with fallback 0.8 but never uses it)
    max_window: int = 8  # M, siglip_encoder.py L382 (every script sets 6); a group holds at most M - 1 frames
    ema: float = 0.9  # EMA, siglip_encoder.py L378 (the scripts set EMA=0.9 without exporting it)
    mode: str = "mixing"  # MERGE_MODE, siglip_encoder.py L379: mixing | naive_mixing | merging (= mixing)
    prune_layers: tuple[int, ...] = (6, 21, 23)  # PRUNE_LAYERS, L383: indices into the 26 kept SigLIP layers
    d: float = 0.0  # D, llava_arch.py L378: share of the per-frame budget given to DPC-kNN contextual tokens
    beta: float = 0.6  # BETA, L377: contextual token = beta * centre + (1 - beta) * mean(members)
    knn: int = 7  # K, L379 (used as min(K, clusters))
    use_beta: bool = True  # NO_BETA unset -> "0" -> beta rule (llava_arch.py L97; L380 prints a fallback "1")
    local_k: int = 1  # merge_tokens_by_local_window's local_k (windows = round(N r') / local_k)
    pool_stride: int = 2  # get_2dPool stride; OneVision mm_spatial_pool_mode = bilinear (27 -> 14)
    inner_k: int | None = None  # INNER_k: Stage III runs only when INNER_k and INNER_r are both set (main.py L26)
    inner_r: float | None = None  # INNER_r (modeling_qwen2.py falls back to 3 / 0.5 once enabled)


DEFAULTS = EarlyTomDefaults()


@dataclass(frozen=True)
class TaskSetting:
    """One row of the evaluation scripts: retain ratio RETAIN_RATIO, threshold T, PRUNE_LAYERS."""

    retain_ratio: float
    tau: float
    prune_layers: tuple[int, ...]


def _rows(taus: tuple[float, ...], layers: tuple[tuple[int, ...], ...]) -> tuple[TaskSetting, ...]:
    return tuple(TaskSetting(r, t, p) for r, t, p in zip((0.10, 0.15, 0.20, 0.25), taus, layers))


_L10, _L8, _L6, _M8, _M6, _L4 = (10, 21, 23), (8, 21, 23), (6, 21, 23), (8, 14, 20), (6, 14, 20), (4, 14, 24)
_OV_TASKS = {
    "mvbench": _rows((0.65, 0.8, 0.8, 0.8), (_M8, _M6, _M6, _M6)),
    "videomme": _rows((0.3, 0.4, 0.5, 0.7), (_L10, _L8, _L8, _L10)),
    "longvideobench_val_v": _rows((0.3, 0.5, 0.6, 0.8), (_L10, _L10, _L10, _L4)),
    "egoschema": _rows((0.3, 0.5, 0.6, 0.7), (_L10, _L10, _L10, _L10)),
}
_VID_TASKS = {
    "mvbench": _OV_TASKS["mvbench"],
    "videomme": _rows((0.3, 0.4, 0.5, 0.6), (_L10, _L8, _L8, _L10)),
    "longvideobench_val_v": _rows((0.3, 0.5, 0.6, 0.8), (_L10, _L10, _L10, _L6)),
    "egoschema": _OV_TASKS["egoschema"],
}


@dataclass(frozen=True)
class ScriptSettings:
    """The settings one evaluation script shares across tasks, and its per-task rows."""

    frames: int
    pool_mode: str
    max_window: int = 6
    ema: float = 0.9
    inner_k: int = 18
    inner_r: float = 0.5
    tasks: dict[str, tuple[TaskSetting, ...]] = field(default_factory=dict)


SCRIPT_SETTINGS: dict[str, ScriptSettings] = {
    # scripts/ov/eval_ov-7b_earlytom.sh (README example: VideoMME, 0.20, T=0.5, "8,21,23") and eval_ov-0-5b_earlytom.sh
    "llava-onevision-7b": ScriptSettings(frames=32, pool_mode="bilinear", tasks=_OV_TASKS),
    "llava-onevision-0.5b": ScriptSettings(frames=32, pool_mode="bilinear", tasks=_OV_TASKS),
    # scripts/llava-vid/eval_vid-7b_earlytom.sh: llava_vid with mm_spatial_pool_mode=average (27 -> 13), 64 frames
    "llava-video-7b": ScriptSettings(frames=64, pool_mode="average", tasks=_VID_TASKS),
}


def task_setting(model: str, task: str, retain_ratio: float) -> TaskSetting:
    """The scripts' (T, PRUNE_LAYERS) for a model ("llava-onevision-7b", ...), task and retain ratio."""
    for row in SCRIPT_SETTINGS[model].tasks[task]:
        if math.isclose(row.retain_ratio, retain_ratio):
            return row
    raise KeyError(f"no EarlyTom setting for {model} / {task} at retain ratio {retain_ratio}")


# --- Stage I: frame segmentation and mixing inside the vision tower ------------------------------------------------


def mean_token_cosine(a: Tensor, b: Tensor) -> Tensor:
    """Frame similarity: mean over tokens of the token-wise cosine, a, b [..., S, D] -> [...]
    (`F.cosine_similarity(a, b, dim=-1).mean(dim=-1)`, as in `compression` / `coarse_segment` / `fine_segment`)."""
    return F.cosine_similarity(a, b, dim=-1).mean(dim=-1)


def streaming_segments(
    normed: Tensor,
    tau: float,
    ema: float = DEFAULTS.ema,
    max_window: int = DEFAULTS.max_window,
    reset_reference: Tensor | None = None,
) -> list[tuple[int, int]]:
    """The streaming EMA segmentation of `compression` (main loop L405-424, refinement L433-448) on frames
    normed [T, S, D] (L2-normalised tokens). Groups are inclusive (start, end) frame ranges covering 0..T-1.

    sim starts at the Python float 1.0; for i = 1..T-1: sim = ema * mean_token_cosine(ref, frame_i) + (1 - ema) *
    sim (in the frames' dtype); a cut before frame i when sim < tau or i - start + 1 >= max_window (so a group has at
    most max_window - 1 frames); after a cut ref = reset_reference[i] (default normed[i]; the official refinement
    passes the un-normalised frames, which only changes rounding) and sim = 1.0."""
    num_frames = normed.shape[0]
    if num_frames <= 1:
        return [(0, num_frames - 1)]
    references = normed if reset_reference is None else reset_reference
    groups: list[tuple[int, int]] = []
    start, ref, sim = 0, normed[0], 1.0
    for i in range(1, num_frames):
        sim = ema * mean_token_cosine(ref, normed[i]) + (1 - ema) * sim
        if sim < tau or (i - start + 1) >= max_window:
            groups.append((start, i - 1))
            start, ref, sim = i, references[i], 1.0
    groups.append((start, num_frames - 1))
    return groups


@dataclass(frozen=True)
class MixedFrame:
    """One output frame of a segmentation, from input frames `frames`:
    "copy": x[frames[0]]; "mix": w * x[i] + (1 - w) * x[j] with (i, j) = frames and w = `weight` (a 0-d tensor, or
    the Python float 1.0 for the last middle pair, which makes x[j] count with weight 0); "mean": the mean of the
    contiguous frames (naive_mixing)."""

    kind: str
    frames: tuple[int, ...]
    weight: Tensor | float | None = None

    def apply(self, x: Tensor) -> Tensor:
        """This output frame from the stack x [T, ...] (the official arithmetic, operand for operand)."""
        if self.kind == "copy":
            return x[self.frames[0]]
        if self.kind == "mix":
            i, j = self.frames
            return self.weight * x[i] + (1 - self.weight) * x[j]
        return x[self.frames[0] : self.frames[-1] + 1].mean(dim=0)

    def fractions(self) -> tuple[float, ...]:
        """The weight of each of `frames` in this output frame (Python floats; the mix weights as actually used)."""
        if self.kind == "copy":
            return (1.0,)
        if self.kind == "mix":
            return (float(self.weight), float(1 - self.weight))
        return (1.0 / len(self.frames),) * len(self.frames)

    def shifted(self, offset: int) -> MixedFrame:
        return MixedFrame(self.kind, tuple(f + offset for f in self.frames), self.weight)


@dataclass(frozen=True)
class FramePlan:
    """A segmentation applied to a stack of `num_input` frames (`coarse_segment`'s output, as indices and weights).

    groups: the segmentation of the input frames; outputs: one `MixedFrame` per output frame, in output order;
    output_groups: the (start, end) range of output frames each group produced (the official `mixed_index`)."""

    num_input: int
    groups: tuple[tuple[int, int], ...]
    outputs: tuple[MixedFrame, ...]
    output_groups: tuple[tuple[int, int], ...]

    @property
    def num_output(self) -> int:
        return len(self.outputs)

    def apply(self, x: Tensor) -> Tensor:
        """x [T_in, ...] (layer output [T, S, D] or attention [T, H, S, S]) -> [T_out, ...]."""
        if x.shape[0] != self.num_input:
            raise ValueError(f"FramePlan.apply: expected {self.num_input} frames, got {x.shape[0]}")
        return torch.stack([out.apply(x) for out in self.outputs], dim=0)

    def matrix(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """The mixing matrix [T_out, T_in]: row o holds the weights of the input frames in output frame o."""
        m = torch.zeros(self.num_output, self.num_input, dtype=dtype)
        for o, out in enumerate(self.outputs):
            for frame, weight in zip(out.frames, out.fractions()):
                m[o, frame] += weight
        return m

    @property
    def dropped(self) -> tuple[int, ...]:
        """Input frames that count with weight 0 in every output frame (removed, not merged)."""
        weight = self.matrix().sum(dim=0)
        return tuple(int(i) for i in torch.nonzero(weight == 0).flatten())


def identity_plan(num_frames: int) -> FramePlan:
    """The plan of `compression` on <= 1 frame (and of a layer that is not a prune layer): every frame kept."""
    outputs = tuple(MixedFrame("copy", (i,)) for i in range(num_frames))
    groups = ((0, num_frames - 1),)
    return FramePlan(num_frames, groups, outputs, groups)


def fine_segment(feat: Tensor, tau: Tensor | float, mode: str = DEFAULTS.mode) -> list[MixedFrame]:
    """`fine_segment` (L502-548) on the middle frames feat [L, S, D] of a group, frame indices relative to feat.

    L < 2: kept as is. naive_mixing: one frame, the mean of all. mixing (and merging): adjacent similarities
    s_i = mean_token_cosine over normalised frames; walking i = 0, 1, ...: frames i, i+1 mix when s_i > tau and
    s_i > s_{i+1} (for the last pair, i = L - 2: s_i > tau alone, with weight 1.0), weight w = s_i / (s_i + s_{i+1}),
    and both are consumed; otherwise frame i is kept. Frame L - 1 is never kept on its own."""
    length = feat.shape[0]
    if length < 2:
        return [MixedFrame("copy", (i,)) for i in range(length)]
    if mode == "naive_mixing":
        return [MixedFrame("mean", tuple(range(length)))]
    normed = F.normalize(feat, dim=-1)
    sims = mean_token_cosine(normed[:-1], normed[1:])
    out: list[MixedFrame] = []
    i = 0
    while i < length - 1:
        cur = sims[i]
        if i + 1 < length - 1:
            nxt = sims[i + 1]
            merge = cur > tau and cur > nxt
        else:
            nxt = 0.0
            merge = cur > tau
        if merge:
            weight = cur / (cur + nxt) if nxt != 0 else 1.0
            out.append(MixedFrame("mix", (i, i + 1), weight))
            i += 2
        else:
            out.append(MixedFrame("copy", (i,)))
            i += 1
    return out


def coarse_segment(
    hidden: Tensor, groups: list[tuple[int, int]], normed: Tensor | None = None, mode: str = DEFAULTS.mode
) -> FramePlan:
    """`coarse_segment` (L456-497): groups of 1 or 2 frames are kept; longer groups keep their first and last frame
    and `fine_segment` their middle frames with tau = mean_token_cosine(normed[start], normed[end]).
    hidden [T, S, D] is the layer output; normed its L2-normalised tokens (computed when None)."""
    if normed is None:
        normed = F.normalize(hidden, p=2, dim=-1)
    outputs: list[MixedFrame] = []
    output_groups: list[tuple[int, int]] = []
    for s, e in groups:
        length = e - s + 1
        if length <= 0:
            continue
        first = len(outputs)
        if length <= 2:
            outputs += [MixedFrame("copy", (f,)) for f in range(s, e + 1)]
        else:
            tau = mean_token_cosine(normed[s], normed[e])
            middle = [m.shifted(s + 1) for m in fine_segment(hidden[s + 1 : e], tau, mode)]
            outputs += [MixedFrame("copy", (s,)), *middle, MixedFrame("copy", (e,))]
        output_groups.append((first, len(outputs) - 1))
    return FramePlan(hidden.shape[0], tuple(groups), tuple(outputs), tuple(output_groups))


def refine_segments(
    merged: Tensor, tau: float, ema: float = DEFAULTS.ema, max_window: int = DEFAULTS.max_window
) -> list[tuple[int, int]]:
    """The last prune layer's refinement (L432-449): the streaming segmentation again, on the mixed frames
    merged [T', S, D], with the un-normalised frame as the reference after a cut (as the official code)."""
    return streaming_segments(F.normalize(merged, p=2, dim=-1), tau, ema, max_window, reset_reference=merged)


def compress_frames(
    hidden: Tensor,
    tau: float = DEFAULTS.tau,
    ema: float = DEFAULTS.ema,
    max_window: int = DEFAULTS.max_window,
    mode: str = DEFAULTS.mode,
    last_layer: bool = False,
) -> tuple[FramePlan, list[tuple[int, int]]]:
    """`SigLipEncoder.compression` (L388-451) on the output hidden [T, S, D] of a prune layer.

    Returns (plan, groups): `plan.apply(hidden)` / `plan.apply(attention)` are the official merged frames and
    attention maps; groups are the segmentation of the input frames, or, at the last prune layer
    (`last_layer=True`), the refined segmentation of the output frames, which Stage II uses (`selected_frames`)."""
    num_frames = hidden.shape[0]
    if num_frames <= 1:
        return identity_plan(num_frames), [(0, num_frames - 1)]
    normed = F.normalize(hidden, p=2, dim=-1)
    groups = streaming_segments(normed, tau, ema, max_window)
    plan = coarse_segment(hidden, groups, normed, mode)
    if last_layer:
        groups = refine_segments(plan.apply(hidden), tau, ema, max_window)
    return plan, groups


def frame_fate(plans: list[FramePlan]) -> Tensor:
    """Composition of successive prune layers' plans: [T_final, T_0] weights of each original frame in each final
    frame (float64). A column of zeros is an original frame that was dropped."""
    fate = torch.eye(plans[0].num_input, dtype=torch.float64)
    for plan in plans:
        fate = plan.matrix() @ fate
    return fate


# --- Stage II: decoupled spatial selection at the connector ------------------------------------------------------


def received_attention(attention: Tensor) -> Tensor:
    """`encode_images_multi` L30: attention maps [T, H, S, S] -> mean over heads and queries [T, S]."""
    return attention.mean(dim=(1, 2))


def pool_2d(x: Tensor, side: int, stride: int = DEFAULTS.pool_stride, mode: str = "bilinear") -> Tensor:
    """`get_2dPool` (LLaVA-NeXT llava_arch.py L189-208): x [T, side * side, C] -> [T, S', C]; bilinear resizes to
    ceil(side / stride) per side (align_corners False), average / max pool with kernel = stride (floor)."""
    frames, _, dim = x.shape
    grid = x.view(frames, side, side, -1).permute(0, 3, 1, 2).contiguous()
    if mode == "average":
        grid = F.avg_pool2d(grid, stride)
    elif mode == "max":
        grid = F.max_pool2d(grid, stride)
    elif mode == "bilinear":
        height, width = grid.shape[2:]
        grid = F.interpolate(grid, size=[math.ceil(height / stride), math.ceil(width / stride)], mode="bilinear")
    else:
        raise ValueError(f"pool_2d: unknown mode {mode!r}")
    return grid.permute(0, 2, 3, 1).view(frames, -1, dim)


def rescaled_ratio(retain_ratio: float, init_frames: int, reduced_frames: int, seq_len: int) -> float:
    """L396-398: r' = min(r / ((N - reduced) / N), 1) with N = T0 * S and reduced = (T0 - T') * S, i.e.
    min(r * T0 / T', 1), so the final count is about r * T0 * S whatever Stage I removed."""
    total_tokens = init_frames * seq_len
    reduced_tokens = (init_frames - reduced_frames) * seq_len
    return min(retain_ratio / ((total_tokens - reduced_tokens) / total_tokens), 1)


def split_static_dynamic(groups: list[tuple[int, int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """`divided_static_dynamic` (L291-334) as indices: per group (dynamic frames, static frames). Groups of <= 2
    frames are all dynamic; longer groups: first and last dynamic, the middle frames static."""
    out = []
    for start, end in groups:
        if end - start + 1 <= 2:
            out.append((tuple(range(start, end + 1)), ()))
        else:
            out.append(((start, end), tuple(range(start + 1, end))))
    return out


def frame_budgets(seq_len: int, retain_ratio: float) -> tuple[int, int]:
    """Tokens per frame: (dynamic = ceil(S r'), static = max(1, round(S r'))) (L134-135, L177; static is exact
    with local_k = 1, where the number of windows equals the target)."""
    return math.ceil(seq_len * retain_ratio), max(1, round(seq_len * retain_ratio))


def group_token_count(num_frames: int, seq_len: int, retain_ratio: float) -> int:
    """Tokens a group of `num_frames` (reduced) frames yields at rescaled ratio r'."""
    dynamic, static = frame_budgets(seq_len, retain_ratio)
    if num_frames <= 2:
        return num_frames * dynamic
    return 2 * dynamic + (num_frames - 2) * static


def video_token_count(
    group_sizes: list[int], seq_len: int, retain_ratio: float, init_frames: int, newline: bool = True
) -> int:
    """Visual tokens reaching the LLM for one video: refined group sizes (summing to T'), pooled tokens per frame
    S, the user's ratio r and T0 input frames; plus OneVision's trailing newline (one_token) when `newline`."""
    ratio = rescaled_ratio(retain_ratio, init_frames, sum(group_sizes), seq_len)
    return sum(group_token_count(n, seq_len, ratio) for n in group_sizes) + int(newline)


def dpc_knn_centers(
    x: Tensor, cluster_num: int, k: int = DEFAULTS.knn, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """`cluster_dpc_knn` (L35-57) on x [B, N, C]: dist = cdist / sqrt(C) in float32; density = exp(-mean of the k
    smallest squared distances) + U(0, 1e-6); delta = distance to the nearest denser token (the largest distance for
    the densest); returns (the `cluster_num` highest delta * density, in score order [B, cluster_num], dist)."""
    with torch.no_grad():
        _, _, dim = x.shape
        dist = torch.cdist(x.float(), x.float()) / (dim**0.5)
        nearest, _ = torch.topk(dist, k, dim=-1, largest=False)
        density = (-(nearest**2).mean(dim=-1)).exp()
        rng_device = density.device if generator is None else generator.device
        noise = torch.rand(density.shape, device=rng_device, dtype=density.dtype, generator=generator)
        density = density + noise.to(density.device) * 1e-6
        mask = (density[:, None, :] > density[:, :, None]).type(x.dtype)
        dist_max = dist.flatten(1).max(dim=-1).values[:, None, None]
        delta, _ = (dist * mask + dist_max * (1 - mask)).min(dim=-1)
        _, centers = (delta * density).topk(cluster_num, dim=-1)
    return centers, dist


def cluster_merge(
    feat: Tensor, centers: Tensor, dist: Tensor, beta: float = DEFAULTS.beta, use_beta: bool = DEFAULTS.use_beta
) -> Tensor:
    """`merge_tokens_by_clustering` (L60-110): every non-centre token of feat [B, N, C] joins its nearest centre
    (dist [B, N, N]); cluster token = beta * centre + (1 - beta) * mean(members) (use_beta; else the mean of centre and
    members); a centre without members stays. Returns [B, len(centers), C] in the order of `centers`."""
    batch, seq_len, _ = feat.shape
    out = []
    for b in range(batch):
        is_center = torch.zeros(seq_len, dtype=torch.bool, device=feat.device)
        is_center[centers[b]] = True
        others = torch.arange(seq_len, device=feat.device)[~is_center]
        assign = torch.argmin(dist[b][others][:, centers[b]], dim=-1)
        members_all = feat[b][others]
        tokens = []
        for i in range(centers.shape[1]):
            center = feat[b][centers[b][i]]
            members = members_all[assign == i]
            if members.shape[0] == 0:
                tokens.append(center)
            elif use_beta:
                tokens.append(beta * center + (1 - beta) * members.mean(dim=0))
            else:
                tokens.append(torch.cat([center.unsqueeze(0), members], dim=0).mean(dim=0))
        out.append(torch.stack(tokens))
    return torch.stack(out)


def select_dominant(
    feat: Tensor,
    attn: Tensor,
    pos: Tensor,
    retain_ratio: float,
    d: float = DEFAULTS.d,
    beta: float = DEFAULTS.beta,
    knn: int = DEFAULTS.knn,
    use_beta: bool = DEFAULTS.use_beta,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """`merge_tokens_by_attention_frame` (L132-170), per dynamic frame: feat [B, N, C], attn [B, N], pos [B, N] ->
    (tokens [B, ceil(N r'), C], pos). round(ceil(N r') (1 - d)) dominant tokens = the top attention, in index order;
    the rest of the budget: DPC-kNN centres over the remaining tokens (sorted by index) merged by `cluster_merge`,
    placed after the dominant tokens with their centre's position."""
    batch, seq_len, dim = feat.shape
    budget = math.ceil(seq_len * retain_ratio)
    dominant_num = round(budget * (1 - d))
    contextual_num = budget - dominant_num
    keep = torch.zeros(batch, seq_len, dtype=torch.bool, device=feat.device)
    if dominant_num > 0:
        keep.scatter_(1, attn.topk(dominant_num, dim=1).indices, True)
    tokens, positions = [feat[keep].view(batch, dominant_num, dim)], [pos[keep].view(batch, dominant_num)]
    if contextual_num > 0:
        rest = feat[~keep].view(batch, seq_len - dominant_num, dim)
        rest_pos = pos[~keep].view(batch, seq_len - dominant_num)
        centers, dist = dpc_knn_centers(rest, contextual_num, k=min(knn, contextual_num), generator=generator)
        centers = torch.sort(centers, dim=-1)[0]
        tokens.append(cluster_merge(rest, centers, dist, beta, use_beta))
        positions.append(rest_pos.gather(1, centers))
    return torch.cat(tokens, dim=1), torch.cat(positions, dim=1)


def select_local_windows(
    feat: Tensor,
    attn: Tensor,
    pos: Tensor,
    retain_ratio: float,
    local_k: int = DEFAULTS.local_k,
    num_windows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """`merge_tokens_by_local_window` (L173-242), per static frame: feat [B, N, C], attn [B, N], pos [B, N] ->
    exactly target = max(1, round(N r')) tokens. The flattened token sequence is cut into W = ceil(target / local_k)
    contiguous windows (sizes N // W, the first N % W one longer; local_k shrinks when windows are too small); each
    window gives its local_k most attended tokens (attention order), windows in order; a surplus is resampled at
    round(arange(0, n, n / target)), a shortfall padded with the last token."""
    batch, seq_len, _ = feat.shape
    target = max(1, round(seq_len * retain_ratio))
    if num_windows is None:
        num_windows = max(1, math.ceil(target / local_k))
    if seq_len // num_windows < local_k:
        local_k = max(1, seq_len // num_windows)
        num_windows = math.ceil(target / local_k)
    base, remainder = divmod(seq_len, num_windows)
    sizes = [base + 1 if i < remainder else base for i in range(num_windows)]
    chosen = []
    offset = 0
    for window_attn in torch.split(attn, sizes, dim=1):
        size = window_attn.shape[1]
        k = min(local_k, size)
        if k == 0:
            continue
        chosen.append(window_attn.topk(k=k, dim=1).indices + offset)
        offset += size
    index = torch.cat(chosen, dim=1)
    count = index.shape[1]
    if count > target:
        index = index[:, torch.round(torch.arange(0, count, count / target, device=feat.device)).long()]
    elif count < target:
        index = torch.cat([index, index[:, -1:].expand(-1, target - count)], dim=1)
    rows = torch.arange(batch, device=feat.device).unsqueeze(1).expand(-1, index.shape[1])
    return feat[rows, index, :], pos[rows, index]


@dataclass(frozen=True)
class SpatialOutput:
    """Stage II output for one video: tokens [n, C] in LLM order, the reduced-stack frame and the pooled-grid
    position of each token (a contextual token carries its centre's position)."""

    tokens: Tensor
    frame: Tensor
    position: Tensor


def spatial_stage(
    feat: Tensor,
    attn: Tensor,
    groups: list[tuple[int, int]],
    retain_ratio: float,
    d: float = DEFAULTS.d,
    beta: float = DEFAULTS.beta,
    knn: int = DEFAULTS.knn,
    use_beta: bool = DEFAULTS.use_beta,
    generator: torch.Generator | None = None,
) -> SpatialOutput:
    """`spatial_compression` over the refined groups (prepare_inputs L401-415, one_token models): feat [T', S, C]
    pooled features, attn [T', S] pooled received attention, retain_ratio the rescaled r'. Per group:
    [first frame ; middle frames (frame-major) ; last frame], groups of <= 2 frames frame by frame."""
    seq_len = feat.shape[1]
    grid_pos = torch.arange(seq_len, device=feat.device)
    tokens, frames, positions = [], [], []
    for dynamic, static in split_static_dynamic(groups):
        dyn = list(dynamic)
        dyn_tok, dyn_pos = select_dominant(
            feat[dyn], attn[dyn], grid_pos.expand(len(dyn), -1), retain_ratio, d, beta, knn, use_beta, generator
        )
        dyn_frame = torch.tensor(dyn, device=feat.device)[:, None].expand_as(dyn_pos)
        if not static:
            parts = [(dyn_tok.flatten(0, 1), dyn_frame.flatten(), dyn_pos.flatten())]
        else:
            st = list(static)
            st_tok, st_pos = select_local_windows(feat[st], attn[st], grid_pos.expand(len(st), -1), retain_ratio)
            st_frame = torch.tensor(st, device=feat.device)[:, None].expand_as(st_pos)
            parts = [
                (dyn_tok[0], dyn_frame[0], dyn_pos[0]),
                (st_tok.flatten(0, 1), st_frame.flatten(), st_pos.flatten()),
                (dyn_tok[-1], dyn_frame[-1], dyn_pos[-1]),
            ]
        for t, f, p in parts:
            tokens.append(t)
            frames.append(f)
            positions.append(p)
    return SpatialOutput(torch.cat(tokens), torch.cat(frames), torch.cat(positions))


# --- Stage III: the optional merge inside the LLM ----------------------------------------------------------------


def inner_keep_count(num_visual: int, r: float) -> int:
    """Visual tokens kept at layer INNER_k: round(V (1 - r)) (V counts OneVision's trailing newline)."""
    return round(num_visual * (1 - r))


def inner_merge(hidden: Tensor, scores: Tensor, start: int, length: int, r: float) -> tuple[Tensor, Tensor]:
    """`Qwen2Model_earlytom.forward` L240-305 at layer INNER_k (prefill): hidden [B, L, C] (layer INNER_k - 1's
    output), scores [length] = that layer's attention of the last query over the visual span [start, start +
    length), averaged over heads (batch row 0). Keeps the top round(length (1 - r)) visual tokens; each other visual
    token, in index order, is folded into its most cosine-similar kept token (first max in top-k order) by
    kept <- (kept + token) / 2. Returns (hidden[:, keep], keep): keep = sorted sequence indices, which are also the
    official position ids of the remaining tokens (original positions; rotary recomputed)."""
    num_keep = inner_keep_count(length, r)
    if num_keep < 1:
        raise ValueError(f"inner_merge: no visual token left (length {length}, r {r})")
    device = hidden.device
    top = scores.topk(num_keep).indices + start
    visual = torch.arange(length, device=device)
    others = visual[~torch.isin(visual, top - start)] + start
    src, dst = hidden[:, others, :], hidden[:, top, :]
    sim = torch.bmm(src, dst.transpose(1, 2)) / (
        torch.norm(src, dim=-1, keepdim=True) * torch.norm(dst, dim=-1, keepdim=True).transpose(1, 2)
    )
    _, partner = torch.max(sim, dim=-1)
    hidden = hidden.clone()
    for b in range(hidden.shape[0]):
        target = top[partner[b]]  # destination of each source, sources in index order
        order = torch.sort(target, stable=True).indices
        sorted_target = target[order]
        first = torch.ones_like(sorted_target, dtype=torch.bool)
        first[1:] = sorted_target[1:] != sorted_target[:-1]
        run_start = torch.cummax(torch.where(first, torch.arange(len(order), device=device), 0), dim=0).values
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order), device=device) - run_start
        for k in range(int(rank.max()) + 1 if len(rank) else 0):
            chosen = rank == k
            d_idx, s_idx = target[chosen], others[chosen]
            hidden[b, d_idx, :] = (hidden[b, d_idx, :] + hidden[b, s_idx, :]) / 2
    tail = torch.arange(start + length, hidden.shape[1], device=device)
    keep = torch.cat((torch.arange(start, device=device), top, tail)).sort().values
    return hidden[:, keep, :], keep


# --- the method ---------------------------------------------------------------------------------------------------

SIGLIP_LAYERS = 26  # the official tower: SigLIP-so400m with its last layer deleted (what PRUNE_LAYERS index)
README_SETTING = TaskSetting(0.20, 0.5, (8, 21, 23))  # the official README's example (VideoMME), with M = 6


def tower_prune_layers(layers: tuple[int, ...], run_layers: int) -> tuple[int, ...]:
    """The official PRUNE_LAYERS (indices into the 26-layer SigLIP) on a tower that runs `run_layers` blocks up to
    the features the projector reads: the same relative depth, floor(l * run_layers / 26), repeats dropped (on the
    26-layer tower: the official indices)."""
    return tuple(sorted({min(run_layers - 1, (layer * run_layers) // SIGLIP_LAYERS) for layer in layers}))


@vtc.method(
    "earlytom",
    paper="Early Token Compression Completes Fast Video Understanding (CVPR 2026)",
    url="https://arxiv.org/abs/2605.30010",
    summary="inside SigLIP: frames grouped by an EMA of frame similarity, middle frames pair-mixed, so later tower "
    "layers run on fewer frames; per group, attention-ranked tokens of the first / last frame and one token per "
    "local window of the middle frames",
    retention_note="the LLM sees about r * frames * tokens per frame: the budget is rescaled to the frames left "
    "(r' = r T0 / T') and rounded per frame (ceil for first / last frames, round for middle ones), so the count "
    "depends on the content by up to a token per frame",
    exempt={
        "identity_at_full_retention": "Stage I mixes similar frames whatever the retention (the official RETAIN_RATIO "
        "sets Stage II's budget only); its identity setting, tau above 1 with retention 1.0, is checked in "
        "tests/test_earlytom.py"
    },
)
class EarlyTom(vtc.TowerMerger):
    """EarlyTom's Stage I (frame mixing after the PRUNE_LAYERS of the vision tower) and Stage II (per-group token
    selection after the projector and the pooling); official: viridisGreen/EarlyTom (LLaVA-OneVision /
    LLaVA-Video). Stage III (an optional HoliTom inner merge in the LLM) is not part of it: compose with vtc's
    own in-LLM methods instead."""

    temporal = True  # frames are grouped by the similarity of consecutive frames: videos only

    ratio: float | None = vtc.param(None, range="(0, 1]", doc="RETAIN_RATIO; default: the retention, else 0.2")
    tau: float = vtc.param(
        README_SETTING.tau, range="[-1, inf)", doc="T: a new frame group when the EMA similarity < T (> 1: no mixing)"
    )
    max_window: int = vtc.param(6, range="[2, inf)", doc="M: a group holds at most M - 1 frames (the scripts' 6)")
    ema: float = vtc.param(DEFAULTS.ema, range="[0, 1]", doc="EMA weight of the new frame's similarity")
    mode: str = vtc.param(DEFAULTS.mode, choices=("mixing", "naive_mixing"), doc="MERGE_MODE of the middle frames")
    prune_layers: tuple | None = vtc.param(
        None,
        doc="tower layers whose output is segmented and mixed (0-based); None: the README's 8,21,23 of the 26-layer "
        "SigLIP, at the same relative depth on other towers",
    )

    requires: ClassVar[frozenset[str]] = frozenset({"tower_blocks", "patch_grid"})
    whole_frames: ClassVar[bool] = True  # Stage II ranks every pooled token of every frame Stage I left

    def fraction(self) -> float:
        if self.ratio is not None:
            return self.ratio
        return self.retention if self.retention is not None else README_SETTING.retain_ratio

    def validate(self) -> None:
        if self.prune_layers is not None and (
            not self.prune_layers
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.prune_layers)
        ):
            raise ValueError(f"earlytom: prune_layers must be tower layer indices >= 0, got {self.prune_layers!r}")

    def layers(self, run_layers: int) -> tuple[int, ...]:
        if self.prune_layers is None:
            return tower_prune_layers(README_SETTING.prune_layers, run_layers)
        layers = tuple(sorted(set(self.prune_layers)))
        if layers[-1] >= run_layers:
            raise ValueError(
                f"earlytom: prune layer {layers[-1]} is past the last tower layer whose output the projector reads "
                f"({run_layers - 1}); choose layers in 0..{run_layers - 1}"
            )
        return layers

    def attention_layers(self, num_layers):
        return frozenset(self.layers(num_layers)[-1:])  # Stage II ranks by the last prune layer's attention

    def encode_block(self, tokens, ctx):
        layers = self.layers(tokens.num_layers)
        if tokens.layer not in layers:
            return tokens
        frames = torch.unique(tokens.frame)
        per_frame = len(tokens) // frames.numel()
        cls = int(tokens.has_class_token)
        if per_frame != tokens.grid[1] * tokens.grid[2] + cls:
            raise ValueError(
                "earlytom mixes frames cell by cell, but another tower method merged tokens within frames before its "
                f"prune layer {tokens.layer} ({per_frame} tokens per frame of {tokens.grid[1]}x{tokens.grid[2]}); "
                "use earlytom without tome, or with connect methods only"
            )
        state = ctx.state.setdefault(ctx.video_index, {})
        if tokens.point == "after_attention":
            if tokens.layer == layers[-1]:  # Stage II ranks by this layer's attention, mixed as its frames are
                state["received"] = tokens.received.view(frames.numel(), per_frame)[:, cls:]
            return tokens
        if tokens.point != "after_block":
            return tokens
        hidden = tokens.hidden[:, 0].view(frames.numel(), per_frame, -1)
        last = tokens.layer == layers[-1]
        plan, groups = compress_frames(hidden[:, cls:], self.tau, self.ema, self.max_window, self.mode, last)
        if last:
            state["groups"] = groups
            state["received"] = plan.apply(state["received"])
        keep, src, dst = [], [], []
        cells = torch.arange(per_frame, device=hidden.device)
        for out in plan.outputs:
            anchor = out.frames[0] * per_frame + cells
            keep.append(anchor)
            for frame, weight in zip(out.frames[1:], out.fractions()[1:]):
                if weight != 0:  # a frame mixed in with weight 0 (the last middle pair's quirk) is dropped
                    src.append(frame * per_frame + cells)
                    dst.append(anchor)
        ctx.report(frames_left=plan.num_output)
        mixed = plan.apply(hidden).reshape(-1, 1, hidden.shape[-1])
        empty = cells[:0]
        return tokens.merge(torch.cat(keep), torch.cat(src or [empty]), torch.cat(dst or [empty]), hidden=mixed)

    def connect(self, tokens, ctx):
        state = ctx.state.get(ctx.video_index, {})
        if "groups" not in state:
            raise RuntimeError(
                "earlytom: its connect stage found no Stage I record for this video (the vision tower ran without "
                "vtc's encode stage: pass pixel_values_videos, not precomputed features)"
            )
        groups, received = state["groups"], state["received"]
        kept_frames = received.shape[0]
        per_frame = tokens.grid[1] * tokens.grid[2]
        if len(tokens) != kept_frames * per_frame:
            raise RuntimeError(
                f"earlytom: expected the {kept_frames} frames Stage I left whole, got {len(tokens)} tokens"
            )
        side = int(math.isqrt(received.shape[1]))
        mode = ctx.geometry.pooling if ctx.geometry is not None else "bilinear"
        attention = pool_2d(received[..., None].float(), side, DEFAULTS.pool_stride, mode)[..., 0]
        ratio = rescaled_ratio(self.fraction(), tokens.grid[0], kept_frames, per_frame)
        feat = tokens.embeds.view(kept_frames, per_frame, -1)
        out = spatial_stage(feat, attention.to(feat.device), groups, ratio)
        ctx.report(frames_after_tower=kept_frames, rescaled_ratio=ratio)
        return tokens.select(torch.sort(out.frame * per_frame + out.position).values)
