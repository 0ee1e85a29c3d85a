"""`vtc bench --backend vllm`: time to first token and throughput of a vLLM engine with no compression, with vtc
methods at several retentions (frame samplers included: they run in the server's prompt processor, so fewer frames
reach the vision tower), and with vLLM's own EVS (`video_pruning_rate = 1 - retention`, the same kept counts),
measured in one run on one machine so the ratios are comparable.

`--size qwen2.5-vl-7b` (or another released shape, `vtc.testing.tiny.RELEASED_SIZES`) builds the checkpoint's
vision tower as released and 4 of its LLM layers at released width, with random weights; the LLM's time (timed
inside the engine, in-process) is scaled to the released depth. TTFT is then split into the sampler, the vision
tower, the LLM prefill and the rest (decoding the request's media, the HF processor, scheduling), with the vision
share and the ceiling of LLM-side methods (TTFT if the LLM cost nothing). Toy sizes give no split: their tower
overstates every TTFT gain.

TTFT: one request (max_tokens=1) on a fresh video (encoder and processor caches cleared), best of `repeats`.
Throughput: `requests` requests with different videos submitted together, requests per second. Each configuration
is its own engine (a vtc config is fixed at engine start).

The overall retention is split as in `vtc bench` (`vtc.tools.bench.frame_budget`): a sampler alone at 0.25 shows a
quarter of the frames; `bolt+vidcom2` at 0.25 half of them, vidcom2 keeping half their tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from vtc.media.encoders import FEATURE_CACHE
from vtc.media.video import synthetic_video
from vtc.testing import tiny
from vtc.testing.serving import clear_caches, engine, shutdown, video_request
from vtc.tools.bench import frame_budget, params_for

QUESTION = "What happens in this video?"
VIDEO_FPS = 1.0  # the clips' frame rate: one frame per second, so a sampler scoring at 1 fps sees every frame
_TIMERS: dict[str, Any] = {}  # ModuleTimers on the in-process engine's vision tower and LLM (install_timers)


def install_timers(model) -> None:
    """Time every forward of the served model's vision tower and language model (`llm.apply_model`)."""
    from vtc.hf.timing import ModuleTimer

    tower = model.visual if hasattr(model, "visual") else model.vision_tower
    # the model's own forward is the LLM's (the runner encodes media before it): vLLM compiles the decoder
    # (`language_model.model`), whose module hooks never fire
    for name, module in (("vision", tower), ("llm", model)):
        _TIMERS[name] = ModuleTimer(module).__enter__()


def stage_seconds(_model=None) -> dict[str, float]:
    return {name: timer.total for name, timer in _TIMERS.items()}


def reset_timers(_model=None) -> None:
    for timer in _TIMERS.values():
        timer.durations.clear()


def _time_engine(llm, videos, repeats: int, layer_scale: float) -> dict[str, Any]:
    from vllm import SamplingParams

    from vtc.vllm import sampling

    llm.apply_model(install_timers)
    tokenizer = llm.get_tokenizer()
    first = SamplingParams(max_tokens=1, temperature=0.0)
    request = video_request(tokenizer, videos[0], QUESTION, fps=VIDEO_FPS)
    llm.generate([request], first, use_tqdm=False)  # warm-up
    runs = []
    for k in range(repeats):
        # every request is a first one: no processed media, encoder outputs or sampler features to reuse
        clear_caches(llm)
        FEATURE_CACHE.clear()
        llm.apply_model(reset_timers)
        sampling.LAST_FRAMES.clear()
        request = video_request(tokenizer, videos[k % len(videos)], QUESTION, fps=VIDEO_FPS)
        start = time.perf_counter()
        out = llm.generate([request], first, use_tqdm=False)
        wall = time.perf_counter() - start
        (seconds,) = llm.apply_model(stage_seconds)
        sample = sum(f["selection"].seconds for f in sampling.LAST_FRAMES)
        prefill = seconds["llm"] * layer_scale
        ttft = wall + seconds["llm"] * (layer_scale - 1.0)
        shown = sum(len(f["selection"].indices) for f in sampling.LAST_FRAMES) or len(videos[0])
        runs.append(
            {
                "ttft_s": ttft,
                "sample_s": sample,
                "vision_s": seconds["vision"],
                "prefill_s": prefill,
                "other_s": ttft - sample - seconds["vision"] - prefill,
                "prompt_tokens": len(out[0].prompt_token_ids),
                "frames_shown": shown,
            }
        )
    best = min(runs, key=lambda r: r["ttft_s"])
    clear_caches(llm)
    FEATURE_CACHE.clear()
    llm.apply_model(reset_timers)
    batch = [video_request(tokenizer, v, QUESTION, fps=VIDEO_FPS) for v in videos]
    start = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    (seconds,) = llm.apply_model(stage_seconds)
    total = time.perf_counter() - start + seconds["llm"] * (layer_scale - 1.0)
    return {**best, "requests_per_s": len(batch) / total}


def bench_vllm(
    model: str | None = None,
    family: str = "qwen2_5_vl",
    size: str = "bench12",
    methods: tuple[str, ...] = ("vidcom2",),
    retentions: tuple[float, ...] = (0.5, 0.25, 0.15),
    frames: int = 32,
    frame_size: int | None = None,
    repeats: int = 2,
    requests: int = 4,
    concurrency: int = 4,
    evs: bool = True,
    params: dict[str, Any] | None = None,
    out_dir: str = "vtc-bench-vllm",
    console: Console | None = None,
) -> dict[str, Any]:
    console = console or Console()
    shape = tiny.SIZES.get(size) if model is None else None
    released = shape is not None and shape.released
    if shape is not None and shape.family:
        family = shape.family
    layer_scale = shape.layer_scale if released else 1.0
    frame_size = frame_size or (448 if released else 392)
    scratch = tempfile.mkdtemp(prefix="vtc-bench-vllm-") if model is None else None  # removed at the end
    try:
        if scratch is not None:
            with console.status(f"saving a random-weight {family} ({size}) model"):
                path = tiny.save(family, os.path.join(scratch, family), size=size)
        else:
            path = model
        rows = _run_configs(
            path,
            methods,
            retentions,
            frames,
            frame_size,
            repeats,
            requests,
            concurrency,
            evs,
            params,
            layer_scale,
            console,
        )
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    base = rows[0]
    for row in rows:
        row["ttft_speedup"] = base["ttft_s"] / row["ttft_s"]
        row["throughput_ratio"] = row["requests_per_s"] / base["requests_per_s"]
        row["vision_share"] = row["vision_s"] / row["ttft_s"]
        row["llm_ceiling"] = base["ttft_s"] / (row["ttft_s"] - row["prefill_s"])  # this row's LLM at no cost
    if released:
        label = shape.describe()
    else:
        label = path if model else f"random {family} ({size})"
    report = {"model": label, "frames": frames, "frame_size": frame_size, "released_shape": released, "rows": rows}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench-vllm.json"), "w") as f:
        json.dump(report, f, indent=2)
    console.print(_table(report, released or model is not None))
    if not (released or model is not None):
        console.print(
            "[yellow]toy vision tower: TTFT ratios overstate what a released checkpoint gives; run with --size "
            f"{', '.join(tiny.RELEASED_SIZES)} for the real share of the vision tower[/yellow]"
        )
    return report


def _run_configs(
    path: str,
    methods: tuple[str, ...],
    retentions: tuple[float, ...],
    frames: int,
    frame_size: int,
    repeats: int,
    requests: int,
    concurrency: int,
    evs: bool,
    params: dict[str, Any] | None,
    layer_scale: float,
    console: Console,
) -> list[dict[str, Any]]:
    """One engine per configuration (no compression; EVS and each method at each retention), timed."""
    videos = [synthetic_video(frames, frame_size, frame_size, seed=s) for s in range(max(requests, repeats))]
    configs: list[tuple[str, float | None, dict[str, Any]]] = [("none", None, {})]
    for r in retentions:
        if evs:
            configs.append(("evs (vLLM)", r, {"video_pruning_rate": round(1.0 - r, 6)}))
        for m in methods:
            shown, method_retention = frame_budget(m, r, frames)
            own = params_for(m, dict(params or {}))
            for entry in _samplers(m):
                own.setdefault(f"{entry}.num_frames", shown)
            configs.append((m, r, {"vtc": {"methods": m, "retention": method_retention, "params": own}}))
    rows = []
    for name, retention, options in configs:
        console.print(f"[bold]vllm bench[/bold]: {name} at retention {retention if retention else 1.0}")
        vtc_config = options.pop("vtc", None)
        # one prefill chunk per prompt: the LLM's time is one forward, scaled to the released depth
        llm = engine(path, vtc=vtc_config, max_num_seqs=concurrency, max_num_batched_tokens=8192, **options)
        try:
            timing = _time_engine(llm, videos[:requests], repeats, layer_scale)
        finally:
            shutdown(llm)
        rows.append({"method": name, "retention": retention, **timing})
    return rows


def _samplers(spec: str) -> list[str]:
    from vtc.core.pipeline import parse_spec
    from vtc.core.registry import registry

    return [name for name in parse_spec(spec) if "sample" in registry()[name].card.stages]


def _table(report: dict[str, Any], split: bool) -> Table:
    table = Table(title=f"vLLM: {report['model']}, {report['frames']} frames of {report['frame_size']}px")
    columns = ["method", "retention", "frames", "prompt tokens", "TTFT s"]
    if split:
        columns += ["sample s", "vision s", "prefill s", "other s", "vision share", "LLM-only ceiling"]
    columns += ["TTFT speedup", "req/s", "throughput x"]
    for column in columns:
        table.add_column(column)
    for row in report["rows"]:
        cells = [
            row["method"],
            f"{row['retention']:.2f}" if row["retention"] else "1.00",
            str(row["frames_shown"]),
            str(row["prompt_tokens"]),
            f"{row['ttft_s']:.2f}",
        ]
        if split:
            cells += [
                f"{row['sample_s']:.2f}",
                f"{row['vision_s']:.2f}",
                f"{row['prefill_s']:.2f}",
                f"{row['other_s']:.2f}",
                f"{row['vision_share']:.0%}",
                f"{row['llm_ceiling']:.2f}x",
            ]
        cells += [f"{row['ttft_speedup']:.2f}x", f"{row['requests_per_s']:.3f}", f"{row['throughput_ratio']:.2f}x"]
        table.add_row(*cells)
    return table
