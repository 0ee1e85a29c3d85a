"""vtc's M-RoPE positions for vLLM (`vtc.vllm.positions`), without an engine: they equal vLLM's own stock positions
on uncompressed prompts (several videos and images, fractional seconds per temporal patch, Qwen3-VL's per-frame
spans), survivors of a compressed video keep their stock positions, the text after them continues where the stock
prompt does, and any chunking of the embeddings gives the same positions."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from vtc.vllm.positions import (
    POSITION_CHANNELS,
    MediaSpan,
    append_positions,
    fill_positions,
    frame_span_extent,
    frame_span_positions,
    grid_extent,
    grid_positions,
    prompt_positions,
    split_positions,
)

VIDEO, IMAGE, START, END, TEXT = 7, 6, 4, 5, 9  # token ids of the layouts below


# --- the pure functions on hand-built layouts ------------------------------------------------------------------


def test_text_media_text_positions_and_delta():
    """3 text tokens, a (2, 2, 3) video at 2 time steps per patch, 2 text tokens."""
    grid = (2, 2, 3)
    rel = grid_positions(grid, 2.0)
    assert rel[:, 0].tolist() == [0] * 6 + [2] * 6
    assert grid_extent(grid, 2.0) == 3  # max(t = 2, h = 1, w = 2) + 1
    positions, delta = prompt_positions(17, [MediaSpan(3, 12, grid_extent(grid, 2.0))])
    assert positions[:, :3].tolist() == [[0, 1, 2]] * 3
    assert (positions[:, 3:15] == -4).all()  # marked with the start, 3, until the media is encoded
    assert positions[:, 15:].tolist() == [[6, 7]] * 3
    assert delta == 8 - 17
    filled, delta = fill_positions(positions, [rel], 0)
    assert filled[:, 3:15].T.tolist() == (rel + 3).tolist()
    assert delta == 8 - 17


def test_a_compressed_video_keeps_its_survivors_positions_and_the_text_after_it():
    """Two videos, the first compressed to 4 of its 12 tokens: the second starts, and the text after both
    continues, exactly where the uncompressed prompt has them."""
    first, second = (2, 2, 3), (1, 2, 2)
    full, _ = prompt_positions(
        2 + 12 + 1 + 4 + 1, [MediaSpan(2, 12, grid_extent(first)), MediaSpan(15, 4, grid_extent(second))]
    )
    full, full_delta = fill_positions(full, [grid_positions(first), grid_positions(second)], 0)
    kept = torch.tensor([0, 5, 6, 11])
    short, delta = prompt_positions(2 + 4 + 1 + 4 + 1, [MediaSpan(2, 4, grid_extent(first)), MediaSpan(7, 4, 2)])
    short, delta = fill_positions(short, [grid_positions(first)[kept], grid_positions(second)], 0)
    gather = torch.cat([torch.arange(2), 2 + kept, torch.arange(14, 20)])
    assert torch.equal(short, full[:, gather])
    assert int(short.max()) + 1 == int(full.max()) + 1  # decoding continues where the stock prompt does
    assert delta == full_delta + (20 - 12)


@pytest.mark.parametrize("chunks", [[1], [5, 2, 9], [3] * 10, [30]])
def test_any_chunking_gives_the_same_positions(chunks):
    """The runner hands over media embeddings chunk by chunk (chunked prefill), an item possibly split in two."""
    grid, image = (2, 3, 3), (1, 2, 2)
    spans = [MediaSpan(1, 18, grid_extent(grid)), MediaSpan(21, 4, grid_extent(image))]
    layout, _ = prompt_positions(27, spans)
    items = [grid_positions(grid), grid_positions(image)]
    whole, whole_delta = fill_positions(layout, items, 0)
    slots = [i for i in range(27) if layout[0, i] < 0]
    rows = torch.cat(items)
    positions, start, done = layout, 0, 0
    for size in chunks * 30:
        if start >= 27:
            break
        end = min(start + size, 27)
        in_chunk = [i for i in slots if start <= i < end]
        part = rows[done : done + len(in_chunk)]
        positions, delta = fill_positions(positions, [part[:2], part[2:]], start)
        done += len(in_chunk)
        start = end
    assert torch.equal(positions, whole)
    assert delta == whole_delta


def test_a_cached_prefix_leaves_its_slots_unread():
    """With a prefix served from the cache the runner starts past some media slots; they stay marked, the rest
    are written from `start` on."""
    grid = (1, 2, 3)
    layout, _ = prompt_positions(10, [MediaSpan(2, 6, grid_extent(grid))])
    positions, _ = fill_positions(layout, [grid_positions(grid)[4:]], 6)
    assert (positions[:, 2:6] < 0).all()
    assert positions[:, 6:8].T.tolist() == (grid_positions(grid)[4:] + 2).tolist()


def test_more_embeddings_than_slots_is_an_error():
    layout, _ = prompt_positions(4, [MediaSpan(1, 2, 2)])
    with pytest.raises(RuntimeError, match="3 media embeddings arrived for 2 media slots"):
        fill_positions(layout, [torch.zeros(3, 3, dtype=torch.long)], 0)


def test_overlapping_spans_are_refused():
    with pytest.raises(ValueError, match="overlaps the previous one"):
        prompt_positions(10, [MediaSpan(1, 4, 2), MediaSpan(3, 2, 2)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_positions_travel_exactly_in_the_embedding_dtype(dtype):
    rel = torch.tensor([[0, 0, 0], [255, 256, 257], [65535, 65536, 1000003], [256**3 - 1, 7, 300]])
    embeds = torch.randn(4, 8).to(dtype)
    packed = append_positions(embeds, rel)
    assert packed.shape == (4, 8 + POSITION_CHANNELS) and packed.dtype == dtype
    out, back = split_positions(packed)
    assert torch.equal(out, embeds) and torch.equal(back, rel)
    with pytest.raises(ValueError, match=r"relative M-RoPE positions must lie in \[0, 16777216\)"):
        append_positions(embeds[:1], torch.tensor([[256**3, 0, 0]]))


def test_qwen3_frame_span_counts_every_frame_even_an_empty_one():
    """Timestamp text, <vision_start>, the frame's tokens, <vision_end>, per frame; frame 1 kept nothing."""
    ids = torch.tensor([TEXT, TEXT, START, VIDEO, VIDEO, END, TEXT, START, END, TEXT, START, VIDEO, END])
    cells = torch.tensor([[0, 1], [1, 2], [1, 0]])  # (h, w) of each kept token, frames 0, 0, 2
    rel = frame_span_positions(ids == VIDEO, ids == START, cells, (2, 3))
    # text counts up by one; each frame moves the counter on by max(H, W) = 3 after its <vision_start>
    expected_text = {0: 0, 1: 1, 2: 2, 5: 3 + 3, 6: 4 + 3, 7: 5 + 3, 8: 6 + 6, 9: 7 + 6, 10: 8 + 6, 12: 9 + 9}
    for index, position in expected_text.items():
        assert rel[index].tolist() == [position] * 3, index
    assert rel[3].tolist() == [3, 3, 4] and rel[4].tolist() == [3, 4, 5]  # frame 0 starts after 3 text tokens
    assert rel[11].tolist() == [15, 16, 15]  # frame 2: 9 text tokens and 2 frames before it
    assert frame_span_extent(10, 3, (2, 3)) == int(rel.max()) + 1


# --- equal to vLLM's own positions on uncompressed prompts -----------------------------------------------------


def feature(modality: str, offset: int, length: int, **fields):
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldConfig,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )

    elems = {
        name: MultiModalFieldElem(data=torch.as_tensor(value), field=MultiModalFieldConfig.batched(modality).field)
        for name, value in fields.items()
    }
    return MultiModalFeatureSpec(
        data=MultiModalKwargsItem(elems),
        modality=modality,
        identifier=f"{modality}-{offset}",
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def vtc_positions(num_tokens: int, items: list[tuple[int, Tensor, int]]) -> tuple[torch.Tensor, int]:  # noqa: F821
    """Positions vtc computes for media `items` (offset, relative positions, extent), nothing compressed."""
    spans = [MediaSpan(offset, len(rel), extent) for offset, rel, extent in items]
    layout, _ = prompt_positions(num_tokens, spans)
    return fill_positions(layout, [rel for _, rel, _ in items], 0)


QWEN_CONFIG = types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=2))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("seconds", [None, 0.25, 2 / 3, 1.0, 4.0])
def test_qwen2_layouts_equal_vllm_stock_positions(family, seconds):
    """Text, a video, text, an image, a second video, text: vLLM's `get_mrope_input_positions` against vtc's."""
    if family == "qwen2_vl":
        from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration as Stock
    else:
        from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Stock
    config = (
        QWEN_CONFIG
        if family == "qwen2_5_vl"
        else types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=2))
    )
    model = types.SimpleNamespace(config=config)
    model.iter_mm_grid_thw = functools.partial(Stock.iter_mm_grid_thw, model)
    rate = getattr(config.vision_config, "tokens_per_second", 1.0)
    videos = [(5, 8, 6), (3, 4, 10)]  # (t, h, w) patches; tokens: (t, h/2, w/2)
    layout, items, features, cursor = [], [], [], 0

    def text(n):
        nonlocal cursor
        layout.extend([TEXT] * n)
        cursor += n

    def media(modality, thw, second=None):
        nonlocal cursor
        grid = (thw[0], thw[1] // 2, thw[2] // 2)
        fields = {f"{modality}_grid_thw": list(thw)}
        if second is not None:
            fields["second_per_grid_ts"] = second
        features.append(feature(modality, cursor, grid[0] * grid[1] * grid[2], **fields))
        t_factor = (1.0 if second is None else float(torch.as_tensor(second).item())) * rate
        items.append((cursor, grid_positions(grid, t_factor), grid_extent(grid, t_factor)))
        layout.extend([VIDEO] * (grid[0] * grid[1] * grid[2]))
        cursor += grid[0] * grid[1] * grid[2]

    text(3)
    media("video", videos[0], seconds)
    text(2)
    media("image", (1, 6, 4))
    text(1)
    media("video", videos[1], seconds)
    text(4)
    stock, stock_delta = Stock.get_mrope_input_positions(model, layout, features)
    ours, delta = vtc_positions(len(layout), items)
    assert torch.equal(ours, stock.to(torch.long))
    assert delta == stock_delta


def test_qwen3_layout_equals_vllm_stock_positions():
    """Two Qwen3-VL videos (per-frame timestamp text and markers) around an image."""
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMultiModalProcessor

    from vtc.testing import tiny

    tokenizer = tiny.build_tokenizer("qwen3_vl")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in QWEN3_TOKENS.items()}
    config = types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=2), **ids)
    layout, items, features = [], [], []
    for kind, value in [("text", 3), ("video", (3, 4, 6)), ("text", 2), ("image", (1, 4, 4)), ("video", (2, 6, 2))]:
        if kind == "text":
            layout.extend([ids["vision_end_token_id"] + 100] * value)
            continue
        t, h, w = value[0], value[1] // 2, value[2] // 2
        if kind == "image":
            features.append(feature("image", len(layout), h * w, image_grid_thw=list(value)))
            items.append((len(layout), grid_positions((1, h, w)), grid_extent((1, h, w))))
            layout.extend([ids["image_token_id"]] * (h * w))
            continue
        span = Qwen3VLMultiModalProcessor.get_video_repl(
            tokens_per_frame=[h * w] * t,
            timestamps=[0.5 + i for i in range(t)],
            tokenizer=tokenizer,
            vision_start_token_id=ids["vision_start_token_id"],
            vision_end_token_id=ids["vision_end_token_id"],
            video_token_id=ids["video_token_id"],
        ).full
        span_ids = torch.tensor(span)
        is_video = span_ids == ids["video_token_id"]
        cells = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
        rel = frame_span_positions(is_video, span_ids == ids["vision_start_token_id"], cells.repeat(t, 1), (h, w))
        features.append(feature("video", len(layout), len(span), video_grid_thw=list(value)))
        items.append((len(layout), rel, frame_span_extent(int((~is_video).sum()), t, (h, w))))
        layout.extend(span)
    layout.extend([ids["vision_end_token_id"] + 100] * 4)
    stock, stock_delta = Qwen3VLForConditionalGeneration._get_mrope_input_positions(layout, features, config)
    ours, delta = vtc_positions(len(layout), items)
    assert torch.equal(ours, stock.to(torch.long))
    assert delta == stock_delta


QWEN3_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "video_token_id": "<|video_pad|>",
    "image_token_id": "<|image_pad|>",
}
