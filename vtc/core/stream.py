"""What a stream memory works with, stated without any backend: the rows a session hands it, the model it runs
them through, and the past it answers a question from.

A `StreamMemoryMethod` (`vtc.core.bases`) returns a memory from `stream_memory(config)`; the backend (today
`vtc.streaming`, on transformers) calls `start(llm, prefix)`, `append(segment)` per chunk and
`answer_past(question)` per question. Everything a memory touches is defined here in plain torch:

* the cache as per-layer `(keys, values)` tensors (`KV`: [1, kv_heads, L, head_dim], keys after RoPE as the
  attention layers cache them) and the helpers on it (`cache_length`, `kv_bytes`, `concat_kv`, `select_kv`);
* `StreamModel`: what `llm` offers (`forward` on rows after a past, `key_rotation()` to rotate stored keys to
  positions, `capture_queries()` to read every layer's queries during the forwards run meanwhile);
* `AnswerPast`: the past a question is answered from, either whole (`kv`) or retrieved layer by layer inside the
  question's own forward (`retrieval`: a `Retrieval(fill, length)`; the backend builds the cache object that
  calls `fill(layer)` the first time that layer attends; a memory never builds a backend cache itself).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Protocol

import torch

Tensor = torch.Tensor
KV = list[tuple[Tensor, Tensor]]


# --- the cache as tensors ------------------------------------------------------------------------------------------


def cache_length(kv: KV | None) -> int:
    return 0 if not kv else int(kv[0][0].shape[2])


def kv_bytes(kv: KV | None) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in (kv or []))


def concat_kv(a: KV | None, b: KV) -> KV:
    if not a:
        return list(b)
    return [(torch.cat([ka, kb], dim=2), torch.cat([va, vb], dim=2)) for (ka, va), (kb, vb) in zip(a, b)]


def select_kv(kv: KV, index: Tensor) -> KV:
    """The cache entries at `index` (token positions along the cache), per layer."""
    return [(k.index_select(2, index.to(k.device)), v.index_select(2, index.to(v.device))) for k, v in kv]


# --- what the session hands a memory -------------------------------------------------------------------------------


@dataclasses.dataclass
class StreamConfig:
    """What a memory is told about its session.

    budget_tokens: the most visual tokens the memory may hold (None: unbounded)
    family / model / adapter: the model being streamed to (`model` / `adapter` are the backend's objects: a memory
    should not need them)
    fps: frames per second of the stream (timestamps = frame index / fps)
    mrope: whether the model's positions are M-RoPE rows (P = 3), else 1-D (None: read from `adapter.mrope`)
    """

    budget_tokens: int | None
    family: str
    model: Any = None
    adapter: Any = None
    fps: float = 0.5
    mrope: bool | None = None

    def __post_init__(self) -> None:
        if self.mrope is None:
            self.mrope = bool(getattr(self.adapter, "mrope", False))


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
class Forward:
    """What `StreamModel.forward` returns."""

    logits: Tensor  # [V] of the last row
    kv: KV  # per layer, the keys/values of the rows just run (not the past)
    hidden: Tensor | None = None  # [L, D] last hidden states
    cache: KV | None = None  # per layer, the past and these rows together (the tensors the forward built)


class KeyRotation(Protocol):
    """Rotate keys [1, heads, L, d] stored before RoPE to their positions [P, L] (or undo it with `inverse`)."""

    def __call__(self, keys: Tensor, positions: Tensor, inverse: bool = False) -> Tensor: ...


class QueryProbe(Protocol):
    """Every decoder layer's queries before RoPE in the forwards run while it is installed (a context manager;
    `remove()` uninstalls it). `mean(layer, head_dim)`: the queries of `layer` averaged over the tokens and over
    the query heads of each KV head -> [kv_heads * head_dim] (StreamingTOM's and MemStream's retrieval query)."""

    kv_heads: int

    def mean(self, layer: int, head_dim: int) -> Tensor: ...

    def remove(self) -> None: ...

    def __enter__(self) -> "QueryProbe": ...

    def __exit__(self, *exc) -> None: ...


class StreamModel(Protocol):
    """The model a memory runs its rows through (`start(llm, prefix)` hands it).

    `forward(embeds [L, D], positions [P, L], past)` runs the rows after the per-layer `past` (None: nothing) and
    never changes the tensors of `past`; `deepstack`/`visual` carry Qwen3-VL's DeepStack features of the visual
    rows."""

    mrope: bool
    num_layers: int

    def forward(
        self,
        embeds: Tensor,
        positions: Tensor,
        past: KV | None = None,
        *,
        deepstack: Tensor | None = None,
        visual: Tensor | None = None,
    ) -> Forward: ...

    def key_rotation(self) -> KeyRotation: ...

    def capture_queries(self) -> QueryProbe: ...


# --- what a memory answers from ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Retrieval:
    """A past chosen layer by layer inside the question's own forward: `fill(layer)` -> (keys, values)
    [1, kv_heads, length, head_dim] of that layer's past, called once per layer, when the question's forward first
    reaches it (so it can read what `capture_queries()` caught in the earlier layers and in this layer's
    projection). Every layer's past has `length` rows."""

    fill: Callable[[int], tuple[Tensor, Tensor]]
    length: int


@dataclasses.dataclass
class AnswerPast:
    """What a question is answered from: the cache (`kv`, or a `retrieval` filled per layer), and, when the memory
    renumbers, where the question starts."""

    kv: KV | None
    next_position: int | None = None  # None: the stream's own next position
    retrieval: Retrieval | None = None  # per-layer retrieval instead of `kv`
    retrieved_tokens: int | None = None  # visual tokens the answer attends to (memories that retrieve)
    seconds: float = 0.0  # time the memory spent building this past (counted in the question's TTFT)
    release: Callable[[], None] | None = None  # called once the question is answered (or failed)


class StreamMemory(Protocol):
    """The interface of a stream memory (see the module docstring)."""

    name: str

    def start(self, llm: StreamModel, prefix: Segment) -> None: ...

    def append(self, segment: Segment) -> None: ...

    def answer_past(self, question: Segment) -> AnswerPast: ...

    @property
    def stored_tokens(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


# --- shared budget rules -------------------------------------------------------------------------------------------


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
