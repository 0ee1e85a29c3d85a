"""`vtc bench`: methods x retentions on one model and video, timed in one run.

For every configuration: prefill time (inside the LLM), time to first token (whole `generate`, vision
encoder included), peak memory, visual tokens in/out and per LLM layer, the method's own time (connect
stage + work inside prefill hooks), and the *limit*: the same decoder layers prefilling the same per-layer
token counts with no compression logic at all. Reported as ratios measured in the same run:

  speedup    = prefill without compression / (prefill + connect stage) of the method
  efficiency = limit / (prefill + connect stage)      (1.0 = the method costs nothing beyond its tokens)
  overhead   = method's own time (connect stage + its hooks inside the LLM) / prefill without compression
  sample s   = time of the sample stage before the processor (QuoTA's frame scoring), not in TTFT

The limit uses the method's per-layer token counts (in-LLM methods keep more tokens in early layers); the
"final-count limit" runs every layer at the last layer's count, i.e. what pruning the same number of tokens
before the LLM would cost.

Configurations are measured round-robin (repeat 1 of every configuration, then repeat 2, ...) and the best
of the repeats is kept, so slow drifts of a noisy machine hit every configuration alike.
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.table import Table

import vtc
from vtc.hf.loading import load_model
from vtc.hf.timing import LLMTimer, peak_memory_mb, plain_prefill_seconds, synchronize
from vtc.tools.loading import build_random_model, demo_clip
from vtc.tools.progress import progress_bar

BENCH_QUESTION = "What happens in this video?"


def params_for(spec: str, params: dict[str, Any]) -> dict[str, Any]:
    """The subset of `params` that belongs to the methods of `spec` (`name=value` when one of them declares
    `name`, `method.name=value` for methods in the spec), so one parameter list can serve every row."""
    import dataclasses

    from vtc.core.pipeline import parse_spec

    names = parse_spec(spec)
    fields = {n: {f.name for f in dataclasses.fields(vtc.registry()[n].params)} for n in names}
    chosen = {}
    for key, value in params.items():
        method, _, field = key.rpartition(".")
        if (method and method in fields) or (not method and any(field in f for f in fields.values())):
            chosen[key] = value
    return chosen


def _measure(
    model,
    processor,
    inputs,
    video,
    frames: int,
    spec: str | None,
    retention: float | None,
    params: dict[str, Any],
    memory: bool,
) -> dict[str, Any]:
    """One timed `generate(max_new_tokens=1)` (prefill = the LLM's first forward inside it); with `memory`,
    also one untimed pass measuring the peak memory of the same call. Methods with a sample stage get their
    inputs from `handle.prepare` (timed separately as the sample stage)."""
    handle = vtc.patch(model, spec, retention=retention, **params_for(spec, params)) if spec else None
    sample_s = 0.0
    try:
        if handle is not None and handle.pipeline.has_stage("sample"):
            start = time.perf_counter()
            inputs = handle.prepare(processor, video, BENCH_QUESTION, num_frames=frames)
            inputs = inputs.to(next(model.parameters()).device)
            sample_s = time.perf_counter() - start
        with LLMTimer(model) as timer, torch.no_grad():
            synchronize()
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
            synchronize()
            ttft = time.perf_counter() - start
        stats = handle.stats() if handle else None
        peak = None
        if memory:
            with torch.no_grad():
                peak = peak_memory_mb(lambda: model.generate(**inputs, max_new_tokens=1, do_sample=False))
    finally:
        if handle:
            handle.unpatch()
    row = {"prefill_s": timer.first, "ttft_s": ttft, "sample_s": sample_s}
    if peak is not None:
        row["peak_mb"] = peak
    if stats is not None:
        secs = stats.stage_seconds()
        row.update(
            connect_s=secs.get("connect", 0.0),
            overhead_s=secs.get("connect", 0.0) + secs.get("prefill", 0.0),
            tokens_in=stats.visual_tokens_in,
            tokens_llm=stats.llm_tokens_in,
            tokens_out=stats.visual_tokens_out,
            layer_tokens=list(stats.layer_visual_tokens),
        )
    return row


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    best = dict(rows[0])
    for key in ("prefill_s", "ttft_s", "sample_s", "connect_s", "overhead_s", "limit_s", "limit_final_s"):
        values = [r[key] for r in rows if key in r]
        if values:
            best[key] = min(values)
    best["peak_mb"] = max(r["peak_mb"] for r in rows if "peak_mb" in r)
    best["repeats"] = len(rows)
    return best


def bench(
    model: str | None = None,
    video: str | None = None,
    family: str = "qwen2_vl",
    size: str = "bench",
    methods: tuple[str, ...] = ("random", "fastv", "framefusion"),
    retentions: tuple[float, ...] = (0.5, 0.3, 0.15),
    frames: int = 48,
    repeats: int = 2,
    out_dir: str | None = None,
    params: dict[str, Any] | None = None,
    dtype: str = "float32",
    console: Console | None = None,
) -> dict[str, Any]:
    console = console or Console()
    params = dict(params or {})
    if model is None:
        with console.status(f"building a random-weight {family} ({size}) model"):
            net, processor = build_random_model(family, size, dtype)
        name = f"random-weight {family} ({size})"
    else:
        with console.status(f"loading {model}"):
            net, processor = load_model(model, dtype=dtype)
        name = model
    video = video or demo_clip()
    inputs = vtc.prepare_inputs(processor, video, BENCH_QUESTION, "uniform", num_frames=frames)
    inputs = inputs.to(next(net.parameters()).device)
    num_layers = len(vtc.api.resolve_adapter(net).decoder_layers)

    # token counts of the uncompressed prompt (a patched run at retention 1 changes nothing)
    with vtc.patch(net, "random", retention=1.0) as probe, torch.no_grad():
        net(**inputs)
        ref_stats = probe.stats()
    visual = ref_stats.visual_tokens_in
    text_tokens = ref_stats.sequence_in - visual

    configs: list[tuple[str, str | None, float | None]] = [("none", None, None)]
    configs += [(m, m, r) for m in methods for r in retentions]
    with console.status("warming up"), torch.no_grad():
        net(**inputs)
    measured: dict[tuple[str, float | None], list[dict[str, Any]]] = {(c[0], c[2]): [] for c in configs}
    with progress_bar(console) as progress:
        task = progress.add_task("benchmarking", total=repeats * len(configs))
        for rep in range(repeats):
            for label, spec, retention in configs:
                progress.update(task, description=f"{label} @ {retention if retention else 1.0}")
                row = _measure(net, processor, inputs, video, frames, spec, retention, params, memory=rep == 0)
                row.setdefault("tokens_in", visual)
                row.setdefault("tokens_llm", visual)
                row.setdefault("tokens_out", visual)
                row.setdefault("layer_tokens", [visual] * num_layers)
                row.setdefault("connect_s", 0.0)
                row.setdefault("overhead_s", 0.0)
                # the limit, timed right after the method so both see the same machine state
                schedule = row["layer_tokens"]
                row["limit_s"] = plain_prefill_seconds(net, text_tokens, schedule)
                final = [row["tokens_out"]] * num_layers
                row["limit_final_s"] = (
                    row["limit_s"] if schedule == final else plain_prefill_seconds(net, text_tokens, final)
                )
                measured[(label, retention)].append(row)
                progress.advance(task)

    results = []
    base = _best(measured[("none", None)])
    for (label, retention), rows in measured.items():
        best = _best(rows)
        method_time = best["prefill_s"] + best["connect_s"]
        best.update(
            method=label,
            retention=retention if retention is not None else 1.0,
            speedup=base["prefill_s"] / method_time,
            ttft_speedup=base["ttft_s"] / best["ttft_s"],
            efficiency=best["limit_s"] / method_time,
            overhead_share=best["overhead_s"] / base["prefill_s"],
            mean_layer_tokens=sum(best["layer_tokens"]) / len(best["layer_tokens"]),
        )
        results.append(best)

    report = {
        "model": name,
        "family": vtc.api.resolve_adapter(net).family,
        "video": video,
        "frames": frames,
        "visual_tokens": visual,
        "text_tokens": text_tokens,
        "num_layers": num_layers,
        "repeats": repeats,
        "environment": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "threads": torch.get_num_threads(),
            "device": str(next(net.parameters()).device),
            "cpu": platform.processor() or platform.machine(),
        },
        "results": results,
    }
    print_table(report, console)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(out_dir, "bench.md"), "w") as f:
            f.write(f"{_title(report)}\n\n{markdown_table(report)}")
        plot(report, os.path.join(out_dir, "bench.png"))
        console.print(f"wrote {os.path.join(out_dir, 'bench.json')}, bench.md and bench.png")
    return report


# (header, formatter) of every reported column; the console splits them into two tables that fit 80 columns
SPEED_COLUMNS = [
    ("method", lambda r: r["method"]),
    ("ret", lambda r: f"{r['retention']:.2f}"),
    ("tokens", lambda r: str(r["tokens_out"])),
    ("/layer", lambda r: f"{r['mean_layer_tokens']:.0f}"),
    ("prefill s", lambda r: f"{r['prefill_s']:.2f}"),
    ("TTFT s", lambda r: f"{r['ttft_s']:.2f}"),
    ("speedup", lambda r: f"{r['speedup']:.2f}x"),
    ("TTFT x", lambda r: f"{r['ttft_speedup']:.2f}x"),
]
COST_COLUMNS = [
    ("peak MB", lambda r: f"{r['peak_mb']:.0f}"),
    ("limit s", lambda r: f"{r['limit_s']:.2f}"),
    ("final limit s", lambda r: f"{r['limit_final_s']:.2f}"),
    ("effic.", lambda r: f"{r['efficiency']:.2f}"),
    ("overhead", lambda r: f"{r['overhead_share']:.1%}"),
    ("sample s", lambda r: f"{r.get('sample_s', 0.0):.2f}"),
]


def _title(report: dict[str, Any]) -> str:
    return (
        f"{report['model']}: {report['visual_tokens']} visual + {report['text_tokens']} text tokens, "
        f"{report['num_layers']} layers, best of {report['repeats']}"
    )


def print_table(report: dict[str, Any], console: Console) -> None:
    """Two tables (speed; cost against the limit) so each stays readable in an 80-column terminal."""
    for title, columns in (
        (_title(report), SPEED_COLUMNS),
        (
            "cost against the limit (same per-layer token counts, no compression logic)",
            SPEED_COLUMNS[:2] + COST_COLUMNS,
        ),
    ):
        table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for header, _ in columns:
            table.add_column(header, justify="left" if header == "method" else "right", no_wrap=header == "method")
        for r in report["results"]:
            table.add_row(*(fmt(r) for _, fmt in columns))
        console.print(table)


def markdown_table(report: dict[str, Any]) -> str:
    """All columns as one Markdown table (what docs/benchmarks.md shows)."""
    columns = SPEED_COLUMNS + COST_COLUMNS
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r) for _, fmt in columns) + " |" for r in report["results"]]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        if r["method"] != "none":
            by_method.setdefault(r["method"], []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.get_cmap("tab20").colors
    markers = "os^vDP*Xh<>"
    for i, (method, rows) in enumerate(by_method.items()):
        rows = sorted(rows, key=lambda r: r["retention"])
        x = [r["retention"] for r in rows]
        style = dict(marker=markers[i % len(markers)], color=colors[(2 * i) % 20 + (2 * i) // 20], label=method)
        axes[0].plot(x, [r["speedup"] for r in rows], **style)
        axes[1].plot(x, [r["efficiency"] for r in rows], **style)
    axes[0].set(xlabel="retention", ylabel="prefill speedup (x)", title="speedup vs no compression")
    axes[1].set(xlabel="retention", ylabel="limit time / method time", title="efficiency (1 = no overhead)")
    axes[1].axhline(0.95, color="grey", linestyle="--", linewidth=0.8)
    efficiencies = [r["efficiency"] for r in report["results"]]
    axes[1].set_ylim(min(0.8, min(efficiencies) - 0.05), max(1.1, max(efficiencies) + 0.05))
    for ax in axes:
        ax.grid(alpha=0.3)
    # one legend outside the plots, so no curve hides behind it
    axes[1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize="small")
    fig.suptitle(report["model"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
