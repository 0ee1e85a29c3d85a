"""What a patched model did on its last prefill: visual tokens in/out per stage, per LLM layer, time per stage."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class StageRecord:
    stage: str
    plugin: str
    tokens_in: int
    tokens_out: int
    seconds: float


@dataclasses.dataclass
class AttentionFallback:
    """An LLM layer whose attention ran another implementation than the model's own (`ForwardStats.attention_fallbacks`;
    when each happens: docs/concepts.md, "Attention implementations")."""

    layer: int
    from_impl: str  # the model's own (config._attn_implementation), e.g. "flash_attention_2"
    to_impl: str  # what ran instead ("sdpa")
    reason: str  # "padding", "bidirectional", "masked keys" or "mask function"
    phase: str = "prefill"  # or "decode" (decode steps record on the prefill they continue)


@dataclasses.dataclass
class FrameSelection:
    """The frames one video was shown with (`ForwardStats.frames`): what the sample stage chose and why."""

    method: str  # the sampler, or "uniform (default)" when the pipeline has none
    indices: list[int]  # frame numbers in the video, in the order the model saw them
    timestamps: list[float]  # their times in the video, seconds (index / fps)
    total_frames: int
    fps: float
    scores: list[float | None] = dataclasses.field(default_factory=list)  # each chosen frame's score (None: unscored)
    candidates: list[int] = dataclasses.field(default_factory=list)  # every frame the sampler scored
    candidate_scores: list[float] = dataclasses.field(default_factory=list)
    sizes: list[tuple[int, int]] | None = None  # (height, width) per chosen frame where the sampler resized them
    seconds: float = 0.0  # time the sampler took (scoring included; decoding the chosen frames not)
    reports: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # the sampler's `ctx.report(...)`


@dataclasses.dataclass
class MediaItem:
    """One video or image of a prompt (`ForwardStats.items`, in prompt order, batch row by batch row)."""

    kind: str  # "video" or "image"
    index: int  # among the forward's items of this kind (0 = the first)
    batch: int  # batch row
    grid: tuple[int, int, int]  # token grid (T, H, W); an image: (1, H, W)
    tokens_in: int  # visual tokens the model produced for it
    tokens_out: int = 0  # visual tokens of it entering the LLM
    compressed: bool = True  # False: it reached the LLM whole (`vtc.patch(..., images=False)`)
    view: str = ""  # a part of an image of several parts (LLaVA's anyres: "base" view, packed "crops" grid)


@dataclasses.dataclass
class ForwardStats:
    """One prefill (a forward call whose prompt contained the video tokens)."""

    has_video: bool  # the prompt had media vtc compressed (videos, or images where they are compressed)
    batch_size: int = 0
    videos: int = 0
    images: int = 0
    visual_tokens_in: int = 0  # compressible visual tokens the model produced (every compressed item)
    llm_tokens_in: int = 0  # visual tokens entering the LLM (after connect)
    visual_tokens_out: int = 0  # visual tokens alive at the last LLM layer
    sequence_in: int = 0  # padded prompt length before / after the connect stage
    sequence_out: int = 0
    grids: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # token grid (T, H, W) per video
    llm_tokens_per_video: list[int] = dataclasses.field(default_factory=list)  # visual tokens entering the LLM
    items: list[MediaItem] = dataclasses.field(default_factory=list)  # every video and image, in prompt order
    layer_visual_tokens: list[int] = dataclasses.field(default_factory=list)
    stages: list[StageRecord] = dataclasses.field(default_factory=list)
    # what plugins reported (`ctx.report(name=value)`): method -> name -> values in call order (connect hooks
    # report once per video; decode-time reports land on the prefill they continue)
    reports: dict[str, dict[str, list[Any]]] = dataclasses.field(default_factory=dict)
    prefill_seconds: float = 0.0  # time inside the LLM (text model) forward
    note: str = ""
    # what vtc warned about this prompt's inputs (`handle.prepare`: a video with fewer frames than asked for)
    warnings: list[str] = dataclasses.field(default_factory=list)
    # the frames each video of the prompt was shown with, when `handle.prepare` sampled them (one per batch row)
    frames: list[FrameSelection] = dataclasses.field(default_factory=list)
    # with `prefill` methods: the attention implementation that computed each LLM layer's output at prefill, and the
    # layers that could not keep the model's own (each listed once per prompt)
    layer_attention: list[str] = dataclasses.field(default_factory=list)
    attention_fallbacks: list[AttentionFallback] = dataclasses.field(default_factory=list)

    @property
    def retention(self) -> float:
        return self.visual_tokens_out / self.visual_tokens_in if self.visual_tokens_in else 1.0

    @property
    def mean_layer_retention(self) -> float:
        """Average fraction of visual tokens over the LLM layers (FrameFusion's `cost`)."""
        if not self.layer_visual_tokens or not self.visual_tokens_in:
            return 1.0
        return sum(self.layer_visual_tokens) / (len(self.layer_visual_tokens) * self.visual_tokens_in)

    def retention_at(self, reference: str) -> float:
        """The measured fraction of visual tokens at a `MethodInfo.retention_reference`: "llm_input" (entering the
        LLM), "last_layer" or "layer_mean" (mean over the LLM layers)."""
        if not self.visual_tokens_in:
            return 1.0
        if reference == "llm_input":
            return self.llm_tokens_in / self.visual_tokens_in
        if reference == "last_layer":
            return self.retention
        if reference == "layer_mean":
            return self.mean_layer_retention
        raise ValueError(f"unknown retention reference {reference!r}; use llm_input, last_layer or layer_mean")

    def stage_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for rec in self.stages:
            out[rec.stage] = out.get(rec.stage, 0.0) + rec.seconds
        return out

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["retention"] = self.retention
        data["mean_layer_retention"] = self.mean_layer_retention
        return data

    def table(self) -> str:
        """A plain-text summary a person can read."""
        if not self.has_video:
            return f"no video in the input: the model ran unchanged. {self.note}".strip()
        lines = [
            f"videos: {self.videos}   images: {self.images}   batch: {self.batch_size}",
            f"{'stage':<9} {'plugin':<16} {'tokens in':>10} {'tokens out':>11} {'ms':>9}",
        ]
        for rec in self.stages:
            lines.append(
                f"{rec.stage:<9} {rec.plugin:<16} {rec.tokens_in:>10} {rec.tokens_out:>11} {rec.seconds * 1e3:>9.1f}"
            )
        lines.append(
            f"visual tokens: {self.visual_tokens_in} produced -> {self.llm_tokens_in} enter the LLM -> "
            f"{self.visual_tokens_out} at the last layer ({self.retention:.1%})"
        )
        if len(self.items) > 1:
            per_item = ", ".join(
                f"{i.kind} {i.index}{' ' + i.view if i.view else ''} {'x'.join(map(str, i.grid))} -> {i.tokens_out}"
                f"{'' if i.compressed else ' (whole)'}"
                for i in self.items
            )
            lines.append(f"per item (grid -> tokens entering the LLM): {per_item}")
        if self.layer_visual_tokens:
            lines.append("per LLM layer: " + " ".join(str(n) for n in self.layer_visual_tokens))
        for k, sel in enumerate(self.frames):
            shown = ", ".join(f"{i} ({t:.1f}s)" for i, t in zip(sel.indices[:12], sel.timestamps[:12]))
            more = f", ... ({len(sel.indices)} in all)" if len(sel.indices) > 12 else ""
            lines.append(f"frames of video {k} ({sel.method}): {shown}{more}")
        lines += [f"warning: {w}" for w in self.warnings]
        for fb in self.attention_fallbacks:
            lines.append(
                f"attention fallback ({fb.phase}): layer {fb.layer} ran {fb.to_impl}, not {fb.from_impl} ({fb.reason})"
            )
        return "\n".join(lines)


class StatsRecorder:
    """Collects `ForwardStats` for the prefill forwards of a patched model."""

    def __init__(self) -> None:
        self.last: ForwardStats | None = None
        self.prefills = 0
        self._current: ForwardStats | None = None
        self._pending_warnings: list[str] = []

    def inputs_next(self, warnings: list[str]) -> None:
        """What `handle.prepare` warned about, for the `ForwardStats.warnings` of the next prefill with a video; it
        replaces what an earlier call left (one request at a time)."""
        self._pending_warnings = list(warnings)

    def begin(self, has_video: bool, **fields) -> ForwardStats:
        self._current = ForwardStats(has_video=has_video, **fields)
        if has_video and self._pending_warnings:
            self._current.warnings.extend(self._pending_warnings)
            self._pending_warnings = []
        return self._current

    @property
    def current(self) -> ForwardStats | None:
        return self._current

    def record(self, stage: str, plugin: str, tokens_in: int, tokens_out: int, seconds: float) -> None:
        if self._current is not None:
            self._current.stages.append(StageRecord(stage, plugin, tokens_in, tokens_out, seconds))

    def add_seconds(self, stage: str, plugin: str, seconds: float) -> None:
        """Accumulate time for a plugin called many times in one forward (prefill plugins: once per layer)."""
        if self._current is None:
            return
        for rec in self._current.stages:
            if rec.stage == stage and rec.plugin == plugin:
                rec.seconds += seconds
                return
        self._current.stages.append(StageRecord(stage, plugin, 0, 0, seconds))

    def report(self, method: str, values: dict[str, list[Any]]) -> None:
        """Append what a plugin reported in one hook call (name -> values) to the forward in progress (or, during
        decode steps, to the prefill they continue)."""
        target = self._current if self._current is not None else self.last
        if target is None or not values:
            return
        entry = target.reports.setdefault(method, {})
        for name, items in values.items():
            entry.setdefault(name, []).extend(items)

    def attention_fallback(self, record: AttentionFallback) -> None:
        """Note a layer that ran another attention implementation, on the forward in progress (or, during decode
        steps, on the prefill they continue); each record once per prompt."""
        target = self._current if self._current is not None else self.last
        if target is not None and record not in target.attention_fallbacks:
            target.attention_fallbacks.append(record)

    def end(self) -> None:
        if self._current is not None:
            self.last = self._current
            self.prefills += 1
            self._current = None
