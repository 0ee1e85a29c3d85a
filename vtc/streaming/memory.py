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

The interface (`StreamMemory`, `Segment`, `StreamConfig`, `AnswerPast`, `Retrieval`, the budget helpers) is
backend-neutral and lives in `vtc.core.stream` (re-exported here), so methods' memories never import a backend.
"""

from __future__ import annotations

import torch

from vtc.core.stream import (
    AnswerPast,
    Retrieval,
    Segment,
    StreamConfig,
    StreamMemory,
    StreamModel,
    cache_length,
    check_frame_fits,
    kv_bytes,
    oldest_frames_over_budget,
    select_kv,
)
from vtc.streaming.llm import KV, StreamLLM

Tensor = torch.Tensor

__all__ = [
    "AnswerPast",
    "Retrieval",
    "Segment",
    "StreamConfig",
    "StreamMemory",
    "StreamModel",
    "WindowMemory",
    "check_frame_fits",
    "oldest_frames_over_budget",
]


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
