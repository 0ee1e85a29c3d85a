"""DIG: CAFS, the refinement and the k-frame mapping against the official functions (transcribed) on random
features and rewards, known answers on hand-made features and rewards (a scene cut where the features change, the
interval around a high-reward r-frame, the official quirks), the answer parsing and its fallbacks, the faithful
0.5-s metadata reaching the processor, end-to-end runs (a colour encoder with a judge whose right answer is known;
the tiny model as classifier and judge, whose noise takes the official fallbacks), composition, and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vtc
from tests.conftest import model_and_processor
from tests.probes import ColourEncoder, coloured_clip
from tests.reference import official_get_r_frames
from vtc.core.tokens import Context
from vtc.media.encoders import FEATURE_CACHE, EncoderLoadError
from vtc.media.frame_selection import cafs_candidates, cafs_chunks
from vtc.media.video import VideoSource
from vtc.testing.fixtures import tiny_dinov2_path
from vtc_plugins.dig import (
    QUERY_IDENTIFICATION_PROMPT,
    Dig,
    cafs_r_frames,
    frames_in_intervals,
    parse_query_type,
    parse_reward,
    refine_intervals,
    reward_prompt,
)


# --- the official code (Jialuo-Li/DIG ffe6d25), transcribed --------------------------------------------------------
def official_merge_intervals(intervals):
    """pipeline/video_refinement.py::merge_intervals."""
    if not intervals:
        return []
    intervals.sort(key=lambda x: x[0])
    merged = [intervals[0]]
    for start, end in intervals[1:]:
        last_start, last_end = merged[-1]
        if start <= last_end:
            merged[-1][1] = max(last_end, end)
        else:
            merged.append([start, end])
    return merged


def official_normalize_scores(scores):
    """pipeline/video_refinement.py::normalize_scores."""
    min_val, max_val = np.min(scores), np.max(scores)
    if max_val == min_val:
        return np.zeros_like(scores)
    return (scores - min_val) / (max_val - min_val + 1e-8) * 100


def official_video_refinement(rewards, boundaries, wlen=2):
    """pipeline/video_refinement.py::video_refinement."""
    scores = official_normalize_scores(np.array(rewards, dtype=float))
    non_zero_indices = np.where(scores > 0)[0]
    if len(non_zero_indices) == 0:
        return [[boundaries[0], boundaries[-1]]]
    if len(non_zero_indices) == 1:
        idx = non_zero_indices[0]
        return [[boundaries[max(0, idx - wlen)], boundaries[min(len(scores) - 1, idx + wlen)]]]
    active_scores = scores[scores > 0]
    s1 = active_scores.copy()
    while True:
        prev_zeros = np.sum(s1 == 0)
        s1 = np.maximum(s1 - np.mean(s1), 0)
        if np.sum(s1 == 0) == prev_zeros:
            break
    s2 = active_scores.copy()
    s2 = np.maximum(s2 - 0.5 * np.max(s2), 0) if len(s2) > 0 else np.array([])
    final_scores = s1 if np.sum(s1 > 0) <= np.sum(s2 > 0) else s2
    segments = []
    valid_indices = np.where(final_scores > 0)[0]
    for i in valid_indices:
        orig_idx = non_zero_indices[i]
        segments.append([boundaries[max(0, orig_idx - wlen)], boundaries[min(len(scores) - 1, orig_idx + wlen)]])
    return official_merge_intervals(segments) or [[boundaries[0], boundaries[-1]]]


def official_select_k_indices(intervals, k):
    """pipeline/video_refinement.py::select_k_indices."""
    if not intervals or k <= 0:
        return []
    total_length = sum(end - start + 1 for start, end in intervals)
    sample_points = np.linspace(0, total_length - 1, k, dtype=int)
    frame_indices = []
    for sample in sample_points:
        current_pos = sample
        for start, end in intervals:
            seg_len = end - start + 1
            if current_pos < seg_len:
                frame_indices.append(int(start + current_pos))
                break
            current_pos -= seg_len
    return frame_indices


# --- against the official code ---------------------------------------------------------------------------------------
def random_rewards(rng, n, kind):
    if kind == "uniform":
        return rng.integers(0, 101, n).astype(float).tolist()
    if kind == "sparse":  # mostly zero, a few relevant shots (the common case)
        r = np.zeros(n)
        r[rng.choice(n, size=max(1, n // 6), replace=False)] = rng.integers(40, 101, max(1, n // 6))
        return r.tolist()
    return rng.choice([0.0, 20.0, 50.0, 90.0], n).tolist()  # ties


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["uniform", "sparse", "ties"])
def test_refinement_and_k_frames_are_the_official_ones_on_random_rewards(seed, kind):
    rng = np.random.default_rng(seed)
    total = int(rng.integers(300, 5000))
    n = int(rng.integers(1, 40))  # r-frames; boundaries = n + 1
    cuts = np.sort(rng.choice(np.arange(1, total - 1), size=n - 1, replace=False)).tolist()
    boundaries = [0, *cuts, total - 1]
    rewards = random_rewards(rng, n, kind)
    intervals = refine_intervals(rewards, boundaries, 2)
    assert intervals == [[int(a), int(b)] for a, b in official_video_refinement(rewards, boundaries, 2)]
    for k in (8, 32, 64, 256):
        assert frames_in_intervals(intervals, k) == official_select_k_indices(intervals, k)
    for wlen in (0, 1, 3):
        assert refine_intervals(rewards, boundaries, wlen) == [
            [int(a), int(b)] for a, b in official_video_refinement(rewards, boundaries, wlen)
        ]


@pytest.mark.parametrize("seed", range(4))
def test_cafs_is_the_official_get_r_frames_on_random_features(seed):
    rng = np.random.default_rng(seed)
    fps = float(rng.choice([24.0, 25.0, 29.97, 30.0]))
    total = int(rng.integers(int(40 * fps), int(200 * fps)))  # one to four 60-s chunks
    cuts = np.sort(rng.choice(total, size=int(rng.integers(3, 25)), replace=False))
    scene_of = np.searchsorted(cuts, np.arange(total))
    scenes = rng.normal(size=(scene_of.max() + 1, 16))
    table = torch.tensor(scenes[scene_of] + 0.3 * rng.normal(size=(total, 16)), dtype=torch.float32)
    candidates = cafs_candidates(total, fps, 2)
    chunks = cafs_chunks(candidates, total, fps, 60)
    r_frames, boundaries = cafs_r_frames(table[candidates], candidates, chunks, total, 0.1)
    official = official_get_r_frames(lambda idx: table[torch.as_tensor(idx)], total, fps)
    assert r_frames == official["r_frame_idx"] and boundaries == official["boundaries"]
    assert len(r_frames) == len(boundaries) - 1 > 1


# --- known answers ---------------------------------------------------------------------------------------------------
def test_a_scene_cut_is_found_where_the_features_change():
    candidates = list(range(0, 150, 15))  # ten candidates, one chunk, a 150-frame video
    feats = torch.tensor([[1.0, 0.0]] * 4 + [[0.0, 1.0]] * 6)
    # 1 - cos peaks between the 4th and 5th candidates: the cut is the 4th (frame 45)
    r_frames, boundaries = cafs_r_frames(feats, candidates, None, 150)
    assert boundaries == [0, 45, 149]
    assert r_frames == [15, 90]  # middles 22 and 97, snapped to the nearest candidate
    # a change below the prominence is no cut; a constant video is one shot
    soft = torch.tensor([[1.0, 0.0]] * 4 + [[1.0, 0.3]] * 6)  # 1 - cos = 0.042
    assert cafs_r_frames(soft, candidates, None, 150) == ([75], [0, 149])
    assert cafs_r_frames(soft, candidates, None, 150, prominence=0.01)[1] == [0, 45, 149]
    # a change right at a chunk edge is not measured: two chunks meeting there, one shot
    assert cafs_r_frames(feats, candidates, [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]], 150)[1] == [0, 149]


def test_the_interval_around_a_high_reward_r_frame_is_chosen():
    boundaries = list(range(0, 101, 10))  # ten shots of ten frames, r-frames 0..9
    # one relevant shot: [b[i - 2], b[i + 2]]
    assert refine_intervals([0, 0, 0, 0, 90, 0, 0, 0, 0, 0], boundaries) == [[20, 60]]
    # two: s1 (iterated mean) keeps only the higher one, s2 (half max) both; s1 has fewer positives and wins
    assert refine_intervals([0, 0, 80, 0, 0, 0, 0, 0, 100, 0], boundaries) == [[60, 90]]
    assert frames_in_intervals([[60, 90]], 4) == [60, 70, 80, 90]
    # overlapping windows merge; the k frames spread over the intervals laid end to end
    # (s1: 100 98 99 10 -> 23.25 21.25 22.25 0 -> 6.6 4.6 5.6 0; s2: 50 48 49 0; three each, s1 wins the tie)
    assert refine_intervals([0, 100, 0, 98, 0, 0, 0, 0, 99, 10], boundaries) == [[0, 50], [60, 90]]
    assert frames_in_intervals([[0, 50], [60, 90]], 5) == [0, 20, 40, 69, 90]
    # nothing stands out: the whole video
    assert refine_intervals([30.0] * 10, boundaries) == [[0, 100]]


def test_the_official_quirks_are_kept():
    boundaries = [0, 10, 20, 30, 40, 50]
    # the upper clamp is n - 1 = len(boundaries) - 2: the last shot's own frames (40..50) are never reached
    assert refine_intervals([0, 0, 0, 0, 100], boundaries) == [[20, 40]]
    # equal top rewards: s1 falls to all zeros (fewer positives than s2), so nothing survives: the whole video
    assert refine_intervals([0, 100, 100, 0, 0], boundaries) == [[0, 50]]


def test_parsing_follows_the_official_readers_and_fallbacks():
    assert parse_query_type('{"analysis_step1": "a", "isGlobal": true}') == "global"
    assert parse_query_type('{"isGlobal": false}') == "local"
    assert parse_query_type('{"isGlobal": "True"}') == "global"  # a string is global only when it reads true
    assert parse_query_type('{"isGlobal": "yes"}') == "local"
    assert parse_query_type('{"isGlobal": 1}') == "local"
    assert parse_query_type('Sure.\n```json\n{"analysis_step4": "x {y}", "isGlobal": true}\n```') == "global"
    assert parse_query_type('{"analysis_step1": "the query names a dog", "isGlobal": false') == "local"  # cut off
    assert parse_query_type("{'isGlobal': True}") == "global"  # loosely quoted
    assert parse_query_type("I think it is global.") is None
    assert parse_query_type("") is None
    assert parse_reward('{"description": "a red ball", "reward": 85}') == 85.0
    assert parse_reward('{"description": "x", "reward": "70"}') == 70.0
    assert parse_reward('The frame shows... {"description": "x", "reward": 12.5} done') == 12.5
    assert parse_reward('{"description": "x", "reward": 40') == 40.0
    assert parse_reward('{"description": "x", "reward": "high"}') is None
    assert parse_reward('{"description": "x", "reward": NaN}') is None
    assert parse_reward("no idea") is None


def test_prompts_are_filled_as_officially():
    assert QUERY_IDENTIFICATION_PROMPT.endswith("User Query: <<<question>>>")
    text = reward_prompt("Where is the cat?", 600 / 29.97, 301 / 29.97)
    assert "Video Duration: 20.02 seconds\nSampled Frame Timestamp: 10.04 seconds\nQuestion: Where is the cat?" in text


# --- the sampler ----------------------------------------------------------------------------------------------------
def says(answer):
    """A classifier or judge function that always answers `answer` (a function of the frame, for a judge)."""
    calls = []

    def fn(prompt, image):
        calls.append(prompt)
        return answer(image) if callable(answer) else answer

    fn.calls = calls
    return fn


def red_judge(image):
    red = image[..., 0].mean() > 200
    return '{"description": "a frame", "reward": %d}' % (90 if red else 0)


def test_global_questions_get_uniform_frames_and_the_official_metadata():
    clip = VideoSource.open(coloured_clip(), fps=4)  # 80 frames
    classifier = says('{"isGlobal": true}')
    ctx = Context(question="What is the video about?")
    choice = Dig(num_frames=8, classifier=classifier, encoder=ColourEncoder()).sample(clip, ctx)
    assert choice.indices == np.linspace(0, 79, 8, dtype=int).tolist()
    assert choice.candidates is None and ctx.reports["query_type"] == ["global"]
    assert len(classifier.calls) == 1 and classifier.calls[0].endswith("User Query: What is the video about?")
    assert choice.metadata == {"fps": 2.0, "frames_indices": list(range(8)), "total_num_frames": 8, "duration": 4.0}
    assert Dig(query_type="global", timestamps="real").sample(clip, ctx).metadata is None


def test_a_localized_question_gets_the_frames_around_the_rewarded_shot():
    FEATURE_CACHE.clear()
    clip = VideoSource.open(coloured_clip(), fps=4)  # grey, blue during second 3, red during seconds 12-13
    encoder, judge = ColourEncoder(), says(red_judge)
    ctx = Context(question="where is the red ball?")
    choice = Dig(num_frames=6, classifier=says('{"isGlobal": false}'), judge=judge, encoder=encoder).sample(clip, ctx)
    # 20 s at 2 fps: 40 samples; the colour changes make four cuts, five shots: grey, blue, grey, red, grey
    assert encoder.images_encoded == 40 and ctx.reports["query_type"] == ["local"]
    boundaries = ctx.reports["boundaries"][0]
    assert len(boundaries) == 6 and boundaries[3] < 48 <= boundaries[4] < 56
    assert len(choice.candidates) == 5 and len(judge.calls) == 5
    assert choice.scores == [0.0, 0.0, 0.0, 90.0, 0.0]  # only the red shot's r-frame is relevant
    assert 48 <= choice.candidates[3] < 56
    # one positive reward: the window [b[3 - 2], b[min(4, 3 + 2)]], six frames spread over it
    assert ctx.reports["intervals"] == [[[boundaries[1], boundaries[4]]]]
    assert choice.indices == np.linspace(boundaries[1], boundaries[4], 6, dtype=int).tolist()
    assert "Sampled Frame Timestamp: %s seconds" % round(choice.candidates[3] / 4, 2) in judge.calls[3]
    assert "Video Duration: 20.0 seconds" in judge.calls[0]


def test_function_answers_are_retried_and_failures_take_the_official_fallbacks():
    clip = VideoSource.open(coloured_clip(), fps=4)
    answers = iter(["garbage", "still garbage", '{"isGlobal": true}'])
    classifier = says(lambda _: next(answers))
    Dig(num_frames=4, classifier=classifier, max_retries=5).sample(clip, Context(question="q"))
    assert len(classifier.calls) == 3  # a function's answers may change: retried until one parses
    # never a type: uniform frames, with a warning
    with pytest.warns(UserWarning, match="no query type.*after 2 attempt"):
        choice = Dig(num_frames=4, classifier=says("?"), max_retries=2).sample(clip, Context(question="q"))
    assert choice.indices == [0, 26, 52, 79]
    # rewards that never parse count as 0.0: all equal, so the whole video
    judge = says("no reward here")
    with pytest.warns(UserWarning, match="5 of 5 r-frame rewards.*0.0"):
        choice = Dig(num_frames=4, query_type="local", judge=judge, encoder=ColourEncoder(), max_retries=3).sample(
            clip, Context(question="q")
        )
    assert choice.scores == [0.0] * 5 and choice.indices == [0, 26, 52, 79] and len(judge.calls) == 15
    # under a second of video (the official code has no 2-fps frames there and fails): one second, one shot
    short = VideoSource.open(coloured_clip(seconds=1, fps=3), fps=4)
    choice = Dig(num_frames=2, query_type="local", judge=says(red_judge), encoder=ColourEncoder()).sample(
        short, Context(question="q")
    )
    assert choice.candidates == [0] and choice.scores == [0.0] and choice.indices == [0, 2]


def test_the_metadata_reaches_the_processor():
    model, processor = model_and_processor("qwen2_5_vl")
    clip = coloured_clip()  # 80 frames at 4 fps
    seconds = {}
    for timestamps in ("uniform", "real"):
        with vtc.patch(model, "dig", query_type="global", timestamps=timestamps, num_frames=8) as handle:
            inputs = handle.prepare(processor, clip, "What is the video about?", fps=4)
            seconds[timestamps] = inputs["second_per_grid_ts"].tolist()
            assert inputs["video_grid_thw"][0, 0].item() == 4  # eight frames, paired
    # qwen-vl-utils' frame list: 2 fps, so a temporal patch of two frames is 1 s; the real spacing is 10 frames
    # = 2.5 s a frame, 5 s a patch
    assert seconds == {"uniform": [1.0], "real": [pytest.approx(5.0)]}


def test_end_to_end_on_the_tiny_model_as_classifier_and_judge():
    model, processor = model_and_processor("qwen2_5_vl")
    clip = coloured_clip()
    with vtc.patch(model, "dig", encoder=tiny_dinov2_path(), max_new_tokens=4, num_frames=8) as handle:
        # the random model's answers are noise: no query type, so uniform frames
        with pytest.warns(UserWarning, match="no query type"):
            inputs = handle.prepare(processor, clip, "Where is the red ball?", fps=4)
        with torch.no_grad():
            model(**inputs)
        frames = handle.stats().frames[0]
        assert frames.method == "dig" and frames.indices == np.linspace(0, 79, 8, dtype=int).tolist()
        assert frames.candidates == [] and frames.reports == {"query_type": [None]}
    with vtc.patch(model, "dig", encoder=tiny_dinov2_path(), query_type="local", max_new_tokens=4) as handle:
        # no reward parses: every r-frame at 0.0, so the whole video, evenly
        with pytest.warns(UserWarning, match="r-frame rewards could not be read"):
            inputs = handle.prepare(processor, clip, "Where is the red ball?", fps=4, num_frames=8)
        with torch.no_grad():
            model(**inputs)
        frames = handle.stats().frames[0]
        assert frames.method == "dig" and frames.indices == np.linspace(0, 79, 8, dtype=int).tolist()
        assert frames.candidates and frames.candidate_scores == [0.0] * len(frames.candidates)
        reports = frames.reports
        assert reports["query_type"] == ["local"] and reports["rewards_failed"] == [len(frames.candidates)]
        assert reports["intervals"] == [[[0, 79]]]
        assert all(c % 2 == 0 or c == 79 for c in frames.candidates)  # r-frames are 2-fps samples


def test_dig_composes_with_a_connect_method_and_refuses_a_second_sampler():
    model, processor = model_and_processor("qwen2_5_vl")
    params = dict(classifier=says('{"isGlobal": false}'), judge=says(red_judge), encoder=ColourEncoder())
    with vtc.patch(model, "dig+vidcom2", retention=0.5, num_frames=4, **params) as handle:
        inputs = handle.prepare(processor, coloured_clip(), "where is the red ball?", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        assert stats.frames[0].method == "dig" and len(stats.frames[0].indices) == 4
        assert max(stats.frames[0].candidate_scores) == 90.0
        assert stats.llm_tokens_in == round(stats.visual_tokens_in * 0.5)
    with pytest.raises(ValueError, match="'dig' and 'uniform' both decide frame selection"):
        vtc.patch(model, "dig+uniform")


def test_bad_inputs_name_the_problem():
    model, processor = model_and_processor("qwen2_5_vl")
    clip = coloured_clip()
    with vtc.patch(model, "dig", query_type="global") as handle:
        with pytest.raises(ValueError, match="question"):
            handle.prepare(processor, clip, "", fps=4)
    with vtc.patch(model, "dig", query_type="local", encoder="no-such-org/dinov2-nope", judge=says("{}")) as handle:
        with pytest.raises(EncoderLoadError, match="dig.encoder"):
            handle.prepare(processor, clip, "where?", fps=4)
    with pytest.raises(ValueError, match="query_type must be one of 'auto', 'global', 'local'"):
        vtc.patch(model, "dig", query_type="both")
    with pytest.raises(ValueError, match="timestamps must be one of 'uniform', 'real'"):
        Dig(timestamps="fake")
    with pytest.raises(ValueError, match="judge must be None.*got int"):
        Dig(judge=42)
    # no patched model to ask, and none named
    with pytest.raises(ValueError, match="patched model.*dig.classifier="):
        Dig().sample(VideoSource.open(clip, fps=4), Context(question="q"))
    with pytest.raises(ValueError, match="dig.judge: cannot load 'no-such-org/vlm'"):
        Dig(query_type="local", judge="no-such-org/vlm", encoder=ColourEncoder()).sample(
            VideoSource.open(clip, fps=4), Context(question="q")
        )
