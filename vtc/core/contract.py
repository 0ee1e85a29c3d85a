"""The plugin contract: what a plugin object offers vtc, and what vtc offers a `prefill` plugin.

A method is declared by a `vtc.MethodInfo` (stages, capabilities) and implemented by the object its
`factory(params, retention)` returns. That object follows `MethodPlugin`: one `@hookimpl` method per declared
stage, plus the optional methods its `MethodInfo` declares (`fixed_count` -> `retained_count`,
`vision_stats` -> `vision_stats`). vtc calls nothing else, and `vtc.patch` refuses a plugin whose object and
declaration disagree (a declared capability without its method, or a capability method that is not declared).

What a plugin keeps for one prompt lives in `ctx.store` (fresh for every prompt, shared by all of the
plugin's hooks of that prompt), and what it wants to show goes through `ctx.report(...)` into
`handle.stats().reports`; the plugin object itself holds only its parameters.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from vtc.core.tokens import Context, VideoTokens
    from vtc.core.vision_stats import VisionStat

Tensor = torch.Tensor
Grid = tuple[int, int, int]


class Video(Protocol):
    """What a `sample` hook gets: a decoded-on-demand video (`vtc.media.video.VideoSource`)."""

    num_frames: int
    fps: float

    @property
    def duration(self) -> float: ...

    def read(self, indices: list[int]) -> Any: ...


@runtime_checkable
class MethodPlugin(Protocol):
    """The object `MethodInfo.factory(params, retention)` returns. Every method is optional; implement the stage
    hooks in `MethodInfo.stages` (decorated with `vtc.hookimpl`) and the capabilities the `MethodInfo` declares.

    vtc_sample(video, ctx) -> list[int]: sorted frame indices into the decoded video.
    vtc_connect(tokens, ctx) -> VideoTokens: one video's tokens after the projector; return `tokens` itself to
        keep everything, or `tokens.select(...)` / `tokens.merge(...)` / `tokens.merge_dense(...)`.
    vtc_prefill(state, ctx) -> None: inside the LLM (see `LLMState`).
    retained_count(num_tokens, grid, family) -> int | None: tokens kept for a video that reaches this plugin
        with `num_tokens` tokens (what earlier methods left) on the original token grid `grid` = (T, H, W) of a
        model of `family`; None when it depends on the content. A pure function of its arguments and the
        parameters: serving engines call it before any model runs. For a method acting in the LLM it is the
        count at the last layer. vtc checks the promise on every forward.
    vision_stats(family) -> list[VisionStat]: the vision-tower statistics the connect hook reads from `ctx.vision`.
    stream_memory(config) -> StreamMemory: the memory a `vtc.stream` session keeps (`vtc.stream.memory`);
        `config` is the session's `StreamConfig` (budget, family, model). Methods declaring `stream_memory`.
    """

    def vtc_sample(self, video: Video, ctx: Context) -> list[int]: ...

    def vtc_connect(self, tokens: VideoTokens, ctx: Context) -> VideoTokens: ...

    def vtc_prefill(self, state: LLMState, ctx: Context) -> None: ...

    def retained_count(self, num_tokens: int, grid: Grid, family: str) -> int | None: ...

    def vision_stats(self, family: str) -> list[VisionStat]: ...


# plugin-object methods that correspond to a `MethodInfo` capability flag
CAPABILITY_METHODS = {
    "fixed_count": "retained_count",
    "vision_stats": "vision_stats",
    "stream_memory": "stream_memory",
}
# attributes of the first plugin contract, now declared on MethodInfo (a plugin that still sets them is refused
# with a message naming the MethodInfo field, so it is never silently ignored)
LEGACY_ATTRIBUTES = {"needs_prepool": "prepool", "acts_during_decode": "acts_during_decode"}


@dataclasses.dataclass
class TokenLayout:
    """Per-slot bookkeeping of the sequence inside the LLM; every field is [B, n].

    index: position of the slot's token in the sequence that entered the LLM (gathers RoPE rows, and
           relates slots to the KV cache of earlier layers)
    valid: a real token (False for padding)
    visual: a compressible visual token; frame/patch/video are -1 elsewhere
    frame: frame (temporal index of the token grid); patch: spatial index within the frame (row * W + col)
    video: which video of the batch row the token belongs to (0, 1, ...)
    tags: connect plugins' labels (`VideoTokens.tags`), -1 elsewhere
    """

    index: Tensor
    valid: Tensor
    visual: Tensor
    frame: Tensor
    patch: Tensor
    video: Tensor
    tags: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    def gather(self, idx: Tensor, valid: Tensor) -> TokenLayout:
        fields = {
            f.name: torch.gather(getattr(self, f.name), 1, idx) for f in dataclasses.fields(self) if f.name != "tags"
        }
        fields["valid"] = valid
        fields["visual"] = fields["visual"] & valid
        return TokenLayout(**fields, tags={name: torch.gather(t, 1, idx) for name, t in self.tags.items()})

    @property
    def num_visual(self) -> int:
        return int((self.visual & self.valid).sum())

    def video_slots(self, row: int) -> dict[int, Tensor]:
        """Slots of each video of batch row `row`: video index -> visual slot indices, ascending."""
        visual = self.visual[row] & self.valid[row]
        return {
            int(v): torch.nonzero(visual & (self.video[row] == v)).flatten()
            for v in torch.unique(self.video[row][visual]).tolist()
        }


class LLMState(Protocol):
    """What a `prefill` plugin sees at each call (the HF backend's `vtc.hf.llm.runtime.LLMState`).

    Where: `layer`, `point` ("layer_start" before a decoder layer, "after_attention" on the residual stream
    after attention, before the MLP), `phase` ("prefill" or "decode"), `num_layers`, `family`.
    What: `hidden` [B, n, D], `layout` (`TokenLayout` of the prompt now), `prefill_layout(layer)` (what that
    layer cached), `grids`, `visual_tokens_in`.
    Attention: `request_attention(num_rows | "after_visual", upcast)` at a layer start, then `attention(layer)`
    [B, heads, rows, keys] and `attention_rows_valid(layer)`; `projections(rows)` gives this layer's query rows
    and keys before RoPE; `attend_bidirectionally()` makes this layer's prompt attention non-causal.
    Changes: `keep(mask, prune_cache=False)`, `merge_mean(batch, dst, src)`, `replace_hidden(hidden)` during
    prefill; `mask_keys(visible)` during decode.
    """

    layer: int
    point: str
    phase: str
    num_layers: int
    family: str
    hidden: Tensor
    layout: TokenLayout

    def prefill_layout(self, layer: int) -> TokenLayout: ...

    def request_attention(self, num_rows: int | str = 1, upcast: bool = True) -> None: ...

    def attention(self, layer: int | None = None) -> Tensor: ...

    def attention_rows_valid(self, layer: int | None = None) -> Tensor: ...

    def projections(self, rows: Tensor) -> tuple[Tensor, Tensor]: ...

    def attend_bidirectionally(self) -> None: ...

    def keep(self, mask: Tensor, prune_cache: bool = False) -> None: ...

    def merge_mean(self, batch: Tensor, dst: Tensor, src: Tensor) -> None: ...

    def replace_hidden(self, hidden: Tensor) -> None: ...

    def mask_keys(self, visible: Tensor) -> None: ...
