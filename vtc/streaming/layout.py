"""Where a stream's tokens sit in the one long prompt it stands for.

A session is one prompt that never ends: the chat template's text up to the video (the *prefix*), then the
video's tokens chunk by chunk, and at each question the template's text after the video (the *suffix*, with
the question). This module splits the template at the video placeholder, and gives every token the position
the same prompt would give it if the whole video had been passed at once (transformers 5.x `get_rope_index`):

  LLaVA families (1-D RoPE)   one running index; with the "compact" policy pruned tokens take no index.
  Qwen2-VL / Qwen2.5-VL        video token (t, h, w) -> (start + long(t * interval), start + h, start + w), with
                               `interval` = 1 (Qwen2-VL) or tokens_per_second * seconds per temporal patch
                               (Qwen2.5-VL); the text after the video starts at start + max(H, W).
  Qwen3-VL                     every temporal patch is its own `<t seconds><|vision_start|>...<|vision_end|>`
                               block with its own text positions: a chunk's positions are the model's own for
                               the chunk, shifted to where the previous chunk ended.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vtc.media.inputs import build_messages

Tensor = torch.Tensor


def split_template(processor, question: str, system: str | None = None) -> tuple[str, str]:
    """(text before the video, text after it) of the chat for `question`, with the generation prompt."""
    chat = build_messages(question, system)
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    placeholder = processor.video_token
    if text.count(placeholder) != 1:
        raise ValueError(f"the chat template should hold one video placeholder {placeholder!r}; got {text!r}")
    before, after = text.split(placeholder)
    return before, after


def text_ids(processor, text: str) -> Tensor:
    """Token ids of a piece of the chat template (special tokens are literal in the template text)."""
    return torch.tensor(processor.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


@dataclasses.dataclass
class PositionCounter:
    """The next position of the stream's prompt, per family (see the module docstring)."""

    family: str
    mrope: bool
    compact: bool = False  # 1-D families: pruned tokens take no position
    interval: Any = 1.0  # Qwen2/2.5-VL: temporal position step per temporal patch (float or 0-d tensor)
    next: int = 0  # next text position (all rows on M-RoPE families)
    video_start: int | None = None  # Qwen2/2.5-VL: position of the first video token

    def text(self, count: int) -> Tensor:
        """Positions [P, count] of `count` text tokens, which then follow."""
        rows = torch.arange(self.next, self.next + count)
        self.next += count
        return rows[None].expand(3 if self.mrope else 1, -1).clone()

    def video(self, kept_grid_index: Tensor, grid: tuple[int, int, int], first_group: int):
        """Positions [P, n] of a chunk's video tokens: `kept_grid_index` [n] = flat (t, h, w) cells on the chunk's
        grid of the tokens kept (all of them before compression); `first_group` = temporal patches before the
        chunk. Qwen3-VL chunks are positioned with `shift` instead."""
        t, h, w = grid
        if not self.mrope:
            return self._running(kept_grid_index, t * h * w)
        if self.family == "qwen3_vl":
            raise RuntimeError("qwen3_vl chunks are positioned with `shift`")
        if self.video_start is None:
            self.video_start = self.next
            self.next = self.video_start + max(h, w)  # where transformers puts the text after a video
        start = self.video_start
        cell = kept_grid_index.long()
        frame, row, col = cell // (h * w), (cell // w) % h, cell % w
        temporal = ((frame + first_group) * self.interval).long()  # the same float32 product transformers takes
        return torch.stack([temporal + start, row + start, col + start])

    def _running(self, kept: Tensor, total: int) -> Tensor:
        if self.compact:
            rows = torch.arange(self.next, self.next + kept.numel())
            self.next += kept.numel()
        else:
            rows = self.next + kept.long()
            self.next += total
        return rows[None]

    def shift(self, model_positions: Tensor) -> Tensor:
        """Qwen3-VL: a chunk's own positions [3, L] (starting at 0) moved to where the stream stands."""
        shifted = model_positions + self.next
        self.next = int(shifted.max()) + 1
        return shifted


def qwen_interval(family: str, config: Any, processor_outputs: dict[str, Any]) -> Any:
    """Temporal position step per temporal patch (transformers' `time_interval`, kept as the same 0-d tensor)."""
    if family != "qwen2_5_vl":
        return 1.0
    seconds = processor_outputs.get("second_per_grid_ts")
    if seconds is None:
        return 1.0
    return config.vision_config.tokens_per_second * seconds[0]
