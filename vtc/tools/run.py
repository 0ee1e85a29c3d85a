"""`vtc run`: one video + one question, answered with and without compression, with tokens per stage and
prefill times side by side. With no model it runs the offline demo (random weights, generated clip)."""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import vtc
from vtc.hf.loading import load_model
from vtc.hf.timing import LLMTimer, synchronize
from vtc.tools.loading import DEMO_FAMILY, build_random_model, demo_clip

DEMO_QUESTION = "What happens in this video, and which object moves?"


def _generate(model, inputs, max_new_tokens: int) -> tuple[torch.Tensor, float, float]:
    """Greedy answer, time of the first LLM forward (prefill) and wall time to the first token."""
    with LLMTimer(model) as timer, torch.no_grad():
        synchronize()
        start = time.perf_counter()
        first = model.generate(**inputs, max_new_tokens=1, do_sample=False)
        synchronize()
        ttft = time.perf_counter() - start
        prefill = timer.first
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False) if max_new_tokens > 1 else first
    return out[:, inputs["input_ids"].shape[1] :], prefill, ttft


def run(
    model: str | None = None,
    video: str | None = None,
    question: str | None = None,
    methods: str = "framefusion",
    retention: float | None = 0.3,
    frames: int = 16,
    max_new_tokens: int = 24,
    params: dict[str, Any] | None = None,
    dtype: str = "auto",
    device: str = "auto",
    positions: str | None = None,
    family: str = DEMO_FAMILY,
    size: str = "demo",
    console: Console | None = None,
) -> dict[str, Any]:
    console = console or Console()
    params = dict(params or {})
    demo = model is None
    if demo:
        console.print(
            f"[bold]vtc demo[/bold]: a {family} model with [bold red]random weights[/bold red] (built offline from a "
            "config) on a generated clip. Its answers are noise; the point is the token counts and timings."
        )
        with console.status("building the demo model"):
            net, processor = build_random_model(family, size, "float32" if dtype == "auto" else dtype)
        video = video or demo_clip()
        question = question or DEMO_QUESTION
        name = f"random-weight {family} ({size})"
    else:
        if video is None or question is None:
            raise ValueError("--video and --question are required with --model")
        with console.status(f"loading {model}"):
            net, processor = load_model(model, dtype=dtype, device=device)
        name = model

    frames = int(params.pop("num_frames", frames))
    device_of = next(net.parameters()).device
    with vtc.patch(net, methods, retention=retention, positions=positions, processor=processor, **params) as handle:
        # the sample stage picks the frames for both runs (and may score them, as QuoTA does)
        with console.status("sampling frames"):
            start = time.perf_counter()
            inputs = handle.prepare(processor, video, question, num_frames=frames).to(device_of)
            sample_s = time.perf_counter() - start
        with handle.suspended():
            with console.status("warming up"), torch.no_grad():
                net(**inputs)
            with console.status("answering without compression"):
                base_ids, base_prefill, base_ttft = _generate(net, inputs, max_new_tokens)
        with console.status(f"answering with {handle.pipeline.spec}"):
            ids, prefill, ttft = _generate(net, inputs, max_new_tokens)
        stats = handle.stats()
    tokenizer = getattr(processor, "tokenizer", processor)
    # random weights mostly emit special tokens; show them rather than an empty string
    answers = {
        "baseline": tokenizer.decode(base_ids[0], skip_special_tokens=not demo).strip(),
        "compressed": tokenizer.decode(ids[0], skip_special_tokens=not demo).strip(),
    }

    table = Table(title=f"{name} - {methods} at retention {retention}")
    for col in ("stage", "plugin", "visual tokens in", "visual tokens out", "ms"):
        table.add_column(col, justify="right" if col not in ("stage", "plugin") else "left")
    for rec in stats.stages:
        rows_in = rec.tokens_in or stats.llm_tokens_in
        rows_out = rec.tokens_out or stats.visual_tokens_out
        table.add_row(rec.stage, rec.plugin, str(rows_in), str(rows_out), f"{rec.seconds * 1e3:.1f}")
    console.print(table)
    console.print(
        f"video: {stats.grids[0][0]} temporal x {stats.grids[0][1]}x{stats.grids[0][2]} tokens -> "
        f"{stats.visual_tokens_in} visual tokens, {stats.visual_tokens_out} at the last LLM layer "
        f"({stats.retention:.1%})"
    )
    if stats.layer_visual_tokens:
        console.print("visual tokens per LLM layer: " + " ".join(map(str, stats.layer_visual_tokens)))
    timing = Table(title="prefill (time inside the LLM) and time to first token")
    for col in ("", "prefill s", "TTFT s"):
        timing.add_column(col, justify="right")
    timing.add_row("no compression", f"{base_prefill:.3f}", f"{base_ttft:.3f}")
    timing.add_row(methods, f"{prefill:.3f}", f"{ttft:.3f}")
    timing.add_row("speedup", f"{base_prefill / prefill:.2f}x", f"{base_ttft / ttft:.2f}x")
    console.print(timing)
    if handle.pipeline.has_stage("sample"):
        console.print(f"sample stage (frame selection before the processor): {sample_s:.2f} s")
    for chosen in stats.frames:  # what the model was shown (also in the JSON: stats.frames)
        shown = ", ".join(
            f"{i} ({t:.1f} s{'' if score is None else f', {score:.3g}'})"
            for i, t, score in zip(chosen.indices, chosen.timestamps, chosen.scores)
        )
        console.print(f"frames shown ({chosen.method}; frame (time, score)): {shown}")
    console.print(f"[bold]answer (no compression):[/bold] {answers['baseline']!r}")
    console.print(f"[bold]answer ({methods}):[/bold] {answers['compressed']!r}")
    if demo:
        console.print("[dim]random weights: answers are meaningless; run with --model for a real checkpoint.[/dim]")
    return {
        "model": name,
        "demo": demo,
        "methods": methods,
        "retention": retention,
        "stats": stats.to_dict(),
        "prefill_s": {"baseline": base_prefill, "compressed": prefill},
        "ttft_s": {"baseline": base_ttft, "compressed": ttft},
        "prefill_speedup": base_prefill / prefill,
        "sample_s": sample_s,
        "answers": answers,
    }
