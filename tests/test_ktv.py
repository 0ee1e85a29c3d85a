"""KTV: the keyframe clustering, the budget tables and the key-token selection against the official logic
(hktk07/KTV, transcribed below) on random features, known answers on hand-made frames and tokens, end-to-end runs
on a tiny LLaVA-NeXT-Video (CLS attention) and a tiny Qwen2-VL (attention received; the CLS reading refused),
positions on the reference frames, `ktv-keyframes` composed with a connect method, and bad inputs."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans

import vtc
from tests.conftest import model_and_processor
from tests.probes import ColourEncoder, ConnectSpy, coloured_clip
from vtc.core.vision_stats import VisionStat, frame_stats
from vtc.media.encoders import EncoderLoadError
from vtc.testing import conformance
from vtc.testing.fixtures import batch_inputs, single_inputs
from vtc_plugins.ktv import (
    KTV,
    KTVKeyframes,
    apportion,
    candidate_frames,
    cls_logits,
    frame_ranks,
    grid_weights,
    keyframes,
    kmeans_picks,
    ordering_text,
    rank_budgets,
    select_key_tokens,
    uniform_keyframes,
)


# --- the official logic, transcribed (hktk07/KTV at d77f844) ---------------------------------------------------------
def official_video_frame_clustering(frame_features, num_cluster):
    """cluster_keyframe_and_order.py::video_frame_clustering."""
    kmeans = KMeans(n_clusters=num_cluster, random_state=0, init="k-means++", n_init=10).fit(frame_features)
    cluster_centers = kmeans.cluster_centers_
    distances = np.linalg.norm(frame_features - cluster_centers[:, np.newaxis, :], axis=2)
    closest_frames = np.argmin(distances, axis=1)
    return [int(closest_frames[j]) for j in range(num_cluster)]


def official_original_frame(total, index, max_frames):
    """cluster_keyframe_and_order.py::get_original_frame_number (no ts)."""
    if total <= max_frames:
        return index
    return np.linspace(0, total - 1, max_frames, dtype=int)[index]


def official_keyframes(features, total, k, max_frames):
    """cluster(): the clustering, the mapping to frame numbers and the fallback; run_inference sorts them."""
    frames = [official_original_frame(total, i, max_frames) for i in official_video_frame_clustering(features, k)]
    if len(set(frames)) != k:
        frames = [int(i) for i in np.linspace(0, float(total), k, endpoint=False)]
    return sorted(int(f) for f in frames)


def official_budget(order, num_frames, tokens_num):
    """llava_arch.py::encode_images, remain_tokens_num with a keyframe order."""
    if num_frames == 6:
        if order == 0:
            remain = 288
        elif order in [1, 2, 3, 4]:
            remain = 144
        else:
            remain = 72
        if tokens_num == 1872:
            remain = 576 if order in [0] else 288 if order in [1, 2, 3, 4] else 144
        if tokens_num == 504:
            remain = 144 if order in [0] else 72
    elif num_frames == 12:
        remain = 288 if order in [0, 1] else 144 if order in [2, 3, 4, 5, 6, 7, 8, 9] else 72
    return remain


def official_key_tokens(cls_sim, image_feature, rate, remain):
    """llava_arch.py::encode_images, prune_mode cls_new_token_sim, one frame."""
    cls_normalized = (cls_sim - cls_sim.min()) / (cls_sim.max() - cls_sim.min())
    features_normalized = image_feature / image_feature.norm(dim=1, keepdim=True)
    n = image_feature.shape[0]
    token_sim = torch.sum(torch.matmul(features_normalized, features_normalized.t()).fill_diagonal_(0), dim=1) / (n - 1)
    normalized_token_sim = (token_sim - token_sim.min()) / (token_sim.max() - token_sim.min())
    score = cls_normalized * rate + (1 - normalized_token_sim) * (1 - rate)
    _, top_k = torch.topk(score, remain, largest=True)
    return top_k.sort()[0]


def official_cls_attention(q, k):
    """clip_encoder.py::token_prune: single-head pre-softmax logits over the full width, CLS row, patch keys."""
    attn = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return attn[:, 0, 1:].squeeze(0)


def official_ordering(similarity):
    """cluster(): topk over all frames; frame at position `index` of the order gets rank `index`."""
    _, top = torch.topk(torch.as_tensor(similarity), len(similarity))
    ranks = [0] * len(similarity)
    for index, i in enumerate(top.tolist()):
        ranks[i] = index
    return ranks


# --- against the official logic ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_keyframes_are_the_official_ones_on_random_features(seed):
    rng = np.random.default_rng(seed)
    for total, limit, k in [(60, 5400, 6), (1000, 50, 6), (300, 40, 12)]:
        n = len(candidate_frames(total, limit))
        centres = rng.normal(size=(k + 2, 16))
        features = (centres[rng.integers(0, k + 2, n)] + 0.3 * rng.normal(size=(n, 16))).astype(np.float32)
        ours, fallback, _ = keyframes(features, candidate_frames(total, limit), total, k)
        assert ours == official_keyframes(features, total, k, limit)
        assert not fallback


def test_candidates_are_every_frame_up_to_the_limit_then_uniform():
    assert candidate_frames(7) == list(range(7))
    assert candidate_frames(10800)[:3] == [0, 2, 4] and len(candidate_frames(10800)) == 5400
    assert candidate_frames(10800) == np.linspace(0, 10799, 5400, dtype=int).tolist()


@pytest.mark.parametrize("seed", range(4))
def test_key_tokens_are_the_official_ones_on_random_tokens(seed):
    gen = torch.Generator().manual_seed(seed)
    heads, width = 4, 64
    for order, (frames, tokens_num) in enumerate([(6, 504), (6, 936), (6, 1872), (12, 504)]):
        q = torch.randn(1, 577, width, generator=gen)
        k = torch.randn(1, 577, width, generator=gen)
        feats = torch.randn(576, 32, generator=gen)
        budget = rank_budgets(frames, tokens_num)[order % frames]
        assert budget == official_budget(order % frames, frames, tokens_num)
        expected = official_key_tokens(official_cls_attention(q, k), feats, 0.2, budget)
        # vtc captures the tower's per-head softmax rows; the logits are recovered from them
        split = lambda x: x.view(1, 577, heads, width // heads).transpose(1, 2)  # noqa: E731
        probs = frame_stats(split(q), split(k), (width // heads) ** -0.5, {"cls"})["cls"]
        importance = cls_logits(probs)[0, 1:]
        got = select_key_tokens(importance, feats, 0.2, budget)
        assert torch.equal(got, expected)


def test_cls_logits_equal_the_official_ones_up_to_minmax():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 50, 32, generator=gen), torch.randn(1, 50, 32, generator=gen)
    official = official_cls_attention(q, k)
    split = lambda x: x.view(1, 50, 4, 8).transpose(1, 2)  # noqa: E731
    ours = cls_logits(frame_stats(split(q), split(k), 8**-0.5, {"cls"})["cls"])[0, 1:]
    norm = lambda x: (x - x.min()) / (x.max() - x.min())  # noqa: E731
    torch.testing.assert_close(norm(ours), norm(official), atol=1e-5, rtol=0)


def test_budget_tables_are_the_official_ones():
    for frames, tokens_num in [(6, 504), (6, 936), (6, 1872), (12, 504), (12, 936), (12, 1872)]:
        assert rank_budgets(frames, tokens_num) == [official_budget(r, frames, tokens_num) for r in range(frames)]
    assert rank_budgets(6, 504) == [144, 72, 72, 72, 72, 72] and sum(rank_budgets(6, 504)) == 504
    # other frame counts: the same shapes, the official total
    assert rank_budgets(3, 504) == [252, 126, 126]
    eight = rank_budgets(8, 936)  # units 4, 2 x 6, 1
    assert sum(eight) == 936 and eight[0] > eight[1] == eight[6] > eight[7]
    assert rank_budgets(1, 1872) == [576]  # at most a whole 576-token frame


def test_budgets_scale_to_the_retention_and_respect_caps():
    # LLaVA-NeXT-Video, 6 keyframes of 144 tokens at retention 0.25: 216 tokens shared 2 : 1 : 1 : 1 : 1 : 1
    shares = rank_budgets(6, 504)
    assert apportion(216, shares, [144] * 6) == [61, 31, 31, 31, 31, 31]
    assert apportion(504, shares, [576] * 6) == shares  # the official setting reproduces the table
    assert apportion(10, [10, 1], [4, 10]) == [4, 6]  # a cap passes its surplus on
    assert apportion(5, [0, 0], [3, 3]) == [3, 2]  # no weights: equal shares
    assert apportion(9, [1, 1], [3, 3]) == [3, 3]  # never more than the caps hold
    # Qwen pairs frames into temporal patches; an odd count leaves the last patch one frame
    assert grid_weights([144, 72, 72], 2) == [216.0, 72.0]
    assert grid_weights([144, 72, 72], 3) == [144.0, 72.0, 72.0]
    assert grid_weights([1, 2, 3, 4, 5], 2) == [6.0, 9.0]


def test_retention_is_the_share_of_visual_tokens_and_none_is_the_official_share():
    grid = (6, 12, 12)
    assert KTV().bind(0.25).retained_count(864, grid, "llava_next_video") == 216
    assert KTV().bind(None).retained_count(864, grid, "llava_next_video") == round(504 / 3456 * 864)
    assert KTV(tokens_num=1872).bind(None).retained_count(864, grid, "llava_next_video") == round(1872 / 3456 * 864)


# --- known answers --------------------------------------------------------------------------------------------------
def test_three_groups_of_identical_frames_give_one_keyframe_each():
    features = np.repeat(np.eye(3, 8, dtype=np.float32) * 5, [10, 12, 8], axis=0)  # frames 0-9, 10-21, 22-29
    frames, fallback, distance = keyframes(features, list(range(30)), 30, 3)
    assert frames == [0, 10, 22] and not fallback  # the first frame of each group (argmin's first on ties)
    assert np.allclose(distance, 0, atol=1e-5)
    assert sorted(kmeans_picks(features, 3)[0]) == [0, 10, 22]


def test_colliding_picks_fall_back_to_uniform_frames():
    features = np.repeat(np.eye(2, 8, dtype=np.float32), [20, 20], axis=0)  # two distinct frames, three clusters
    frames, fallback, _ = keyframes(features, list(range(40)), 40, 3)
    assert fallback and frames == uniform_keyframes(40, 3) == [0, 13, 26]
    # fewer frames than keyframes: k-means cannot run; the same fallback (repeats kept)
    assert keyframes(np.zeros((2, 4), np.float32), [0, 1], 2, 4)[:2] == ([0, 0, 1, 1], True)


def test_a_distinct_token_is_kept_over_duplicates():
    feats = torch.cat([torch.ones(10, 4), torch.tensor([[1.0, -1.0, 0.0, 0.0]])])
    importance = torch.zeros(11)  # no importance signal: redundancy decides
    assert select_key_tokens(importance, feats, 0.2, 1).tolist() == [10]
    # with alpha = 1 importance alone decides
    importance[3] = 1.0
    assert select_key_tokens(importance, feats, 1.0, 1).tolist() == [3]
    assert select_key_tokens(importance, feats, 0.2, 3).tolist() == sorted(select_key_tokens(importance, feats, 0.2, 3))


def test_question_ordering_rules():
    short = " ".join(f"w{i}" for i in range(40))
    long = " ".join(f"w{i}" for i in range(60))
    assert ordering_text(short) == short
    assert ordering_text(long) == " ".join(f"w{i}" for i in range(10, 50))
    for sims in ([0.1, 0.5, 0.3], [3.0, 1.0, 2.0, 0.5, 4.0, 2.5]):
        assert frame_ranks(sims) == official_ordering(sims)


# --- end to end -----------------------------------------------------------------------------------------------------
def test_ktv_on_llava_next_video_keeps_the_reference_tokens_of_each_keyframe():
    """Keyframes one per colour, the red frame (what the question is about) ranked first with the largest budget,
    and per frame the tokens the official selection picks from the captured CLS logits and pooled features."""
    model, processor = model_and_processor("llava_next_video")
    encoder = ColourEncoder()
    ktv = KTV(encoder=encoder, clip=encoder, attention_layer=-1, num_frames=3)
    spy = ConnectSpy((VisionStat("cls", -1), VisionStat("features", -1)))
    with vtc.patch(model, [ktv, spy], retention=0.25) as handle:
        inputs = handle.prepare(processor, coloured_clip(), "where is the red ball?", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
    chosen = stats.frames[0]
    assert chosen.method == "ktv" and chosen.indices == [0, 12, 48]  # grey, blue (second 3), red (second 12)
    assert chosen.candidates == list(range(80)) and max(chosen.candidate_scores) == 0.0
    assert chosen.reports["fallback"] == [False] and chosen.reports["ranks"] == [[1, 2, 0]]
    assert np.argmax(chosen.reports["similarity"][0]) == 2  # CLIP (here: colour) similarity to the question
    report = stats.reports["ktv"]
    assert report["ranks"] == [[1, 2, 0]] and report["budgets"] == [[27, 27, 54]]
    assert stats.llm_tokens_in == round(0.25 * stats.visual_tokens_in) == 108
    tokens, ctx = spy.seen[0]
    t, h, w = tokens.grid
    importance = ctx.geometry.to_token_grid(cls_logits(ctx.vision[VisionStat("cls", -1)]), (h, w))
    feats = ctx.geometry.to_token_grid(ctx.vision[VisionStat("features", -1)].float(), (h, w))
    for f, budget in enumerate(report["budgets"][0]):
        kept = tokens.patch[tokens.frame == f]
        expected = official_key_tokens(importance[f], feats[f], 0.2, budget)
        assert torch.equal(kept, expected), f"frame {f}"


def test_ktv_default_layer_is_the_official_clip_layer():
    model, _ = model_and_processor("llava_next_video")
    assert KTV().vision_stats("llava_next_video")[0] == VisionStat("cls", 23)
    assert KTV().vision_stats("qwen2_vl") == [VisionStat("received", -1)]  # no pre-projector features: LLM tokens
    assert KTV().vision_stats("llava_onevision") == [VisionStat("received", -1), VisionStat("features", -1)]
    with pytest.raises(ValueError, match="layer 23"):  # the tiny CLIP tower has 2 layers
        vtc.patch(model, "ktv", encoder=ColourEncoder(), clip=ColourEncoder())


def test_ktv_on_qwen_reads_attention_received_and_refuses_the_cls_reading():
    model, processor = model_and_processor("qwen2_vl")
    encoder = ColourEncoder()
    with vtc.patch(model, "ktv", retention=0.5, encoder=encoder, clip=encoder, num_frames=3) as handle:
        inputs = handle.prepare(processor, coloured_clip(), "the red ball", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        assert stats.frames[0].indices == [0, 12, 48]
        assert inputs["video_grid_thw"][0, 0].item() == 2  # three frames, padded to two temporal patches
        (budgets,) = stats.reports["ktv"]["budgets"]
        # ranks [1, 2, 0] -> table [126, 126, 252] -> patches (grey + blue, red): equal halves
        assert sum(budgets) == stats.llm_tokens_in == round(0.5 * stats.visual_tokens_in)
        assert budgets[0] == budgets[1]
        # without a question there is no ordering: equal budgets (the official run without an order)
        inputs = handle.prepare(processor, coloured_clip(), "", fps=4)
        with torch.no_grad():
            model(**inputs)
        assert handle.stats().reports["ktv"]["ranks"] == [None]
    with pytest.raises(ValueError, match=r"statistic\(s\) cls on qwen2_vl"):
        vtc.patch(model, "ktv", importance="cls", encoder=encoder, clip=encoder)


@pytest.mark.parametrize("family", ["llava_next_video", "qwen2_vl"])
def test_positions_on_the_reference_frames(family, monkeypatch):
    """The conformance position checks, on the matrix's own (uniform) frames: ktv's connect stage alone."""
    monkeypatch.setattr(
        conformance,
        "_inputs",
        lambda handle, fam, which: single_inputs(fam) if which is not None else batch_inputs(fam),
    )
    conformance._patched_layers.cache_clear()
    try:
        conformance.check_original_positions("ktv", family)
        conformance.check_ordered_positions("ktv", family)
    finally:
        conformance._patched_layers.cache_clear()


def test_ktv_keyframes_composes_with_a_connect_method():
    model, processor = model_and_processor("qwen2_vl")
    with vtc.patch(model, "ktv-keyframes+vidcom2", retention=0.5, encoder=ColourEncoder(), num_frames=4) as handle:
        inputs = handle.prepare(processor, coloured_clip(blue=(3, 4)), "anything", fps=4)
        with torch.no_grad():
            model(**inputs)
        stats = handle.stats()
        assert stats.frames[0].method == "ktv-keyframes" and len(stats.frames[0].indices) == 4
        assert stats.llm_tokens_in == round(stats.visual_tokens_in * 0.5)  # vidcom2 takes the whole retention
    assert not vtc.registry()["ktv-keyframes"].card.reduces_tokens
    assert not vtc.registry()["ktv-keyframes"].card.query_aware
    with pytest.raises(ValueError, match="both decide frame selection"):
        vtc.patch(model, "ktv+bolt")


def test_bad_inputs_name_the_problem(monkeypatch):
    with pytest.raises(ValueError, match="alpha"):
        KTV(alpha=1.5)
    with pytest.raises(ValueError, match="tokens_num"):
        KTV(tokens_num=500)
    with pytest.raises(ValueError, match="importance"):
        KTV(importance="mean")
    with pytest.raises(ValueError, match="num_frames"):
        KTVKeyframes(num_frames=0)
    with pytest.raises(ValueError, match="at least 3 feature rows"):
        kmeans_picks(np.zeros((2, 4)), 3)
    with pytest.raises(ValueError, match="feature rows for"):
        keyframes(np.zeros((3, 4)), [0, 1], 3, 1)
    with pytest.raises(ValueError, match="weights for"):
        apportion(3, [1.0], [1, 1])
    monkeypatch.setitem(sys.modules, "sklearn.cluster", None)
    with pytest.raises(ImportError, match=r"vtc\[samplers\]"):
        kmeans_picks(np.zeros((4, 2)), 2)
    monkeypatch.undo()
    model, processor = model_and_processor("qwen2_vl")
    with vtc.patch(model, "ktv-keyframes", encoder="/nonexistent/dinov2") as handle:
        with pytest.raises(EncoderLoadError, match="ktv-keyframes.encoder"):
            handle.prepare(processor, coloured_clip(), "q", fps=4)
