"""M-RoPE positions of a compressed prompt on vLLM (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), computed by vtc.

vLLM computes a request's M-RoPE positions once, when the request is scheduled and before any pixel is encoded
(`get_mrope_input_positions`), by laying out every video and image at its full grid. Once a video is compressed
that layout no longer fits the prompt: the next item's offset falls inside the span the first one would have
taken (vLLM's own EVS crashes there), and its position fix-up after the encoder (`recompute_mrope_positions`)
places the text after a video from the grid's width and misreads Qwen3-VL's per-frame spans. vtc's model classes
use these functions instead. Under vtc's `keep` policy every token keeps the position it has in the uncompressed
(stock) prompt:

* when the request is scheduled, `prompt_positions` gives every text token its stock position and marks each
  media slot with the position its media starts at, as `-(1 + start)`: which tokens a slot holds is known only
  once the encoder ran;
* the encoder output of each item carries, for each of its slots, the slot's position relative to the start of
  its media (`append_positions`: base-256 digits, exact in bf16, fp16 and fp32);
* when the runner merges a chunk of embeddings into the prompt, `fill_positions` writes start + relative
  position into the marked slots, in prompt order. That holds for any chunking, any number of items, and a
  prefix served from the cache (its slots are never read).

The relative positions are the stock ones: `grid_positions` for a Qwen2/2.5-VL video or any image (t scaled by
seconds per temporal patch x tokens per second, as a float, then truncated, as vLLM and transformers do), and
`frame_span_positions` for a Qwen3-VL video span (timestamp text, frame markers and each frame's tokens). Pure
tensor code: no vLLM import, so the layout is tested on its own (tests/test_vllm_positions.py).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

Tensor = torch.Tensor

DIGIT_BASE = 256  # every integer in [0, 256] is exact in bf16
DIGITS = 3  # positions up to 256**3 - 1
POSITION_CHANNELS = 3 * DIGITS  # columns `append_positions` adds to an item's embeddings


@dataclasses.dataclass(frozen=True)
class MediaSpan:
    """One image or video in a prompt: `length` slots from `offset` on, which move the stock position counter on by
    `extent` (the stock prompt continues at start + extent after the item)."""

    offset: int
    length: int
    extent: int


def prompt_positions(num_tokens: int, spans: Sequence[MediaSpan]) -> tuple[Tensor, int]:
    """Positions [3, num_tokens] of a prompt whose media occupy `spans`, and the M-RoPE delta (first position after
    the prompt minus its length). Text tokens get their stock positions; a media slot holds `-(1 + start)`, start
    being the stock position of its item's first token, until `fill_positions` writes it."""
    positions = torch.empty(3, num_tokens, dtype=torch.long)
    cursor = 0  # next prompt index
    position = 0  # next stock position
    for span in sorted(spans, key=lambda s: s.offset):
        if span.offset < cursor or span.length < 0 or span.offset + span.length > num_tokens:
            raise ValueError(
                f"vtc: media span at {span.offset} (+{span.length}) overlaps the previous one or runs past the "
                f"prompt ({num_tokens} tokens)"
            )
        text = span.offset - cursor
        positions[:, cursor : span.offset] = torch.arange(position, position + text)
        position += text
        positions[:, span.offset : span.offset + span.length] = -(1 + position)
        position += span.extent
        cursor = span.offset + span.length
    positions[:, cursor:] = torch.arange(position, position + num_tokens - cursor)
    position += num_tokens - cursor
    return positions, position - num_tokens


def fill_positions(positions: Tensor, relative: Sequence[Tensor], start: int) -> tuple[Tensor, int]:
    """Write the positions of the media slots one chunk of embeddings fills. `relative` holds each item's (or
    item part's) relative positions [n, 3], in prompt order, as `split_positions` returns them; they fill the first
    marked slots at or after `start` (the tokens computed so far). Returns new positions and the delta."""
    rows = [r for r in relative if r.numel()]
    if not rows:  # no media in this chunk (vLLM's V1 runner asks at every step, decoding included)
        return positions, int(positions.max()) + 1 - positions.shape[1]
    out = positions.clone()
    rel = torch.cat([r.to(out.device, torch.long) for r in rows]).T  # [3, M]
    pending = torch.nonzero(out[0, start:] < 0).flatten()[: rel.shape[1]] + start
    if pending.numel() != rel.shape[1]:
        raise RuntimeError(
            f"vtc: {rel.shape[1]} media embeddings arrived for {pending.numel()} media slots after token {start}"
        )
    out[:, pending] = rel + (-1 - out[0, pending]).to(out.dtype)
    # text follows every media item in Qwen prompts (`<|vision_end|>`), so the largest written position is the stock
    # prompt's last one whether or not every slot is written yet
    return out, int(out.max()) + 1 - out.shape[1]


def append_positions(embeds: Tensor, relative: Tensor) -> Tensor:
    """`embeds` [n, D] with the slots' relative positions [n, 3] appended as base-256 digits: [n, D + 9]."""
    rel = relative.to(torch.long)
    if rel.numel() and (int(rel.min()) < 0 or int(rel.max()) >= DIGIT_BASE**DIGITS):
        low, high = int(rel.min()), int(rel.max())
        raise ValueError(f"vtc: relative M-RoPE positions must lie in [0, {DIGIT_BASE**DIGITS}), got {low} to {high}")
    digits = [(rel // DIGIT_BASE**i) % DIGIT_BASE for i in range(DIGITS)]
    packed = torch.stack(digits, dim=-1).reshape(rel.shape[0], POSITION_CHANNELS)
    return torch.cat([embeds, packed.to(embeds.device, embeds.dtype)], dim=1)


def split_positions(item: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of `append_positions`: (embeddings [n, D], relative positions [n, 3])."""
    digits = item[:, -POSITION_CHANNELS:].round().to(torch.long).reshape(item.shape[0], 3, DIGITS)
    scale = torch.tensor([DIGIT_BASE**i for i in range(DIGITS)], device=item.device)
    return item[:, :-POSITION_CHANNELS], (digits * scale).sum(-1)


def grid_positions(grid: tuple[int, int, int], t_factor: float = 1.0) -> Tensor:
    """Stock relative positions [t*h*w, 3] of a (t, h, w) token grid in raster order: (floor(t * t_factor), h, w).
    Qwen2/2.5-VL videos (t_factor = seconds per temporal patch * tokens per second) and images (t = 1)."""
    t, h, w = grid
    times = (torch.arange(t, dtype=torch.float64) * float(t_factor)).to(torch.long)
    rows = torch.stack(
        torch.meshgrid(times, torch.arange(h), torch.arange(w), indexing="ij"),
        dim=-1,
    )
    return rows.reshape(t * h * w, 3)


def grid_extent(grid: tuple[int, int, int], t_factor: float = 1.0) -> int:
    """How far a grid moves the stock position counter: its largest relative position + 1."""
    t, h, w = grid
    return max(int(float(t - 1) * float(t_factor)), h - 1, w - 1) + 1


def frame_span_positions(is_video: Tensor, frame_start: Tensor, cells_hw: Tensor, frame_hw: tuple[int, int]) -> Tensor:
    """Stock relative positions [L, 3] of a Qwen3-VL video span: per frame, timestamp text, `<|vision_start|>`,
    the frame's tokens, `<|vision_end|>`. Text tokens count up by one; a frame's tokens sit at (0, h, w) from where
    the text before them stopped, and each frame moves the counter on by max(H, W) whether or not tokens of it
    were kept. `is_video` and `frame_start` (the `<|vision_start|>` tokens) are [L] masks; `cells_hw` [n, 2] holds
    the (h, w) cell of each video slot in order."""
    extent = max(frame_hw)
    text = (~is_video).to(torch.long)
    text_before = torch.cumsum(text, 0) - text  # text tokens strictly before each slot
    frames_before = torch.cumsum(frame_start.to(torch.long), 0) - frame_start.to(torch.long)
    out = torch.empty(is_video.shape[0], 3, dtype=torch.long, device=is_video.device)
    out[:] = (text_before + frames_before * extent)[:, None]
    video = torch.nonzero(is_video).flatten()
    # a frame's tokens follow its `<|vision_start|>`, which frames_before already counts
    base = text_before[video] + (frames_before[video] - 1) * extent
    out[video, 0] = base
    out[video, 1:] = base[:, None] + cells_hw.to(out.device, torch.long)
    return out


def frame_span_extent(num_text_tokens: int, num_frames: int, frame_hw: tuple[int, int]) -> int:
    """How far a Qwen3-VL video span moves the stock position counter."""
    return num_text_tokens + num_frames * max(frame_hw)
