"""GPU check: FastV and FrameFusion keep the model's own attention implementation (flash-attention-2 vs SDPA).

vtc used to run every layer after a prune with SDPA and a dense mask, so a model loaded with
`attn_implementation="flash_attention_2"` lost flash-attention exactly where the sequence was long. Now each layer
keeps the model's own implementation (docs/concepts.md, "Attention implementations"). Two parts:

  check   vtc's demo-size Qwen2.5-VL (8 layers, 512 wide), bf16, on the GPU, loaded with each implementation; for
          FastV and FrameFusion at retention 0.5, one video and a left-padded batch of two videos of different
          sizes (rows keep different numbers of tokens): which implementation computed each layer
          (`stats.layer_attention`), the fallbacks (`stats.attention_fallbacks`, expected: none), and how far
          the last-token logits are from the same model under SDPA (relative L2 error). Seconds.
  timing  prefill of a Qwen2.5-VL-7B-shaped model at 64 frames, unpatched / FastV / FrameFusion, under SDPA and
          flash_attention_2 (`eval/gpu_prefill.py` measures it), and flash_attention_2 / SDPA per method. With
          `--prefill-json PATH` the timings are read from a gpu_prefill report (eval/gpu_check.sh runs that one
          step earlier, so no GPU time is spent twice); without it this script runs gpu_prefill's measurement.

`--tiny` runs both parts on the CPU with vtc's tiny model, comparing eager with SDPA (flash-attention does not
exist there), so the code has run before a GPU is lent. The exit code is 1 when a check fails.

Run by eval/gpu_check.sh; alone: `python eval/gpu_attention.py --json attention.json` (add `--tiny` without a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
from typing import Any, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("fastv", "framefusion")
MAX_RELATIVE_ERROR = {"bf16": 2e-2, "fp32": 1e-4}  # last-token logits, another implementation vs SDPA


def _gpu_prefill():
    spec = importlib.util.spec_from_file_location("gpu_prefill", os.path.join(HERE, "gpu_prefill.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def implementations(tiny: bool) -> tuple[list[str], dict[str, str]]:
    """(implementations to compare, skipped -> why); SDPA first, it is the reference."""
    if tiny:
        return ["sdpa", "eager"], {"flash_attention_2": "no flash-attention on the CPU (--tiny compares eager)"}
    reason = _gpu_prefill().flash_attention_available()
    if reason is not None:
        return ["sdpa"], {"flash_attention_2": reason}
    return ["sdpa", "flash_attention_2"], {}


def check(tiny: bool, methods: Sequence[str], retention: float) -> dict[str, Any]:
    """Which implementation ran each layer, and the logits against SDPA's, per implementation, method and input."""
    import vtc
    from vtc.testing import fixtures
    from vtc.testing import tiny as tiny_models

    device = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    model, processor = tiny_models.build("qwen2_5_vl", size="tiny" if tiny else "demo", dtype=dtype)
    model.to(device)
    clips = fixtures.videos()
    inputs = {
        "one video": vtc.prepare_inputs(processor, clips[0], fixtures.QUESTIONS[0], num_frames=8, fps=8),
        "padded batch": vtc.prepare_inputs(processor, list(clips), list(fixtures.QUESTIONS), num_frames=8, fps=8),
    }
    inputs = {name: batch.to(device) for name, batch in inputs.items()}
    impls, skipped = implementations(tiny)
    tolerance = MAX_RELATIVE_ERROR["fp32" if tiny else "bf16"]
    report: dict[str, Any] = {"model": f"vtc {'tiny' if tiny else 'demo'} qwen2_5_vl, {dtype}", "skipped": skipped}
    rows, reference, failures = [], {}, []
    for impl in impls:
        model.set_attn_implementation(impl)
        for method in methods:
            for name, batch in inputs.items():
                with vtc.patch(model, method, retention=retention) as handle, torch.no_grad():
                    logits = model(**batch).logits[:, -1].float()
                stats = handle.stats()
                key = (method, name)
                if impl == "sdpa":
                    reference[key] = logits
                error = float((logits - reference[key]).norm() / reference[key].norm())
                row = {
                    "implementation": impl,
                    "method": method,
                    "input": name,
                    "layer_attention": list(stats.layer_attention),
                    "fallbacks": [dataclasses.asdict(f) for f in stats.attention_fallbacks],
                    "visual_tokens_per_layer": list(stats.layer_visual_tokens),
                    "relative_error_vs_sdpa": error,
                }
                problems = []
                if set(stats.layer_attention) != {impl}:
                    problems.append(f"layers ran {stats.layer_attention}")
                if stats.attention_fallbacks:
                    problems.append(f"fallbacks {row['fallbacks']}")
                if error > tolerance:
                    problems.append(f"logits differ from SDPA's by {error:.3g} (relative L2 > {tolerance})")
                row["ok"] = not problems
                if problems:
                    failures.append(f"{impl} {method} {name}: " + "; ".join(problems))
                rows.append(row)
                print(
                    f"[check] {impl:<18} {method:<12} {name:<13} layers {','.join(sorted(set(row['layer_attention'])))}"
                    f"  fallbacks {len(row['fallbacks'])}  error vs sdpa {error:.2e}  {'ok' if row['ok'] else 'FAIL'}",
                    flush=True,
                )
    model.set_attn_implementation("sdpa")
    report.update(rows=rows, failures=failures)
    return report


def flash_vs_sdpa(prefill: dict[str, Any]) -> dict[str, Any]:
    """Per method, from a gpu_prefill report: median prefill under each implementation, and their ratio."""
    results = prefill.get("attention", {})
    sdpa, flash = results.get("sdpa", {}), results.get("flash_attention_2", {})
    if "skipped" in flash or not flash:
        return {"skipped": flash.get("skipped", "no flash_attention_2 measurement in the prefill report")}
    out: dict[str, Any] = {}
    for label in sdpa:
        a, b = sdpa[label], flash.get(label, {})
        if "prefill_ms" not in a or "prefill_ms" not in b:
            out[label] = {"error": a.get("error") or b.get("error") or "not measured"}
            continue
        out[label] = {
            "sdpa_ms": a["prefill_ms"]["median"],
            "flash_attention_2_ms": b["prefill_ms"]["median"],
            "flash_over_sdpa": b["prefill_ms"]["median"] / a["prefill_ms"]["median"],
            "sdpa_ratio_vs_unpatched": a.get("prefill_ratio", {}).get("median"),
            "flash_ratio_vs_unpatched": b.get("prefill_ratio", {}).get("median"),
        }
    return out


def timing(tiny: bool, prefill_json: str | None, methods: Sequence[str], retention: float) -> dict[str, Any]:
    if prefill_json and not os.path.exists(prefill_json):  # its own step failed, and says so
        print(f"[timing] skipped: no prefill report at {prefill_json}", flush=True)
        return {"source": prefill_json, "per_method": {"skipped": f"no prefill report at {prefill_json}"}}
    if prefill_json:
        with open(prefill_json) as fh:
            prefill = json.load(fh)
        source = prefill_json
    else:
        impls, _ = implementations(tiny)
        gpu_prefill = _gpu_prefill()
        prefill = gpu_prefill.run(
            tiny_model=tiny,
            frames=8 if tiny else 64,
            frame_size=112 if tiny else 448,
            methods=list(methods),
            retention=retention,
            repeats=1 if tiny else 5,
            attentions=impls if not tiny else ["sdpa"],
        )
        source = "eval/gpu_prefill.py (run here)"
    result = {"source": source, "model": prefill.get("model"), "per_method": flash_vs_sdpa(prefill)}
    per_method = result["per_method"]
    if "skipped" in per_method:
        print(f"[timing] flash_attention_2 vs sdpa: skipped ({per_method['skipped']})", flush=True)
    else:
        print(f"[timing] {result['model']}: median prefill, flash_attention_2 vs sdpa", flush=True)
        for label, row in per_method.items():
            if "error" in row:
                print(f"[timing] {label:<12} ERROR {row['error']}", flush=True)
            else:
                print(
                    f"[timing] {label:<12} sdpa {row['sdpa_ms']:9.1f} ms  flash_attention_2 "
                    f"{row['flash_attention_2_ms']:9.1f} ms  ratio {row['flash_over_sdpa']:.3f}",
                    flush=True,
                )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="vtc's tiny model on the CPU, eager vs sdpa (seconds)")
    parser.add_argument("--methods", default=",".join(METHODS), help="in-LLM methods (default fastv,framefusion)")
    parser.add_argument("--retention", type=float, default=0.5, help="retention in the check (default 0.5)")
    parser.add_argument("--prefill-json", metavar="PATH", help="take the timings from this gpu_prefill report")
    parser.add_argument("--skip-timing", action="store_true", help="only the implementation check")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("gpu_attention: no CUDA device here; run with --tiny for the CPU version")
    methods = [m for m in args.methods.split(",") if m]
    import vtc  # noqa: F401  (fail early, before any model is built)

    report: dict[str, Any] = {
        "device": "cpu" if args.tiny else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "check": check(args.tiny, methods, args.retention),
    }
    if not args.skip_timing:
        try:
            report["timing"] = timing(args.tiny, args.prefill_json, methods, 0.3)
        except Exception as err:  # reported, never swallowed: the exit code says so
            report["timing"] = {"error": f"{type(err).__name__}: {err}"}
            report["check"]["failures"].append(f"timing failed: {report['timing']['error']}")
    failures = report["check"]["failures"]
    print(f"[attention] {len(failures)} failure(s)" + "".join(f"\n  {f}" for f in failures), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
