"""Turning a video and a question into processor inputs, with the `sample` stage choosing the frames.

This is the one place frames are picked, so `uniform+...` means the same in `vtc run`, in the benchmark
and in user code (`handle.prepare(...)` / `vtc.prepare_inputs(...)`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Sequence

from vtc.core.bases import FrameChoice
from vtc.core.families import family_of_processor_class
from vtc.core.stats import FrameSelection
from vtc.core.tokens import Context
from vtc.media.video import VideoSource, sampling_rule, uniform_indices

DEFAULT_NUM_FRAMES = 16


@dataclasses.dataclass
class SampledVideo:
    frames: Any  # [n, H, W, 3] uint8
    indices: list[int]
    source: VideoSource
    prepared: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the sampler hands to later stages
    warnings: list[str] = dataclasses.field(default_factory=list)  # what sampling warned about (`frame_shortfall`)
    selection: FrameSelection | None = None  # what was chosen and why (`handle.stats().frames`)

    metadata_overrides: dict[str, Any] | None = None  # what the sampler tells the processor instead (`FrameChoice`)

    @property
    def metadata(self) -> dict[str, Any]:
        """Video metadata in the form transformers' video processors take (`video_metadata=`): the real frame
        indices and fps, unless the sampler follows an official pipeline that tells the model otherwise."""
        data = {
            "fps": self.source.fps,
            "total_num_frames": self.source.num_frames,
            "frames_indices": list(self.indices),
            "duration": self.source.duration,
            "width": self.source.width,
            "height": self.source.height,
        }
        data.update({k: list(v) if k == "frames_indices" else v for k, v in (self.metadata_overrides or {}).items()})
        return data


def sample_frames(
    video,
    question: str | None,
    pipeline=None,
    num_frames: int | None = None,
    fps: float | None = None,
    model=None,
    processor=None,
    family: str | None = None,
    *,
    stacklevel: int = 2,
) -> SampledVideo:
    """Run the pipeline's `sample` stage (uniform over the whole video, by the family's rule, when it has none).

    Asking for more frames than the video has is not an error (a clip shorter than the method's count gets every
    frame, or repeated frames under the "floor" rule), but it is warned about (`UserWarning`, naming both counts;
    `stacklevel` points it at the caller) and kept in `SampledVideo.warnings` (`handle.stats().warnings`).

    Samplers see `ctx.question`, `ctx.family`, `ctx.num_frames`, `ctx.model` and `ctx.processor` (for
    query-aware scoring) and may leave data for later stages in `ctx.state` (QuoTA's frame weights), which
    those stages read as `ctx.prepared`."""
    if num_frames is not None and (isinstance(num_frames, bool) or int(num_frames) != num_frames or num_frames < 1):
        raise ValueError(
            f"num_frames must be a positive integer (or None for the method's default), got {num_frames!r}"
        )
    source = VideoSource.open(video, fps=fps)
    reports: dict[str, list[Any]] = {}  # what the sampler explains with ctx.report(...)
    ctx = Context(
        question=question, family=family, model=model, num_frames=num_frames, processor=processor, reports=reports
    )
    start = time.perf_counter()
    sampled = pipeline.run_sample(source, ctx) if pipeline is not None else None
    seconds = time.perf_counter() - start
    chosen, prepared = sampled if sampled is not None else (None, {})
    method = pipeline.stage_entries("sample")[0].card.name if sampled is not None else "uniform (default)"
    if chosen is None:
        chosen = uniform_indices(source.num_frames, num_frames or DEFAULT_NUM_FRAMES, sampling_rule(family))
    choice = chosen if isinstance(chosen, FrameChoice) else FrameChoice(list(chosen))
    indices = choice.indices
    if indices != sorted(indices) or not indices:
        raise ValueError(f"a sampler must return a non-empty sorted list of frame indices, got {indices[:8]}...")
    note = frame_shortfall(indices, source.num_frames, *_requested_frames(pipeline, num_frames, indices))
    if note is not None:
        warnings.warn(note, UserWarning, stacklevel=stacklevel)
    selection = frame_selection(method, choice, source, seconds)
    selection.reports = reports
    frames = source.read(indices)
    return SampledVideo(frames, indices, source, prepared, [note] if note else [], selection, choice.metadata)


def frame_selection(method: str, choice: FrameChoice, source: VideoSource, seconds: float = 0.0) -> FrameSelection:
    """The record of what a sampler chose from `source`: each chosen frame's time and score."""
    by_frame = dict(zip(choice.candidates or [], choice.scores or []))
    return FrameSelection(
        method=method,
        indices=list(choice.indices),
        timestamps=[i / source.fps for i in choice.indices],
        total_frames=source.num_frames,
        fps=source.fps,
        scores=[by_frame.get(i) for i in choice.indices],
        candidates=list(choice.candidates or []),
        candidate_scores=list(choice.scores or []),
        sizes=choice.sizes,
        seconds=seconds,
    )


def _requested_frames(pipeline, num_frames: int | None, indices: list[int]) -> tuple[int, str]:
    """How many frames the call asked for, and who asked: the `num_frames` argument, else the sampler's own
    `num_frames` parameter, else (a sampler without one) the count it returned, else vtc's default."""
    if num_frames is not None:
        return int(num_frames), f"num_frames={int(num_frames)}"
    entries = pipeline.stage_entries("sample") if pipeline is not None else []
    if not entries:
        return DEFAULT_NUM_FRAMES, f"the default num_frames={DEFAULT_NUM_FRAMES}"
    entry = entries[0]
    name = entry.card.name
    count = getattr(entry.method, "num_frames", None)
    if isinstance(count, int) and not isinstance(count, bool):
        return count, f"{name}'s num_frames={count}"
    return len(indices), f"{name} (sampling {len(indices)} frames)"


def frame_shortfall(indices: list[int], available: int, requested: int, asked_by: str) -> str | None:
    """The warning for a request of more frames than the video has (None when it has enough)."""
    if requested <= available:
        return None
    distinct = len(set(indices))
    if len(indices) > distinct:
        got = f"the model gets {len(indices)} frames, only {distinct} of them distinct (frames repeat)"
    else:
        got = f"the model gets {len(indices)} frames"
    return (
        f"{asked_by} asks for {requested} frames but the video has only {available} frames: {got}. Ask for at most "
        f"{available} frames (num_frames=) to match this video"
    )


def processor_family(processor) -> str | None:
    """The model family a processor belongs to (its class is among a family's `processor_classes`), for the family's
    frame-sampling rule."""
    family = family_of_processor_class(type(processor).__name__)
    return family.name if family is not None else None


def processor_video_kwargs(processor, sampled: list[SampledVideo]) -> dict[str, Any]:
    """Family-specific arguments for passing already-sampled frames to a processor."""
    video_processor = getattr(processor, "video_processor", None)
    name = type(video_processor).__name__
    if name.startswith("Qwen"):
        kwargs: dict[str, Any] = {"video_metadata": [s.metadata for s in sampled], "do_sample_frames": False}
        # transformers >= 5.2x warns unless the per-frame pixel cap (qwen-vl-utils' behaviour) is chosen
        if hasattr(type(video_processor), "cap_pixels_per_frame"):
            kwargs["cap_pixels_per_frame"] = True
        return kwargs
    return {}


def build_messages(question: str, system: str | None = None, videos: int = 1, images: int = 0) -> list[dict[str, Any]]:
    """A chat with one user turn: `videos` video entries, then `images` image entries, then the question."""
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
    content = [{"type": "video"}] * videos + [{"type": "image"}] * images + [{"type": "text", "text": question}]
    messages.append({"role": "user", "content": content})
    return messages


def image_inputs(processor, images: Sequence[Any], question: str, system: str | None = None):
    """Processor inputs of one prompt holding `images` (PIL images, or [H, W, 3] uint8 arrays), then the question."""
    import numpy as np
    from PIL import Image

    pictures = [Image.fromarray(i) if isinstance(i, np.ndarray) else i for i in images]
    chat = build_messages(question, system, videos=0, images=len(pictures))
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=pictures, return_tensors="pt")


def prepare_batch(
    processor,
    videos: Sequence[Any],
    questions: Sequence[str],
    pipeline=None,
    num_frames: int | None = None,
    fps: float | None = None,
    system: str | None = None,
    model=None,
    family: str | None = None,
    messages: Sequence[list[dict[str, Any]]] | None = None,
    images: Sequence[list[Any]] | None = None,
    processor_kwargs: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    frames: list[FrameSelection] | None = None,
):
    """Processor inputs (a `BatchFeature`) for one question per video, left-padded for generation, and what
    the sample stage prepared for each video. `family` (default: the processor's) picks the uniform rule.

    `messages` (one chat per video, with one `{"type": "video"}` entry each) replace vtc's own prompt (the video,
    then the question): an evaluation task brings its own. `images` (a list per video) fill the chats' image
    entries. The sample stage still sees `questions`. `processor_kwargs` go to the processor call (Qwen's
    `max_pixels` / `min_pixels`). `notes`, when given, receives every video's sampling warnings (they are also
    issued as `UserWarning`s), and `frames` every video's `FrameSelection`."""
    if len(videos) != len(questions):
        raise ValueError(f"got {len(videos)} videos but {len(questions)} questions; pass one question per video")
    if messages is not None and len(messages) != len(videos):
        raise ValueError(f"got {len(videos)} videos but {len(messages)} chats; pass one chat per video")
    family = family or processor_family(processor)
    sampled = []
    for v, q in zip(videos, questions):  # stacklevel 4: a warning points at the caller of handle.prepare
        sampled.append(sample_frames(v, q, pipeline, num_frames, fps, model, processor, family, stacklevel=4))
    if notes is not None:
        notes.extend(note for s in sampled for note in s.warnings)
    if frames is not None:
        frames.extend(s.selection for s in sampled if s.selection is not None)
    chats = messages if messages is not None else [build_messages(q, system) for q in questions]
    texts = [processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    padding = {"padding": True, "padding_side": "left"} if len(texts) > 1 else {}
    extra = {"images": [list(i) for i in images]} if images is not None and any(images) else {}
    inputs = processor(
        text=texts,
        videos=[s.frames for s in sampled],
        return_tensors="pt",
        **padding,
        **extra,
        **processor_video_kwargs(processor, sampled),
        **(processor_kwargs or {}),
    )
    return inputs, [s.prepared for s in sampled]
