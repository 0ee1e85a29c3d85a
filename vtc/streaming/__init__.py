"""Streaming sessions: frames in as they arrive, questions at any time, memory bounded by a token budget.

`vtc.stream(model, processor, methods, budget_tokens=...)` opens a `StreamSession` (`vtc.streaming.session`)."""

from vtc.streaming.memory import AnswerPast, Segment, StreamConfig, StreamMemory, WindowMemory
from vtc.streaming.session import AskRecord, StreamSession, StreamStats, stream

__all__ = [
    "AnswerPast",
    "AskRecord",
    "Segment",
    "StreamConfig",
    "StreamMemory",
    "StreamSession",
    "StreamStats",
    "WindowMemory",
    "stream",
]
