"""`vtc bench --stream`: memory and time to first token against stream length, for naive full-KV streaming and
each streaming method, in one run on one model (ratios between methods are measured in the same run).

Each method gets one stream of `frames` frames at 0.5 fps; at every checkpoint (16, 32, 64, ... frames) the
same question is asked twice (the faster TTFT is kept: the machine is noisy), and the memory the session holds
is read. Writes bench-stream.json, bench-stream.md and bench-stream.png to `out`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import vtc
from vtc.media.video import synthetic_video
from vtc.tools.loading import build_random_model
from vtc.tools.progress import progress_bar

QUESTION = "What happened so far, and which object moved?"

# what each method runs with in the benchmark (per-frame keep 25 %, a 4096-token memory, and retrieval of 256
# frames' worth of tokens: StreamingTOM's 12544 tokens are 251 frames of 50)
DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "none": {},
    "streamingtom": {"retention": 0.25, "retrieval_tokens": "256 frames"},
    "mssavt": {"retention": 0.25, "budget_tokens": 4096},
    "lifestream": {"budget_tokens": 4096},
    "memstream": {"budget_tokens": 4096, "experts": "internal", "retrieval_tokens": "256 frames"},
}


def checkpoints(frames: int, first: int = 16) -> list[int]:
    points, n = [], first
    while n < frames:
        points.append(n)
        n *= 2
    return points + [frames]


def _session_kwargs(spec: str, config: dict[str, Any], tokens_per_patch: int, params: dict[str, Any]) -> dict:
    kwargs = dict(config)
    if kwargs.get("retrieval_tokens") == "256 frames":
        kept = round(config.get("retention", 1.0) * tokens_per_patch) if spec == "streamingtom" else tokens_per_patch
        kwargs["retrieval_tokens"] = 256 * max(1, kept)
    kwargs.update(params)
    return kwargs


def bench_stream(
    methods: list[str] | None = None,
    frames: int = 2048,
    family: str = "qwen2_5_vl",
    size: str = "demo",
    frame_size: int = 168,
    params: dict[str, Any] | None = None,
    out: str = "vtc-bench-stream",
    console: Console | None = None,
) -> dict[str, Any]:
    console = console or Console()
    methods = methods or list(DEFAULT_CONFIGS)
    model, processor = build_random_model(family, size, "float32")
    # Qwen processors upscale small frames to their minimum pixels; pin the frame size so tokens per frame are known
    pinned = (
        {"size": {"shortest_edge": frame_size**2, "longest_edge": frame_size**2}} if family.startswith("qwen") else {}
    )
    clip = synthetic_video(min(frames, 512), frame_size, frame_size, seed=0)
    points = checkpoints(frames)
    fps = 0.5
    results: dict[str, Any] = {
        "family": family,
        "size": size,
        "frame_size": frame_size,
        "fps": fps,
        "frames": frames,
        "checkpoints": points,
        "threads": torch.get_num_threads(),
        "methods": {},
    }
    # tokens of one temporal patch, for the configurations sized in frames
    with vtc.stream(model, processor, fps=fps, processor_kwargs=pinned) as probe:
        for frame in clip[:2]:
            probe.feed(frame)
        probe.flush()
        tokens_per_patch = probe.stats().visual_tokens_fed
    results["tokens_per_patch"] = tokens_per_patch
    for spec in methods:
        config = DEFAULT_CONFIGS.get(spec, {})
        kwargs = _session_kwargs(spec, config, tokens_per_patch, params or {})
        rows = []
        start = time.perf_counter()
        methods_spec = None if spec == "none" else spec
        with vtc.stream(model, processor, methods_spec, fps=fps, processor_kwargs=pinned, **kwargs) as session:
            with progress_bar(console, transient=True) as progress:
                task = progress.add_task(f"{spec:>14}", total=frames)
                for k in range(frames):
                    # the clip loops, shifted a little on every pass so no two passes are identical
                    frame = clip[k % len(clip)]
                    if k >= len(clip):
                        frame = frame.copy()
                        frame[:, :, (k // len(clip)) % 3] //= 2
                    session.feed(frame)
                    progress.advance(task)
                    if k + 1 in points:
                        ttfts = []
                        for _ in range(2):
                            session.ask(QUESTION, max_new_tokens=1)
                            ttfts.append(session.last_ask.ttft_s)
                        record = session.last_ask
                        rows.append(
                            {
                                "frames": k + 1,
                                "ttft_s": min(ttfts),
                                "memory_bytes": record.memory_bytes,
                                "stored_tokens": record.stored_tokens,
                                "retrieved_tokens": record.retrieved_tokens,
                            }
                        )
            stats = session.stats()
        results["methods"][spec] = {
            "config": dict(kwargs),
            "rows": rows,
            "visual_tokens_fed": stats.visual_tokens_fed,
            "visual_tokens_kept": stats.visual_tokens_kept,
            "wall_s": time.perf_counter() - start,
        }
        console.print(f"{spec}: {len(rows)} checkpoints in {time.perf_counter() - start:.0f} s")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench-stream.json"), "w") as fh:
        json.dump(results, fh, indent=2)
    table_md = markdown_table(results)
    with open(os.path.join(out, "bench-stream.md"), "w") as fh:
        fh.write(table_md)
    plot(results, os.path.join(out, "bench-stream.png"))
    console.print(rich_table(results))
    return results


def _ratios(results: dict[str, Any]) -> list[tuple[str, dict, dict]]:
    """(method, its row, naive's row) at the last checkpoint."""
    naive = results["methods"].get("none")
    out = []
    for spec, data in results["methods"].items():
        last = data["rows"][-1]
        base = naive["rows"][-1] if naive else None
        out.append((spec, last, base))
    return out


def markdown_table(results: dict[str, Any]) -> str:
    points = results["checkpoints"]
    lines = [
        f"Stream of {results['frames']} frames at {results['fps']} fps, random-weight {results['family']} "
        f"({results['size']}), {results['frame_size']} px frames = {results['tokens_per_patch']} visual tokens per "
        f"temporal patch (2 frames), fp32, CPU ({results['threads']} threads).",
        "",
        "Memory held (MB) after N frames:",
        "",
        "| method | " + " | ".join(str(p) for p in points) + " |",
        "|---|" + "---|" * len(points),
    ]
    for spec, data in results["methods"].items():
        cells = [f"{r['memory_bytes'] / 2**20:.1f}" for r in data["rows"]]
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    lines += ["", "Time to first token (ms) after N frames (best of 2):", ""]
    lines += ["| method | " + " | ".join(str(p) for p in points) + " |", "|---|" + "---|" * len(points)]
    for spec, data in results["methods"].items():
        cells = [f"{1000 * r['ttft_s']:.0f}" for r in data["rows"]]
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    lines += ["", f"At {points[-1]} frames, against naive full-KV streaming (same run):", ""]
    lines += [
        "| method | stored tokens | retrieved | memory | KV compression | TTFT | TTFT speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec, last, base in _ratios(results):
        compression = f"{base['memory_bytes'] / last['memory_bytes']:.1f}x" if base else "-"
        speedup = f"{base['ttft_s'] / last['ttft_s']:.1f}x" if base else "-"
        retrieved = "-" if last["retrieved_tokens"] is None else str(last["retrieved_tokens"])
        lines.append(
            f"| {spec} | {last['stored_tokens']} | {retrieved} | {last['memory_bytes'] / 2**20:.1f} MB | "
            f"{compression} | {1000 * last['ttft_s']:.0f} ms | {speedup} |"
        )
    return "\n".join(lines) + "\n"


def rich_table(results: dict[str, Any]) -> Table:
    table = Table(title=f"streaming at {results['frames']} frames ({results['fps']} fps)")
    for col in ("method", "stored tokens", "memory (MB)", "vs naive", "TTFT (ms)", "vs naive"):
        table.add_column(col)
    for spec, last, base in _ratios(results):
        table.add_row(
            spec,
            str(last["stored_tokens"]),
            f"{last['memory_bytes'] / 2**20:.1f}",
            f"{base['memory_bytes'] / last['memory_bytes']:.1f}x smaller" if base else "-",
            f"{1000 * last['ttft_s']:.0f}",
            f"{base['ttft_s'] / last['ttft_s']:.1f}x faster" if base else "-",
        )
    return table


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for spec, data in results["methods"].items():
        x = [r["frames"] for r in data["rows"]]
        mem.plot(x, [r["memory_bytes"] / 2**20 for r in data["rows"]], marker="o", label=spec)
        ttft.plot(x, [1000 * r["ttft_s"] for r in data["rows"]], marker="o", label=spec)
    for ax, label in ((mem, "memory held (MB)"), (ttft, "time to first token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"frames streamed ({results['fps']} fps)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    mem.legend()
    fig.suptitle(
        f"vtc.stream on a random-weight {results['family']} ({results['size']}), {results['tokens_per_patch']} "
        "tokens per temporal patch, CPU fp32"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
