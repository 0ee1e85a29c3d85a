"""`vtc stream`: play a video into a `vtc.stream` session at a frame rate, ask questions at given stream times,
and show each answer with the memory held and the time to first token. With no model it runs the offline demo
(a random-weight model and a generated clip)."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

import vtc
from vtc.hf.loading import load_model
from vtc.streaming.session import open_stream_video
from vtc.tools.loading import build_random_model, demo_clip
from vtc.tools.progress import progress_bar

DEMO_QUESTION = "What happened so far, and which object moved?"


def parse_times(text: str | None) -> list[float]:
    """`"30,120,300"` -> [30.0, 120.0, 300.0] seconds of stream time, increasing."""
    if not text:
        return []
    try:
        times = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(
            f"--ask-at takes comma-separated seconds of stream time, e.g. 30,120,300; got {text!r}"
        ) from None
    if any(t < 0 or math.isnan(t) for t in times) or times != sorted(times):
        raise ValueError(f"--ask-at times must be increasing seconds >= 0, got {text!r}")
    return times


def stream_video(
    model: str | None = None,
    video: str | None = None,
    fps: float = 0.5,
    methods: str | None = "streamingtom",
    retention: float | None = None,
    budget_tokens: int | None = None,
    questions: list[str] | None = None,
    ask_at: list[float] | None = None,
    max_new_tokens: int = 24,
    params: dict[str, Any] | None = None,
    chunk_frames: int | None = None,
    family: str = "qwen2_5_vl",
    size: str = "demo",
    dtype: str = "auto",
    device: str = "auto",
    console: Console | None = None,
) -> dict[str, Any]:
    """Feed `video` at `fps` into a stream and ask at each time of `ask_at` (seconds; default: a third, two
    thirds and the end of the video). Returns the asks (answer, memory, TTFT) and the stream's stats."""
    console = console or Console()
    if model is None:
        demo_model, processor = build_random_model(family, size, dtype if dtype != "auto" else "float32")
        label = f"random-weight {family} ({size}; offline demo, answers are noise)"
    else:
        demo_model, processor = load_model(model, dtype=dtype, device=device)
        label = model
    if video is None:
        video = demo_clip(num_frames=360, size=224, fps=1.0)  # six minutes at 1 fps
    source, indices = open_stream_video(video, fps)
    duration = len(indices) / fps
    times = ask_at if ask_at else [round(duration / 3, 1), round(2 * duration / 3, 1), round(duration, 1)]
    questions = questions or [DEMO_QUESTION]
    if len(questions) not in (1, len(times)):
        raise ValueError(
            f"give one --ask (asked every time) or one per --ask-at time ({len(times)}); got {len(questions)}"
        )
    asks = [(t, questions[min(k, len(questions) - 1)]) for k, t in enumerate(times)]
    console.print(
        f"[bold]vtc stream[/bold] {label}: {methods or 'no compression'}, {len(indices)} frames at {fps:g} fps "
        f"({duration:g} s), budget {budget_tokens if budget_tokens is not None else 'the method default'}"
    )
    rows = []
    kwargs = dict(budget_tokens=budget_tokens, fps=fps, chunk_frames=chunk_frames, **(params or {}))
    with vtc.stream(demo_model, processor, methods, retention, **kwargs) as session:
        with progress_bar(console, transient=True) as progress:
            task = progress.add_task("streaming", total=len(indices))
            pending = list(asks)
            for start in range(0, len(indices), 16):
                for frame in source.read(indices[start : start + 16]):
                    session.feed(frame)
                    progress.advance(task)
                    now = session.frames_fed / fps
                    while pending and pending[0][0] <= now:
                        at, question = pending.pop(0)
                        answer = session.ask(question, max_new_tokens=max_new_tokens)
                        rows.append(_row(at, session, answer))
            for at, question in pending:  # times past the end: ask at the end
                rows.append(_row(at, session, session.ask(question, max_new_tokens=max_new_tokens)))
        stats = session.stats()
    table = Table(title=f"asks ({methods or 'no compression'})")
    for col in ("at (s)", "frames", "question", "answer", "stored tokens", "retrieved", "memory (MB)", "TTFT (ms)"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            f"{r['at_s']:g}",
            str(r["frames_seen"]),
            r["question"],
            r["answer"] or "(empty)",
            str(r["stored_tokens"]),
            "-" if r["retrieved_tokens"] is None else str(r["retrieved_tokens"]),
            f"{r['memory_bytes'] / 2**20:.2f}",
            f"{1000 * r['ttft_s']:.0f}",
        )
    console.print(table)
    return {"model": label, "methods": methods, "fps": fps, "asks": rows, "stats": stats.to_dict()}


def _row(at: float, session, answer: str) -> dict[str, Any]:
    record = session.last_ask.to_dict()
    record["at_s"] = at
    return record
