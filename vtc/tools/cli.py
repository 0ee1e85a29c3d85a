"""Command line: `vtc methods`, `vtc run`, `vtc bench`, `vtc bench-kernels`, `vtc eval`, `vtc viz`, `vtc serve`,
`vtc stream`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_params(items: list[str] | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--param expects name=value (e.g. k=3 or fastv.k=3), got {item!r}")
        key, value = item.split("=", 1)
        params[key.strip()] = parse_value(value.strip())
    return params


def cmd_methods(args, console: Console) -> int:
    import vtc
    from vtc.core.families import family_names

    infos = vtc.methods()
    if args.json:
        print(json.dumps([i.capabilities() for i in infos], indent=2, default=str))
        return 0
    table = Table(title="installed vtc methods")
    for col in ("method", "stage", "paper", "families", "fixed count", "retention counts", "what it does"):
        table.add_column(col)
    for i in infos:
        families = f"all {len(i.families)}" if set(i.families) == set(family_names()) else ", ".join(i.families)
        if not i.reduces_tokens:
            fixed, counts = "n/a (sampler)", "-"
        else:
            fixed = {"always": "yes", "optional": "optional", "no": "no"}[i.fixed_count_mode]
            if i.fixed_count and i.acts_in_llm:
                fixed += " (last layer)"
            counts = i.retention_reference.replace("_", " ") + ("*" if i.retention_note else "")
        stage = "+".join(i.stages)
        if i.stream_only:
            stage = "stream only"
        elif i.streams:
            stage += " (streams)"
        table.add_row(i.name, stage, i.paper, families, fixed, counts, i.summary)
    console.print(table)
    notes = [(i.name, i.retention_note) for i in infos if i.retention_note]
    if notes:
        console.print("* where retention is not exact:")
        for name, note in notes:
            console.print(f"  [bold]{name}[/bold]: {note}")
    return 0


def cmd_run(args, console: Console) -> int:
    from vtc.tools.run import run

    result = run(
        model=args.model,
        video=args.video,
        question=args.question,
        methods=args.methods,
        retention=args.retention,
        frames=args.frames,
        max_new_tokens=args.max_new_tokens,
        params=parse_params(args.param),
        dtype=args.dtype,
        device=args.device,
        positions=args.positions,
        family=args.family,
        size=args.size,
        console=console,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


# defaults of `vtc bench` per backend (the vLLM one mirrors the EVS peer measurement: Qwen2.5-VL, 12 layers)
BENCH_DEFAULTS = {
    "hf": dict(
        family="qwen2_vl", size="bench", methods="random,fastv,framefusion", retentions="0.5,0.3,0.15", frames=48
    ),
    # the vLLM bench keeps the best TTFT of its repeats (each configuration is its own engine, so there is no
    # per-repeat pairing); the hf default is vtc.tools.bench.DEFAULT_REPEATS, imported only when it runs
    "vllm": dict(
        family="qwen2_5_vl", size="bench12", methods="vidcom2", retentions="0.5,0.25,0.15", frames=32, repeats=2
    ),
}
HF_ONLY_BENCH_OPTIONS = ("video", "image", "dtype")


def cmd_bench(args, console: Console) -> int:
    if args.stream:
        from vtc.tools.bench_stream import bench_stream

        bench_stream(
            methods=args.methods.split(",") if args.methods else None,
            frames=args.frames or 2048,
            family=args.family or "qwen2_5_vl",
            size=args.size or "demo",
            frame_size=args.frame_size,
            params=parse_params(args.param),
            out=args.out if args.out != "vtc-bench-results" else "vtc-bench-stream",
            console=console,
        )
        return 0
    for name, value in BENCH_DEFAULTS[args.backend].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    methods = tuple(m for m in args.methods.split(",") if m and m != "none")
    retentions = tuple(float(r) for r in args.retentions.split(","))
    if args.backend == "vllm":
        given = [f"--{name}" for name in HF_ONLY_BENCH_OPTIONS if getattr(args, name) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: only with --backend hf (the vLLM bench uses generated clips, fp32 on CPU)"
            )
        from vtc.tools.bench_vllm import bench_vllm

        bench_vllm(
            model=args.model,
            family=args.family,
            size=args.size,
            methods=methods,
            retentions=retentions,
            frames=args.frames,
            repeats=args.repeats,
            requests=args.requests,
            evs=not args.no_evs,
            params=parse_params(args.param),
            out_dir=args.out,
            console=console,
        )
        return 0
    from vtc.tools.bench import DEFAULT_REPEATS, bench

    bench(
        model=args.model,
        video=args.video,
        image=args.image,
        family=args.family,
        size=args.size,
        methods=methods,
        retentions=retentions,
        frames=args.frames,
        repeats=DEFAULT_REPEATS if args.repeats is None else args.repeats,
        out_dir=args.out,
        params=parse_params(args.param),
        dtype=args.dtype or "float32",
        console=console,
    )
    return 0


def cmd_eval(args, console: Console) -> int:
    from vtc.tools.eval import evaluate_grid, parse_frame_counts, parse_methods, parse_retentions

    retentions = parse_retentions(args.retentions)
    frame_counts = parse_frame_counts(args.num_frames)
    methods = parse_methods(args.methods)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks needs at least one lmms-eval task name")
    report = evaluate_grid(
        model=args.model,
        tasks=tasks,
        methods=methods,
        retentions=retentions,
        out_dir=args.out,
        include_path=args.include_path,
        num_frames=frame_counts if len(frame_counts) > 1 else frame_counts[0],
        limit=args.limit,
        params=parse_params(args.param),
        model_args={"backend": args.backend, **parse_params(args.model_arg)},
        family=args.family,
        console=console,
    )
    return 0 if all(c.get("status") == "ok" for c in report["cells"]) else 1


def cmd_viz(args, console: Console) -> int:
    from vtc.tools.viz import viz

    viz(
        video=args.video,
        question=args.question,
        methods=args.methods,
        retention=args.retention,
        num_frames=args.num_frames,
        model=args.model,
        params=parse_params(args.param),
        out=args.out,
        family=args.family,
        size=args.size,
        console=console,
    )
    return 0


def _retention_range(text: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH such as 0.1,0.5; got {text!r}") from None
    return low, high


def cmd_serve(args, console: Console) -> int:
    from vtc.tools.serve import serve

    return serve(
        model=args.model,
        methods=args.methods,
        retention=args.retention,
        params=parse_params(args.param),
        seed=args.seed,
        vllm_args=args.vllm_args,
        request_settings=not args.no_request_settings,
        retention_range=args.retention_range,
        images=not args.no_images,
    )


# the repository's benchmarks/ folder (official codes' baselines, not installed with the package), next to the
# `vtc` package of a checkout
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_module(name: str):
    """`benchmarks/<name>.py` of the checkout vtc runs from, imported as `benchmarks.<name>`. From an installed
    wheel there is no such folder: the error says the command needs a checkout."""
    folder = BENCHMARKS
    if not (folder / f"{name}.py").is_file():
        raise FileNotFoundError(
            f"vtc bench-kernels needs a checkout of the vtc repository: it runs benchmarks/{name}.py (the official "
            f"codes' baselines), which is not part of the installed package and is not at {folder}. Clone the "
            "repository, install it from there (pip install -e .) and run vtc bench-kernels again"
        )
    package = sys.modules.get("benchmarks")
    if package is None:
        spec = importlib.util.spec_from_file_location(
            "benchmarks", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = package
        spec.loader.exec_module(package)
    elif folder not in [Path(p).resolve() for p in getattr(package, "__path__", [])]:
        raise FileNotFoundError(
            f"another module named 'benchmarks' is already imported ({package!r}); vtc bench-kernels needs the "
            f"repository's own, {folder}"
        )
    return importlib.import_module(f"benchmarks.{name}")


def cmd_bench_kernels(args, console: Console) -> int:
    bench = benchmark_module("bench_kernels")
    report = bench.bench_kernels(
        ops=bench.parse_ops(args.ops),
        size=args.sizes,
        repeats=bench.DEFAULT_REPEATS if args.repeats is None else args.repeats,
        device=args.device,
        json_path=args.json,
        peak_override=args.peak_gbps,
        console=console,
    )
    return 1 if any("error" in r for r in report["results"]) else 0


def cmd_stream(args, console: Console) -> int:
    from vtc.tools.stream import parse_times, stream_video

    result = stream_video(
        model=args.model,
        video=args.video,
        fps=args.fps,
        methods=None if args.methods in ("", "none") else args.methods,
        retention=args.retention,
        budget_tokens=args.budget_tokens,
        questions=args.ask,
        ask_at=parse_times(args.ask_at),
        max_new_tokens=args.max_new_tokens,
        params=parse_params(args.param),
        chunk_frames=args.chunk_frames,
        family=args.family,
        size=args.size,
        dtype=args.dtype,
        device=args.device,
        console=console,
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
        console.print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vtc.testing.tiny import RELEASED_SIZES

    parser = argparse.ArgumentParser(prog="vtc", description="training-free visual-token compression for video-LLMs")
    sub = parser.add_subparsers(dest="command")

    methods = sub.add_parser("methods", help="list installed methods")
    methods.add_argument("--json", action="store_true", help="print JSON instead of a table")

    run = sub.add_parser(
        "run", help="answer a question about a video with and without compression (no arguments: offline demo)"
    )
    run.add_argument("--model", help="HF model id or local path (default: offline random-weight demo model)")
    run.add_argument("--video", help="video file (default with the demo: a generated clip)")
    run.add_argument("--question", help="question about the video")
    run.add_argument("--methods", default="framefusion", help="method spec, e.g. 'uniform+fastv' (default framefusion)")
    run.add_argument("--retention", type=float, default=0.3, help="fraction of visual tokens kept (default 0.3)")
    run.add_argument("--frames", type=int, default=16, help="frames sampled from the video (default 16)")
    run.add_argument("--max-new-tokens", type=int, default=24)
    run.add_argument("--param", action="append", metavar="NAME=VALUE", help="method parameter, e.g. k=3 or fastv.k=3")
    run.add_argument("--positions", choices=("keep", "compact"), help="position policy override")
    run.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    run.add_argument("--device", default="auto", help="device_map for from_pretrained (auto = GPU if available)")
    run.add_argument("--family", default="qwen2_5_vl", help="demo model family")
    run.add_argument("--size", default="demo", help="demo model size: tiny, demo, bench")
    run.add_argument("--json", metavar="PATH", help="also write the results as JSON")

    bench = sub.add_parser("bench", help="time prefill / TTFT / memory for methods x retentions")
    bench.add_argument("--model", help="HF model id or local path (default: mid-size random-weight model)")
    bench.add_argument(
        "--video",
        help="video file, or a generated clip: demo (default: moving shapes, scene cuts) or static (a still "
        "background with a small moving square; hf only)",
    )
    bench.add_argument(
        "--image",
        help="bench an image prompt instead of a video (hf only): an image file, or slide (a generated 672 px "
        "slide-like picture: 576 tokens on the Qwen towers)",
    )
    bench.add_argument("--family", help="family of the random model (default qwen2_vl; vllm: qwen2_5_vl)")
    bench.add_argument(
        "--size",
        help="random model size: tiny, demo, bench, bench12 (toy vision towers: no TTFT figures), or a released "
        f"checkpoint's shape: {', '.join(RELEASED_SIZES)} (default bench; vllm: bench12)",
    )
    bench.add_argument(
        "--methods", help="comma-separated method specs (default random,fastv,framefusion; vllm: vidcom2)"
    )
    bench.add_argument("--retentions", help="comma-separated retentions (default 0.5,0.3,0.15; vllm: 0.5,0.25,0.15)")
    bench.add_argument(
        "--frames", type=int, help="frames (default 48: ~3.5k visual tokens; vllm: 32 of 392 px = 3136 tokens)"
    )
    bench.add_argument(
        "--repeats",
        type=int,
        help="measurements per configuration (hf default 5: times and ratios as median with min-max over repeats; "
        "vllm default 2: best TTFT kept)",
    )
    bench.add_argument("--param", action="append", metavar="NAME=VALUE")
    bench.add_argument("--dtype", help="model dtype (default float32; hf only)")
    bench.add_argument("--out", default="vtc-bench-results", help="directory for bench.json, bench.md and bench.png")
    bench.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="hf (default) or vllm (TTFT, req/s)")
    bench.add_argument("--requests", type=int, default=4, help="vllm: requests sent together for throughput")
    bench.add_argument("--no-evs", action="store_true", help="vllm: skip vLLM's own EVS at the same kept counts")
    bench.add_argument(
        "--stream",
        action="store_true",
        help="memory and TTFT against stream length (vtc.stream; methods default none,streamingtom,mssavt,"
        "lifestream,memstream; --frames default 2048; --size default demo)",
    )
    bench.add_argument("--frame-size", type=int, default=168, help="--stream: frame side in pixels (default 168)")

    evaluate = sub.add_parser(
        "eval",
        help="accuracy / visual tokens / TTFT of methods x retentions on lmms-eval tasks (table + Pareto plots)",
        description="vtc eval --model MODEL --tasks videomme --methods a,b+c --retentions 0.5,0.25,0.1 --out DIR",
    )
    evaluate.add_argument("--model", help="HF model id or local path (default: a random-weight demo model)")
    evaluate.add_argument("--tasks", required=True, help="comma-separated lmms-eval tasks, e.g. videomme,mlvu_dev")
    evaluate.add_argument("--methods", required=True, help="comma-separated method specs (the baseline always runs)")
    evaluate.add_argument(
        "--retentions", default="0.5,0.25,0.1", help="comma-separated retentions in (0, 1], or default (official)"
    )
    evaluate.add_argument("--out", default="vtc-eval", help="output directory (rerun with the same one to resume)")
    evaluate.add_argument("--include-path", help="directory of extra lmms-eval task YAMLs (lmms-eval --include_path)")
    evaluate.add_argument(
        "--num-frames",
        default="32",
        help="frames per video (default 32; none: the sampler's rule); several (8,16,32) make a grid axis",
    )
    evaluate.add_argument("--limit", type=int, help="documents per task (for a quick look)")
    evaluate.add_argument("--param", action="append", metavar="NAME=VALUE", help="method parameter, e.g. k=3")
    evaluate.add_argument(
        "--model-arg", action="append", metavar="NAME=VALUE", help="model arg of --model vtc, e.g. dtype=bfloat16"
    )
    evaluate.add_argument("--family", default="qwen2_5_vl", help="family of the random-weight demo model")
    evaluate.add_argument(
        "--backend", choices=("hf", "vllm"), default="hf", help="hf (default) or vllm (one engine per cell)"
    )

    picture = sub.add_parser(
        "viz",
        help="PNGs of what a pipeline showed the model: frame timeline with scores, kept tokens, tokens per layer",
        description="vtc viz [VIDEO] --question Q --methods bolt+vidcom2 --out DIR (no arguments: the offline demo)",
    )
    picture.add_argument("video", nargs="?", help="video file (default: the generated demo clip)")
    picture.add_argument("--question", help="the question (default: the demo's)")
    picture.add_argument("--methods", default="bolt+vidcom2", help="method spec (default bolt+vidcom2)")
    picture.add_argument("--retention", type=float, default=0.25, help="fraction of visual tokens kept (default 0.25)")
    picture.add_argument("--num-frames", type=int, default=16, help="frames the sampler chooses (default 16)")
    picture.add_argument("--model", help="HF model id or local path (default: the random-weight demo model)")
    picture.add_argument("--param", action="append", metavar="NAME=VALUE", help="method parameter, e.g. bolt.alpha=3")
    picture.add_argument("--out", default="vtc-viz", help="directory for timeline.png, kept_tokens.png, layers.png")
    picture.add_argument("--family", default="qwen2_5_vl", help="demo model family")
    picture.add_argument("--size", default="demo", help="demo model size")

    serve = sub.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server with compression (any further option goes to `vllm serve`)",
        description="vtc serve MODEL --methods vidcom2 --retention 0.25 [any vllm serve option]",
    )
    serve.add_argument("model", help="HF model id or local path (Qwen2/2.5/3-VL, LLaVA-OneVision, LLaVA-NeXT-Video)")
    serve.add_argument(
        "--methods",
        required=True,
        help="connect-stage methods (vidcom2), a frame sampler before them (bolt+vidcom2), on Qwen an encode method "
        "(pixelprune, pixelprune-video+random); see docs/serving.md",
    )
    serve.add_argument("--retention", type=float, help="fraction of each video's tokens the LLM sees, in (0, 1]")
    serve.add_argument("--param", action="append", metavar="NAME=VALUE", help="method parameter, e.g. k=3")
    serve.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    serve.add_argument(
        "--no-request-settings",
        action="store_true",
        help='refuse per-request settings (mm_processor_kwargs={"vtc": {...}}) with HTTP 400',
    )
    serve.add_argument(
        "--no-images",
        action="store_true",
        help="let images reach the LLM whole (default: each image is compressed too)",
    )
    serve.add_argument(
        "--retention-range",
        type=_retention_range,
        default=(0.0, 1.0),
        metavar="LOW,HIGH",
        help="the retention a request may ask for (default 0,1: any in (0, 1])",
    )
    kernels = sub.add_parser(
        "bench-kernels",
        help="time vtc's shared ops against the official codes (CPU) or their Triton kernels (CUDA); needs a checkout",
        description="vtc bench-kernels [--ops a,b] [--sizes small|video] [--repeats N] [--device cpu|cuda] "
        "[--json PATH]. Runs benchmarks/ of a checkout of the repository (not installed with the package).",
    )
    kernels.add_argument("--ops", help="comma-separated ops (default: all; an unknown name lists the allowed ones)")
    kernels.add_argument(
        "--sizes", choices=("small", "video"), default="video", help="video (default: 7B video shapes) or small"
    )
    kernels.add_argument("--repeats", type=int, help="timed runs per op (default 5); median with min-max reported")
    kernels.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: official vs vtc's torch reference; cuda: official, reference and Triton kernel, with bandwidth",
    )
    kernels.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    kernels.add_argument("--peak-gbps", type=float, help="cuda: the device's HBM peak in GB/s (default: by name)")

    stream = sub.add_parser(
        "stream",
        help="feed a video into a bounded-memory stream and ask at given times (no arguments: offline demo)",
        description="vtc stream --video long.mp4 --fps 0.5 --methods streamingtom --ask '...' --ask-at 30,120,300",
    )
    stream.add_argument("--model", help="HF model id or local path (default: offline random-weight demo model)")
    stream.add_argument("--video", help="video file (default: a generated six-minute clip)")
    stream.add_argument("--fps", type=float, default=0.5, help="frames per second fed to the stream (default 0.5)")
    stream.add_argument("--methods", default="streamingtom", help="streaming method spec (default streamingtom; none)")
    stream.add_argument("--retention", type=float, help="fraction of each frame's tokens the connect stage keeps")
    stream.add_argument("--budget-tokens", type=int, help="most visual tokens the memory holds (default: method's)")
    stream.add_argument("--ask", action="append", metavar="QUESTION", help="question (repeat: one per --ask-at time)")
    stream.add_argument("--ask-at", help="comma-separated seconds of stream time (default: 1/3, 2/3 and the end)")
    stream.add_argument("--max-new-tokens", type=int, default=24)
    stream.add_argument("--chunk-frames", type=int, help="frames encoded together (default: the method's)")
    stream.add_argument("--param", action="append", metavar="NAME=VALUE", help="method parameter, e.g. bits=2")
    stream.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    stream.add_argument("--device", default="auto", help="device_map for from_pretrained (auto = GPU if available)")
    stream.add_argument("--family", default="qwen2_5_vl", help="demo model family")
    stream.add_argument("--size", default="demo", help="demo model size: tiny, demo, bench")
    stream.add_argument("--json", metavar="PATH", help="also write the asks and stats as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "serve":
        args.vllm_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # wide enough for the benchmark table in logs and narrow terminals alike (rich wraps nothing then)
    console = Console(width=max(Console().width, 150))
    if args.command is None:
        parser.print_help()
        return 0
    handler = {
        "methods": cmd_methods,
        "run": cmd_run,
        "bench": cmd_bench,
        "eval": cmd_eval,
        "viz": cmd_viz,
        "serve": cmd_serve,
        "stream": cmd_stream,
        "bench-kernels": cmd_bench_kernels,
    }
    handler = handler[args.command]
    try:
        return handler(args, console)
    except (ValueError, TypeError, FileNotFoundError) as err:
        console.print(f"[bold red]error:[/bold red] {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
