"""End-to-end prefill check on a GPU: does vtc's in-LLM compression pay for itself on a 7B model?

Once a prefill plugin (FastV, FrameFusion) shortens the sequence, the shortened layers still run the model's own
attention implementation, on gathered position ids (a mask only where there is padding). That must not cost
more than the tokens it saves. This script builds a random-weight model with the shapes of Qwen2.5-VL-7B (from
its config.json; offline, bf16, on the GPU), feeds it a generated 64-frame clip, and for each attention
implementation ("sdpa", and "flash_attention_2" when flash_attn imports) times the prefill of the unpatched model
and of each method, round-robin over repeats:

  prefill ratio = prefill with the method / prefill unpatched            (< 1: the method saves time)
  efficiency    = limit / prefill with the method, where the limit is the same decoder layers running the
                  method's per-layer token counts with the model's own attention and no compression logic
                  (vtc.hf.timing.plain_prefill_seconds); 1.0 = the method costs nothing beyond its tokens

Both as median (min-max) over repeats, each ratio from one repeat's measurements. `--tiny` runs the same code on
vtc's tiny random Qwen2.5-VL on the CPU in seconds (the test suite does, so the GPU run's code has run before).

Run by eval/gpu_check.sh; alone: `python eval/gpu_prefill.py --json prefill.json` (add `--tiny` without a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Sequence

import torch

QUESTION = "What happens in this video?"

# Qwen/Qwen2.5-VL-7B-Instruct config.json (text model and vision tower shapes); the vocabulary is the offline
# test tokenizer's (the LM head runs on one position in prefill, so its size does not move the timing)
QWEN25_VL_7B_TEXT = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=128000,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
QWEN25_VL_7B_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
)
ATTENTION = ("sdpa", "flash_attention_2")


def flash_attention_available() -> str | None:
    """None when transformers can run flash_attention_2 here, else why not."""
    try:
        import flash_attn  # noqa: F401
    except Exception as err:  # ImportError, or a build that fails to load its CUDA library
        return f"flash_attn does not import ({type(err).__name__}: {err})"
    from transformers.utils import is_flash_attn_2_available

    return None if is_flash_attn_2_available() else "transformers reports flash_attention_2 unavailable"


def build_7b(device: str, dtype: torch.dtype, attn: str):
    """(model, processor): Qwen2.5-VL-7B shapes with random weights, created directly on `device`."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    from vtc.testing import tiny

    tokenizer = tiny.build_tokenizer("qwen2_5_vl", 1024)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            **QWEN25_VL_7B_TEXT,
        ),
        vision_config=QWEN25_VL_7B_VISION,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(0)
    # created on the GPU: initialising 8B parameters on the CPU first would take minutes of the device's time
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation=attn)
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        video_processor=Qwen2VLVideoProcessor(),
        tokenizer=tokenizer,
        chat_template=tiny.QWEN_CHAT_TEMPLATE,
    )
    return model, processor


def build_tiny(attn: str):
    """vtc's tiny Qwen2.5-VL (the test suite's shared instance: built once per process)."""
    from vtc.testing.fixtures import model_and_processor

    model, processor = model_and_processor("qwen2_5_vl")
    if model.config._attn_implementation != attn:
        model.set_attn_implementation(attn)
    return model, processor


def measure(model, inputs, spec: str | None, retention: float | None) -> dict[str, Any]:
    """One timed `generate(max_new_tokens=1)`: prefill inside the LLM, TTFT, token counts per layer."""
    import vtc
    from vtc.hf.timing import LLMTimer, synchronize

    handle = vtc.patch(model, spec, retention=retention) if spec else None
    try:
        with LLMTimer(model) as timer, torch.no_grad():
            synchronize()
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=1, do_sample=False)
            synchronize()
            ttft = time.perf_counter() - start
        stats = handle.stats() if handle else None
    finally:
        if handle is not None:
            handle.unpatch()
    row: dict[str, Any] = {"prefill_s": timer.first, "ttft_s": ttft}
    if stats is not None:
        row.update(
            connect_s=stats.stage_seconds().get("connect", 0.0),
            tokens_out=stats.visual_tokens_out,
            layer_tokens=list(stats.layer_visual_tokens),
        )
    return row


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run(
    tiny_model: bool,
    frames: int,
    frame_size: int,
    methods: Sequence[str],
    retention: float,
    repeats: int,
    attentions: Sequence[str],
    warmup: int = 1,
) -> dict[str, Any]:
    import vtc
    from vtc.hf.timing import plain_prefill_seconds
    from vtc.media.video import synthetic_video

    device = "cpu" if tiny_model else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_prefill: no CUDA device here; run with --tiny for the CPU smoke version")
    dtype = torch.float32 if tiny_model else torch.bfloat16
    video = synthetic_video(frames, frame_size, frame_size)
    report: dict[str, Any] = {
        "model": "vtc tiny qwen2_5_vl (CPU)" if tiny_model else "random-weight Qwen2.5-VL-7B shapes, bf16",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "frames": frames,
        "frame_size": frame_size,
        "retention": retention,
        "repeats": repeats,
        "warmup": warmup,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "attention": {},
    }
    failures = 0
    model = processor = None
    for attn in attentions:
        reason = flash_attention_available() if attn == "flash_attention_2" else None
        if reason is not None:
            report["attention"][attn] = {"skipped": reason}
            print(f"[{attn}] skipped: {reason}", flush=True)
            continue
        if model is None:
            start = time.perf_counter()
            model, processor = build_tiny(attn) if tiny_model else build_7b(device, dtype, attn)
            built_with = attn
            print(f"model built in {time.perf_counter() - start:.1f} s", flush=True)
            inputs = vtc.prepare_inputs(processor, video, QUESTION, "uniform", num_frames=frames, fps=8)
            inputs = inputs.to(device)
        else:
            model.set_attn_implementation(attn)
        configs: list[tuple[str, str | None]] = [("none", None)] + [(m, m) for m in methods]
        rows: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in configs}
        errors: dict[str, str] = {}
        # untimed runs of every configuration first: cuBLAS and attention kernel selection, the Triton kernels'
        # compilation on the methods' first calls, and the allocator's first growth all land here
        for _ in range(warmup):
            for label, spec in configs:
                if label in errors:
                    continue
                try:
                    measure(model, inputs, spec, retention if spec else None)
                except Exception as err:  # the timed loop skips it and the report shows why
                    errors[label] = f"{type(err).__name__}: {err}"
                    print(f"[{attn}] {label} failed in warm-up: {errors[label]}", flush=True)
                    failures += 1
        for rep in range(repeats):
            for label, spec in configs:
                if label in errors:
                    continue
                try:
                    row = measure(model, inputs, spec, retention if spec else None)
                    if spec:
                        # the limit right after the method: its own per-layer counts, no compression logic
                        text_tokens = int(inputs["input_ids"].shape[1]) - int(
                            (inputs["input_ids"] == model.config.video_token_id).sum()
                        )
                        row["limit_s"] = plain_prefill_seconds(model, text_tokens, row["layer_tokens"])
                except Exception as err:  # reported in the JSON and the exit code, never swallowed
                    errors[label] = f"{type(err).__name__}: {err}"
                    print(f"[{attn}] {label} failed: {errors[label]}", flush=True)
                    failures += 1
                    continue
                rows[label].append(row)
                print(
                    f"[{attn}] repeat {rep + 1}/{repeats} {label}: prefill {row['prefill_s'] * 1e3:.1f} ms", flush=True
                )
        report["attention"][attn] = summarize(rows, errors)
    if model is not None and model.config._attn_implementation != built_with:
        model.set_attn_implementation(built_with)  # the tiny model is shared with the rest of the test run
    print_report(report)
    report["failures"] = failures
    return report


def summarize(rows: dict[str, list[dict[str, Any]]], errors: dict[str, str]) -> dict[str, Any]:
    base = rows["none"]
    out: dict[str, Any] = {}
    for label, measured in rows.items():
        if label in errors:
            out[label] = {"error": errors[label]}
            continue
        entry: dict[str, Any] = {
            "prefill_ms": spread([r["prefill_s"] * 1e3 for r in measured]),
            "ttft_ms": spread([r["ttft_s"] * 1e3 for r in measured]),
        }
        if label != "none" and base:
            paired = list(zip(measured, base))
            entry["prefill_ratio"] = spread([r["prefill_s"] / b["prefill_s"] for r, b in paired])
            entry["efficiency"] = spread([r["limit_s"] / (r["prefill_s"] + r["connect_s"]) for r, _ in paired])
            entry["limit_ms"] = spread([r["limit_s"] * 1e3 for r in measured])
            entry["tokens_out"] = measured[0]["tokens_out"]
            entry["mean_layer_tokens"] = sum(measured[0]["layer_tokens"]) / len(measured[0]["layer_tokens"])
        out[label] = entry
    return out


def print_report(report: dict[str, Any]) -> None:
    print(
        f"\n{report['model']} on {report['device']}: {report['frames']} frames of {report['frame_size']} px, "
        f"retention {report['retention']}, median (min-max) of {report['repeats']} repeats"
    )
    print(f"{'attention':<18} {'method':<12} {'prefill ms':>11} {'ratio vs none':>24} {'efficiency':>22} {'tokens':>8}")
    for attn, result in report["attention"].items():
        if "skipped" in result:
            print(f"{attn:<18} skipped: {result['skipped']}")
            continue
        for label, entry in result.items():
            if "error" in entry:
                print(f"{attn:<18} {label:<12} ERROR {entry['error']}")
                continue
            ratio = _fmt(entry.get("prefill_ratio"))
            eff = _fmt(entry.get("efficiency"))
            tokens = entry.get("tokens_out", "all")
            print(f"{attn:<18} {label:<12} {entry['prefill_ms']['median']:>11.1f} {ratio:>24} {eff:>22} {tokens:>8}")


def _fmt(s: dict[str, float] | None) -> str:
    return "-" if s is None else f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="vtc's tiny model on the CPU (a smoke run, seconds)")
    parser.add_argument("--frames", type=int, help="frames (default 64; --tiny: 8)")
    parser.add_argument(
        "--frame-size", type=int, help="frame side in px (default 448: 8192 visual tokens; --tiny: 112)"
    )
    parser.add_argument("--methods", default="fastv,framefusion", help="in-LLM methods (default fastv,framefusion)")
    parser.add_argument("--retention", type=float, default=0.3, help="retention of every method (default 0.3)")
    parser.add_argument("--repeats", type=int, help="repeats (default 5; --tiny: 1)")
    parser.add_argument("--attention", default=",".join(ATTENTION), help="attention implementations to compare")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of every configuration (default 1)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    args = parser.parse_args(argv)
    attentions = [a for a in args.attention.split(",") if a]
    unknown = [a for a in attentions if a not in ATTENTION]
    if unknown:
        parser.error(f"unknown attention {unknown}; choose from {', '.join(ATTENTION)}")
    report = run(
        tiny_model=args.tiny,
        frames=args.frames or (8 if args.tiny else 64),
        frame_size=args.frame_size or (112 if args.tiny else 448),
        methods=[m for m in args.methods.split(",") if m],
        retention=args.retention,
        repeats=args.repeats or (1 if args.tiny else 5),
        attentions=attentions,
        warmup=args.warmup,
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.json}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
