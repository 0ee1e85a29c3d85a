"""The encode stage on a GPU: time to first token when the vision tower itself does less work.

On the released Qwen2.5-VL-7B shapes the tower is a third of TTFT, so a method acting after it stops near 2x at 25 %
of the tokens whatever its prefill saving. This script builds the random-weight Qwen2.5-VL-7B (eval/gpu_prefill.py:
`build_7b`, bf16, on the GPU) and times `generate(max_new_tokens=1)` on a generated clip for the unpatched model and
every method at an overall retention, round-robin over repeats, with the tower's own time measured apart:

  TTFT x      = TTFT unpatched / TTFT with the method (median (min-max) over repeats, paired per repeat)
  vision ms   = the vision tower's time inside that call (`vtc.hf.timing.VisionTimer`)
  tokens      = visual tokens the LLM received

Methods (default): `random` (after the tower: the LLM-side ceiling), `pixelprune` (units dropped before the tower),
`tome` (merged between the tower's blocks, proportional attention by SDPA), `pixelprune+tome`, and `uniform` (a
quarter of the frames: the tower encodes a quarter of the patches). A second clip, static-heavy (a still background
with a small moving square, `vtc.media.video.static_clip`), runs `pixelprune` with the official tau = 0 rule and
reports the kept fraction it finds there. For each attention implementation ("sdpa", and "flash_attention_2" when
flash_attn imports: the tower's own blocks keep FlashAttention varlen where a method does not need weights).
`--tiny` runs the same code on vtc's tiny Qwen2.5-VL on the CPU (the test suite does).

Run by eval/gpu_check.sh; alone: `python eval/gpu_encode.py --json encode.json` (add `--tiny` without a GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
METHODS = ("random", "pixelprune", "tome", "pixelprune+tome", "uniform")
QUESTION = "What happens in this video?"


def _prefill_module():
    spec = importlib.util.spec_from_file_location("gpu_prefill", HERE / "gpu_prefill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(model, processor, video, frames: int, spec: str | None, retention: float | None, device: str):
    """One timed request: inputs (the sample stage for `uniform`), then generate(max_new_tokens=1)."""
    import vtc
    from vtc.hf.timing import VisionTimer, synchronize

    handle = vtc.patch(model, spec, retention=retention) if spec else None
    try:
        shown = frames
        if spec == "uniform":  # the sampler's budget: a quarter of the frames at 0.25
            shown = max(2, round(frames * retention))
            inputs = handle.prepare(processor, video, QUESTION, num_frames=shown, fps=8)
        else:
            inputs = vtc.prepare_inputs(processor, video, QUESTION, "uniform", num_frames=frames, fps=8)
        inputs = inputs.to(device)
        with VisionTimer(model) as vision, torch.no_grad():
            synchronize()
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
            synchronize()
            ttft = time.perf_counter() - start
        stats = handle.stats() if handle is not None else None
    finally:
        if handle is not None:
            handle.unpatch()
    return {
        "ttft_s": ttft,
        "vision_s": vision.total,
        "tokens": stats.visual_tokens_out if stats is not None else None,
        "tokens_in": stats.visual_tokens_in if stats is not None else None,
        "frames": shown,
    }


def spread(values) -> dict[str, float]:
    return _prefill_module().spread(values)


def run(tiny: bool, frames: int, size: int, methods, retention: float, repeats: int, attentions) -> dict[str, Any]:
    from vtc.media.video import VideoSource, static_clip, synthetic_video

    prefill = _prefill_module()
    device = "cpu" if tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_encode: no CUDA device here; run with --tiny for the CPU smoke version")
    clip = VideoSource.open(synthetic_video(frames * 4, size, size), fps=8.0)
    still = VideoSource.open(static_clip(frames * 4, size, size), fps=8.0)
    report: dict[str, Any] = {
        "model": "vtc tiny qwen2_5_vl (CPU)" if tiny else "random-weight Qwen2.5-VL-7B shapes, bf16",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "frames": frames,
        "frame_size": size,
        "retention": retention,
        "repeats": repeats,
        "attention": {},
    }
    failures = 0
    model = processor = None
    for attn in attentions:
        reason = prefill.flash_attention_available() if attn == "flash_attention_2" else None
        if reason is not None:
            report["attention"][attn] = {"skipped": reason}
            print(f"[{attn}] skipped: {reason}", flush=True)
            continue
        if model is None:
            model, processor = prefill.build_tiny(attn) if tiny else prefill.build_7b(device, torch.bfloat16, attn)
            built_with = attn
        else:
            model.set_attn_implementation(attn)
        configs = [("none", None, None)] + [(m, m, retention) for m in methods]
        configs.append(("pixelprune tau=0 (static clip)", "pixelprune", None))
        rows: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs}
        errors: dict[str, str] = {}
        for rep in range(repeats + 1):  # the first round is a warm-up, not kept
            for label, spec, ret in configs:
                if label in errors:
                    continue
                video = still if "static" in label else clip
                try:
                    row = measure(model, processor, video, frames, spec, ret, device)
                except Exception as err:  # reported, never swallowed
                    errors[label] = f"{type(err).__name__}: {err}"
                    print(f"[{attn}] {label} failed: {errors[label]}", flush=True)
                    failures += 1
                    continue
                if rep:
                    rows[label].append(row)
                    print(f"[{attn}] repeat {rep}/{repeats} {label}: TTFT {row['ttft_s'] * 1e3:.1f} ms", flush=True)
        still_none = [measure(model, processor, still, frames, None, None, device)["ttft_s"] for _ in range(repeats)]
        report["attention"][attn] = summarize(rows, errors, still_none)
    if model is not None and model.config._attn_implementation != built_with:
        model.set_attn_implementation(built_with)  # the tiny model is shared with the rest of the test run
    print_report(report)
    report["failures"] = failures
    return report


def summarize(rows, errors, still_none) -> dict[str, Any]:
    base = rows["none"]
    out: dict[str, Any] = {}
    for label, measured in rows.items():
        if label in errors:
            out[label] = {"error": errors[label]}
            continue
        reference = [{"ttft_s": s} for s in still_none] if "static" in label else base
        entry = {
            "ttft_ms": spread([r["ttft_s"] * 1e3 for r in measured]),
            "vision_ms": spread([r["vision_s"] * 1e3 for r in measured]),
            "frames": measured[0]["frames"],
            "tokens": measured[0]["tokens"],
        }
        if label != "none":
            entry["ttft_x"] = spread([b["ttft_s"] / r["ttft_s"] for r, b in zip(measured, reference)])
        if measured[0]["tokens_in"]:
            entry["kept_fraction"] = measured[0]["tokens"] / measured[0]["tokens_in"]
        out[label] = entry
    return out


def print_report(report: dict[str, Any]) -> None:
    print(
        f"\n{report['model']} on {report['device']}: {report['frames']} frames of {report['frame_size']} px, "
        f"retention {report['retention']}, median (min-max) of {report['repeats']} repeats"
    )
    print(f"{'attention':<18} {'method':<32} {'TTFT ms':>9} {'vision ms':>10} {'TTFT x':>22} {'tokens':>7}")
    for attn, result in report["attention"].items():
        if "skipped" in result:
            print(f"{attn:<18} skipped: {result['skipped']}")
            continue
        for label, entry in result.items():
            if "error" in entry:
                print(f"{attn:<18} {label:<32} ERROR {entry['error']}")
                continue
            x = entry.get("ttft_x")
            ratio = "-" if x is None else f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})"
            tokens = entry["tokens"] if entry["tokens"] is not None else "all"
            print(
                f"{attn:<18} {label:<32} {entry['ttft_ms']['median']:>9.1f} {entry['vision_ms']['median']:>10.1f} "
                f"{ratio:>22} {tokens:>7}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="vtc's tiny model on the CPU (a smoke run, seconds)")
    parser.add_argument("--frames", type=int, help="frames (default 16; --tiny: 4)")
    parser.add_argument("--frame-size", type=int, help="frame side in px (default 448; --tiny: 112)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"method specs (default {','.join(METHODS)})")
    parser.add_argument("--retention", type=float, default=0.25, help="overall retention (default 0.25)")
    parser.add_argument("--repeats", type=int, help="repeats after one warm-up round (default 3; --tiny: 1)")
    parser.add_argument("--attention", default="sdpa,flash_attention_2", help="attention implementations")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    args = parser.parse_args(argv)
    report = run(
        tiny=args.tiny,
        frames=args.frames or (4 if args.tiny else 16),
        size=args.frame_size or (112 if args.tiny else 448),
        methods=[m for m in args.methods.split(",") if m],
        retention=args.retention,
        repeats=args.repeats or (1 if args.tiny else 3),
        attentions=[a for a in args.attention.split(",") if a],
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.json}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
