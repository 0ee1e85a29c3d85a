"""The sample stage on a vLLM server: frames chosen inside the prompt processor, after vLLM decoded the video and
before the HF processor turns frames into patches, so only the chosen frames are resized, encoded and read.

`select_frames(processor, inputs, config)` runs once per request, in the process that processes prompts (the API
server, or the engine's own process with `vllm.LLM`):

1. the question of each video is the request's text after that video, up to the end of its turn (the chat
   template's end-of-turn marker; other media placeholders and special tokens removed), unless the request names
   one (`mm_processor_kwargs={"vtc": {"question": ...}}`);
2. the pipeline's sampler (`vtc.media.inputs.sample_frames`, the same call the HF backend makes) chooses among the
   frames vLLM decoded (`--media-io-kwargs '{"video": {"num_frames": N}}'` sets how many: vLLM's default is 32);
3. each video item is replaced by its chosen frames, with metadata telling the processor their true frame numbers
   in the original video (or what the sampler's official pipeline tells the model instead, `FrameChoice.metadata`);
4. the item's cache identity becomes (the video's own hash, the chosen frames): vLLM's processor and encoder
   caches key on it, so a question never gets another question's frames, and two requests that choose the same
   frames of the same video (a query-agnostic sampler, or the same question) share the encoder's output.

`LAST_FRAMES` keeps what was chosen for each video (a `vtc.core.stats.FrameSelection` plus the question), newest
last, for tests, `vtc eval` records and debugging; every selection is also logged at INFO.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import numpy as np

from vtc.core.pipeline import Pipeline
from vtc.media.inputs import sample_frames

LAST_FRAMES: list[dict[str, Any]] = []  # {"question", "selection", "hash"} per sampled video, newest last
_SENTINEL = "\x00vtc-question\x00"


@functools.lru_cache(maxsize=16)
def _turn_end(tokenizer, template: str | None = None) -> str | None:
    """What ends a user turn in the chat template (the tokenizer's, else `template`, the processor's; Qwen:
    "<|im_end|>", Vicuna-style: "ASSISTANT:"), found by rendering a turn around a sentinel; None without one."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}],
            add_generation_prompt=True,
            tokenize=False,
            chat_template=getattr(tokenizer, "chat_template", None) or template,
        )
    except Exception:  # noqa: BLE001 - no template, or one that needs other arguments
        return None
    suffix = text.split(_SENTINEL, 1)[-1].strip()
    return suffix.splitlines()[0].strip() if suffix else None


def _special_strings(tokenizer) -> list[str]:
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            specials.add(str(token))
    return sorted((s for s in specials if s), key=len, reverse=True)


def media_runs(prompt: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each run of `token_id` in the prompt: one per video before the processor expands it."""
    out, start = [], None
    for i, tok in enumerate(list(prompt) + [None]):
        if tok == token_id and start is None:
            start = i
        elif tok != token_id and start is not None:
            out.append((start, i))
            start = None
    return out


def questions_of(
    prompt: list[int], video_token_id: int, tokenizer, count: int, template: str | None = None
) -> list[str | None]:
    """Each video's question: the text after it, to the end of its turn, without media placeholders or special
    tokens (None where that text is empty). `template`: the chat template when the tokenizer has none."""
    runs = media_runs(prompt, video_token_id)
    if len(runs) != count:
        return [None] * count
    marker = _turn_end(tokenizer, template)
    specials = _special_strings(tokenizer)
    out: list[str | None] = []
    for _, end in runs:
        text = tokenizer.decode(list(prompt[end:]), skip_special_tokens=False)
        if marker and marker in text:
            text = text[: text.index(marker)]
        for special in specials:
            text = text.replace(special, " ")
        text = re.sub(r"\s+", " ", text).strip()
        out.append(text or None)
    return out


def _effective_fps(metadata: dict[str, Any] | None, decoded: int) -> float:
    """The rate of the frames vLLM decoded: the video's fps when it decoded every frame, proportionally less when
    it decoded a subset (its `frames_indices`)."""
    if not metadata or not metadata.get("fps"):
        return 1.0
    fps, total = float(metadata["fps"]), int(metadata.get("total_num_frames") or decoded)
    return fps * decoded / total if total else fps


def _chosen_metadata(metadata: dict[str, Any] | None, chosen: list[int], overrides: dict[str, Any] | None):
    """Metadata of the chosen frames: the video's own with their original frame numbers (as the HF backend tells
    the processor), then the sampler's overrides."""
    if metadata is None:
        return None
    out = dict(metadata)
    original = list(metadata.get("frames_indices") or range(int(metadata.get("total_num_frames") or 0)))
    out["frames_indices"] = [int(original[i]) if i < len(original) else int(i) for i in chosen]
    for key, value in (overrides or {}).items():
        out[key] = list(value) if key == "frames_indices" else value
    return out


@dataclasses.dataclass
class _Video:
    frames: np.ndarray
    metadata: dict[str, Any] | None
    tupled: bool  # the item was (frames, metadata), as families that need metadata keep it


def _video_items(items) -> list[_Video]:
    out = []
    metadata_list = items.metadata if isinstance(items.metadata, list) else [None] * items.get_count()
    for k in range(items.get_count()):
        item = items.get(k)
        if item is None:
            raise ValueError(
                "vtc chooses frames on the server, which needs each video's frames; this request sent only a media "
                "uuid for a video (multi_modal_uuids without data)"
            )
        tupled = isinstance(item, tuple)
        frames, metadata = item if tupled else (item, metadata_list[k] if k < len(metadata_list) else None)
        out.append(_Video(np.asarray(frames), metadata, tupled))
    return out


def select_frames(processor, inputs, pipeline: Pipeline, question: str | None, family: str):
    """`inputs` (vLLM's `ProcessorInputs`) with every video replaced by the frames `pipeline`'s sampler chose, and
    cache identities keyed by (video, frames). `question`: the request's own (None: read from the prompt)."""
    from vllm.multimodal.parse import MultiModalDataItems, VideoProcessorItems

    items = inputs.mm_data_items.get("video")
    if items is None or not items.get_count():
        return inputs
    if not isinstance(items, VideoProcessorItems):
        raise ValueError(
            f"this server chooses frames ({pipeline.spec}), which needs each video's frames; the request sent "
            "video embeddings"
        )
    videos = _video_items(items)
    hashes = processor.stock_hashes(inputs)
    tokenizer = processor.info.get_tokenizer()
    questions = [question] * len(videos)
    if question is None:
        template = getattr(processor.info.get_hf_processor(), "chat_template", None)
        questions = questions_of(inputs.prompt, processor.video_token_id(), tokenizer, len(videos), template)
    new_items, new_metadata, uuids = [], [], []
    for k, video in enumerate(videos):
        try:
            sampled = sample_frames(
                video.frames,
                questions[k],
                pipeline,
                fps=_effective_fps(video.metadata, len(video.frames)),
                family=family,
            )
        except ValueError as err:
            raise ValueError(f"{err}{_question_hint(questions[k])}") from None
        metadata = _chosen_metadata(video.metadata, sampled.indices, sampled.metadata_overrides)
        frames = np.ascontiguousarray(sampled.frames)
        new_items.append((frames, metadata) if video.tupled else frames)
        new_metadata.append(metadata)
        uuids.append(f"{hashes['video'][k]}+vtc-frames:{','.join(map(str, sampled.indices))}")
        numbers = metadata["frames_indices"] if metadata else sampled.indices
        _record(sampled, questions[k], uuids[-1], sampled.warnings, numbers)
    data = MultiModalDataItems(dict(inputs.mm_data_items))
    data["video"] = VideoProcessorItems(new_items, metadata=new_metadata)
    uuid_items = {modality: list(values) for modality, values in hashes.items()}
    uuid_items["video"] = uuids
    return dataclasses.replace(inputs, mm_data_items=data, mm_uuid_items=uuid_items)


def _question_hint(question: str | None) -> str:
    if question:
        return ""
    return (
        " (vtc reads the question from the prompt text after each video; this request has none there: put the "
        'question after the video, or send it as mm_processor_kwargs={"vtc": {"question": ...}})'
    )


def _record(sampled, question: str | None, identity: str, notes: list[str], numbers: list[int]) -> None:
    from vllm.logger import init_logger

    logger = init_logger("vllm.vtc")
    selection = sampled.selection
    LAST_FRAMES.append(
        {"question": question, "selection": selection, "hash": identity, "warnings": notes, "frames": list(numbers)}
    )
    del LAST_FRAMES[:-64]
    logger.info(
        "vtc %s: chose %d of %d decoded frames %s (frames %s of the video) for %r",
        selection.method if selection else "sampler",
        len(sampled.indices),
        sampled.source.num_frames,
        sampled.indices,
        list(numbers),
        question,
    )
    for note in notes:
        logger.warning("vtc: %s", note)
