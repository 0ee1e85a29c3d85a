"""Unit tests of the HF backend's plumbing on hand-built inputs: the sequence rebuild after the connect stage
(text in place, survivors in their frame's segment, padding side, positions kept or renumbered, DeepStack
side features), the identity layout, and the family adapters (video spans, grids and geometry read from real
processor outputs before any forward)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import FAMILIES, batch_inputs, model_and_processor, single_inputs
from vtc.core.geometry import default_geometry
from vtc.core.tokens import VideoTokens
from vtc.hf.adapters import CapturedInputs, VideoSpan, resolve_adapter
from vtc.hf.sequence import deepstack_per_token, identity_layout, rebuild
from vtc.testing.fixtures import token_grids


def span_tokens(span: VideoSpan, embeds: torch.Tensor, positions: torch.Tensor) -> VideoTokens:
    """The VideoTokens the patch builds for a span (what connect plugins receive)."""
    idx = span.seq_index
    tokens = VideoTokens.from_grid(embeds[span.batch, idx], span.grid, positions=positions[0, span.batch, idx])
    tokens.seq_index = idx
    return tokens


def test_rebuild_keeps_text_in_place_and_right_aligns_rows():
    # two rows, left padded: row 0 = [pad, t, v v v v, t]; row 1 = [t, t, v v v v, t]; video grid (1, 2, 2)
    bsz, length, dim = 2, 7, 3
    embeds = torch.arange(bsz * length * dim, dtype=torch.float32).view(bsz, length, dim)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    positions = torch.tensor([[0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]])[None]
    spans = [
        VideoSpan(0, 0, torch.arange(2, 6), (1, 2, 2), torch.tensor([2])),
        VideoSpan(1, 1, torch.arange(2, 6), (1, 2, 2), torch.tensor([2])),
    ]
    outputs = [span_tokens(s, embeds, positions).select(torch.tensor([3, 0])) for s in spans]  # reordered on purpose
    new = rebuild(embeds, mask, positions, spans, outputs, compact=False)
    assert new.embeds.shape == (2, 5, 3) and new.attention_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # row 0: pad, text(1), visual 5 then 2 (the order the plugin left), text(6); right-aligned (last prompt token last)
    torch.testing.assert_close(new.embeds[0, 1:], embeds[0, [1, 5, 2, 6]])
    torch.testing.assert_close(new.embeds[1], embeds[1, [0, 1, 5, 2, 6]])
    assert new.positions[0, 0, 1:].tolist() == [0, 4, 1, 5]  # original positions travel with the tokens
    assert new.layout.visual[1].tolist() == [False, False, True, True, False]
    assert new.layout.patch[1].tolist() == [-1, -1, 3, 0, -1] and new.layout.video[0].tolist() == [-1, -1, 0, 0, -1]
    compact = rebuild(embeds, mask, positions, spans, outputs, compact=True)
    assert compact.positions[0, 0, 1:].tolist() == [0, 1, 2, 3] and compact.positions[0, 1].tolist() == [0, 1, 2, 3, 4]


def test_rebuild_writes_survivors_into_their_frames_segment_and_carries_deepstack():
    """Qwen3-VL layout: text between frames ([t, f0 f0, ts, f1 f1, t]); a kept token of frame 1 goes after the
    timestamp text, and DeepStack features follow their tokens."""
    embeds = torch.randn(1, 7, 4)
    mask = torch.ones(1, 7, dtype=torch.long)
    positions = torch.arange(7).view(1, 1, 7).expand(3, 1, 7).clone()
    span = VideoSpan(0, 0, torch.tensor([1, 2, 4, 5]), (2, 1, 2), torch.tensor([1, 4]))
    visual = torch.tensor([[False, True, True, False, True, True, False]])
    ds = [torch.randn(4, 4), torch.randn(4, 4)]  # two DeepStack levels, one row per visual token
    dense = deepstack_per_token(visual, ds, (1, 7))
    assert torch.equal(dense[0, 4, 1], ds[1][2]) and bool((dense[0, 0] == 0).all())
    tokens = span_tokens(span, embeds, positions[:1])
    tokens.positions = positions[:, 0, span.seq_index]
    tokens.extras["deepstack"] = dense[0, span.seq_index]
    out = tokens.select(torch.tensor([3, 0]))  # frame 1's second token, frame 0's first
    new = rebuild(embeds, mask, positions, [span], [out], compact=False, deepstack=dense, deepstack_mask=visual)
    torch.testing.assert_close(new.embeds[0], embeds[0, [0, 1, 3, 5, 6]])  # frame 0 token, timestamp, frame 1 token
    assert new.positions[:, 0].tolist() == [[0, 1, 3, 5, 6]] * 3
    assert new.deepstack_mask[0].tolist() == [False, True, False, True, False]
    torch.testing.assert_close(new.deepstack[0, 3], dense[0, 5])


def test_identity_layout_marks_every_video_token():
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    span = VideoSpan(0, 0, torch.tensor([2, 3]), (2, 1, 1), torch.tensor([2, 3]))
    layout = identity_layout(mask, [span])
    assert layout.visual.tolist() == [[False, False, True, True, False]]
    assert layout.frame.tolist() == [[-1, -1, 0, 1, -1]] and layout.valid.tolist() == [[False, True, True, True, True]]
    assert {k: v.tolist() for k, v in layout.video_slots(0).items()} == {0: [2, 3]}


@pytest.mark.parametrize("fam", FAMILIES)
def test_adapter_spans_grids_and_geometry_from_processor_outputs(fam):
    model, _ = model_and_processor(fam)
    adapter = resolve_adapter(model)
    assert adapter.geometry == default_geometry(fam)  # the tiny configs match the published geometry
    for inputs in (single_inputs(fam), batch_inputs(fam)):
        grids = token_grids(model, inputs)
        spans = adapter.video_spans(adapter.capture(inputs["input_ids"], inputs["attention_mask"], dict(inputs)))
        assert [s.grid for s in spans] == grids and len(spans) == inputs["input_ids"].shape[0]
        for span in spans:
            ids = inputs["input_ids"][span.batch, span.seq_index]
            assert bool((ids == adapter.video_token_id).all())
            assert span.num_tokens == span.grid[0] * span.grid[1] * span.grid[2]
            assert span.frame_slot.numel() == span.grid[0]
            if fam == "qwen3_vl":  # one segment per temporal patch, between timestamp texts
                assert bool((span.frame_slot[1:] > span.frame_slot[:-1]).all())
    if fam.startswith("qwen"):
        # Qwen: 2 input frames per temporal patch, 2x2 merge: 8 frames at 224 px -> (4, 8, 8)
        assert token_grids(model, single_inputs(fam))[0][0] == 4
    else:  # one token grid per frame: from the patch grid where the tower's statistics have one, else 8 x 8
        t, h, w = token_grids(model, single_inputs(fam))[0]
        assert t == 8 and (h, w) == (default_geometry(fam).token_grid_size() or (8, 8))


def test_adapter_refuses_inputs_that_do_not_match():
    model, _ = model_and_processor("qwen2_vl")
    inputs = single_inputs("qwen2_vl")
    adapter = resolve_adapter(model)
    ids = inputs["input_ids"][:, :-20]  # cut the prompt inside the video tokens
    with pytest.raises(ValueError, match="qwen2_vl"):
        adapter.video_spans(CapturedInputs(ids, None, {"video_grid_thw": inputs["video_grid_thw"]}))
