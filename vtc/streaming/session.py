"""`vtc.stream`: feed frames to a video-LLM as they arrive, ask questions at any time, in bounded memory.

    with vtc.stream(model, processor, "streamingtom", budget_tokens=12544) as s:
        for frame in camera:
            s.feed(frame)                       # encode, compress, store
        answer = s.ask("What did the person pick up?", max_new_tokens=64)

A session is one prompt that never ends (`vtc.streaming.layout`): the chat template's text before the video, the
video chunk by chunk, and at each question the text after the video. Each chunk of frames goes through the
model's own vision path (`vtc.streaming.encoder`), then the pipeline's causal connect plugins (the same connect
engine every backend calls, with one `ctx.state` per method for the whole stream), then into the memory
(`vtc.streaming.memory`, or the method's own), which keeps at most `budget_tokens` visual tokens. A question is
answered from the memory's past with greedy decoding and never changes the memory.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import weakref
from typing import Any

import numpy as np
import torch

from vtc.core.engine import connect_video, grid_cells, video_tokens
from vtc.core.pipeline import Pipeline
from vtc.core.tokens import Context
from vtc.hf.adapters import resolve_adapter
from vtc.hf.patching import OPEN_STREAMS, PATCHED_MODELS
from vtc.hf.vision import VisionCapture
from vtc.streaming.encoder import ChunkEncoder, EncodedChunk
from vtc.streaming.layout import PositionCounter, qwen_interval, split_template, text_ids
from vtc.streaming.llm import StreamLLM, past_cache
from vtc.streaming.memory import Segment, StreamConfig, WindowMemory

Tensor = torch.Tensor


@dataclasses.dataclass
class AskRecord:
    """One question: its answer, and what answering it cost."""

    question: str
    answer: str
    token_ids: list[int]
    first_logits: Tensor  # [V] logits of the first answer token
    ttft_s: float  # question prefill (and retrieval) to the first token; excludes encoding pending frames
    flush_s: float  # encoding the frames still pending when the question came
    frames_seen: int
    stored_tokens: int
    retrieved_tokens: int | None
    memory_bytes: int
    prompt_rows: int  # rows of the question prefill

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("first_logits")
        return out


@dataclasses.dataclass
class StreamStats:
    """What `session.stats()` reports."""

    methods: str
    memory: str
    budget_tokens: int | None
    frames_fed: int  # frames given to feed (including pending ones)
    frames_encoded: int
    frames_pending: int  # fed but waiting for a full chunk (a Qwen temporal patch needs 2 frames)
    chunks: int
    visual_tokens_fed: int  # visual tokens of the encoded frames, before compression
    visual_tokens_kept: int  # after the connect stage, summed over chunks
    stored_tokens: int  # visual tokens in memory now
    memory_bytes: int  # bytes the memory holds now (KV cache, quantized groups, stored tokens)
    encode_s: float
    connect_s: float
    memory_s: float
    asks: list[AskRecord]

    @property
    def ttft_s(self) -> list[float]:
        return [a.ttft_s for a in self.asks]

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "asks"}
        out["asks"] = [a.to_dict() for a in self.asks]
        return out


def fixed_frame_size(video_processor, chunk_frames: int) -> dict[str, int]:
    """Qwen3-VL's video processor sizes frames from the whole video's pixel budget (min and max pixels over all
    frames), so a chunk of 2 frames and one of 32 would get different resolutions. A stream needs one: the
    minimum becomes one temporal patch of the smallest frame, and the maximum grows with the chunk, so only the
    per-frame cap (`cap_pixels_per_frame`) and the frame's own size decide."""
    factor = int(video_processor.patch_size) * int(video_processor.merge_size)
    temporal = int(video_processor.temporal_patch_size)
    longest = int(video_processor.size["longest_edge"])
    return {"shortest_edge": temporal * factor * factor, "longest_edge": longest * max(1, chunk_frames // temporal)}


def open_stream_video(video: Any, fps: float):
    """(source, indices): a video file (or a [T, H, W, 3] array, whose frames are taken as already at `fps`) and
    the indices of its frames at `fps` frames per second, from its first frame on."""
    from vtc.media.video import VideoSource

    is_array = not isinstance(video, (str, bytes)) and not hasattr(video, "__fspath__")
    source = VideoSource.open(video, fps=fps if is_array else None)
    step = source.fps / fps
    indices = [int(round(k * step)) for k in range(int(source.num_frames / step + 1e-9) + 1)]
    return source, [i for i in indices if i < source.num_frames] or [0]


def _as_frame(frame: Any) -> np.ndarray:
    if isinstance(frame, torch.Tensor):
        frame = frame.detach().cpu().numpy()
    elif not isinstance(frame, np.ndarray):
        frame = np.asarray(frame)  # PIL images and nested lists
    if frame.ndim != 3 or frame.shape[-1] != 3:
        raise ValueError(f"a frame is an [H, W, 3] RGB array (uint8), got shape {tuple(frame.shape)}")
    if frame.dtype != np.uint8:
        raise ValueError(f"a frame is an [H, W, 3] uint8 array, got dtype {frame.dtype}")
    return frame


class StreamSession:
    """A stream on one model; see `vtc.stream`."""

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        methods: str | None = None,
        retention: float | None = None,
        *,
        budget_tokens: int | None = None,
        fps: float = 0.5,
        chunk_frames: int | None = None,
        system: str | None = None,
        positions: str | None = None,
        seed: int = 0,
        processor_kwargs: dict[str, Any] | None = None,
        **params: Any,
    ) -> None:
        self.adapter = resolve_adapter(model)
        if model in PATCHED_MODELS:
            raise ValueError(
                "this model is patched by vtc.patch; a stream runs its own compression: call handle.unpatch() first "
                "(or open the stream on another instance)"
            )
        self.model = model
        self.processor = processor
        family = self.adapter.family
        if budget_tokens is not None and (
            isinstance(budget_tokens, bool) or int(budget_tokens) != budget_tokens or budget_tokens < 1
        ):
            raise ValueError(f"budget_tokens must be a positive integer (visual tokens kept), got {budget_tokens!r}")
        if not (isinstance(fps, (int, float)) and fps > 0):
            raise ValueError(f"fps must be a positive number (frames per second of the stream), got {fps!r}")
        if positions not in (None, "keep", "compact"):
            raise ValueError(f"positions must be 'keep' or 'compact', got {positions!r}")
        self.pipeline = Pipeline(methods, retention, params, family=family, streaming=True) if methods else None
        if self.pipeline is None and (retention is not None or params):
            raise ValueError(
                "retention and method parameters need methods; e.g. vtc.stream(model, processor, 'mssavt')"
            )
        self.spec = self.pipeline.spec if self.pipeline else "none"
        self.config = StreamConfig(
            budget_tokens, family, model, self.adapter, float(fps), mrope=bool(self.adapter.mrope)
        )
        owner = self.pipeline.stream_memory_entry() if self.pipeline else None
        self.memory = owner.method.stream_memory(self.config) if owner is not None else WindowMemory(self.config)
        policy = (
            self.pipeline.position_policy(positions, self.adapter.mrope) if self.pipeline else (positions or "keep")
        )
        self.temporal_patch = (
            int(getattr(processor.video_processor, "temporal_patch_size", 1)) if self.adapter.mrope else 1
        )
        chunk = chunk_frames if chunk_frames is not None else getattr(self.memory, "chunk_frames", None)
        chunk = chunk or self.temporal_patch
        if isinstance(chunk, bool) or int(chunk) != chunk or chunk < 1 or chunk % self.temporal_patch:
            raise ValueError(
                f"chunk_frames must be a positive multiple of {self.temporal_patch} (frames per temporal patch of "
                f"{family}), got {chunk!r}"
            )
        self.chunk_frames = int(chunk)
        self.system = system
        processor_kwargs = dict(processor_kwargs or {})
        if family == "qwen3_vl" and "size" not in processor_kwargs:
            processor_kwargs["size"] = fixed_frame_size(processor.video_processor, self.chunk_frames)
        self.processor_kwargs = processor_kwargs
        self.grid_hw: tuple[int, int] | None = None
        stats = self.pipeline.vision_stats(family) if self.pipeline else set()
        self.vision = VisionCapture(self.adapter, stats) if stats else None  # installed last: nothing can fail after
        self.encoder = ChunkEncoder(self.adapter, processor, self.vision, processor_kwargs)
        self.llm = StreamLLM(self.adapter)
        self.ctx = Context(
            retention=self.pipeline.retention if self.pipeline else None,
            family=family,
            geometry=self.adapter.geometry,
            generator=torch.Generator(device="cpu").manual_seed(seed),
            model=model,
            embed_fn=self.adapter.embed,
        )
        self.counter = PositionCounter(family, self.adapter.mrope, compact=policy == "compact")
        self.prefix_text, _ = split_template(processor, "", system)
        self.prefix_rows = text_ids(processor, self.prefix_text)
        prefix = self._text_segment(self.prefix_rows, self.counter)
        self.memory.start(self.llm, prefix)
        self.tail: Tensor | None = None  # rows closing the video (LLaVA-OneVision's newline)
        self.pending: list[np.ndarray] = []
        self.frame_size: tuple[int, int] | None = None
        self.frames_fed = self.frames_encoded = self.chunks = 0
        self.tokens_fed = self.tokens_kept = 0
        self.seconds = {"encode": 0.0, "connect": 0.0, "memory": 0.0}
        self.asks: list[AskRecord] = []
        self.closed = False
        if self.vision is not None:
            self.vision.install()
        OPEN_STREAMS.setdefault(model, weakref.WeakSet()).add(self)  # vtc.patch refuses the model until close()

    # --- rows -------------------------------------------------------------------------------------------------
    def _text_segment(self, ids: Tensor, counter: PositionCounter, lead: Tensor | None = None) -> Segment:
        embeds = self.adapter.embed(ids.to(self.llm.device)).detach()
        if lead is not None:
            embeds = torch.cat([lead.to(embeds.dtype), embeds])
        n = embeds.shape[0]
        return Segment(
            embeds=embeds,
            positions=counter.text(n),
            visual=torch.zeros(n, dtype=torch.bool),
            frame=torch.full((n,), -1, dtype=torch.long),
        )

    # --- feeding ------------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this stream is closed; open a new one with vtc.stream(...)")

    def feed(self, frame: Any) -> None:
        """Add one frame ([H, W, 3] uint8 RGB). Frames are encoded a chunk at a time (`chunk_frames`)."""
        self._check_open()
        frame = _as_frame(frame)
        if self.frame_size is None:
            self.frame_size = frame.shape[:2]
        elif frame.shape[:2] != self.frame_size:
            raise ValueError(
                f"every frame of a stream must have the same size: the stream is {self.frame_size[0]}x"
                f"{self.frame_size[1]}, this frame is {frame.shape[0]}x{frame.shape[1]}"
            )
        self.pending.append(frame)
        self.frames_fed += 1
        if len(self.pending) >= self.chunk_frames:
            self._encode(self.chunk_frames)

    def feed_video(self, video: Any, fps: float | None = None, progress: Any = None) -> int:
        """Feed a video file (or [T, H, W, 3] array) sampled at `fps` (default: the stream's fps). Returns the
        number of frames fed. `progress(done, total)` is called after each frame when given."""
        self._check_open()
        fps = float(fps or self.config.fps)
        source, indices = open_stream_video(video, fps)
        batch = max(self.chunk_frames, 8)
        for start in range(0, len(indices), batch):
            for frame in source.read(indices[start : start + batch]):
                self.feed(frame)
                if progress is not None:
                    progress(self.frames_fed, len(indices))
        return len(indices)

    def _encode(self, count: int) -> None:
        frames, self.pending = self.pending[:count], self.pending[count:]
        first = self.frames_encoded
        indices = list(range(first, first + len(frames)))
        start = time.perf_counter()
        chunk = self.encoder.encode(np.stack(frames), indices, self.config.fps)
        self.seconds["encode"] += time.perf_counter() - start
        if self.grid_hw is None:
            self.grid_hw = chunk.grid[1:]
        elif chunk.grid[1:] != self.grid_hw:
            raise RuntimeError(
                f"the processor gave this chunk of {len(frames)} frames a {chunk.grid[1]}x{chunk.grid[2]} token grid, "
                f"but the stream's frames are {self.grid_hw[0]}x{self.grid_hw[1]}: a stream needs one resolution; "
                "pass processor_kwargs that fix the frame size (e.g. Qwen's size / max_pixels)"
            )
        segment = self._connect(chunk, first // self.temporal_patch)
        segment.pixels = np.stack(frames)
        start = time.perf_counter()
        self.memory.append(segment)
        self.seconds["memory"] += time.perf_counter() - start
        self.frames_encoded += len(frames)
        self.chunks += 1
        self.tokens_fed += segment.tokens_in
        self.tokens_kept += segment.num_visual
        if chunk.tail is not None and self.tail is None:
            self.tail = chunk.tail.detach()

    def _connect(self, chunk: EncodedChunk, first_group: int) -> Segment:
        """The chunk's rows after the connect plugins, with their stream positions."""
        span = chunk.span
        video_rows = span.seq_index.to(chunk.embeds.device)
        extras = {"deepstack": chunk.deepstack} if chunk.deepstack is not None else None
        start = time.perf_counter()
        if self.pipeline is not None:
            tokens_in, out = connect_video(
                self.pipeline,
                chunk.embeds[video_rows],
                chunk.grid,
                self.ctx.replace(vision=chunk.vision),
                None,
                extras=extras,
                seq_index=video_rows,
            )
        else:
            tokens_in = out = video_tokens(
                chunk.embeds[video_rows], chunk.grid, mrope=self.adapter.mrope, extras=extras, seq_index=video_rows
            )
        self.seconds["connect"] += time.perf_counter() - start
        # rows of the chunk in prompt order: its text rows (Qwen3-VL timestamps) and the kept video tokens
        order = torch.argsort(out.seq_index)
        kept_rows = out.seq_index[order]
        text_rows = torch.ones(chunk.embeds.shape[0], dtype=torch.bool, device=chunk.embeds.device)
        text_rows[video_rows] = False
        text_index = torch.nonzero(text_rows).flatten()
        rows = torch.cat([text_index, kept_rows])
        rank = torch.argsort(rows)
        rows = rows[rank]
        embeds = torch.cat([chunk.embeds[text_index], out.embeds[order]])[rank]
        visual = torch.cat(
            [torch.zeros(len(text_index), dtype=torch.bool), torch.ones(len(kept_rows), dtype=torch.bool)]
        )[rank.cpu()]
        frames_of_kept = (out.frame[order] + first_group).cpu()
        if chunk.model_positions is not None and self.adapter.family == "qwen3_vl":
            positions = self.counter.shift(chunk.model_positions.cpu())[:, rows.cpu()]
        else:
            if self.chunks == 0:
                self.counter.interval = qwen_interval(self.adapter.family, self.model.config, chunk.processor_outputs)
            positions = self.counter.video(grid_cells(out)[order].cpu(), chunk.grid, first_group)
        # text rows belong to the frame of the next video row (the timestamp before a frame's tokens)
        frame = torch.full((len(rows),), -1, dtype=torch.long)
        vis_pos = torch.nonzero(visual).flatten()
        if len(vis_pos):
            nxt = torch.searchsorted(vis_pos, torch.arange(len(rows))).clamp(max=len(vis_pos) - 1)
            frame = frames_of_kept[nxt]
        extras = {name: value[order] for name, value in out.extras.items()}
        deepstack = extras.pop("deepstack", None)
        return Segment(embeds, positions, visual, frame, deepstack, extras, len(tokens_in), chunk.grid)

    # --- asking -------------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Encode the pending frames now (whole temporal patches only; a lone frame of a Qwen patch waits)."""
        self._check_open()
        usable = len(self.pending) - len(self.pending) % self.temporal_patch
        if usable:
            self._encode(usable)

    def ask(self, question: str, max_new_tokens: int = 64) -> str:
        """Answer `question` about everything fed so far (greedy decoding). The memory is left as it was."""
        self._check_open()
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question must be a non-empty string, got {question!r}")
        if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        start = time.perf_counter()
        self.flush()
        flush_s = time.perf_counter() - start
        if self.chunks == 0:
            raise ValueError(
                f"nothing to answer from yet: {self.frames_fed} frame(s) fed, and a chunk needs "
                f"{self.temporal_patch} (feed more frames first)"
            )
        before, after = split_template(self.processor, question, self.system)
        if before != self.prefix_text:
            raise ValueError(
                "this chat template puts question-dependent text before the video; vtc.stream needs the video first"
            )
        counter = copy.deepcopy(self.counter)  # asking never moves the stream's own positions
        question_rows = self._text_segment(text_ids(self.processor, after), counter, lead=self.tail)
        question_rows.text = question
        past = self.memory.answer_past(question_rows)
        try:
            positions = question_rows.positions
            next_position = counter.next
            if past.next_position is not None:
                n = len(question_rows)
                rows = torch.arange(past.next_position, past.next_position + n)
                positions = rows[None].expand(positions.shape[0], -1).clone()
                next_position = past.next_position + n
            kv, cache = past_cache(past)  # a memory's per-layer `Retrieval` becomes a transformers cache here
            ids, logits, ttft = self.llm.greedy(
                kv,
                question_rows.embeds,
                positions,
                next_position,
                int(max_new_tokens),
                self._eos(),
                cache=cache,
            )
        finally:
            if past.release is not None:
                past.release()
        ttft += past.seconds
        answer = self.processor.tokenizer.decode(ids, skip_special_tokens=True).strip()
        record = AskRecord(
            question,
            answer,
            ids,
            logits,
            ttft,
            flush_s,
            self.frames_encoded,
            self.memory.stored_tokens,
            past.retrieved_tokens,
            self.memory.nbytes,
            len(question_rows),
        )
        self.asks.append(record)
        return answer

    def _eos(self) -> set[int]:
        eos: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.processor.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if value is not None:
                eos.update(value if isinstance(value, (list, tuple)) else [value])
        return eos

    @property
    def last_ask(self) -> AskRecord | None:
        return self.asks[-1] if self.asks else None

    # --- report / lifecycle -------------------------------------------------------------------------------------
    def stats(self) -> StreamStats:
        return StreamStats(
            methods=self.spec,
            memory=self.memory.name,
            budget_tokens=getattr(self.memory, "budget_tokens", self.config.budget_tokens),
            frames_fed=self.frames_fed,
            frames_encoded=self.frames_encoded,
            frames_pending=len(self.pending),
            chunks=self.chunks,
            visual_tokens_fed=self.tokens_fed,
            visual_tokens_kept=self.tokens_kept,
            stored_tokens=self.memory.stored_tokens,
            memory_bytes=self.memory.nbytes,
            encode_s=self.seconds["encode"],
            connect_s=self.seconds["connect"],
            memory_s=self.seconds["memory"],
            asks=list(self.asks),
        )

    def close(self) -> None:
        """Remove the vision-tower hooks (the model is left exactly as it was) and refuse further feeds and asks;
        `stats()` still reports."""
        if self.closed:
            return
        if self.vision is not None:
            self.vision.remove()
            self.vision = None
        self.pending = []
        self.closed = True
        sessions = OPEN_STREAMS.get(self.model)
        if sessions is not None:
            sessions.discard(self)
            if not sessions:
                del OPEN_STREAMS[self.model]

    def __enter__(self) -> "StreamSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.frames_fed} frames"
        return f"StreamSession({self.spec!r}, budget_tokens={self.config.budget_tokens}, {state})"


def stream(
    model: torch.nn.Module, processor: Any, methods: str | None = None, retention: float | None = None, **kwargs: Any
) -> StreamSession:
    """Open a stream on `model`: `with vtc.stream(model, processor, "streamingtom", budget_tokens=12544) as s:`.

    methods: a spec of streaming methods (`vtc methods` marks them), or None for no compression.
    retention: fraction of each frame's visual tokens the connect stage keeps (methods' own knobs override).
    budget_tokens: the most visual tokens the memory holds (None: unbounded, or the method's own default).
    fps: frames per second of the stream (timestamps); chunk_frames: frames encoded together; system: the
    system prompt; positions: "keep" / "compact" (1-D RoPE families); params: method parameters.
    """
    return StreamSession(model, processor, methods, retention, **kwargs)
