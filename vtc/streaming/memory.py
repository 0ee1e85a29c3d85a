"""What a stream remembers, and the memory every stream has unless a method brings its own.

A session hands its memory the prompt's prefix once (`start`), then every chunk after the connect stage
(`append`, a `Segment`), and asks it for the past to answer from (`answer_past`). A memory decides what it
keeps and in what form (full-precision KV, quantized KV, token embeddings), and must stay within
`config.budget_tokens` visual tokens whatever the stream's length.

`WindowMemory` (the default): the keys and values of every kept token, prefilled chunk by chunk onto the
cache, so a question only prefills itself. Over the budget, the oldest frames are dropped whole (the prefix
stays: it is the attention sink). Remaining tokens keep the positions they were encoded at. With no budget
and nothing pruned, the cache is exactly the cache of the whole video passed as one prompt (causal attention:
a token's keys and values never depend on later tokens).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import torch

from vtc.streaming.llm import KV, StreamLLM, cache_length, kv_bytes, select_kv

Tensor = torch.Tensor


@dataclasses.dataclass
class StreamConfig:
    """What a memory is told about its session.

    budget_tokens: the most visual tokens the memory may hold (None: unbounded)
    family / model / adapter: the model being streamed to
    fps: frames per second of the stream (timestamps = frame index / fps)
    """

    budget_tokens: int | None
    family: str
    model: Any = None
    adapter: Any = None
    fps: float = 0.5


@dataclasses.dataclass
class Segment:
    """Rows of the stream's prompt, ready for the LLM.

    embeds [L, D], positions [P, L] (P = 3 on M-RoPE families), visual [L] (video tokens; False for text such as
    Qwen3-VL's timestamps), frame [L] (temporal index in the stream of the row's frame; -1 for rows outside any
    frame), deepstack [N, levels, D] (Qwen3-VL, for the visual rows in order). `tokens`: the chunk's kept
    `VideoTokens` after the connect stage (with the extras plugins attached), `tokens_in`: visual tokens before.
    """

    embeds: Tensor
    positions: Tensor
    visual: Tensor
    frame: Tensor
    deepstack: Tensor | None = None
    extras: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    tokens_in: int = 0
    grid: tuple[int, int, int] | None = None  # the chunk's token grid (T, H, W); None for text
    pixels: Any = None  # the chunk's frames [n, H, W, 3] uint8 (for memories with their own image encoder)
    text: str | None = None  # a question's text (question segments)

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def num_visual(self) -> int:
        return int(self.visual.sum())


@dataclasses.dataclass
class AnswerPast:
    """What a question is answered from: the cache, and, when the memory renumbers, where the question starts."""

    kv: KV | None
    next_position: int | None = None  # None: the stream's own next position
    cache: Any = None  # a ready transformers cache instead of `kv`
    retrieved_tokens: int | None = None  # visual tokens the answer attends to (memories that retrieve)
    seconds: float = 0.0  # time the memory spent building this past (counted in the question's TTFT)
    release: Any = None  # called once the question is answered (or failed): remove what the memory hooked


class StreamMemory(Protocol):
    """The interface of a stream memory (see the module docstring)."""

    name: str

    def start(self, llm: StreamLLM, prefix: Segment) -> None: ...

    def append(self, segment: Segment) -> None: ...

    def answer_past(self, question: Segment) -> AnswerPast: ...

    @property
    def stored_tokens(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


def check_frame_fits(budget: int | None, segment: Segment, what: str = "visual tokens") -> None:
    """A budget must hold at least one frame of what the memory stores."""
    if budget is None or segment.grid is None:
        return
    per_frame = segment.num_visual / segment.grid[0]
    if per_frame > budget:
        raise ValueError(
            f"budget_tokens={budget} is smaller than one frame: each temporal patch brings {per_frame:g} {what}; "
            f"raise the budget to at least {math.ceil(per_frame)}"
        )


def oldest_frames_over_budget(frame_of_token: Tensor, budget: int) -> Tensor:
    """The oldest frames to drop, whole, so that the tokens of the remaining frames fit in `budget`
    (`frame_of_token`: the frame of every stored visual token)."""
    frames, counts = torch.unique(frame_of_token, return_counts=True)  # ascending: oldest first
    kept_from_newest = counts.flip(0).cumsum(0)
    keep = int((kept_from_newest <= budget).sum())
    return frames[: len(frames) - keep]


class WindowMemory:
    """Full-precision KV of every kept token; the oldest frames leave once the budget is exceeded."""

    name = "window"

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        self.llm: StreamLLM | None = None
        self.kv: KV | None = None
        self.frame: Tensor = torch.empty(0, dtype=torch.long)  # frame of each cached row (-1: prefix)
        self.visual: Tensor = torch.empty(0, dtype=torch.bool)
        self.evicted_frames = 0

    def start(self, llm: StreamLLM, prefix: Segment) -> None:
        self.llm = llm
        self.kv = llm.forward(prefix.embeds, prefix.positions).kv
        self.frame = prefix.frame.clone()
        self.visual = prefix.visual.clone()

    def append(self, segment: Segment) -> None:
        check_frame_fits(self.config.budget_tokens, segment)
        out = self.llm.forward(
            segment.embeds, segment.positions, self.kv, deepstack=segment.deepstack, visual=segment.visual
        )
        self.kv = out.cache  # the past and the chunk, already concatenated by the forward
        self.frame = torch.cat([self.frame, segment.frame.cpu()])
        self.visual = torch.cat([self.visual, segment.visual.cpu()])
        self._evict()

    def _evict(self) -> None:
        budget = self.config.budget_tokens
        if budget is None or self.stored_tokens <= budget:
            return
        drop = oldest_frames_over_budget(self.frame[self.visual], budget)
        keep = ~torch.isin(self.frame, drop)
        index = torch.nonzero(keep).flatten()
        self.kv = select_kv(self.kv, index)
        self.frame, self.visual = self.frame[keep], self.visual[keep]
        self.evicted_frames += int(drop.numel())

    def answer_past(self, question: Segment) -> AnswerPast:
        return AnswerPast(self.kv, retrieved_tokens=self.stored_tokens)

    @property
    def stored_tokens(self) -> int:
        return int(self.visual.sum())

    @property
    def cached_rows(self) -> int:
        return cache_length(self.kv)

    @property
    def nbytes(self) -> int:
        return kv_bytes(self.kv)
