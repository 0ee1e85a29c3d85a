"""The public entry points: `vtc.patch(model, "a+b", retention=...)`, the `PatchHandle` it returns, and
`vtc.prepare_inputs(...)` for the frame-sampling stage in user code."""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from vtc.core.pipeline import Pipeline, Spec
from vtc.core.stats import ForwardStats, StatsRecorder
from vtc.hf import loading as _loading  # noqa: F401 - registers the checkpoint loaders methods ask for
from vtc.hf.adapters import resolve_adapter
from vtc.hf.patching import ModelPatch
from vtc.media.inputs import prepare_batch, processor_family


class PatchHandle:
    """What `vtc.patch` returns. Unpatch it (or use it as a context manager) to restore the model."""

    def __init__(self, model: torch.nn.Module, pipeline: Pipeline, patch: ModelPatch, recorder: StatsRecorder):
        self.model = model
        self.pipeline = pipeline
        self.recorder = recorder
        self.images = patch.images  # images are compressed (vtc.patch(..., images=...))
        self._patch: ModelPatch | None = patch

    # --- lifecycle -----------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._patch is not None

    @property
    def family(self) -> str:
        return (self._patch.adapter if self._patch else resolve_adapter(self.model)).family

    def unpatch(self) -> None:
        """Remove every hook vtc installed; the model is bit-for-bit what it was. Safe to call twice."""
        if self._patch is None:
            return
        self._patch.remove()
        self._patch = None

    def suspended(self):
        """Context manager: run the model exactly as if unpatched inside the block (for A/B comparisons)."""
        if self._patch is None:
            return contextlib.nullcontext()
        return self._patch.suspended()

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()

    def __repr__(self) -> str:
        state = "active" if self.active else "unpatched"
        return f"PatchHandle({self.pipeline.spec!r}, retention={self.pipeline.retention}, {state})"

    # --- results -------------------------------------------------------------------------------------------------
    def stats(self) -> ForwardStats | None:
        """Visual tokens in/out per stage and per LLM layer, and stage timings, of the last prefill
        (None before the first forward)."""
        return self.recorder.last

    def retained_count(self, grid: tuple[int, int, int], kind: str = "video") -> int | None:
        """Visual tokens the LLM keeps for a video whose token grid is `grid` = (T, H, W) (at the last LLM layer
        when a method acts in the LLM); None when the methods decide adaptively from the content. `kind="image"`:
        for an image of grid (1, H, W), through the methods that act on images (`Pipeline.for_images`); with
        `images=False` an image keeps every token."""
        if kind not in ("video", "image"):
            raise ValueError(f"kind must be 'video' or 'image', got {kind!r}")
        if kind == "video":
            return self.pipeline.retained_count(grid)
        if not self.images:
            t, h, w = grid
            return t * h * w
        return self.pipeline.for_images().retained_count(grid)

    # --- inputs ---------------------------------------------------------------------------------------------------
    def prepare(
        self,
        processor,
        video: Any,
        question: str | Sequence[str],
        num_frames: int | None = None,
        fps: float | None = None,
        system: str | None = None,
        *,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]] | None = None,
        images: Sequence[Any] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
    ):
        """Processor inputs for `video` (path, [T, H, W, 3] array, or a list of them) and `question`, with
        frames chosen by this pipeline's `sample` stage (uniform when it has none). Feed the result to
        `model.generate(**inputs)`.

        `messages`: your own chat (one per video, each with one `{"type": "video"}` entry) instead of vtc's
        "video, then question" prompt; `question` is then what query-aware methods read. `images`: the images
        of the chats' image entries (a list per video). `processor_kwargs`: extra arguments of the processor call
        (e.g. Qwen's `max_pixels`).

        A video with fewer frames than asked for (`num_frames`, or the sampler's own) gets what it has, with a
        `UserWarning` naming both counts; the warning is also in `handle.stats().warnings` of the next prefill, and the
        frames each video was shown with (indices, timestamps, the sampler's scores) in its `stats().frames`."""
        videos, questions = _as_batch(video, question)
        if messages is not None and isinstance(question, str):
            messages, images = [messages], ([images] if images is not None else None)
        args = (processor, videos, questions, self.pipeline, num_frames, fps, system, self.model, self.family)
        extra = dict(messages=messages, images=images, processor_kwargs=processor_kwargs)
        if self._patch is None:
            inputs, _ = prepare_batch(*args, **extra)
            return inputs
        notes: list[str] = []  # sampling warnings (a video with fewer frames than asked): also in the next stats
        frames: list = []  # the frames each video was shown with (stats().frames)
        # samplers may run the model itself (QuoTA scores frames with it): not through vtc's own hooks
        with self._patch.suspended():
            inputs, prepared = prepare_batch(*args, **extra, notes=notes, frames=frames)
        self.recorder.inputs_next(notes)
        if self._patch.tokenizer is None:
            self._patch.tokenizer = getattr(processor, "tokenizer", None)
        # one request at a time: what an earlier prepare call computed is dropped (memory stays bounded)
        self._patch.prepared = {}
        mask = inputs["attention_mask"].bool()
        for b, q in enumerate(questions):
            ids = tuple(inputs["input_ids"][b][mask[b]].tolist())
            # the frames go with the prompt: every forward of it (a warm-up, a second generate) reports them
            self._patch.prepared[ids] = {"question": q, "methods": prepared[b], "frames": frames[b : b + 1]}
        return inputs


def _as_batch(video, question) -> tuple[list[Any], list[str]]:
    if isinstance(question, str):
        return [video], [question]
    questions = list(question)
    videos = list(video) if isinstance(video, (list, tuple)) else [video] * len(questions)
    return videos, questions


def patch(
    model: torch.nn.Module,
    methods: Spec,
    retention: float | None = None,
    *,
    positions: str | None = None,
    processor: Any = None,
    seed: int = 0,
    images: bool = True,
    **params: Any,
) -> PatchHandle:
    """Apply token-compression methods to a HuggingFace video-LLM instance.

    methods:   a spec such as "framefusion" or "uniform+fastv" (see `vtc methods`), or method instances:
               `DivPrune(ratio=0.1)`, `[DivPrune(ratio=0.1), FastV(k=3)]`, `DivPrune() + FastV()`.
    retention: fraction of visual tokens the LLM sees, in (0, 1]; each method maps it onto its own
               parameters (split evenly over several token-reducing methods). None = official defaults.
    positions: "keep" (survivors keep their original positions) or "compact" (renumbered; 1-D RoPE
               families only). Default: what each method's official code does.
    processor: optional; lets query-aware methods read the question as text (and encode-stage methods read its
               pixel normalisation; default: the family's video processor's).
    images:    compress images too (default): each image of a prompt goes through the methods that act on one
               image (connect and prefill methods that need no time) with its own `retention`; False lets images
               reach the LLM whole (the stats still list them).
    params:    method parameters by name (`k=3`) or qualified (`**{"fastv.k": 3}`).

    Only this instance is changed; `handle.unpatch()` restores it exactly. A model carries one patch: patching
    it again while a handle is active is refused (compose the methods in one spec, `"a+b"`, or unpatch first).
    """
    adapter = resolve_adapter(model)
    pipeline = Pipeline(methods, retention=retention, params=params, family=adapter.family)
    recorder = StatsRecorder()
    tokenizer = getattr(processor, "tokenizer", processor) if processor is not None else None
    if not isinstance(images, bool):
        raise ValueError(
            f"images must be True (compress images) or False (let them reach the LLM whole), got {images!r}"
        )
    model_patch = ModelPatch(
        adapter,
        pipeline,
        recorder,
        positions=positions,
        seed=seed,
        tokenizer=tokenizer,
        processor=processor,
        images=images,
    )
    model_patch.install()  # refuses a model another handle has patched (naming it)
    return PatchHandle(model, pipeline, model_patch, recorder)


def prepare_inputs(
    processor,
    video: Any,
    question: str | Sequence[str],
    methods: Spec = "uniform",
    num_frames: int | None = None,
    fps: float | None = None,
    system: str | None = None,
    model: torch.nn.Module | None = None,
    **params: Any,
):
    """Processor inputs for a video and question with frames chosen by `methods`' sample stage, without
    patching a model. `vtc.prepare_inputs(processor, "clip.mp4", "What happens?", "uniform", num_frames=16)`.
    `model` is needed by samplers that score frames with a model (QuoTA); what such samplers prepare for later
    stages only reaches a model patched by a handle, so prefer `handle.prepare` for them."""
    family = resolve_adapter(model).family if model is not None else processor_family(processor)
    pipeline = Pipeline(methods, params=params, family=family)
    videos, questions = _as_batch(video, question)
    inputs, _ = prepare_batch(processor, videos, questions, pipeline, num_frames, fps, system, model, family)
    return inputs
