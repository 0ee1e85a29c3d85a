"""PixelPrune: "Pixel-Level Adaptive Visual Token Reduction via Predictive Coding" (OPPO, 2026).
arXiv: https://arxiv.org/abs/2604.00886. Official code: OPPO-Mente-Lab/PixelPrune @ a870e31b
(`pixelprune/methods/pred_2d.py`: `_sim2d`, `Pred2DSelector`; `pixelprune/methods/base.py`: `_prepare_merged`;
`pixelprune/core.py`: `merged_indices_to_patch_indices`; `pixelprune/patches/qwen3_vl_hf.py`:
`normalize_pixel_values_for_selector`).

Before the vision tower runs, drop the 2x2 merge units (one LLM token each) that a JPEG-LS / LOCO-I style
predictor reconstructs from the units already seen: with A = left, B = up, C = up-left, predict from B when
C matches A but not B (a vertical edge), else from A; a unit is kept iff it does not match its prediction.
Matching is a distance between the de-normalised pixels (L-inf by default) at most a threshold (0: bit-exact).
Stage: pre-ViT, on `pixel_values` alone (no model), so the kept count is known before the tower runs.

These are the pure tensor functions; faithful to the official selector: the de-normalisation of the first
temporal slice, the merge-unit vectors (4 consecutive patch rows in the Qwen processor order), `_sim2d`'s four
metrics (`exact` = `max` at threshold 0, `dist <= threshold`), the dispatch between the sliding fast path
(neighbours are original values: `exact`, `max` at threshold 0, or `anchored=False`) and the anchored path
(neighbours are reconstructions). vtc differences: the anchored path gives the official raster loop's
results but is computed one anti-diagonal at a time (a unit depends only on its left, upper and upper-left
neighbours, all on earlier anti-diagonals); the processor's own mean/std are inverted (the official code
hard-codes Qwen3-VL's 0.5/0.5, wrong for Qwen2/2.5-VL's CLIP values); videos: the official code handles
images (t = 1) only, here every temporal patch of a video is one image (`pixelprune_keep`), and
`pixelprune_video_keep` (vtc's own, not in the paper) also predicts a unit from the same unit of the previous
temporal patch; kept indices are global over all media (the official ones restart at 0 for every image).

The method (`PixelPrune`, stage encode) runs these on each video's `VideoPatches`. The official rule keeps as many
units as the content needs. With a retention and no explicit `threshold`, vtc keeps a fixed count instead
(`prediction_residual`): the round(r * n) units farthest from their prediction, which is what the fast path keeps
at the threshold that leaves that many (ties aside); this is vtc's fixed-count form, not the paper's. On a video
the method compares both frames of each temporal patch (on an image, where they are copies, the same as the
official first slice).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch

import vtc

Tensor = torch.Tensor

METRICS = ("max", "mae", "rmse", "exact")  # `_sim2d`'s methods; `max` is the official default (PIXELPRUNE_METRIC)
QWEN3_VL_MEAN = (0.5, 0.5, 0.5)  # what the official `x * 0.5 + 0.5` inverts
QWEN3_VL_STD = (0.5, 0.5, 0.5)
_GATHER_ELEMENTS = 1 << 24  # the fast path works in chunks of at most this many gathered values per operand


def denormalize_patches(
    pixel_values: Tensor,
    mean: Sequence[float] | Tensor,
    std: Sequence[float] | Tensor,
    temporal_patch: int,
    patch: int,
    temporal_index: int | None = 0,
) -> Tensor:
    """Qwen processor rows [N, C*temporal_patch*patch*patch], each patch flattened as (C, T, P, P), back to
    pixel values: `x * std + mean` per channel, in `pixel_values`' dtype (as the official code).

    `temporal_index=0` (official): the first temporal slice only, [N, C*P*P]; an image's temporal slices are
    copies of one frame. `None`: the whole temporal patch, [N, C*T*P*P] in (C, T, P, P) order, which for a video
    also compares the second frame of every temporal patch."""
    mean_t = torch.as_tensor(mean, dtype=pixel_values.dtype, device=pixel_values.device)
    std_t = torch.as_tensor(std, dtype=pixel_values.dtype, device=pixel_values.device)
    channels = mean_t.numel()
    per_patch = channels * temporal_patch * patch * patch
    if pixel_values.dim() != 2 or pixel_values.shape[1] != per_patch:
        raise ValueError(
            f"pixelprune: pixel_values must be [N, {channels}*{temporal_patch}*{patch}*{patch}={per_patch}], "
            f"got {tuple(pixel_values.shape)}"
        )
    x = pixel_values.view(-1, channels, temporal_patch, patch, patch)
    if temporal_index is not None:
        x = x[:, :, temporal_index : temporal_index + 1]
    x = x * std_t.view(1, -1, 1, 1, 1) + mean_t.view(1, -1, 1, 1, 1)  # multiply, then add: the official order
    return x.reshape(pixel_values.shape[0], -1)


def merge_unit_vectors(patches: Tensor, merge: int = 2) -> Tensor:
    """[N, D] patch rows -> [N / merge^2, merge^2 * D]: the processor emits the merge^2 patches of one merge unit
    as consecutive rows (unit-row-major, then the merge x merge patches row-major), so a unit is a plain reshape."""
    block = merge * merge
    if patches.shape[0] % block:
        raise ValueError(f"pixelprune: {patches.shape[0]} patch rows are not whole {merge}x{merge} merge units")
    return patches.reshape(-1, block * patches.shape[-1])


def unit_distance(x: Tensor, y: Tensor, metric: str = "max") -> Tensor:
    """`_sim2d`'s distance over the last dimension: `max` / `exact` = L-inf, `mae` = mean |x - y|,
    `rmse` = sqrt(mean (x - y)^2)."""
    diff = x - y
    if metric in ("max", "exact"):
        return diff.abs().amax(dim=-1)
    if metric == "mae":
        return diff.abs().mean(dim=-1)
    if metric == "rmse":
        return diff.pow(2).mean(dim=-1).sqrt()
    raise ValueError(f"pixelprune: unknown metric {metric!r}; expected one of {', '.join(METRICS)}")


def units_similar(x: Tensor, y: Tensor, metric: str = "max", threshold: float = 0.0) -> Tensor:
    """`dist(x, y) <= threshold` (bool, last dimension reduced); `exact` ignores the threshold (0)."""
    return unit_distance(x, y, metric) <= (0.0 if metric == "exact" else threshold)


def uses_fast_path(metric: str, threshold: float, anchored: bool) -> bool:
    """The official dispatch: the sliding path (neighbours are original values) for `exact`, `max` at threshold 0,
    or `anchored=False`; otherwise the anchored path. (`mae`/`rmse` at threshold 0 take the anchored path there
    too; kept as is, although both paths then agree but for underflowing distances.)"""
    return metric == "exact" or (metric == "max" and threshold == 0) or not anchored


def pred2d_keep(units: Tensor, threshold: float = 0.0, metric: str = "max", anchored: bool = True) -> Tensor:
    """The official `Pred2DSelector` on one image of merge units [h_m, w_m, D] (or a batch of independent images
    [B, h_m, w_m, D]): the bool keep mask [h_m, w_m] ([B, h_m, w_m]).

    Unit (0, 0) is always kept; row 0 is predicted from the left, column 0 from above; elsewhere from the upper
    neighbour B when sim(C, A) and not sim(C, B) (A left, C up-left), else from A; kept iff not sim(X, prediction).
    Fast path (`uses_fast_path`): A, B, C are original values. Anchored path: A, B and C are all read from the
    reconstruction (kept: its own value; dropped: its prediction's reconstruction), both in the edge test and as
    the prediction; only X is original. So every reconstruction is the original value of some kept unit, and no
    unit drifts more than one threshold from its reconstruction."""
    if units.dim() == 3:
        return _predictive_keep(units[None], threshold, metric, anchored, temporal=False)[0]
    return _predictive_keep(units, threshold, metric, anchored, temporal=False)


def pred2d_video_keep(units: Tensor, threshold: float = 0.0, metric: str = "max", anchored: bool = True) -> Tensor:
    """vtc's video variant on the merge units of one video [T, h_m, w_m, D] (T temporal patches): keep mask
    [T, h_m, w_m].

    Patch 0 is exactly `pred2d_keep`. In patch s > 0 unit X at (r, c) has two predictors: the spatial one P of
    `pred2d_keep` (within patch s) and the temporal one Q = unit (r, c) of patch s - 1; X is dropped iff
    sim(X, P) or sim(X, Q) (so (0, 0) of a later patch is kept unless it matches Q). Fast path: P, Q and the
    edge test's A, B, C are original values. Anchored path: they are reconstructions, and a dropped unit's
    reconstruction is Q's when it matches Q (the temporal predictor wins, so a static region keeps copying the
    same anchor through time), else P's; a kept unit's is its own value."""
    return _predictive_keep(units, threshold, metric, anchored, temporal=True)


def _predictive_keep(units: Tensor, threshold: float, metric: str, anchored: bool, temporal: bool) -> Tensor:
    """Keep mask [T, h, w] of units [T, h, w, D]: T independent images (`temporal=False`) or the temporal
    patches of one video, each also predicted from the one before (`temporal=True`)."""
    if metric not in METRICS:
        raise ValueError(f"pixelprune: unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    steps, h, w, dim = units.shape
    flat = units.reshape(-1, dim)
    cells = torch.arange(steps * h * w, device=units.device)
    if uses_fast_path(metric, threshold, anchored):
        # no reconstruction: every unit is compared with original values, so all units at once (in chunks)
        chunk = max(1, _GATHER_ELEMENTS // max(dim, 1))
        keep = [_predict(flat, part, cells, (h, w), threshold, metric, temporal)[0] for part in cells.split(chunk)]
        return torch.cat(keep).view(steps, h, w)
    # Anchored: a unit needs the reconstructions of its left, upper, upper-left (and previous-patch) neighbours,
    # all on an earlier wavefront r + c (+ t): one vectorised step per wavefront replaces the raster loop.
    # The reconstruction is kept as the index of the unit whose original value it is (`source`).
    source = cells.clone()
    keep = torch.ones(cells.numel(), dtype=torch.bool, device=units.device)
    t, r, c = cells // (h * w), (cells // w) % h, cells % w
    level = r + c + (t if temporal else 0)
    order = torch.argsort(level, stable=True)
    for wave in order.split(torch.bincount(level).tolist())[1:]:  # wavefront 0: units without any predictor
        keep[wave], source[wave] = _predict(flat, wave, source, (h, w), threshold, metric, temporal)
    return keep.view(steps, h, w)


def _predict(
    flat: Tensor,
    cells: Tensor,
    source: Tensor,
    grid: tuple[int, int],
    threshold: float,
    metric: str,
    temporal: bool,
) -> tuple[Tensor, Tensor]:
    """One prediction step for the flat units `cells` of a [T, h, w] grid, given the reconstruction `source`
    (the identity for the fast path): (kept, the reconstruction's source index of each of these cells)."""
    h, w = grid
    a, b, corner, interior, has_any = _neighbours(cells, h, w)
    value_a, value_b, value_c = flat[source[a]], flat[source[b]], flat[source[corner]]
    # vertical edge (C continues left, not up): copy from above; otherwise the default horizontal inheritance
    use_b = interior & units_similar(value_c, value_a, metric, threshold)
    use_b &= ~units_similar(value_c, value_b, metric, threshold)
    predicted = source[torch.where(use_b, b, a)]
    x = flat[cells]
    spatial = has_any & units_similar(x, flat[predicted], metric, threshold)
    reconstruction = torch.where(spatial, predicted, cells)
    if temporal:
        plane = h * w
        has_prev = cells >= plane
        previous = source[torch.where(has_prev, cells - plane, cells)]
        repeated = has_prev & units_similar(x, flat[previous], metric, threshold)
        reconstruction = torch.where(repeated, previous, reconstruction)  # the temporal predictor wins
        return ~(spatial | repeated), reconstruction
    return ~spatial, reconstruction


def prediction_residual(units: Tensor, metric: str = "max", temporal: bool = False) -> Tensor:
    """How far every unit of [T, h, w, D] is from its prediction on the fast path at threshold 0 (the edge test on
    exact matches, neighbours as original values): [T, h, w] distances under `metric`; +inf where a unit has no
    predictor ((0, 0) of every temporal patch, or of the first one only with `temporal`). With `temporal`, the
    smaller of the spatial distance and the distance to the same unit of the previous temporal patch (a unit is
    dropped when either predictor matches). The fast path at threshold tau keeps exactly the units whose residual
    exceeds tau but for the edge test's own tau, so the top-k by residual is the official selection at the tau that
    leaves k units."""
    if metric not in METRICS:
        raise ValueError(f"pixelprune: unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    steps, h, w, dim = units.shape
    flat = units.reshape(-1, dim)
    cells = torch.arange(steps * h * w, device=units.device)
    chunk = max(1, _GATHER_ELEMENTS // max(dim, 1))
    residual = []
    for part in cells.split(chunk):
        a, b, corner, interior, has_any = _neighbours(part, h, w)
        use_b = interior & units_similar(flat[corner], flat[a], metric) & ~units_similar(flat[corner], flat[b], metric)
        spatial = unit_distance(flat[part], flat[torch.where(use_b, b, a)], metric)
        spatial = torch.where(has_any, spatial, torch.inf)
        if temporal:
            has_prev = part >= h * w
            previous = unit_distance(flat[part], flat[torch.where(has_prev, part - h * w, part)], metric)
            spatial = torch.minimum(spatial, torch.where(has_prev, previous, torch.inf))
        residual.append(spatial)
    return torch.cat(residual).view(steps, h, w)


def top_residual_keep(residual: Tensor, count: int) -> Tensor:
    """The `count` flat indices of the largest residuals, ascending; ties go to the lower index (a stable sort)."""
    order = torch.sort(residual.flatten(), descending=True, stable=True).indices
    return torch.sort(order[:count]).values


def _neighbours(cells: Tensor, h: int, w: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """For flat units `cells` of a [T, h, w] grid: the indices of A (left; column 0: up), B (up; row 0: A) and C
    (up-left; off the interior: B), whether a unit is interior, and whether it has any spatial predictor."""
    r, c = (cells // w) % h, cells % w
    has_left, has_up = c > 0, r > 0
    interior = has_left & has_up
    up = torch.where(has_up, cells - w, cells)
    a = torch.where(has_left, cells - 1, up)  # column 0 predicts from above (the official `A` there)
    b = torch.where(has_up, up, a)
    corner = torch.where(interior, cells - w - 1, b)
    return a, b, corner, interior, has_left | has_up


class KeptUnits(NamedTuple):
    """Kept merge units over all media of one `grid_thw`."""

    indices: Tensor  # [M] long, ascending: global merge-unit indices (units in processor order over all media)
    per_temporal_patch: Tensor  # [sum t] long: kept units of each temporal patch (one vision-tower attention segment)
    per_item: Tensor  # [K] long: kept units (= LLM tokens) of each image / video


def pixelprune_keep(
    pixel_values: Tensor,
    grid_thw: Tensor,
    mean: Sequence[float] | Tensor,
    std: Sequence[float] | Tensor,
    temporal_patch: int,
    patch: int,
    merge: int = 2,
    threshold: float = 0.0,
    metric: str = "max",
    anchored: bool = True,
    temporal_index: int | None = 0,
    temporal: bool = False,
) -> KeptUnits:
    """PixelPrune over all media of `pixel_values` [N, C*T*P*P] with `grid_thw` [K, 3] rows (t, h, w) in patches
    (Qwen's `image_grid_thw` / `video_grid_thw`): every temporal patch of every item is one image of
    (h / merge) x (w / merge) merge units, pruned by `pred2d_keep` on its own (the official code only sees images,
    t = 1; applying it to each temporal patch of a video is the natural extension). `mean` / `std`: the
    processor's normalisation (Qwen3-VL: `QWEN3_VL_MEAN` / `QWEN3_VL_STD`); `temporal_index`: see
    `denormalize_patches`; `temporal`: `pixelprune_video_keep`."""
    units = merge_unit_vectors(
        denormalize_patches(pixel_values, mean, std, temporal_patch, patch, temporal_index), merge
    )
    items = grid_thw.tolist()
    if any(h % merge or w % merge for _, h, w in items):
        raise ValueError(f"pixelprune: grid_thw {items} is not whole {merge}x{merge} merge units")
    total = sum(t * (h // merge) * (w // merge) for t, h, w in items)
    if total != units.shape[0]:
        raise ValueError(f"pixelprune: grid_thw describes {total} merge units, pixel_values holds {units.shape[0]}")
    indices, per_patch, per_item = [], [], []
    offset = 0
    for t, h, w in items:
        rows, cols = h // merge, w // merge
        count = t * rows * cols
        # units of one item: temporal-patch-major, then raster order of its (h / merge) x (w / merge) grid
        item = units[offset : offset + count].view(t, rows, cols, -1)
        keep = _predictive_keep(item, threshold, metric, anchored, temporal)
        indices.append(keep.flatten().nonzero()[:, 0] + offset)
        per_patch.append(keep.view(t, -1).sum(dim=1))
        per_item.append(per_patch[-1].sum().view(1))
        offset += count
    empty = torch.zeros(0, dtype=torch.long, device=pixel_values.device)
    return KeptUnits(
        torch.cat(indices) if indices else empty,
        torch.cat(per_patch) if per_patch else empty,
        torch.cat(per_item) if per_item else empty,
    )


def pixelprune_video_keep(*args, temporal_index: int | None = None, **kwargs) -> KeptUnits:
    """vtc's temporal variant of `pixelprune_keep` (same arguments; not in the official code): each item's temporal
    patches go through `pred2d_video_keep`, so a unit that repeats the same unit of the previous temporal patch is
    dropped too; an item with t = 1 (an image) gets exactly `pred2d_keep`. By default the whole temporal patch is
    compared (`temporal_index=None`), since a video's temporal patch holds two different frames."""
    return pixelprune_keep(*args, temporal_index=temporal_index, temporal=True, **kwargs)


def units_to_patch_indices(units: Tensor, merge: int = 2) -> Tensor:
    """Merge-unit indices -> the patch rows they cover: unit m -> merge^2 * m ... merge^2 * m + merge^2 - 1
    (ascending when `units` is)."""
    block = merge * merge
    offsets = torch.arange(block, device=units.device)
    return (units.long()[:, None] * block + offsets).flatten()


# --- the method -------------------------------------------------------------------------------------------------
COMMON = dict(url="https://arxiv.org/abs/2604.00886")
RETENTION_NOTE = (
    "with a retention and no threshold: exactly round(r * n) units, those farthest from their prediction (vtc's "
    "fixed-count form); with a threshold (or no retention): the official adaptive count"
)


@vtc.method(
    "pixelprune",
    paper="PixelPrune: Pixel-Level Adaptive Visual Token Reduction via Predictive Coding (2026)",
    **COMMON,
    summary="before the vision tower: drop the merge units a LOCO-I predictor rebuilds from their neighbours",
    retention_note=RETENTION_NOTE,
)
class PixelPrune(vtc.PatchSelector):
    """The official `Pred2DSelector` on every temporal patch of a video, before the tower (official:
    OPPO-Mente-Lab/PixelPrune)."""

    threshold: float | None = vtc.param(
        None,
        range="[0, inf)",
        doc="tau (PIXELPRUNE_THRESHOLD): match when the distance of de-normalised pixels is <= tau; official "
        "adaptive rule; None: a fixed count at the retention, or tau = 0 (bit-exact, official) without one",
    )
    metric: str = vtc.param("max", choices=METRICS, doc="PIXELPRUNE_METRIC: max (L-inf), mae, rmse, exact")
    anchored: bool = vtc.param(True, doc="compare with reconstructions, not originals (official, for tau > 0)")

    # pixelprune-video: also predict from the previous temporal patch (so it needs time: videos only)
    temporal: ClassVar[bool] = False

    def adaptive(self) -> bool:
        return self.threshold is not None or self.retention is None

    def retained_count(self, num_tokens, grid, family):
        if self.adaptive():
            return None
        return super().retained_count(num_tokens, grid, family)

    def choose(self, patches, count, ctx):
        units = self.unit_vectors(patches)
        if count is None:
            threshold = 0.0 if self.threshold is None else self.threshold
            keep = _predictive_keep(units, threshold, self.metric, self.anchored, self.temporal).flatten()
            chosen = keep[patches.kept]
            ctx.report(threshold=threshold)
            return torch.nonzero(chosen).flatten()
        residual = prediction_residual(units, self.metric, self.temporal).flatten()[patches.kept]
        return top_residual_keep(residual, count)

    def unit_vectors(self, patches) -> Tensor:
        """[T, h, w, D] de-normalised merge units of the whole grid, both frames of each temporal patch (the official
        code reads the first slice of an image, whose slices are copies: the same decisions there; on a video a unit
        is redundant only when both frames the tower embeds together are)."""
        channels, tp, p, _ = patches.patch_shape
        rows = patches.pixels.reshape(-1, patches.pixels.shape[-1])
        values = denormalize_patches(rows, patches.mean, patches.std, tp, p, temporal_index=None)
        merge = int(round(patches.pixels.shape[1] ** 0.5))
        return merge_unit_vectors(values, merge).view(*patches.grid, -1)


@vtc.method(
    "pixelprune-video",
    paper="PixelPrune variant (vtc): the previous temporal patch as a second predictor",
    **COMMON,
    summary="PixelPrune's predictor plus the same unit of the previous temporal patch: static regions drop out",
    retention_note=RETENTION_NOTE,
)
class PixelPruneVideo(PixelPrune):
    """PixelPrune with a temporal predictor (vtc's, not in the official code, which handles images only): a unit is
    dropped when it matches its spatial prediction or the same unit of the previous temporal patch; both frames of
    a temporal patch are compared."""

    temporal: ClassVar[bool] = True
