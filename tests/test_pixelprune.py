"""PixelPrune's tensor functions: the LOCO-I keep mask against a loop transcription of the official
`Pred2DSelector` (fast and anchored paths) on grids full of near-duplicates, hand-built answers, the
de-normalisation and merge-unit layout against the HF Qwen2-VL processors, the temporal (video) variant against a
raster-loop transcription of its definition, and the merge-unit -> patch indices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vtc
from vtc_plugins.pixelprune import (
    QWEN3_VL_MEAN,
    QWEN3_VL_STD,
    denormalize_patches,
    merge_unit_vectors,
    pixelprune_keep,
    pixelprune_video_keep,
    pred2d_keep,
    pred2d_video_keep,
    unit_distance,
    units_similar,
    units_to_patch_indices,
    uses_fast_path,
)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / _STD: Qwen2-VL's and Qwen2.5-VL's processors
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# --- the official selector, transcribed as literally as possible (pred_2d.py @ a870e31b) -----------------------


def official_sim2d(X, Y, method, threshold):
    diff = X - Y
    if method in ("max", "exact"):
        dist = diff.abs().amax(dim=-1)
        thr = 0.0 if method == "exact" else threshold
    elif method == "mae":
        dist = diff.abs().mean(dim=-1)
        thr = threshold
    elif method == "rmse":
        dist = diff.pow(2).mean(dim=-1).sqrt()
        thr = threshold
    else:
        raise ValueError(method)
    return dist <= thr


def official_fast(g, method, threshold):
    h, w, _ = g.shape
    keep = torch.zeros(h, w, dtype=torch.bool)
    keep[0, 0] = True
    if w > 1:
        keep[0, 1:] = ~official_sim2d(g[0:1, 1:], g[0:1, :-1], method, threshold)[0]
    if h > 1:
        keep[1:, 0] = ~official_sim2d(g[1:, 0:1], g[:-1, 0:1], method, threshold)[:, 0]
    if h > 1 and w > 1:
        X, A, B, C = g[1:, 1:], g[1:, :-1], g[:-1, 1:], g[:-1, :-1]
        cb = official_sim2d(C, B, method, threshold)
        ca = official_sim2d(C, A, method, threshold)
        use_b = ca & ~cb
        pred = torch.where(use_b.unsqueeze(-1), B, A)
        keep[1:, 1:] = ~official_sim2d(X, pred, method, threshold)
    return keep


def official_anchored(g, method, threshold):
    h, w, _ = g.shape
    keep = torch.zeros(h, w, dtype=torch.bool)
    keep[0, 0] = True
    anchor_grid = g.clone()

    def sim(a, b):
        return official_sim2d(a.unsqueeze(0), b.unsqueeze(0), method, threshold).item()

    for r in range(h):
        for c in range(w):
            if r == 0 and c == 0:
                continue
            if c > 0:
                A = anchor_grid[r, c - 1]
            elif r > 0:
                A = anchor_grid[r - 1, 0]
            else:
                A = None
            B = anchor_grid[r - 1, c] if r > 0 else A
            C = anchor_grid[r - 1, c - 1] if (r > 0 and c > 0) else B
            if r > 0 and c > 0:
                pred = B if (sim(C, A) and not sim(C, B)) else A
            else:
                pred = A
            X = g[r, c]
            if not sim(X, pred):
                keep[r, c] = True
                anchor_grid[r, c] = X
            else:
                anchor_grid[r, c] = pred
    return keep


def official_select(g, method, threshold, anchored=True):
    if method == "exact" or (method == "max" and threshold == 0) or not anchored:
        return official_fast(g, method, threshold)
    return official_anchored(g, method, threshold)


def near_duplicate_grid(h: int, w: int, seed: int, dim: int = 12) -> torch.Tensor:
    """Units copied from the left / upper neighbour or drawn from a small quantised palette, many with a small
    noise (0.003 / 0.012 / 0.05 amplitude): chains of near-duplicates where sliding and anchored differ."""
    gen = torch.Generator().manual_seed(seed)
    palette = torch.randint(0, 8, (3, dim), generator=gen).float() / 8
    source = torch.randint(0, 4, (h, w), generator=gen)  # 0: palette, 1: left, 2: up, 3: up-left
    colour = torch.randint(0, 3, (h, w), generator=gen)
    amplitude = torch.tensor([0.0, 0.0, 0.003, 0.012, 0.05])[torch.randint(0, 5, (h, w), generator=gen)]
    noise = (torch.rand(h, w, dim, generator=gen) * 2 - 1) * amplitude[..., None]
    grid = torch.empty(h, w, dim)
    for r in range(h):
        for c in range(w):
            s = int(source[r, c])
            if s == 1 and c > 0:
                base = grid[r, c - 1]
            elif s == 2 and r > 0:
                base = grid[r - 1, c]
            elif s == 3 and r > 0 and c > 0:
                base = grid[r - 1, c - 1]
            else:
                base = palette[colour[r, c]]
            grid[r, c] = base + noise[r, c]
    return grid


GRIDS = [(1, 1), (1, 9), (8, 1), (6, 9), (9, 5), (8, 8)]
THRESHOLDS = [0.0, 0.005, 0.02, 0.1]


@pytest.mark.parametrize("metric", ["max", "mae", "rmse", "exact"])
def test_matches_the_official_selector_on_near_duplicates(metric):
    anchored_differs = False
    for seed, (h, w) in enumerate(GRIDS):
        g = near_duplicate_grid(h, w, seed)
        for threshold in THRESHOLDS:
            for anchored in (True, False):
                expected = official_select(g, metric, threshold, anchored)
                got = pred2d_keep(g, threshold, metric, anchored)
                assert got.dtype == torch.bool and got.shape == (h, w)
                assert torch.equal(got, expected), (metric, h, w, threshold, anchored)
            if metric != "exact" and threshold > 0:
                anchored_differs |= not torch.equal(
                    official_fast(g, metric, threshold), official_anchored(g, metric, threshold)
                )
    # the inputs do exercise the reconstruction: somewhere the anchored path keeps what the sliding one drops
    # (max and mae; rmse averages the noise away on these grids, its paths agree here)
    assert anchored_differs or metric in ("exact", "rmse")


def test_batched_images_are_independent():
    grids = torch.stack([near_duplicate_grid(5, 7, seed) for seed in (11, 12, 13)])
    for threshold in (0.0, 0.02):
        batch = pred2d_keep(grids, threshold, "max")
        assert batch.shape == (3, 5, 7)
        for i in range(3):
            assert torch.equal(batch[i], official_select(grids[i], "max", threshold))


def test_dispatch_and_metrics():
    assert uses_fast_path("exact", 0.1, True) and uses_fast_path("max", 0.0, True)
    assert uses_fast_path("mae", 0.1, False) and not uses_fast_path("max", 0.02, True)
    assert not uses_fast_path("mae", 0.0, True)  # the official dispatch: only exact and max at 0 short-cut
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    y = torch.tensor([[0.4, -0.2, 0.0, 0.0]])
    assert torch.allclose(unit_distance(x, y, "max"), torch.tensor([0.4]))
    assert torch.allclose(unit_distance(x, y, "mae"), torch.tensor([0.15]))
    assert torch.allclose(unit_distance(x, y, "rmse"), torch.tensor([(0.2 / 4) ** 0.5]))
    assert units_similar(x, y, "max", 0.4).item() and not units_similar(x, y, "max", 0.39).item()  # dist <= thr
    assert not units_similar(x, y, "exact", 1.0).item() and units_similar(x, x, "exact", 1.0).item()
    with pytest.raises(ValueError, match="unknown metric 'l2'"):
        pred2d_keep(torch.zeros(2, 2, 3), metric="l2")


# --- known answers --------------------------------------------------------------------------------------------


def units_from_labels(labels: list[list[int]], dim: int = 6) -> torch.Tensor:
    """A [h, w, dim] grid whose unit (r, c) is the constant vector labels[r][c] / 10."""
    return torch.tensor(labels, dtype=torch.float32)[..., None].expand(-1, -1, dim) / 10


@pytest.mark.parametrize("threshold,anchored", [(0.0, True), (0.05, True), (0.05, False)])
def test_constant_image_keeps_only_the_first_unit(threshold, anchored):
    keep = pred2d_keep(torch.full((4, 6, 5), 0.3), threshold, "max", anchored)
    expected = torch.zeros(4, 6, dtype=torch.bool)
    expected[0, 0] = True
    assert torch.equal(keep, expected)


def test_all_distinct_image_keeps_everything():
    units = torch.arange(5 * 7, dtype=torch.float32).view(5, 7, 1).expand(-1, -1, 4) / 100
    for threshold in (0.0, 0.005):
        assert bool(pred2d_keep(units, threshold).all())


def test_vertical_edge_predicts_from_above():
    # C=1 B=2 / A=1 X=2: C continues to the left (A), not up (B): a vertical edge, X copies B and is dropped
    assert pred2d_keep(units_from_labels([[1, 2], [1, 2]])).tolist() == [[True, True], [False, False]]
    # C=1 B=1 / A=2 X=2: horizontal edge, X copies A
    assert pred2d_keep(units_from_labels([[1, 1], [2, 2]])).tolist() == [[True, False], [True, False]]
    # C=1 B=2 / A=3 X=2: no edge pattern, the default is A, so X is kept although it equals B
    assert pred2d_keep(units_from_labels([[1, 2], [3, 2]])).tolist() == [[True, True], [True, True]]
    # three vertical stripes: only the first row carries information
    stripes = units_from_labels([[1, 2, 3]] * 4)
    assert pred2d_keep(stripes).sum().item() == 3 and bool(pred2d_keep(stripes)[0].all())


def test_exact_repeats_are_dropped_at_threshold_zero_and_near_repeats_kept():
    units = units_from_labels([[1, 1, 4, 4], [5, 5, 4, 4]])
    # (1, 2) = 4 equals the unit above, but its up-left (1) does not continue its left (5): predicted from the
    # left (5), so kept; (1, 3) = 4 is dropped
    assert pred2d_keep(units).tolist() == [[True, False, True, False], [True, False, True, False]]
    nudged = units.clone()
    nudged[0, 1, 0] += 1e-6  # no longer a bit-exact repeat
    assert pred2d_keep(nudged)[0, 1].item() and not pred2d_keep(nudged, 1e-5)[0, 1].item()


def test_anchored_reconstruction_stops_drift():
    # a ramp of steps 0.01 along the row: each step matches its neighbour at 0.015, so the sliding path drops
    # all; the anchored path compares with the last kept unit and keeps one every other step
    ramp = (torch.arange(7, dtype=torch.float32) * 0.01).view(1, 7, 1).expand(-1, -1, 3)
    assert pred2d_keep(ramp, 0.015, "max", anchored=False).tolist() == [[True] + [False] * 6]
    assert pred2d_keep(ramp, 0.015, "max", anchored=True).tolist() == [[True, False, True, False, True, False, True]]


# --- de-normalisation and the processor layout ----------------------------------------------------------------


@pytest.mark.parametrize("mean,std", [(QWEN3_VL_MEAN, QWEN3_VL_STD), (CLIP_MEAN, CLIP_STD)])
def test_denormalize_inverts_the_normalisation(mean, std):
    gen = torch.Generator().manual_seed(3)
    pixels = torch.randint(0, 256, (10, 3, 2, 4, 4), generator=gen).float() / 255  # [N, C, T, P, P] in [0, 1]
    m, s = torch.tensor(mean).view(1, 3, 1, 1, 1), torch.tensor(std).view(1, 3, 1, 1, 1)
    rows = ((pixels - m) / s).reshape(10, -1)
    first = denormalize_patches(rows, mean, std, temporal_patch=2, patch=4)
    assert first.shape == (10, 3 * 4 * 4)
    assert torch.allclose(first, pixels[:, :, 0].reshape(10, -1), atol=1e-6)
    whole = denormalize_patches(rows, mean, std, temporal_patch=2, patch=4, temporal_index=None)
    assert torch.allclose(whole, pixels.reshape(10, -1), atol=1e-6)
    second = denormalize_patches(rows, mean, std, temporal_patch=2, patch=4, temporal_index=1)
    assert torch.allclose(second, pixels[:, :, 1].reshape(10, -1), atol=1e-6)
    if mean == QWEN3_VL_MEAN:  # the official `x * 0.5 + 0.5` of the first slice, bit for bit
        assert torch.equal(first, (rows.view(10, 3, 2, 4, 4)[:, :, 0] * 0.5 + 0.5).reshape(10, -1))
    with pytest.raises(ValueError, match=r"pixel_values must be \[N, 3\*2\*4\*4=96\]"):
        denormalize_patches(rows[:, :95], mean, std, 2, 4)


def raw_units(frames: torch.Tensor, patch: int, merge: int = 2) -> torch.Tensor:
    """The merge units of frames [T, C, H, W] straight from the pixels: per unit (raster order) its merge x merge
    patches row-major, each (C, T, P, P)."""
    t, ch, height, width = frames.shape
    rows, cols = height // (patch * merge), width // (patch * merge)
    x = frames.reshape(t, ch, rows, merge, patch, cols, merge, patch)
    return x.permute(2, 5, 3, 6, 1, 0, 4, 7).reshape(rows * cols, -1)


def test_unit_vectors_are_the_pixels_of_each_unit_qwen2_vl_image_processor():
    from transformers import Qwen2VLImageProcessor

    gen = torch.Generator().manual_seed(4)
    image = torch.randint(0, 256, (3, 56, 84), generator=gen, dtype=torch.uint8)
    out = Qwen2VLImageProcessor()(images=[image], do_resize=False, return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]]
    units = merge_unit_vectors(denormalize_patches(out["pixel_values"], CLIP_MEAN, CLIP_STD, 2, 14))
    assert units.shape == (6, 4 * 3 * 14 * 14)
    assert torch.allclose(units, raw_units(image[None].float() / 255, 14), atol=1e-5)
    # the whole frame is the image twice (the processor repeats it over the temporal patch)
    whole = merge_unit_vectors(denormalize_patches(out["pixel_values"], CLIP_MEAN, CLIP_STD, 2, 14, None))
    assert torch.allclose(whole, raw_units(image[None].float().expand(2, -1, -1, -1) / 255, 14), atol=1e-5)


def test_unit_vectors_of_a_video_qwen2_vl_video_processor():
    from transformers import Qwen2VLVideoProcessor

    gen = np.random.default_rng(5)
    video = gen.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)  # [T, H, W, C], 2 temporal patches of 2x2 units
    out = Qwen2VLVideoProcessor()(videos=[video], do_resize=False, do_sample_frames=False, return_tensors="pt")
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]
    whole = merge_unit_vectors(denormalize_patches(out["pixel_values_videos"], CLIP_MEAN, CLIP_STD, 2, 14, None))
    frames = torch.from_numpy(video).permute(0, 3, 1, 2).float() / 255
    expected = torch.cat([raw_units(frames[0:2], 14), raw_units(frames[2:4], 14)])
    assert whole.shape == (8, 4 * 3 * 2 * 14 * 14) and torch.allclose(whole, expected, atol=1e-5)


# --- over all media of a grid_thw -----------------------------------------------------------------------------


def normalised_rows(units: torch.Tensor, patch: int, mean=QWEN3_VL_MEAN, std=QWEN3_VL_STD) -> torch.Tensor:
    """Processor rows [4 * U, 3 * 2 * P * P] whose first-slice merge units are `units` [U, 4 * 3 * P * P] and whose
    second temporal slice repeats the first (an image)."""
    patches = units.reshape(-1, 3, 1, patch, patch).expand(-1, -1, 2, -1, -1)
    m, s = torch.tensor(mean).view(1, 3, 1, 1, 1), torch.tensor(std).view(1, 3, 1, 1, 1)
    return ((patches - m) / s).reshape(patches.shape[0], -1)


def quantised_units(count: int, patch: int, seed: int) -> torch.Tensor:
    """Merge units (each 4 patches of 3 x P x P pixels in [0, 1]) with many exact repeats: values in 1/4 steps."""
    gen = torch.Generator().manual_seed(seed)
    palette = torch.randint(0, 5, (3, 4 * 3 * patch * patch), generator=gen).float() / 4
    return palette[torch.randint(0, 3, (count,), generator=gen)]


def test_pixelprune_keep_over_several_images_and_a_video():
    patch = 2
    grid_thw = torch.tensor([[1, 4, 6], [1, 2, 2], [3, 6, 4]])  # units: 2x3, 1x1, three temporal patches of 3x2
    units = quantised_units(6 + 1 + 18, patch, seed=6)
    rows = normalised_rows(units, patch)
    kept = pixelprune_keep(rows, grid_thw, QWEN3_VL_MEAN, QWEN3_VL_STD, temporal_patch=2, patch=patch)
    back = merge_unit_vectors(denormalize_patches(rows, QWEN3_VL_MEAN, QWEN3_VL_STD, 2, patch))
    masks = [
        official_select(back[0:6].view(2, 3, -1), "max", 0.0),
        official_select(back[6:7].view(1, 1, -1), "max", 0.0),
        *[official_select(back[7 + 6 * s : 13 + 6 * s].view(3, 2, -1), "max", 0.0) for s in range(3)],
    ]
    offsets = [0, 6, 7, 13, 19]
    expected = torch.cat([m.flatten().nonzero()[:, 0] + o for m, o in zip(masks, offsets)])
    assert kept.indices.dtype == torch.long and torch.equal(kept.indices, expected)
    assert kept.per_temporal_patch.tolist() == [int(m.sum()) for m in masks]
    assert kept.per_item.tolist() == [int(masks[0].sum()), 1, sum(int(m.sum()) for m in masks[2:])]
    assert kept.indices.numel() < 25  # the repeats were found
    # Qwen2/2.5-VL: the CLIP normalisation inverted with the processor's own values gives the same units
    clip = pixelprune_keep(normalised_rows(units, patch, CLIP_MEAN, CLIP_STD), grid_thw, CLIP_MEAN, CLIP_STD, 2, patch)
    assert torch.equal(clip.indices, expected)  # equal pixels de-normalise to equal floats
    with pytest.raises(ValueError, match="grid_thw describes 25 merge units, pixel_values holds 24"):
        pixelprune_keep(rows[:-4], grid_thw, QWEN3_VL_MEAN, QWEN3_VL_STD, 2, patch)


# --- the temporal variant -------------------------------------------------------------------------------------


def video_reference(g: torch.Tensor, metric: str, threshold: float, anchored: bool) -> torch.Tensor:
    """`pred2d_video_keep`'s definition as a raster loop over (t, r, c) with a reconstruction grid."""
    steps, h, w, _ = g.shape
    fast = uses_fast_path(metric, threshold, anchored)
    recon = g.clone()
    keep = torch.zeros(steps, h, w, dtype=torch.bool)

    def sim(a, b):
        return bool(units_similar(a, b, metric, threshold))

    for t in range(steps):
        seen = g if fast else recon
        for r in range(h):
            for c in range(w):
                x = g[t, r, c]
                pred = None
                if c > 0 and r > 0:
                    a, b, corner = seen[t, r, c - 1], seen[t, r - 1, c], seen[t, r - 1, c - 1]
                    pred = b if (sim(corner, a) and not sim(corner, b)) else a
                elif c > 0:
                    pred = seen[t, r, c - 1]
                elif r > 0:
                    pred = seen[t, r - 1, c]
                previous = seen[t - 1, r, c] if t > 0 else None
                if previous is not None and sim(x, previous):
                    recon[t, r, c] = previous
                elif pred is not None and sim(x, pred):
                    recon[t, r, c] = pred
                else:
                    keep[t, r, c] = True
    return keep


def drifting_video(steps: int, h: int, w: int, seed: int) -> torch.Tensor:
    """Temporal patches that each copy the previous one with small noise, some units replaced by new content."""
    gen = torch.Generator().manual_seed(seed)
    frames = [near_duplicate_grid(h, w, seed)]
    for _ in range(steps - 1):
        step = frames[-1] + (torch.rand(frames[-1].shape, generator=gen) * 2 - 1) * 0.006
        fresh = torch.rand(h, w, generator=gen) < 0.3
        frames.append(torch.where(fresh[..., None], near_duplicate_grid(h, w, seed + 100 + len(frames)), step))
    return torch.stack(frames)


@pytest.mark.parametrize("metric", ["max", "mae", "exact"])
def test_video_variant_matches_its_definition(metric):
    video = drifting_video(3, 5, 6, seed=20)
    for threshold in (0.0, 0.005, 0.02):
        for anchored in (True, False):
            got = pred2d_video_keep(video, threshold, metric, anchored)
            assert torch.equal(got, video_reference(video, metric, threshold, anchored)), (threshold, anchored)
            assert torch.equal(got[0], pred2d_keep(video[0], threshold, metric, anchored))  # patch 0 is pred2d
            if uses_fast_path(metric, threshold, anchored):  # one more way to be dropped: never keeps more
                assert bool((got <= pred2d_keep(video, threshold, metric, anchored)).all())


def test_repeated_temporal_patch_is_dropped_entirely():
    patch = 2
    first = quantised_units(12, patch, seed=8)
    second = first.clone()
    second[5] = 1.0 - second[5]  # one unit changes
    # a video of three temporal patches of 3x4 units: [first, first, second]
    rows = torch.cat([normalised_rows(first, patch), normalised_rows(first, patch), normalised_rows(second, patch)])
    grid = torch.tensor([[3, 6, 8]])
    video = pixelprune_video_keep(rows, grid, QWEN3_VL_MEAN, QWEN3_VL_STD, 2, patch)
    spatial = pixelprune_keep(rows, grid, QWEN3_VL_MEAN, QWEN3_VL_STD, 2, patch)
    first_mask, second_mask = pred2d_keep(first.view(3, 4, -1)), pred2d_keep(second.view(3, 4, -1))
    assert 1 < int(first_mask.sum()) < 12
    assert video.per_temporal_patch.tolist() == [int(first_mask.sum()), 0, 1]  # only the changed unit survives
    assert torch.equal(video.indices, torch.cat([first_mask.flatten().nonzero()[:, 0], torch.tensor([24 + 5])]))
    assert video.per_item.tolist() == [int(first_mask.sum()) + 1]
    # pixelprune_keep prunes each temporal patch on its own
    assert spatial.per_temporal_patch.tolist() == [int(first_mask.sum())] * 2 + [int(second_mask.sum())]
    # an image (t = 1) gets exactly pred2d from the video variant as well
    image = pixelprune_video_keep(rows[:48], torch.tensor([[1, 6, 8]]), QWEN3_VL_MEAN, QWEN3_VL_STD, 2, patch)
    assert torch.equal(image.indices, first_mask.flatten().nonzero()[:, 0])


def test_units_to_patch_indices():
    assert units_to_patch_indices(torch.tensor([0, 2, 5])).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 20, 21, 22, 23]
    assert units_to_patch_indices(torch.tensor([1, 3]), merge=3).tolist() == list(range(9, 18)) + list(range(27, 36))
    assert units_to_patch_indices(torch.zeros(0, dtype=torch.long)).numel() == 0


# --- the method on the Qwen families ----------------------------------------------------------------------------


def model_processor(family: str):
    from tests.conftest import model_and_processor

    return model_and_processor(family)[1]


def processor_patches(family: str):
    """The fixture clip's processor output as `VideoPatches`, with the processor's own normalisation."""
    from tests.conftest import model_and_processor, single_inputs
    from vtc.hf.adapters import resolve_adapter
    from vtc.hf.encode import pixel_normalization

    model, processor = model_and_processor(family)
    inputs = single_inputs(family)
    vision = model.config.vision_config
    mean, std = pixel_normalization(resolve_adapter(model), processor)
    shape = (3, vision.temporal_patch_size, vision.patch_size, vision.patch_size)
    grid = inputs["video_grid_thw"][0].tolist()
    patches = vtc.VideoPatches.from_rows(inputs["pixel_values_videos"], grid, 2, shape, mean, std)
    return model, inputs, patches, (mean, std)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_the_method_keeps_the_official_selection_and_the_llm_sees_that_many(family):
    model, inputs, patches, (mean, std) = processor_patches(family)
    vision = model.config.vision_config
    official = pixelprune_keep(  # both frames of each temporal patch compared (an image's are copies)
        inputs["pixel_values_videos"],
        inputs["video_grid_thw"],
        mean,
        std,
        vision.temporal_patch_size,
        vision.patch_size,
        temporal_index=None,
    )
    method = vtc.registry()["pixelprune"]().bind(None)  # no retention: the official rule at tau = 0
    assert method.retained_count(len(patches), patches.grid, family) is None
    ctx = vtc.Context(family=family)
    chosen = patches.select(method.choose(patches, None, ctx)).kept
    assert torch.equal(chosen, official.indices)
    assert 0 < chosen.numel() < 0.8 * len(patches)  # the fixture clip's flat scenes repeat exactly
    with vtc.patch(model, "pixelprune") as handle:
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
    assert stats.llm_tokens_in == chosen.numel() and stats.visual_tokens_in == len(patches)
    # the temporal variant drops at least as much (a second predictor); on a still background with a moving square
    # (the fixture clip's first scene) it keeps the square and the first temporal patch
    video = vtc.registry()["pixelprune-video"]().bind(None)
    assert bool(torch.isin(video.choose(patches, None, ctx), chosen).all())
    from vtc.media.video import synthetic_video
    from vtc.testing.fixtures import prepare_inputs

    still = prepare_inputs(model_processor(family), synthetic_video(32, 224, 224)[:10], "What moves?", num_frames=8)
    still_patches = vtc.VideoPatches.from_rows(
        still["pixel_values_videos"], still["video_grid_thw"][0].tolist(), 2, patches.patch_shape, mean, std
    )
    spatial = method.choose(still_patches, None, ctx)
    temporal = video.choose(still_patches, None, ctx)
    t, h, w = still_patches.grid
    assert t == 4 and bool(torch.isin(temporal, spatial).all())
    first = int((spatial < h * w).sum())
    assert int((temporal < h * w).sum()) == first  # patch 0 has no previous one
    assert temporal.numel() - first < 0.5 * (spatial.numel() - first)  # the later patches: mostly the square


def test_fixed_count_keeps_the_largest_residuals():
    from vtc_plugins.pixelprune import prediction_residual, top_residual_keep

    _, _, patches, _ = processor_patches("qwen2_vl")
    method = vtc.registry()["pixelprune"]().bind(0.25)
    count = method.retained_count(len(patches), patches.grid, "qwen2_vl")
    assert count == round(0.25 * len(patches))
    kept = method.choose(patches, count, vtc.Context(family="qwen2_vl"))
    units = method.unit_vectors(patches)
    residual = prediction_residual(units).flatten()
    assert kept.numel() == count and torch.equal(kept, torch.sort(kept).values)
    dropped = torch.ones(len(patches), dtype=torch.bool)
    dropped[kept] = False
    assert float(residual[kept].min()) >= float(residual[dropped].max())  # no dropped unit is farther off
    t, h, w = patches.grid
    assert bool(torch.isin(torch.arange(t) * h * w, kept).all())  # every temporal patch's first unit
    # the residual is what the fast path thresholds: units kept at tau are exactly those with residual > tau
    # (wherever the edge test agrees with tau = 0's, which it does on exact-repeat content)
    fast = pred2d_keep(units, 0.0, "max", anchored=False).flatten()
    assert torch.equal(fast, residual > 0)
    assert torch.equal(top_residual_keep(torch.tensor([1.0, 3.0, 3.0, 0.0]), 2), torch.tensor([1, 2]))
    assert torch.equal(top_residual_keep(torch.tensor([2.0, 2.0, 2.0]), 2), torch.tensor([0, 1]))  # ties: earlier
    # an explicit threshold is the official adaptive rule, whatever the retention
    assert vtc.registry()["pixelprune"](threshold=0.0).bind(0.25).retained_count(10, (1, 2, 5), "qwen2_vl") is None


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="metric"):
        vtc.registry()["pixelprune"](metric="l2")
    with pytest.raises(ValueError, match="threshold"):
        vtc.registry()["pixelprune"](threshold=-0.1)
