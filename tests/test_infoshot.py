"""InfoShot (abstract only, vtc's reading): DIG's CAFS scene cuts against the official loop (transcribed), known
answers on hand-made features (shots at the cuts, the representative nearest the shot mean, the flash frame as the
deviation frame, the shot count fitted to K/2), a colour encoder whose shots are known, what `handle.stats().frames`
shows, composition with a connect method, and bad inputs."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

import vtc
from tests.conftest import model_and_processor
from tests.probes import ColourEncoder, coloured_clip
from tests.reference import official_get_r_frames
from vtc.media.encoders import FEATURE_CACHE, EncoderLoadError, image_encoder
from vtc.media.frame_selection import cafs_candidates, cafs_chunks, scene_boundaries, scene_cuts
from vtc.testing.fixtures import tiny_dinov2_path
from vtc_plugins.infoshot import fit_shots, infoshot_positions, shot_keyframes, shots_from_cuts


def scene_features(total_frames, seed):
    """Per video frame: a direction that jumps every 3-20 s (at 10 fps), plus noise."""
    rng = np.random.default_rng(seed)
    feats, direction = np.zeros((total_frames, 16), dtype=np.float32), rng.normal(size=16)
    for f in range(total_frames):
        if rng.random() < 1 / 80:
            direction = rng.normal(size=16)
        feats[f] = direction + rng.normal(scale=0.15, size=16)
    return torch.from_numpy(feats)


@pytest.mark.parametrize("seconds,seed", [(25, 0), (61, 1), (90, 2), (150, 3), (200, 4)])
def test_scene_cuts_are_dig_cafs_official_on_random_scenes(seconds, seed):
    total, fps = seconds * 10 + 3, 10.0
    video = scene_features(total, seed)
    official = official_get_r_frames(lambda idx: video[idx], total, fps)
    candidates, boundaries = official["candidates"], official["boundaries"]
    assert cafs_candidates(total, fps, 2) == candidates
    chunks = cafs_chunks(candidates, total, fps)
    assert len(chunks) == math.ceil(seconds / 60) and sum(map(len, chunks)) == len(candidates)
    cuts = scene_cuts(video[candidates], chunks)
    assert scene_boundaries(candidates, cuts, total) == boundaries
    assert len(boundaries) > 3  # the random scenes did change


def test_chunks_split_the_video_evenly_and_no_change_is_measured_across_them():
    # a 90-s video: two 45-s chunks (ceil(90 / 60) equal segments), not 60 + 30
    candidates = cafs_candidates(900, 10.0)
    chunks = cafs_chunks(candidates, 900, 10.0)
    assert [len(c) for c in chunks] == [90, 90] and candidates[chunks[1][0]] >= 449
    # a jump exactly at the chunk edge is the first / last difference of a chunk: no peak there
    feats = np.ones((180, 4), dtype=np.float32)
    feats[90:, 0] = -1.0
    assert scene_cuts(feats, chunks) == [] and scene_cuts(feats) == [89]
    # shorter than a second (official: no candidates at all): one second's worth
    assert cafs_candidates(10, 30.0) == [0, 9] and cafs_chunks([0, 9], 10, 30.0) == [[0, 1]]


def directions(*angles):
    """Unit vectors in the plane at the given angles (radians), as [n, 3] features (third axis 0)."""
    a = np.asarray(angles, dtype=np.float64)
    return np.stack([np.cos(a), np.sin(a), np.zeros_like(a)], axis=1)


def test_shots_are_found_at_the_cuts():
    # three scenes (0, 90 and 180 degrees), five frames each, with a small wobble inside each scene
    wobble = [0.0, 0.02, -0.02, 0.01, 0.0]
    feats = directions(*[w for w in wobble], *[math.pi / 2 + w for w in wobble], *[math.pi + w for w in wobble])
    cuts = scene_cuts(feats)
    assert cuts == [4, 9]  # the last frame of each scene before a change
    assert shots_from_cuts(15, cuts) == [(0, 5), (5, 10), (10, 15)]


def test_the_representative_is_nearest_the_mean_and_the_flash_is_the_deviation_frame():
    # one shot: angles around 0.1 rad, and a brief flash at frame 6 (0.4 rad: below the cut prominence)
    angles = [0.0, 0.2, 0.05, 0.15, 0.1, 0.12, 0.4, 0.08]
    feats = directions(*angles)
    assert scene_cuts(feats) == []  # 1 - cos(0.3) = 0.045: the flash is no cut
    (rep,), (dev,), deviation = shot_keyframes([(0, 8)], feats)
    mean = (feats / np.linalg.norm(feats, axis=1, keepdims=True)).mean(axis=0)
    assert rep == int(np.argmin(np.linalg.norm(feats - mean, axis=1)))
    assert rep == 3  # 0.15 rad: the frame nearest the mean direction (~0.1375 rad; 0.12 is 0.005 farther)
    assert dev == 6 and deviation.argmax() == 6
    # the deviation is normalised by the shot's spread: the mean of every frame's score is ~1
    assert deviation[rep] == deviation.min() and abs(deviation.mean() - 1) < 1e-4


def test_a_one_frame_shot_gives_one_frame_and_its_spare_slot_goes_to_the_largest_deviation():
    # shot A: frames 0-3 with a deviant frame 2; shot B: frame 4 alone; shot C: frames 5-8 with deviants 5 and 8
    feats = directions(0.0, 0.01, 0.3, 0.0, 1.6, 3.0, 3.1, 3.1, 3.25)
    shots = [(0, 4), (4, 5), (5, 9)]
    reps, devs, deviation = shot_keyframes(shots, feats)
    assert devs[1] is None and reps[1] == 4
    positions, _ = infoshot_positions(feats, shots, 6)
    spare = max((p for p in range(9) if p not in reps + [d for d in devs if d is not None]), key=lambda p: deviation[p])
    assert sorted(positions) == positions and len(positions) == 6
    assert set(positions) == set(reps) | {d for d in devs if d is not None} | {spare}


def test_the_shot_count_is_fitted_to_half_the_budget():
    # four shots: 0 and 0.1 rad alike, 1.5 and 1.6 alike -> two shots at K = 4 (the most similar neighbours merge)
    feats = directions(0.0, 0.0, 0.1, 0.1, 1.5, 1.5, 1.6, 1.6)
    shots = [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert fit_shots(shots, feats, 2) == [(0, 4), (4, 8)]
    assert fit_shots(shots, feats, 3) == [(0, 4), (4, 6), (6, 8)]  # the first of two equally similar pairs
    # one long shot, K = 6: split the longest where it changes most (after 3, then after 6 in the longer rest)
    feats = directions(0.0, 0.01, 0.02, 0.03, 0.3, 0.31, 0.32, 0.6, 0.61, 0.62, 0.63)
    assert fit_shots([(0, 11)], feats, 3) == [(0, 4), (4, 7), (7, 11)]
    positions, _ = infoshot_positions(feats, [(0, 11)], 6)
    assert len(positions) == 6 and {0, 1, 2, 3} & set(positions) and {7, 8, 9, 10} & set(positions)
    # one-frame shots cannot split: fewer shots, the rest filled by deviation; never more frames than candidates
    assert fit_shots([(0, 1), (1, 2)], directions(0.0, 1.0), 5) == [(0, 1), (1, 2)]
    assert infoshot_positions(directions(0.0, 1.0), [(0, 1), (1, 2)], 10)[0] == [0, 1]
    # K = 1: the one shot's representative; odd K: the last slot goes to the largest deviation
    assert infoshot_positions(directions(0.0, 0.01, 0.5), [(0, 3)], 1)[0] == [1]
    assert len(infoshot_positions(feats, [(0, 11)], 7)[0]) == 7


def test_infoshot_picks_two_frames_per_colour_shot_and_stats_show_them():
    model, processor = model_and_processor("qwen2_vl")
    FEATURE_CACHE.clear()
    encoder = ColourEncoder()
    clip = coloured_clip(blue=())  # grey, red during seconds 12-13, grey
    with vtc.patch(model, "infoshot", encoder=encoder, num_frames=6) as handle:
        inputs = handle.prepare(processor, clip, "what happens?", fps=4)
        with torch.no_grad():
            model(**inputs)
        chosen = handle.stats().frames[0]
    assert chosen.method == "infoshot"
    candidates = cafs_candidates(80, 4.0, 2)
    assert chosen.candidates == candidates and encoder.images_encoded == len(candidates) == 40
    # shots grey [0, 46], red [48, 54], grey [56, 78]: K = 6 is three shots, two frames each (the identical frames
    # of a shot tie: the first is the representative, the next the deviation frame)
    assert chosen.indices == [0, 2, 48, 50, 56, 58]
    assert max(chosen.candidate_scores) < 1e-12  # no frame deviates inside its shot
    assert inputs["video_grid_thw"][0, 0].item() == 3


def test_infoshot_composes_with_a_connect_method_on_a_real_dinov2():
    model, processor = model_and_processor("qwen2_5_vl")
    with vtc.patch(model, "infoshot+vidcom2", retention=0.5, encoder=tiny_dinov2_path()) as handle:
        inputs = handle.prepare(processor, coloured_clip(), "the red ball", fps=4, num_frames=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
    frames = stats.frames[0]
    assert frames.method == "infoshot" and len(frames.indices) == 4 == len(set(frames.indices))
    assert len(frames.candidates) == 40 and frames.indices == sorted(frames.indices)
    assert stats.llm_tokens_in == round(stats.visual_tokens_in * 0.5)
    with pytest.raises(ValueError, match="'infoshot' and 'bolt' both decide frame selection"):
        vtc.patch(model, "infoshot+bolt")


def test_bad_inputs_name_the_problem(tmp_path, monkeypatch):
    model, processor = model_and_processor("qwen2_vl")
    missing = str(tmp_path / "no-dinov2")
    with vtc.patch(model, "infoshot", encoder=missing) as handle:
        with pytest.raises(EncoderLoadError, match="infoshot.encoder"):
            handle.prepare(processor, coloured_clip(), "q", fps=4)
    with pytest.raises(TypeError, match="infoshot.encoder.*encode_images"):
        image_encoder(object(), param="infoshot.encoder")
    with pytest.raises(ValueError, match="num_frames"):
        vtc.patch(model, "infoshot", num_frames=0)
    monkeypatch.setitem(sys.modules, "scipy.signal", None)
    with pytest.raises(ImportError, match=r"scipy: pip install 'vtc\[samplers\]'"):
        scene_cuts(np.ones((3, 2)))
