"""`vtc bench --backend vllm`: time to first token and throughput of a vLLM engine with no compression, with vtc
methods at several retentions, and with vLLM's own EVS (`video_pruning_rate = 1 - retention`, the same kept
counts), measured in one run on one machine so the ratios are comparable.

TTFT: one request (max_tokens=1) on a fresh video (encoder and processor caches cleared), best of `repeats`.
Throughput: `requests` requests with different videos submitted together (vLLM batches up to `concurrency`),
requests per second. Each configuration is its own engine (a vtc config is fixed at engine start).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from vtc.media.video import synthetic_video
from vtc.testing import tiny
from vtc.testing.serving import clear_caches, engine, shutdown, video_request


def _time_engine(llm, videos, repeats: int) -> dict[str, float]:
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    question = "What happens in this video?"
    first = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([video_request(tokenizer, videos[0], question)], first, use_tqdm=False)  # warm-up
    ttft = []
    prompt_tokens = 0
    for k in range(repeats):
        clear_caches(llm)
        start = time.perf_counter()
        out = llm.generate([video_request(tokenizer, videos[k % len(videos)], question)], first, use_tqdm=False)
        ttft.append(time.perf_counter() - start)
        prompt_tokens = len(out[0].prompt_token_ids)
    clear_caches(llm)
    batch = [video_request(tokenizer, v, question) for v in videos]
    start = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"ttft_s": min(ttft), "requests_per_s": len(batch) / seconds, "prompt_tokens": prompt_tokens}


def bench_vllm(
    model: str | None = None,
    family: str = "qwen2_5_vl",
    size: str = "bench12",
    methods: tuple[str, ...] = ("vidcom2",),
    retentions: tuple[float, ...] = (0.5, 0.25, 0.15),
    frames: int = 32,
    frame_size: int = 392,
    repeats: int = 2,
    requests: int = 4,
    concurrency: int = 4,
    evs: bool = True,
    out_dir: str = "vtc-bench-vllm",
    console: Console | None = None,
) -> dict[str, Any]:
    console = console or Console()
    path = model or tiny.save(family, os.path.join(tempfile.mkdtemp(prefix="vtc-bench-vllm-"), family), size=size)
    videos = [synthetic_video(frames, frame_size, frame_size, seed=s) for s in range(max(requests, repeats))]
    configs: list[tuple[str, float | None, dict[str, Any]]] = [("none", None, {})]
    for r in retentions:
        if evs:
            configs.append(("evs (vLLM)", r, {"video_pruning_rate": round(1.0 - r, 6)}))
        for m in methods:
            configs.append((m, r, {"vtc": {"methods": m, "retention": r}}))
    rows = []
    for name, retention, options in configs:
        console.print(f"[bold]vllm bench[/bold]: {name} at retention {retention if retention else 1.0}")
        vtc_config = options.pop("vtc", None)
        llm = engine(path, vtc=vtc_config, max_num_seqs=concurrency, **options)
        try:
            timing = _time_engine(llm, videos[:requests], repeats)
        finally:
            shutdown(llm)
        rows.append({"method": name, "retention": retention, **timing})
    base = rows[0]
    for row in rows:
        row["ttft_speedup"] = base["ttft_s"] / row["ttft_s"]
        row["throughput_ratio"] = row["requests_per_s"] / base["requests_per_s"]
    report = {"model": path if model else f"random {family} ({size})", "frames": frames, "rows": rows}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench-vllm.json"), "w") as f:
        json.dump(report, f, indent=2)
    table = Table(title=f"vLLM: {report['model']}, {frames} frames of {frame_size}px")
    for column in ("method", "retention", "prompt tokens", "TTFT s", "TTFT speedup", "req/s", "throughput x"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["method"],
            f"{row['retention']:.2f}" if row["retention"] else "1.00",
            str(row["prompt_tokens"]),
            f"{row['ttft_s']:.2f}",
            f"{row['ttft_speedup']:.2f}x",
            f"{row['requests_per_s']:.3f}",
            f"{row['throughput_ratio']:.2f}x",
        )
    console.print(table)
    return report
