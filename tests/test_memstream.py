"""MemStream: the 2x2 window selection on known inputs, reciprocal-rank fusion, frame retrieval against a brute-force
reference, and equality with the whole-video prompt when nothing is merged and everything is retrieved."""

from __future__ import annotations

import pytest
import torch

import vtc
from tests.test_streaming import whole_prompt
from vtc.media.video import synthetic_video
from vtc.testing.fixtures import model_and_processor
from vtc_plugins.memstream import (
    MemStream,
    drift_corrected,
    reciprocal_rank_fusion,
    select_frame,
    take_frames,
)

QUESTION = "What happens in this video?"
TINY_CLIP = {"clip_model": "vtc-tiny-clip", "clip_pretrained": None}


def test_identical_frames_merge_every_window_into_its_top_left_token():
    x = torch.randn(16, 8)
    keep, dst, src = select_frame(x, x.clone(), (4, 4), 0.9, 2)
    assert keep.tolist() == [0, 2, 8, 10]  # top-left of each 2 x 2 window
    # every other token merges into its window's anchor
    anchors = keep[dst]
    assert sorted(src.tolist()) == [1, 3, 4, 5, 6, 7, 9, 11, 12, 13, 14, 15]
    for s, a in zip(src.tolist(), anchors.tolist()):
        assert (s // 4) // 2 == (a // 4) // 2 and (s % 4) // 2 == (a % 4) // 2


def test_a_window_with_one_changed_token_stays_whole_and_the_first_frame_is_kept():
    x = torch.randn(16, 8)
    current = x.clone()
    current[5] = -current[5]  # window (0, 0) covers 0, 1, 4, 5
    keep, dst, src = select_frame(current, x, (4, 4), 0.9, 2)
    assert keep.tolist() == [0, 1, 2, 4, 5, 8, 10]
    assert 1 not in src.tolist() and 5 not in src.tolist()
    keep, _, src = select_frame(x, None, (4, 4), 0.9, 2)
    assert keep.tolist() == list(range(16)) and src.numel() == 0


def test_edge_windows_of_an_odd_grid():
    x = torch.randn(15, 4)  # 3 x 5 grid: windows of 2x2, 2x1, 1x2 and 1x1
    keep, _, src = select_frame(x, x.clone(), (3, 5), 0.9, 2)
    assert keep.tolist() == [0, 2, 4, 10, 12, 14]
    assert len(keep) + len(src) == 15


def test_reciprocal_rank_fusion_and_frame_budget():
    a = torch.tensor([0.9, 0.1, 0.5])  # ranks 1, 3, 2
    b = torch.tensor([0.2, 0.8, 0.7])  # ranks 3, 1, 2
    fused = reciprocal_rank_fusion([a, b], k=60)
    expected = torch.tensor([1 / 61 + 1 / 63, 1 / 63 + 1 / 61, 2 / 62], dtype=torch.float64)
    torch.testing.assert_close(fused, expected)
    tokens = torch.tensor([10, 10, 10])
    assert take_frames(fused, tokens, 20).tolist() == [0, 1]  # 0 and 1 tie above 2 (1/61 + 1/63 > 2/62)
    assert take_frames(fused, tokens, 5).tolist() == [0]  # the best frame always
    trend = torch.arange(10, dtype=torch.float64) * 0.3 + torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    corrected = drift_corrected(trend)
    assert int(torch.argmax(corrected)) == 0 and int(torch.argmax(trend)) == 9


def test_bad_parameters():
    with pytest.raises(ValueError, match="experts must be one of"):
        MemStream(experts="clip+dino")
    with pytest.raises(ValueError, match=r"tau must be in \[-1, 1\]"):
        MemStream(tau=2.0)


@pytest.mark.parametrize("family", ["llava_onevision", "qwen2_5_vl"])
def test_nothing_merged_everything_retrieved_equals_the_whole_video_prompt(family):
    model, processor = model_and_processor(family)
    frames = synthetic_video(6, 224, 224, seed=3)
    ref_logits, ref_ids, _ = whole_prompt(model, processor, frames)
    with vtc.stream(model, processor, "memstream", tau=1.0, chunk_frames=6, experts="internal") as s:
        for frame in frames:
            s.feed(frame)
        s.ask(QUESTION, max_new_tokens=4)
    torch.testing.assert_close(s.last_ask.first_logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert s.last_ask.token_ids == ref_ids


def test_retrieval_follows_a_brute_force_reference():
    model, processor = model_and_processor("qwen2_vl")
    frames = synthetic_video(16, 224, 224, seed=4)
    with vtc.stream(model, processor, "memstream", chunk_frames=4, retrieval_tokens=300, **TINY_CLIP) as s:
        for frame in frames:
            s.feed(frame)
        s.ask(QUESTION, max_new_tokens=1)
        memory = s.memory
        internal, clip = memory.last_scores["internal"], memory.last_scores["clip"]
        counts = [int((memory.row_frame == f).sum()) for f in memory.frame_ids]

    # brute force: rank each expert, fuse, take frames greedily within the budget, sort by time
    def ranks(scores):
        order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
        return {frame: r + 1 for r, frame in enumerate(order)}

    ri, rc = ranks(internal), ranks(clip)
    fused = {f: 1 / (60 + ri[f]) + 1 / (60 + rc[f]) for f in range(len(counts))}
    chosen, total = [], 0
    for f in sorted(fused, key=lambda f: -fused[f]):
        if chosen and total + counts[f] > 300:
            break
        chosen.append(f)
        total += counts[f]
    assert memory.last_selection.tolist() == [int(memory.frame_ids[f]) for f in sorted(chosen)]
    assert s.last_ask.retrieved_tokens == total
