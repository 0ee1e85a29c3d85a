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

Configurations are measured round-robin (repeat 1 of every configuration, then repeat 2, ...), so slow drifts
of a noisy machine hit every configuration alike. Every repeat is kept. Each ratio is formed repeat by repeat
from measurements of the same repeat (the method against the "none" row of that repeat; against the limit
timed right after the method), then reported as the median with the min and max over repeats: the range is
the noise of one measurement on this machine, the median what the ratio is. Times are medians too.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Any, Sequence

import torch
from rich import box
from rich.console import Console
from rich.table import Table

import vtc
from vtc.hf.loading import load_model
from vtc.hf.timing import LLMTimer, VisionTimer, peak_memory_mb, plain_prefill_seconds, synchronize
from vtc.media.encoders import FEATURE_CACHE
from vtc.media.inputs import image_inputs
from vtc.testing.tiny import RELEASED_SIZES, SIZES
from vtc.tools.loading import build_random_model, demo_clip
from vtc.tools.progress import progress_bar

BENCH_QUESTION = "What happens in this video?"
BENCH_IMAGE_QUESTION = "What is in this picture?"

# measured on the 2-core CI-class machine (docs/benchmarks.md, "How noisy is it"): the median efficiency of
# this many repeats stays within +-5 % between runs; fewer repeats did not
DEFAULT_REPEATS = 5

# per-repeat times (seconds) and the ratios formed from them; each is reported as median / min / max
TIMING_KEYS = (
    "prefill_s",
    "ttft_s",
    "generate_s",
    "vision_s",
    "sample_s",
    "decode_s",
    "connect_s",
    "overhead_s",
    "limit_s",
    "limit_final_s",
)
RATIO_KEYS = ("speedup", "ttft_speedup", "efficiency", "overhead_share", "vision_share", "llm_ceiling")


def params_for(spec: str, params: dict[str, Any]) -> dict[str, Any]:
    """The subset of `params` that belongs to the methods of `spec` (`name=value` when one of them declares
    `name`, `method.name=value` for methods in the spec), so one parameter list can serve every row."""
    import dataclasses

    from vtc.core.pipeline import parse_spec

    names = parse_spec(spec)
    fields = {n: {f.name for f in dataclasses.fields(vtc.registry()[n])} for n in names}
    chosen = {}
    for key, value in params.items():
        method, _, field = key.rpartition(".")
        if (method and method in fields) or (not method and any(field in f for f in fields.values())):
            chosen[key] = value
    return chosen


def frame_budget(spec: str | None, retention: float | None, frames: int) -> tuple[int, float | None]:
    """(frames the model is shown, retention of the token reducers) for `spec` at an overall `retention` of the
    visual tokens of `frames` frames. A frame sampler counts as one more reducer of the pipeline's geometric split:
    `bolt` alone at 0.25 shows a quarter of the frames, `bolt+vidcom2` at 0.25 half of them with vidcom2 keeping
    half their tokens. Without a sampler: every frame, at `retention`."""
    from vtc.core.pipeline import parse_spec

    if spec is None or retention is None:
        return frames, retention
    cards = [vtc.registry()[name].card for name in parse_spec(spec)]
    if not any(card.stages == ("sample",) and not card.reduces_tokens for card in cards):
        return frames, retention
    reducers = sum(card.reduces_tokens for card in cards)
    share = retention ** (1.0 / (reducers + 1))
    shown = max(1, round(frames * share))
    return shown, (retention / share if reducers else None)


def _measure(
    model,
    processor,
    video,
    frames: int,
    spec: str | None,
    retention: float | None,
    params: dict[str, Any],
    memory: bool,
    layer_scale: float = 1.0,
    image: Any = None,
) -> dict[str, Any]:
    """One request, timed stage by stage: the inputs built from the video (`handle.prepare`: the sample stage,
    decoding and the processor; with `image`, the processor on that image alone), then `generate(max_new_tokens=1)`
    with the vision tower and the LLM timed inside it. With `memory`, also one untimed pass measuring the peak memory
    of the same call. The LLM's time is multiplied by `layer_scale` (released depth / built depth) in the prefill,
    limit and TTFT figures."""
    handle = vtc.patch(model, spec, retention=retention, **params_for(spec, params)) if spec else None
    sample_s = 0.0
    device = next(model.parameters()).device
    # every request pays its sampler's frame features (a second question about the same video would not:
    # vtc.media.encoders.FEATURE_CACHE), so TTFT is the first request's
    FEATURE_CACHE.clear()
    try:
        start = time.perf_counter()
        if image is not None:
            inputs = image_inputs(processor, [image], BENCH_IMAGE_QUESTION)
        elif handle is not None:
            inputs = handle.prepare(processor, video, BENCH_QUESTION, num_frames=frames)
        else:
            inputs = vtc.prepare_inputs(processor, video, BENCH_QUESTION, "uniform", num_frames=frames)
        inputs = inputs.to(device)
        prepare_s = time.perf_counter() - start
        with LLMTimer(model) as timer, VisionTimer(model) as vision, torch.no_grad():
            synchronize()
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
            synchronize()
            generate_s = time.perf_counter() - start
        stats = handle.stats() if handle else None
        peak = None
        if memory:
            with torch.no_grad():
                peak = peak_memory_mb(lambda: model.generate(**inputs, max_new_tokens=1, do_sample=False))
    finally:
        if handle:
            handle.unpatch()
    if stats is not None and stats.frames:
        sample_s = sum(f.seconds for f in stats.frames)
    prefill = timer.first
    shown = int(sum(len(f.indices) for f in stats.frames) if stats and stats.frames else frames)
    row = {
        "prefill_s": prefill * layer_scale,
        "generate_s": generate_s,
        "vision_s": vision.total,
        "sample_s": sample_s,
        "decode_s": prepare_s - sample_s,
        # what a user waits for: the inputs, the tower, the connect stage and the whole LLM's prefill
        "ttft_s": prepare_s + generate_s + (layer_scale - 1.0) * prefill,
        "frames_shown": shown,
    }
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


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of per-repeat values (the median of an even count is the mean of the middle two)."""
    if not values:
        raise ValueError("spread of no values")
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def repeat_ratios(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """The ratios of one repeat: `row` (a configuration) against `base` (no compression, the same repeat)."""
    method_time = row["prefill_s"] + row["connect_s"]
    return {
        "speedup": base["prefill_s"] / method_time,
        "ttft_speedup": base["ttft_s"] / row["ttft_s"],
        "efficiency": row["limit_s"] / method_time,
        "overhead_share": row["overhead_s"] / base["prefill_s"],
        "vision_share": row["vision_s"] / row["ttft_s"],
        # the best TTFT speedup a method acting only on the LLM's input could reach with this row's final count:
        # the uncompressed request with its prefill replaced by the plain prefill of that count; on the
        # uncompressed row, with no prefill at all (what no LLM-side method can pass, whatever its retention)
        "llm_ceiling": base["ttft_s"]
        / (base["ttft_s"] - base["prefill_s"] + (0.0 if row is base else row["limit_final_s"])),
    }


def summarize(rows: list[dict[str, Any]], base_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One result row from a configuration's repeats and the baseline's repeats (paired by repeat index):
    every time and ratio as its median (the plain keys, as before) plus `spread` (min / median / max) and
    `per_repeat` (each repeat's times and ratios, the data the statistics come from)."""
    if len(rows) != len(base_rows) or not rows:
        raise ValueError(f"need the same number of repeats, got {len(rows)} and {len(base_rows)}")
    per_repeat = [
        {**{key: row[key] for key in TIMING_KEYS}, **repeat_ratios(row, base)} for row, base in zip(rows, base_rows)
    ]
    # token counts are the same every repeat (the methods are deterministic); taken from the first
    summary = {k: v for k, v in rows[0].items() if k not in TIMING_KEYS and k != "peak_mb"}
    summary["spread"] = {key: spread([r[key] for r in per_repeat]) for key in TIMING_KEYS + RATIO_KEYS}
    summary.update({key: summary["spread"][key]["median"] for key in TIMING_KEYS + RATIO_KEYS})
    summary["peak_mb"] = max(r["peak_mb"] for r in rows if "peak_mb" in r)
    summary["repeats"] = len(rows)
    summary["per_repeat"] = per_repeat
    return summary


GENERATED_VIDEOS = ("demo", "static")
GENERATED_IMAGES = ("slide",)


def bench_image(image: str):
    """An image path as given, or a generated one: "slide" (672 x 672 px: the first frame of
    `vtc.media.video.static_clip`, flat panels, a title bar, a textured picture and a small red square; 576 tokens
    on the Qwen towers, as 8 frames of 224 px)."""
    if image == "slide":
        from vtc.media.video import static_clip

        return static_clip(1, 672, 672)[0]
    from PIL import Image

    if not os.path.exists(image):
        raise ValueError(f"--image {image!r}: no such file (or a generated one: {', '.join(GENERATED_IMAGES)})")
    return Image.open(image).convert("RGB")


def bench_video(video: str | None):
    """A video path as given, or a generated clip: "demo" (default: moving shapes, scene cuts, a static stretch;
    written to an mp4) or "static" (`vtc.media.video.static_clip`: a still slide-like background with one small
    moving square, 96 frames of 336 px at 8 fps, handed over as frames, so repeats stay bit-exact)."""
    if video in (None, "demo"):
        return demo_clip()
    if video == "static":
        from vtc.media.video import VideoSource, static_clip

        return VideoSource.open(static_clip(96, 336, 336), fps=8.0)
    return video


def bench(
    model: str | None = None,
    video: str | None = None,
    family: str = "qwen2_vl",
    size: str = "bench",
    methods: tuple[str, ...] = ("random", "fastv", "framefusion"),
    retentions: tuple[float, ...] = (0.5, 0.3, 0.15),
    frames: int = 48,
    repeats: int = DEFAULT_REPEATS,
    out_dir: str | None = None,
    params: dict[str, Any] | None = None,
    dtype: str = "float32",
    console: Console | None = None,
    image: str | None = None,
) -> dict[str, Any]:
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if image is not None and video is not None:
        raise ValueError("--image and --video: a bench request holds one video or one image, not both")
    console = console or Console()
    params = dict(params or {})
    layer_scale, released = 1.0, model is not None
    if model is None:
        shape = SIZES.get(size)
        family = shape.family if shape is not None and shape.family else family
        with console.status(f"building a random-weight {family} ({size}) model"):
            net, processor = build_random_model(family, size, dtype)
        name = f"random-weight {family} ({size})"
        if shape is not None and shape.released:
            released, layer_scale = True, shape.layer_scale
            name = shape.describe()
    else:
        with console.status(f"loading {model}"):
            net, processor = load_model(model, dtype=dtype)
        name = model
    picture = bench_image(image) if image is not None else None
    video_name = f"image: {image}" if image is not None else video or "demo"
    video = bench_video(video) if image is None else None
    if picture is not None:
        frames = 0
        inputs = image_inputs(processor, [picture], BENCH_IMAGE_QUESTION)
    else:
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
    # the machine's 1-minute load average at the start of each repeat: other processes on the cores are the
    # usual cause of a repeat far from the others (None where the OS has no load average)
    load: list[float | None] = []
    with progress_bar(console) as progress:
        task = progress.add_task("benchmarking", total=repeats * len(configs))
        for rep in range(repeats):
            load.append(os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
            for label, spec, retention in configs:
                progress.update(task, description=f"{label} @ {retention if retention else 1.0}")
                # an image has no frames to sample: its methods share the whole retention (`Pipeline.for_images`)
                shown, method_retention = frame_budget(spec, retention, frames) if picture is None else (0, retention)
                row = _measure(
                    net,
                    processor,
                    video,
                    shown,
                    spec,
                    method_retention,
                    params,
                    rep == 0,
                    layer_scale=layer_scale,
                    image=picture,
                )
                row.setdefault("tokens_in", visual)
                row.setdefault("tokens_llm", visual)
                row.setdefault("tokens_out", visual)
                row.setdefault("layer_tokens", [visual] * num_layers)
                row.setdefault("connect_s", 0.0)
                row.setdefault("overhead_s", 0.0)
                # the limit, timed right after the method so both see the same machine state
                schedule = row["layer_tokens"]
                row["limit_s"] = plain_prefill_seconds(net, text_tokens, schedule) * layer_scale
                final = [row["tokens_out"]] * num_layers
                row["limit_final_s"] = (
                    row["limit_s"]
                    if schedule == final
                    else plain_prefill_seconds(net, text_tokens, final) * layer_scale
                )
                measured[(label, retention)].append(row)
                progress.advance(task)

    base_rows = measured[("none", None)]
    results = []
    for (label, retention), rows in measured.items():
        row = summarize(rows, base_rows)
        row.update(
            method=label,
            retention=retention if retention is not None else 1.0,
            mean_layer_tokens=sum(row["layer_tokens"]) / len(row["layer_tokens"]),
        )
        results.append(row)

    report = {
        "model": name,
        "family": vtc.api.resolve_adapter(net).family,
        "video": video_name,
        "frames": frames,
        "visual_tokens": visual,
        "text_tokens": text_tokens,
        "num_layers": num_layers,
        "layer_scale": layer_scale,
        # a vision tower of a released checkpoint's shape (or a real model): TTFT figures count only then
        "released_tower": released,
        "repeats": repeats,
        # what the plain time and ratio keys of each result are (reports before issue 10 kept the best repeat)
        "aggregate": "median",
        "environment": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "threads": torch.get_num_threads(),
            "device": str(next(net.parameters()).device),
            "cpu": platform.processor() or platform.machine(),
            "load_1m_per_repeat": load,
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


def with_range(r: dict[str, Any], key: str, fmt: str, suffix: str = "", scale: float = 1.0) -> str:
    """A ratio as `median (min–max)` over the repeats, e.g. `2.44x (2.40–2.50)`; the range is left out for a
    single repeat, where it says nothing."""
    low, median, high = (format(scale * r["spread"][key][k], fmt) for k in ("min", "median", "max"))
    if r["repeats"] < 2:
        return f"{median}{suffix}"
    return f"{median}{suffix} ({low}–{high}{suffix if suffix == '%' else ''})"


# (header, formatter) of every reported column, in the Markdown table's order; times are medians over repeats
COLUMNS = [
    ("method", lambda r: r["method"]),
    ("ret", lambda r: f"{r['retention']:.2f}"),
    ("frames", lambda r: str(r["frames_shown"])),
    ("tokens", lambda r: str(r["tokens_out"])),
    ("/layer", lambda r: f"{r['mean_layer_tokens']:.0f}"),
    ("prefill s", lambda r: f"{r['prefill_s']:.2f}"),
    ("speedup", lambda r: with_range(r, "speedup", ".2f", "x")),
    ("peak MB", lambda r: f"{r['peak_mb']:.0f}"),
    ("limit s", lambda r: f"{r['limit_s']:.2f}"),
    ("final limit s", lambda r: f"{r['limit_final_s']:.2f}"),
    ("effic.", lambda r: with_range(r, "efficiency", ".2f")),
    ("overhead", lambda r: with_range(r, "overhead_share", ".1f", "%", scale=100)),
    # time to first token by stage (only with a released tower: a toy tower overstates every TTFT gain)
    ("sample s", lambda r: f"{r['sample_s']:.2f}"),
    ("decode+proc s", lambda r: f"{r['decode_s']:.2f}"),
    ("vision s", lambda r: f"{r['vision_s']:.2f}"),
    ("connect s", lambda r: f"{r['connect_s']:.2f}"),
    ("TTFT s", lambda r: f"{r['ttft_s']:.2f}"),
    ("vision %", lambda r: f"{100 * r['vision_share']:.0f}%"),
    ("TTFT x", lambda r: with_range(r, "ttft_speedup", ".2f", "x")),
    ("LLM-side ceiling", lambda r: f"{r['llm_ceiling']:.2f}x"),
]
TTFT_COLUMNS = (
    "sample s",
    "decode+proc s",
    "vision s",
    "connect s",
    "TTFT s",
    "vision %",
    "TTFT x",
    "LLM-side ceiling",
)
# the console splits the columns into tables, each within 80 columns with the ranges shown
CONSOLE_TABLES = (
    ("tokens and memory", ("method", "ret", "frames", "tokens", "/layer", "peak MB")),
    ("prefill against no compression", ("method", "ret", "prefill s", "speedup", "limit s", "effic.", "overhead")),
    (
        "time to first token by stage",
        ("method", "ret", "sample s", "decode+proc s", "vision s", "connect s", "prefill s", "TTFT s"),
    ),
    (
        "time to first token against no compression",
        ("method", "ret", "TTFT s", "vision %", "TTFT x", "LLM-side ceiling"),
    ),
)
TOY_TOWER_NOTE = (
    "no TTFT figures: this model's vision tower is a toy (2-4 blocks, 64 wide), which hides the tower's share of "
    f"time to first token; run with a released shape (--size {', '.join(RELEASED_SIZES)}) or a real model (--model) "
    "for TTFT"
)


def _columns(report: dict[str, Any], headers) -> list[str]:
    if report.get("released_tower", True):
        return list(headers)
    return [h for h in headers if h not in TTFT_COLUMNS]


def _title(report: dict[str, Any]) -> str:
    n = report["repeats"]
    stat = "one repeat" if n == 1 else f"median (min–max) of {n} repeats"
    media = f"{report['frames']} frames" if report["frames"] else report["video"]
    title = (
        f"{report['model']}: {media}, {report['visual_tokens']} visual + {report['text_tokens']} "
        f"text tokens, {report['num_layers']} LLM layers, {stat}"
    )
    return title if report.get("released_tower", True) else f"{title} (toy vision tower)"


def print_table(report: dict[str, Any], console: Console) -> None:
    """Three tables (tokens and memory; speed; cost against the limit) so each stays readable in an
    80-column terminal with the ratios' ranges."""
    formatters = dict(COLUMNS)
    console.print(_title(report))
    if not report.get("released_tower", True):
        console.print(f"[bold yellow]{TOY_TOWER_NOTE}[/]")
    for title, headers in CONSOLE_TABLES:
        headers = _columns(report, headers)
        if len(headers) <= 3:  # nothing but the method, its retention and a TTFT-free leftover
            continue
        table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for header in headers:
            table.add_column(header, justify="left" if header == "method" else "right", no_wrap=header == "method")
        for r in report["results"]:
            table.add_row(*(formatters[h](r) for h in headers))
        console.print(table)


def markdown_table(report: dict[str, Any]) -> str:
    """All columns as one Markdown table (what docs/benchmarks.md shows)."""
    keep = set(_columns(report, dict(COLUMNS)))
    columns = [(h, fmt) for h, fmt in COLUMNS if h in keep]
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r) for _, fmt in columns) + " |" for r in report["results"]]
    return "\n".join(lines) + "\n"


def _error_bars(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[list[float]]]:
    """Medians and (below, above) distances to the min and max over repeats, as `errorbar`'s `y` and `yerr`."""
    spreads = [r["spread"][key] for r in rows]
    medians = [s["median"] for s in spreads]
    return medians, [[s["median"] - s["min"] for s in spreads], [s["max"] - s["median"] for s in spreads]]


def plot(report: dict[str, Any], path: str) -> None:
    """Speedup and efficiency against retention: medians over repeats, error bars from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        if r["method"] != "none":
            by_method.setdefault(r["method"], []).append(r)
    ttft = report.get("released_tower", True)  # a toy tower's TTFT is not plotted (it overstates every gain)
    fig, axes = plt.subplots(1, 3 if ttft else 2, figsize=(16.5 if ttft else 11, 4.2))
    colors = plt.get_cmap("tab20").colors
    markers = "os^vDP*Xh<>"
    # methods share the retentions: shift each a little sideways so their error bars do not hide each other
    retentions = sorted({r["retention"] for rows in by_method.values() for r in rows})
    gap = min((b - a for a, b in zip(retentions, retentions[1:])), default=0.1)
    dodge = 0.3 * gap / max(1, len(by_method))
    for i, (method, rows) in enumerate(by_method.items()):
        rows = sorted(rows, key=lambda r: r["retention"])
        x = [r["retention"] + (i - (len(by_method) - 1) / 2) * dodge for r in rows]
        style = dict(marker=markers[i % len(markers)], color=colors[(2 * i) % 20 + (2 * i) // 20], label=method)
        for ax, key in zip(axes, ("speedup", "efficiency", "ttft_speedup")):
            y, yerr = _error_bars(rows, key)
            ax.errorbar(x, y, yerr=yerr, capsize=3, **style)
    axes[0].set(xlabel="retention", ylabel="prefill speedup (x)", title="speedup vs no compression")
    axes[1].set(xlabel="retention", ylabel="limit time / method time", title="efficiency (1 = no overhead)")
    # the baseline against its own limit: how far from 1.0 a method with no overhead at all can land here
    none = next(r["spread"]["efficiency"] for r in report["results"] if r["method"] == "none")
    axes[1].axhspan(none["min"], none["max"], color="grey", alpha=0.2, label="none vs its limit (min–max)")
    axes[1].axhline(none["median"], color="grey", linestyle="--", linewidth=0.8)
    low = min(r["spread"]["efficiency"]["min"] for r in report["results"])
    high = max(r["spread"]["efficiency"]["max"] for r in report["results"])
    axes[1].set_ylim(min(0.8, low - 0.05), max(1.1, high + 0.05))
    if ttft:
        axes[2].set(xlabel="retention", ylabel="TTFT speedup (x)", title="time to first token vs no compression")
        # no LLM-side method passes this line, whatever its retention (the uncompressed request without prefill)
        ceiling = next(r["llm_ceiling"] for r in report["results"] if r["method"] == "none")
        axes[2].axhline(ceiling, color="grey", linestyle=":", label=f"LLM-side ceiling {ceiling:.2f}x")
    for ax in axes:
        ax.grid(alpha=0.3)
    # one legend outside the plots, so no curve hides behind it
    handles, labels = axes[1].get_legend_handles_labels()
    for handle, label in zip(*axes[-1].get_legend_handles_labels()):
        if label not in labels:
            handles.append(handle)
            labels.append(label)
    axes[-1].legend(handles, labels, loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize="small")
    n = report["repeats"]
    fig.suptitle(f"{report['model']}: " + (f"median, bars min–max of {n} repeats" if n > 1 else "one repeat"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
