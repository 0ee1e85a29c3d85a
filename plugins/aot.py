"""AOT: "Token Reduction via Local and Global Contexts Optimization for Efficient Video Large Language Models"
(Li, Jiang, Zhang, Sebe; CVPR 2026). arXiv: https://arxiv.org/abs/2603.01400. Official code: TyroneLi/AOT
(`LLaVA-NeXT/llava/model/llava_arch.py`: `window_cls_selection_siglip`, `token_merging_siglip_with_OTA`,
`Sinkhorn_v1`, `ota_merge_N_to_M_time`, `encode_images_siglip_OTA`, `get_2dPool_index`, the patched
`prepare_inputs_labels_for_multimodal` with `temporal_ota_merge`; `scripts/eval_ov-7b.sh`, `eval_vid-7b.sh`).

Intra-frame: pick token anchors per frame (local ones per 3x3 window by shallow vision-tower attention, global
ones by deep attention), fold every other token into the anchors with Sinkhorn optimal transport (blended with
a nearest-neighbour merge), then pool and keep the cells the pooled anchor mask covers. Inter-frame: in each
clip the first frame's tokens are anchors; later frames' well-matched tokens are transported into them, the
KEEP_RATIO least-matched stay as residuals. Stage: connect (needs vision-tower attention and, on LLaVA, the
pre-pool 27x27 grid).

Faithful to the official code: window top-k by the layer-5 "received" map and global top-k by the layer -2 map
with the local picks zeroed; cost (1 - cos) + 0.5 * spatial distance on a [0, 1]^2 grid; `Sinkhorn_v1` with
eps 0.1, 100 iterations, tol 1e-2, one stop criterion shared by all frames of the video; the OT update with
scale 1.0 (INTRA_SCALE is ignored, as in the code), 0.1 * nearest-neighbour + 0.9 * OT written back into the
pre-pool grid; the model's pooling; the pooled float mask >= 0.5; the time cost 1 - exp(-dt^2 / (2 * 1.5^2)),
`quantile(pmax, KEEP_RATIO)` residuals, cumulative anchor updates, the per-clip order [anchors ; residuals
f1 ; ... ; merged anchors] with the anchor frame twice; OT arithmetic in the model dtype. vtc differences:
clips of F // 8 frames for any frame count (official: 32 or 64 frames only); the model's newline token
stays (the official line that would append it does not parse); on LLaVA-NeXT-Video the OT runs on CLIP
features (its pooling precedes the projector); on Qwen families (no pre-pool grid) anchors and OT run on the
LLM token grid and the anchors are kept (no pooling mask). See docs/methods/aot.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

import vtc
from vtc.core.geometry import FamilyGeometry, default_geometry
from vtc.core.tokens import VideoTokens
from vtc.core.vision_stats import VisionStat
from vtc_kernels import reconcile_count, sinkhorn

Tensor = torch.Tensor

SIGLIP_TOKENS = 729  # 27 x 27: the grid VISUAL_TOKEN_NUM counts on
# the two LLaVA-OV-7B settings of scripts/eval_ov-7b.sh (VISUAL_TOKEN_NUM, KEEP_RATIO); both are the runs the
# repo's logs and the paper's table label "10 %"
SETTINGS = {"mvbench": (126, 0.3), "videomme": (108, 0.1)}
# scripts/eval_vid-7b.sh (LLaVA-Video-7B, no inter-frame step): VISUAL_TOKEN_NUM 180, logged as "25 %"
NO_INTER_POINT = (180, 0.25)


# --- budgets ------------------------------------------------------------------------------------------------------


def scaled_token_num(visual_token_num: int, h: int, w: int) -> int:
    """VISUAL_TOKEN_NUM (out of 729) on an h x w grid: the same fraction of its tokens."""
    return visual_token_num if h * w == SIGLIP_TOKENS else max(1, round(visual_token_num * h * w / SIGLIP_TOKENS))


def anchor_budget(visual_token_num: int, global_ratio: float, windows: int = 3) -> tuple[int, int]:
    """(local anchors per window, global anchors): `int(V (1 - g)) // windows^2` and `V - int(V (1 - g))`."""
    local_total = int(visual_token_num * (1 - global_ratio))
    return local_total // (windows * windows), visual_token_num - local_total


def window_bounds(size: int, windows: int = 3) -> list[tuple[int, int]]:
    """Row (or column) ranges of `windows` bands: 27 -> [0, 9), [9, 18), [18, 27); any size in near-equal bands."""
    edges = [(i * size) // windows for i in range(windows + 1)]
    return [(edges[i], edges[i + 1]) for i in range(windows)]


def anchors_on_grid(visual_token_num: int, global_ratio: float, h: int, w: int, windows: int = 3) -> int:
    """Anchors `select_anchors` picks on a full h x w grid (windows smaller than their quota give all cells)."""
    per_window, num_global = anchor_budget(visual_token_num, global_ratio, windows)
    local = sum(
        min(per_window, (r1 - r0) * (c1 - c0))
        for r0, r1 in window_bounds(h, windows)
        for c0, c1 in window_bounds(w, windows)
    )
    return local + min(num_global, h * w - local)


def residual_count(n: int, keep_ratio: float) -> int:
    """Tokens strictly below the linear-interpolation `quantile(pmax, keep_ratio)` of n distinct values."""
    return 0 if n <= 1 else min(n, math.ceil(keep_ratio * (n - 1)))


def clip_segments(num_frames: int, clip: int) -> list[tuple[int, int]]:
    """(first frame, length) of each clip: consecutive runs of `clip` frames (the last one may be shorter)."""
    return [(start, min(clip, num_frames - start)) for start in range(0, num_frames, clip)]


def frame_count_for(v: int, h: int, w: int, prepool_grid: bool, global_ratio: float = 0.5, windows: int = 3) -> int:
    """Tokens a frame keeps in fixed-count mode on an h x w token grid, for VISUAL_TOKEN_NUM v: on models that pool
    a 27 x 27 patch grid (LLaVA) the anchors' share of that grid, else the anchors picked on the token grid."""
    if prepool_grid:
        if v >= SIGLIP_TOKENS:
            return h * w
        frac = anchors_on_grid(v, global_ratio, 27, 27, windows) / SIGLIP_TOKENS
        return max(1, min(h * w, round(frac * h * w)))
    vg = scaled_token_num(v, h, w)
    return h * w if vg >= h * w else anchors_on_grid(vg, global_ratio, h, w, windows)


@functools.lru_cache(maxsize=1024)
def visual_token_num_for(
    retention: float,
    grid: tuple[int, int, int],
    keep_ratio: float,
    clip: int,
    inter: bool,
    prepool_grid: bool,
    global_ratio: float = 0.5,
    windows: int = 3,
) -> int:
    """VISUAL_TOKEN_NUM for a retention: the v (1..729) whose fixed-count total (`frame_count_for` per frame, then
    the inter-frame step's clips) is closest to round(retention * T * H * W), the smaller v on ties. The adaptive
    count then follows it up to the content-dependent pooled mask and residual quantile."""
    t, h, w = grid
    target = round(retention * t * h * w)

    def miss(v: int) -> tuple[int, int]:
        frame = frame_count_for(v, h, w, prepool_grid, global_ratio, windows)
        return abs(fixed_total(frame, t, clip, keep_ratio, inter) - target), v

    return min(range(1, SIGLIP_TOKENS + 1), key=miss)


def fixed_total(frame_count: int, num_frames: int, clip: int, keep_ratio: float, inter: bool) -> int:
    """Tokens of a video whose frames all keep `frame_count` tokens, after the inter-frame step."""
    if not inter or clip <= 1:
        return num_frames * frame_count
    total = 0
    for _, length in clip_segments(num_frames, clip):
        total += frame_count
        if length > 1:
            total += frame_count + (length - 1) * residual_count(frame_count, keep_ratio)
    return total


# --- intra-frame: anchors and OT merge ----------------------------------------------------------------------------


def select_anchors(
    shallow: Tensor,
    deep: Tensor,
    h: int,
    w: int,
    per_window: int,
    num_global: int,
    windows: int = 3,
    valid: Tensor | None = None,
) -> Tensor:
    """Anchor mask [F, h*w]: in each of windows x windows windows the top `per_window` tokens by the shallow
    map; then, with those zeroed in the deep map, the top `num_global` by the deep map. `valid` [F, h*w]
    marks tokens that exist (absent ones are never picked)."""
    frames, length = shallow.shape
    mask = torch.zeros(frames, length, dtype=torch.bool, device=shallow.device)
    cell = torch.arange(length, device=shallow.device).view(h, w)
    if per_window > 0:
        for r0, r1 in window_bounds(h, windows):
            for c0, c1 in window_bounds(w, windows):
                cells = cell[r0:r1, c0:c1].reshape(-1)  # row-major within the window, as the official loop
                if cells.numel() == 0:
                    continue
                scores = shallow[:, cells]
                k = min(per_window, cells.numel())
                if valid is not None:
                    scores = scores.masked_fill(~valid[:, cells], float("-inf"))
                    k = min(k, int(valid[:, cells].sum(-1).min()))
                if k > 0:
                    mask.scatter_(1, cells[torch.topk(scores, k, dim=-1).indices], True)
    rest = deep.clone()
    rest[mask] = 0  # `image_attentions_deep[b, local_indices[b]] = 0`
    free = ~mask if valid is None else valid & ~mask
    if valid is not None:
        rest = rest.masked_fill(~valid, float("-inf"))
    k = min(num_global, int(free.sum(-1).min()))
    if k > 0:
        mask.scatter_(1, torch.topk(rest, k, dim=-1).indices, True)
    return mask


def grid_coords(h: int, w: int, dtype=torch.float32, device=None) -> Tensor:
    """(x, y) of every cell of an h x w grid on [0, 1]^2, row-major: [h*w, 2]."""
    yy, xx = torch.meshgrid(
        torch.linspace(0, 1, h, device=device, dtype=dtype),
        torch.linspace(0, 1, w, device=device, dtype=dtype),
        indexing="ij",
    )
    return torch.stack([xx, yy], dim=-1).view(-1, 2)


@dataclasses.dataclass
class IntraMerge:
    """The intra-frame OT merge of F frames with N anchors and M other tokens each."""

    features: Tensor  # [F, L, D] the input with every anchor replaced by its merged value
    anchors: Tensor  # [F, N] anchor indices (ascending)
    others: Tensor  # [F, M] non-anchor indices (ascending)
    plan: Tensor  # [F, M, N] Sinkhorn plan (rows: non-anchors)
    nearest: Tensor  # [F, M] most cosine-similar anchor of each non-anchor
    count: Tensor  # [F, N] non-anchors whose nearest anchor it is
    load: Tensor  # [F, N] plan mass each anchor receives (column sums, clamped at 1e-9)
    nn_weight: float = 0.1

    def coefficients(self) -> tuple[Tensor, Tensor]:
        """The merge as a linear map: merged anchor n = a[n] x_n + sum_m W[n, m] x_m. Returns (a [F, N],
        W [F, N, M]) in float32 (used for side features that must follow the tokens)."""
        count = self.count.float()
        load = self.load.float()
        nn_part = self.nn_weight / (1.0 + count)
        ot_part = (1.0 - self.nn_weight) / (1.0 + load)
        a = nn_part + ot_part
        onehot = F.one_hot(self.nearest, self.anchors.shape[1]).float()  # [F, M, N]
        weights = onehot * nn_part[:, None, :] + self.plan.float() * ot_part[:, None, :]
        return a, weights.transpose(1, 2)


def intra_ot_merge(
    x: Tensor,
    mask: Tensor,
    coords: Tensor,
    epsilon: float = 0.1,
    max_iter: int = 100,
    tol: float = 1e-2,
    spatial_weight: float = 0.5,
    nn_weight: float = 0.1,
) -> IntraMerge:
    """`token_merging_siglip_with_OTA` on x [F, L, D] with anchor mask [F, L] (the same count in every frame)
    and cell coordinates [L, 2]. All frames share one Sinkhorn run (one stop criterion), as the official
    batch over the video's frames. Arithmetic in x's dtype."""
    frames, length, dim = x.shape
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # anchors first, each part ascending
    num_anchors = int(mask[0].sum())
    anchors, others = order[:, :num_anchors], order[:, num_anchors:]
    y = torch.gather(x, 1, anchors[..., None].expand(-1, -1, dim))
    src = torch.gather(x, 1, others[..., None].expand(-1, -1, dim))
    pos = coords.to(x.dtype)
    cos = F.normalize(src, dim=-1) @ F.normalize(y, dim=-1).transpose(1, 2)  # [F, M, N]
    spatial = torch.cdist(pos[others], pos[anchors], p=2)
    cost = 1.0 * (1.0 - cos) + spatial_weight * spatial
    with torch.no_grad():
        plan = sinkhorn(cost, epsilon=epsilon, max_iter=max_iter, tol=tol)
    agg = torch.einsum("fmn,fmd->fnd", plan, src)
    load = plan.sum(dim=1).clamp_min(1e-9)
    ota = (y + 1.0 * agg) / (1.0 + 1.0 * load[..., None])
    nearest = cos.argmax(dim=2)
    count = torch.zeros(frames, num_anchors, dtype=torch.int32, device=x.device)
    count.scatter_add_(1, nearest, torch.ones_like(nearest, dtype=torch.int32))
    nn = (y * 1.0).scatter_add(1, nearest[..., None].expand(-1, -1, dim), src)
    nn = (nn / (1.0 + count[..., None])).to(x.dtype)
    merged = nn * nn_weight + ota * (1.0 - nn_weight)
    features = x.clone().scatter(1, anchors[..., None].expand(-1, -1, dim), merged.to(x.dtype))
    return IntraMerge(features, anchors, others, plan, nearest, count, load, nn_weight)


# --- inter-frame: clip OT merge -----------------------------------------------------------------------------------


def time_cost(dt, sigma_t: float = 1.5):
    """C_time = 1 - exp(-dt^2 / (2 sigma_t^2 + 1e-9)): dt=1 -> 0.199, 2 -> 0.589, 3 -> 0.865 (sigma_t 1.5)."""
    dt = torch.as_tensor(dt)
    return 1.0 - torch.exp(-(dt * dt) / (2.0 * (sigma_t**2) + 1e-9))


@dataclasses.dataclass
class TimeMerge:
    anchors: Tensor  # [M, D] updated anchors
    keep: Tensor  # [N] bool: sources kept as residual tokens
    p_row: Tensor  # [N, M] row-normalised plan
    pmax: Tensor  # [N]
    weights: Tensor  # [N, M] p_row restricted to the merged sources (what the anchors absorbed)
    load: Tensor  # [M]


def ota_merge_time(
    anchors: Tensor,
    sources: Tensor,
    dt: float,
    keep_ratio: float,
    epsilon: float = 0.1,
    max_iter: int = 100,
    tol: float = 1e-2,
    sigma_t: float = 1.5,
    scale: float = 1.0,
    residuals: int | None = None,
) -> TimeMerge:
    """`ota_merge_N_to_M_time` for one source frame: anchors [M, D], sources [N, D] at time distance dt.
    Sources with `pmax < quantile(pmax, keep_ratio)` stay; the rest are transported into the anchors,
    `Y <- (Y + s agg) / (1 + s load)`. `residuals` (fixed-count mode) keeps exactly that many, lowest pmax."""
    dtype = anchors.dtype
    cos = (F.normalize(sources, dim=-1) @ F.normalize(anchors, dim=-1).T).clamp(-1 + 1e-6, 1 - 1e-6)
    c_sim = 1.0 - cos
    c_sim = c_sim - c_sim.amin()
    anchors_ts = torch.zeros(1, anchors.shape[0], dtype=dtype, device=anchors.device)
    sources_ts = torch.ones(sources.shape[0], 1, dtype=dtype, device=anchors.device) * dt
    c_time = time_cost((sources_ts - anchors_ts).abs(), sigma_t)
    with torch.no_grad():
        plan = sinkhorn(c_sim * c_time, epsilon=epsilon, max_iter=max_iter, tol=tol)
    plan = plan.to(sources.dtype)
    p_row = plan / plan.sum(dim=1, keepdim=True).clamp_min(1e-9)
    pmax = p_row.max(dim=1).values
    tau = torch.quantile(pmax.double(), keep_ratio)
    keep = pmax < tau
    if residuals is not None:
        keep = reconcile_count(keep, -pmax.double(), residuals)
    weights = p_row * (~keep)[:, None]
    agg = weights.T @ sources
    load = weights.sum(dim=0)
    new = (anchors + scale * agg) / (1.0 + scale * load[:, None])
    return TimeMerge(new, keep, p_row, pmax, weights, load)


@dataclasses.dataclass
class ClipMerge:
    """One clip of the inter-frame step (frame numbers index the `frames` list given to `temporal_merge`)."""

    anchor_frame: int
    residuals: list[tuple[int, Tensor]]  # (frame, local indices of its residual tokens, ascending)
    merged: Tensor | None  # [M, D] merged anchors (None for a one-frame clip)
    anchor_coef: Tensor | None = None  # [M] merged = anchor_coef * Y0 + sum_t source_coef[t] @ X_t
    source_coef: list[tuple[int, Tensor]] = dataclasses.field(default_factory=list)  # (frame, [M, n_t])


def temporal_merge(
    frames: list[Tensor],
    clip: int,
    keep_ratio: float,
    epsilon: float = 0.1,
    max_iter: int = 100,
    tol: float = 1e-2,
    sigma_t: float = 1.5,
    scale: float = 1.0,
    fixed: bool = False,
) -> list[ClipMerge]:
    """`temporal_ota_merge` over frames (list of [n_f, D], temporal order) in clips of `clip` frames. The
    output of a clip is [frame 0 ; residuals of frames 1.. ; merged anchors]."""
    out = []
    for start, length in clip_segments(len(frames), clip):
        y0 = frames[start]
        if length == 1:
            out.append(ClipMerge(start, [], None))
            continue
        y = y0.clone()
        coef = torch.ones(y0.shape[0], dtype=torch.float32, device=y0.device)
        sources: list[tuple[int, Tensor]] = []
        residuals: list[tuple[int, Tensor]] = []
        for inner in range(1, length):
            x = frames[start + inner]
            if x.shape[0] == 0:
                continue
            if y.shape[0] == 0:  # nothing to merge into: the frame's tokens stay (vtc guard)
                residuals.append((start + inner, torch.arange(x.shape[0], device=x.device)))
                continue
            target = residual_count(x.shape[0], keep_ratio) if fixed else None
            step = ota_merge_time(y, x, inner, keep_ratio, epsilon, max_iter, tol, sigma_t, scale, target)
            denom = 1.0 + scale * step.load.float()
            coef = coef / denom
            sources = [(f, c / denom[:, None]) for f, c in sources]
            sources.append((start + inner, scale * step.weights.float().T / denom[:, None]))
            y = step.anchors
            residuals.append((start + inner, torch.nonzero(step.keep).flatten()))
        out.append(ClipMerge(start, residuals, y, coef, sources))
    return out


# --- merge plans ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Block:
    """One diagonal block of a merge plan: the kept tokens `keep` with their new features `embeds`; with `src`,
    side features follow keep_weight * the token + weight @ the tokens `src` (`VideoTokens.merge_dense`), without
    it the tokens stay as they are."""

    keep: Tensor  # [K_b] token indices
    embeds: Tensor  # [K_b, D] their features after the merge
    keep_weight: Tensor | None = None  # [K_b] float32 (None: ones)
    src: Tensor | None = None  # [S_b] token indices
    weight: Tensor | None = None  # [K_b, S_b] float32


def block_plan(blocks: list[Block], device, allow_repeats: bool = False) -> vtc.DenseMerge:
    """The `DenseMerge` of consecutive diagonal blocks (frames or clips merged each on their own)."""
    index = torch.zeros(0, dtype=torch.long, device=device)
    return vtc.DenseMerge(
        keep=torch.cat([b.keep for b in blocks] + [index]),
        keep_weight=torch.cat(
            [b.keep_weight if b.keep_weight is not None else torch.ones(b.keep.numel(), device=device) for b in blocks]
            + [torch.zeros(0, device=device)]
        ),
        src=torch.cat([b.src for b in blocks if b.src is not None] + [index]),
        src_weight=[b.weight if b.src is not None else torch.zeros(b.keep.numel(), 0, device=device) for b in blocks],
        embeds=torch.cat([b.embeds for b in blocks]) if blocks else None,
        allow_repeats=allow_repeats,
    )


# --- the method ---------------------------------------------------------------------------------------------------


@vtc.method(
    "aot",
    paper="Token Reduction via Local and Global Contexts Optimization for Efficient Video LLMs (CVPR 2026)",
    url="https://arxiv.org/abs/2603.01400",
    summary="attention anchors per frame + Sinkhorn OT merge, then inter-frame OT merge within clips",
    retention_note="retention picks VISUAL_TOKEN_NUM so the fixed-count total is round(r N), within one "
    "anchor per 3 x 3 window and frame; adaptive runs follow it up to the content-dependent pooled anchor "
    "mask (LLaVA) and residual quantile",
    retention_granularity=9,  # anchors come one per window of the 3 x 3 layout at a time
    test_params={"shallow_layer": 1},
    exempt={
        "retention": "adaptive count: on LLaVA the pooled anchor mask (>= 0.5) depends on where the anchors "
        "fall; fixed_count=True is checked instead",
        "ordered_positions": "official per-clip order: anchor frame, residuals, merged anchors",
    },
)
class AOT(vtc.Method):
    """Attention anchors + intra-frame OT merge, then the inter-frame OT merge per clip (official: TyroneLi/AOT
    `LLaVA-NeXT/llava/model/llava_arch.py`)."""

    temporal = True  # inter-frame OT merge across the frames of a clip: videos only

    visual_token_num: int | None = vtc.param(
        None, range="[1, 729]", doc="VISUAL_TOKEN_NUM: anchors per frame, counted on 27 x 27 = 729 tokens"
    )
    keep_ratio: float | None = vtc.param(
        None, range="[0, 1]", doc="KEEP_RATIO: fraction of a later frame's tokens kept as residuals"
    )
    setting: str = vtc.param(
        "mvbench",
        choices=tuple(SETTINGS),
        doc='eval_ov-7b.sh: "mvbench" (MVBench/EgoSchema: 126/0.3), "videomme" (VMME/LVB: 108/0.1)',
    )
    global_ratio: float = vtc.param(0.5, range="[0, 1]", doc="GLOBAL_RATIO: share of the anchors chosen globally")
    inter_compress: bool | None = vtc.param(
        None, doc="INTER_COMPRESS; None: on, except llava_next_video (eval_vid-7b.sh: off)"
    )
    clip_frames: int | None = vtc.param(
        None, range="[1, inf)", doc="frames per clip; None: max(1, T // 8) (official: 4 for 32 frames, 8 for 64)"
    )
    inter_scale: float = vtc.param(1.0, range="[0, inf)", doc="INTER_SCALE: step size of the inter-frame update")
    intra_scale: float = vtc.param(
        1.0, range="[0, inf)", doc="INTRA_SCALE: ignored, as in the code (`token_merging_siglip_with_OTA` sets 1.0)"
    )
    epsilon: float = vtc.param(0.1, range="(0, inf)", doc="eps: Sinkhorn entropic regularisation (both steps)")
    max_iter: int = vtc.param(100, range="[1, inf)", doc="Sinkhorn iterations")
    tol: float = vtc.param(1e-2, range="[0, inf)", doc="Sinkhorn stop: mean |r - r_prev| below this")
    spatial_weight: float = vtc.param(0.5, range="[0, inf)", doc="weight of the spatial distance in the intra cost")
    nn_weight: float = vtc.param(
        0.1, range="[0, 1]", doc="blend: nn_weight * nearest-neighbour merge + (1 - nn_weight) * OT merge"
    )
    sigma_t: float = vtc.param(1.5, range="(0, inf)", doc="sigma_t of the time cost 1 - exp(-dt^2 / (2 sigma_t^2))")
    shallow_layer: int = vtc.param(5, doc="`image_attentions[5]`: local anchors")
    deep_layer: int = vtc.param(-2, doc="`image_attentions[-2]`: global anchors")
    windows: int = vtc.param(3, range="[1, inf)", doc="windows per side (27 / 9 = 3 windows of 9 x 9)")
    fixed_count: bool = vtc.param(False, doc="exact, content-independent count (reconciled by score)")
    compute_dtype: vtc.DType | None = vtc.param(None, doc="None: the features' (model) dtype, as the official code")

    positions = "compact"
    prepool = True  # LLaVA: anchors and OT on the pre-pool 27 x 27 grid

    # --- configuration ---------------------------------------------------------------------------------------
    @property
    def keeps_everything(self) -> bool:
        explicit = self.visual_token_num is not None or self.keep_ratio is not None
        return self.retention is not None and self.retention >= 1.0 and not explicit

    def _inter(self, geometry: FamilyGeometry) -> bool:
        if self.inter_compress is not None:
            return bool(self.inter_compress)
        return not geometry.pool_before_projector  # eval_vid-7b.sh runs LLaVA-NeXT-style models without it

    def _clip(self, num_frames: int) -> int:
        return int(self.clip_frames) if self.clip_frames is not None else max(1, num_frames // 8)

    def budget(self, grid: tuple[int, int, int], family: str) -> tuple[int, float, int, bool]:
        """(VISUAL_TOKEN_NUM, KEEP_RATIO, clip length, inter step on) for a video with token grid `grid`."""
        geometry = default_geometry(family)
        inter = self._inter(geometry)
        t = int(grid[0])
        clip = self._clip(t)
        keep = float(self.keep_ratio) if self.keep_ratio is not None else SETTINGS[self.setting][1]
        if self.visual_token_num is not None:
            v = int(self.visual_token_num)
        elif self.retention is not None:
            v = visual_token_num_for(
                float(self.retention),
                tuple(int(x) for x in grid),
                keep,
                clip,
                inter,
                geometry.has_prepool_grid,
                float(self.global_ratio),
                int(self.windows),
            )
        else:
            v = SETTINGS[self.setting][0] if inter and clip > 1 else NO_INTER_POINT[0]
        return v, keep, clip, inter

    def vision_stats(self, family):
        return [VisionStat("received", self.shallow_layer), VisionStat("received", self.deep_layer)]

    def frame_count(self, v: int, h: int, w: int, family: str) -> int:
        """Tokens per frame in fixed-count mode on a token grid h x w."""
        prepool = default_geometry(family).has_prepool_grid
        return frame_count_for(v, h, w, prepool, float(self.global_ratio), int(self.windows))

    def retained_count(self, num_tokens: int, grid, family: str) -> int | None:
        if self.keeps_everything:
            return num_tokens
        if not self.fixed_count:
            return None  # the pooled mask and the residual quantile depend on the content
        t, h, w = grid
        if num_tokens != t * h * w:
            return None  # an earlier method thinned the frames: frames may have fewer tokens than their quota
        v, keep, clip, inter = self.budget(grid, family)
        return fixed_total(self.frame_count(v, h, w, family), t, clip, keep, inter)

    # --- connect -----------------------------------------------------------------------------------------------
    def _dtype(self, x: Tensor) -> torch.dtype:
        return vtc.as_dtype(self.compute_dtype, x.dtype)

    def _ot(self, x: Tensor, mask: Tensor, coords: Tensor) -> IntraMerge:
        return intra_ot_merge(
            x.to(self._dtype(x)),
            mask,
            coords,
            epsilon=self.epsilon,
            max_iter=self.max_iter,
            tol=self.tol,
            spatial_weight=self.spatial_weight,
            nn_weight=self.nn_weight,
        )

    def _stats(self, ctx, length: int) -> tuple[Tensor, Tensor]:
        try:
            shallow = ctx.vision[VisionStat("received", self.shallow_layer)]
            deep = ctx.vision[VisionStat("received", self.deep_layer)]
        except KeyError:
            raise RuntimeError("aot: the vision-tower attention statistics were not captured") from None
        cls = ctx.geometry.cls_tokens if ctx.geometry.has_prepool_grid else 0
        shallow, deep = shallow[:, cls:], deep[:, cls:]  # CLIP towers: drop the CLS column
        if shallow.shape[-1] != length:
            raise RuntimeError(f"aot: attention maps have {shallow.shape[-1]} tokens per frame, expected {length}")
        return shallow.float(), deep.float()

    def connect(self, tokens, ctx):
        n = len(tokens)
        if self.keeps_everything or n == 0:
            return tokens
        t, h, w = tokens.grid
        v, keep, clip, inter = self.budget(tokens.grid, ctx.family)
        ctx.report(budget=(v, keep, clip, inter))  # (VISUAL_TOKEN_NUM, KEEP_RATIO, clip, inter step)
        k_fixed = self.frame_count(v, h, w, ctx.family) if self.fixed_count else None
        if ctx.prepool is not None and ctx.pool is not None:
            out = self._intra_prepool(tokens, ctx, v, k_fixed)
        else:
            out = self._intra_tokens(tokens, ctx, v, k_fixed)
        if inter and clip > 1:
            out = self._inter_step(out, clip, keep, self.fixed_count)
        return out

    def _intra_prepool(self, tokens: VideoTokens, ctx, v: int, k_fixed: int | None) -> VideoTokens:
        """LLaVA: anchors + OT on the pre-pool grid, the model's pooling, the pooled mask >= 0.5. The kept cells
        take the pooled features of the merged grid."""
        grid = ctx.prepool
        frames, ph, pw, dim = grid.shape
        t, h, w = tokens.grid
        vg = scaled_token_num(v, ph, pw)
        if vg >= ph * pw:
            return tokens  # VISUAL_TOKEN_NUM == 729: no intra-frame step
        shallow, deep = self._stats(ctx, ph * pw)
        shallow, deep = shallow.to(grid.device), deep.to(grid.device)
        per_window, num_global = anchor_budget(vg, self.global_ratio, self.windows)
        mask = select_anchors(shallow, deep, ph, pw, per_window, num_global, self.windows)
        x = grid.reshape(frames, ph * pw, dim)
        features = x
        if bool(mask[0].any()):
            coords = grid_coords(ph, pw, dtype=self._dtype(x), device=x.device)
            features = self._ot(x, mask, coords).features.to(grid.dtype)
        pooled = ctx.pool(features.reshape(frames, ph, pw, dim))
        if tuple(pooled.shape[1:3]) != (h, w) or pooled.shape[0] != t:
            raise RuntimeError(f"aot: pooled grid {tuple(pooled.shape[:3])} does not match the tokens' {tokens.grid}")
        # `get_2dPool_index`: the float anchor mask pooled like the features, then the threshold
        value = ctx.geometry.pool_grid(mask.float().view(frames, ph, pw), (h, w))
        cells = value >= 0.5
        if k_fixed is not None:  # exact count per frame: pooled mask value, then pooled deep attention
            tie = ctx.geometry.pool_grid(deep.view(frames, ph, pw), (h, w)).double()
            tie = tie / tie.amax(dim=1, keepdim=True).clamp_min(1e-30)
            score = value.double() + 1e-6 * tie
            cells = torch.stack([reconcile_count(cells[f], score[f], k_fixed) for f in range(t)])
        lookup = tokens.grid_index().flatten()
        flat = torch.nonzero(cells.flatten()).flatten().to(lookup.device)
        idx = lookup[flat]
        present = idx >= 0
        embeds = pooled.reshape(t * h * w, -1)[flat[present].to(pooled.device)].to(tokens.embeds.dtype)
        return block_plan([Block(idx[present], embeds)], tokens.embeds.device).apply(tokens)

    def _intra_tokens(self, tokens: VideoTokens, ctx, v: int, k_fixed: int | None) -> VideoTokens:
        """Qwen families: anchors + OT on the LLM token grid; the merged anchors are the frame's tokens."""
        t, h, w = tokens.grid
        length = h * w
        vg = scaled_token_num(v, h, w)
        if vg >= length:
            return tokens
        shallow, deep = self._stats(ctx, length)
        per_window, num_global = anchor_budget(vg, self.global_ratio, self.windows)
        device = tokens.embeds.device
        shallow, deep = shallow.to(device), deep.to(device)
        frame, patch = tokens.frame.to(device), tokens.patch.to(device)
        full = tokens.is_full_grid
        if full:  # every frame complete: one batched merge, as the official batch over frames
            groups = [torch.arange(t * length, device=device).view(t, length)]
        else:  # an earlier method thinned the video: frame by frame on the tokens present
            groups = [idx[None] for idx in tokens.frame_groups("index")]
        coords = grid_coords(h, w, dtype=self._dtype(tokens.embeds), device=device)
        blocks: list[Block] = []
        for members in groups:
            fr, cells = frame[members[:, 0]], patch[members]  # [g], [g, n]
            if full:
                mask = select_anchors(shallow, deep, h, w, per_window, num_global, self.windows)
            else:
                valid = torch.zeros(1, length, dtype=torch.bool, device=device)
                valid[0, cells[0]] = True
                mask = select_anchors(shallow[fr], deep[fr], h, w, per_window, num_global, self.windows, valid)[
                    :, cells[0]
                ]
            if k_fixed is not None:  # chosen anchors first, then deep attention
                score = deep[fr[:, None], cells] + mask.float() * (float(deep.max()) + 1.0)
                mask = torch.stack([reconcile_count(mask[i], score[i], k_fixed) for i in range(mask.shape[0])])
            blocks += self._merge_group(tokens, members, mask, coords[cells[0]])
        return block_plan(blocks, device).apply(tokens)

    def _merge_group(self, tokens: VideoTokens, members: Tensor, mask: Tensor, coords: Tensor) -> list[Block]:
        """The merge of frames `members` [g, n] (token indices) into their anchors `mask` [g, n]: one block per
        frame (its anchors, their merged features, the linear map side features follow), frame-major."""
        if int(mask[0].sum()) in (0, mask.shape[1]):  # nothing to merge into / nothing to merge
            rows = members[mask]
            return [Block(rows, tokens.embeds[rows])]
        x = tokens.embeds[members]
        merge = self._ot(x, mask, coords)
        rows = torch.gather(members, 1, merge.anchors)
        srcs = torch.gather(members, 1, merge.others)
        dim = x.shape[-1]
        embeds = torch.gather(merge.features, 1, merge.anchors[..., None].expand(-1, -1, dim)).to(tokens.embeds.dtype)
        a, wmat = merge.coefficients()
        return [Block(rows[i], embeds[i], a[i], srcs[i], wmat[i]) for i in range(rows.shape[0])]

    def _inter_step(self, tokens: VideoTokens, clip: int, keep: float, fixed: bool) -> VideoTokens:
        """The inter-frame step: per clip [anchor frame ; residuals of the later frames ; merged anchors]."""
        device = tokens.embeds.device
        frame = tokens.frame.to(device)
        # every frame of the grid, in order (a frame left without tokens still takes its place in its clip)
        members = [torch.nonzero(frame == f).flatten() for f in range(tokens.grid[0])]
        cdtype = self._dtype(tokens.embeds)
        clips = temporal_merge(
            [tokens.embeds[m].to(cdtype) for m in members],
            clip,
            keep,
            epsilon=self.epsilon,
            max_iter=self.max_iter,
            tol=self.tol,
            sigma_t=self.sigma_t,
            scale=self.inter_scale,
            fixed=fixed,
        )
        blocks: list[Block] = []
        for c in clips:
            anchor_rows = members[c.anchor_frame]
            plain = torch.cat([anchor_rows] + [members[f][local] for f, local in c.residuals])
            blocks.append(Block(plain, tokens.embeds[plain]))
            if c.merged is None:
                continue
            # the anchor frame again, merged: a * Y0 + sum_t C_t @ X_t over the clip's later frames
            merged = c.merged.to(tokens.embeds.dtype)
            if c.source_coef:
                src = torch.cat([members[f] for f, _ in c.source_coef])
                coef = torch.cat([m for _, m in c.source_coef], dim=1)
                blocks.append(Block(anchor_rows, merged, c.anchor_coef, src, coef))
            else:  # no later frame had tokens to merge
                blocks.append(Block(anchor_rows, merged, c.anchor_coef))
        return block_plan(blocks, device, allow_repeats=True).apply(tokens)
