"""Per-document efficiency records and their summary: what the `vtc` lmms-eval model logs with every sample
(visual tokens per stage, prefill time, TTFT) and what `vtc eval` and the results JSON aggregate from them.
Plain dictionaries, so a results file can be read back without lmms-eval or vtc's model classes."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from vtc.core.stats import ForwardStats, MediaItem

NO_VIDEO = "no video in this document: vtc compressed nothing"


def _record(
    backend: str,
    grids: list[tuple[int, int, int]],
    counts: dict[str, int],
    stages: list[dict[str, Any]],
    times: dict[str, float | None],
    output_tokens: int,
) -> dict[str, Any]:
    return {
        "backend": backend,
        "grids": [list(g) for g in grids],
        **counts,
        "stages": stages,
        **times,
        "output_tokens": output_tokens,
    }


def _counts(visual_in: int, llm_visual: int, visual_out: int, prompt: int, llm_prompt: int) -> dict[str, int]:
    return {
        "visual_tokens_in": visual_in,  # produced by the vision encoder (compressible)
        "llm_visual_tokens": llm_visual,  # entering the LLM
        "visual_tokens_out": visual_out,  # alive at the LLM's last layer
        "prompt_tokens": prompt,  # the prompt before compression
        "llm_prompt_tokens": llm_prompt,  # the prompt the LLM ran
    }


def doc_record(
    stats: ForwardStats | None,
    *,
    visual_tokens: int,
    grids: list[tuple[int, int, int]],
    prompt_tokens: int,
    output_tokens: int,
    ttft_s: float,
    generate_s: float,
    prefill_s: float,
    sample_s: float,
) -> dict[str, Any]:
    """One document on the HF backend. With `stats` (a patched model's last prefill) the counts are vtc's; without
    (the uncompressed baseline) every visual token reaches every layer: `visual_tokens` in, the same out."""
    times = {"ttft_s": ttft_s, "prefill_s": prefill_s, "generate_s": generate_s, "sample_s": sample_s}
    if stats is None or not stats.has_video:
        counts = _counts(visual_tokens, visual_tokens, visual_tokens, prompt_tokens, prompt_tokens)
        record = _record("hf", grids, counts, [], times, output_tokens)
        if stats is not None:
            record["note"] = NO_VIDEO
        return record
    counts = _counts(
        stats.visual_tokens_in, stats.llm_tokens_in, stats.visual_tokens_out, stats.sequence_in, stats.sequence_out
    )
    stages = [
        {
            "stage": s.stage,
            "plugin": s.plugin,
            "tokens_in": s.tokens_in,
            "tokens_out": s.tokens_out,
            "ms": round(s.seconds * 1e3, 3),
        }
        for s in stats.stages
    ]
    record = _record("hf", grids, counts, stages, times, output_tokens)
    record["layer_visual_tokens"] = list(stats.layer_visual_tokens)
    record["items"] = [dataclasses.asdict(item) for item in stats.items]  # each video and image: tokens in / out
    if stats.frames:  # what the model was shown: the sampler's frames, their times and scores
        record["frames"] = [frame_record(f) for f in stats.frames]
    return record


def frame_record(selection) -> dict[str, Any]:
    """A `FrameSelection` as the logged sample keeps it (the candidates' scores left out: they can be thousands)."""
    return {
        "method": selection.method,
        "indices": list(selection.indices),
        "timestamps": [round(t, 3) for t in selection.timestamps],
        "scores": list(selection.scores),
        "sizes": selection.sizes,
    }


def served_record(
    methods: str | None,
    *,
    grids: list[tuple[int, int, int]],
    visual_tokens: int,
    kept_tokens: int,
    prompt_tokens: int,
    llm_prompt_tokens: int,
    output_tokens: int,
    ttft_s: float | None,
    prefill_s: float | None,
    generate_s: float,
    sample_s: float,
    items: list[MediaItem] = (),
) -> dict[str, Any]:
    """One document answered by vLLM: the connect stage as one step (vLLM reports no per-plugin times), the LLM
    untouched after it (serving runs connect-stage methods only). TTFT and prefill are vLLM's request metrics
    (arrival to first token; scheduled to first token)."""
    stages = []
    if methods is not None:
        stages = [
            {"stage": "connect", "plugin": methods, "tokens_in": visual_tokens, "tokens_out": kept_tokens, "ms": None}
        ]
    counts = _counts(visual_tokens, kept_tokens, kept_tokens, prompt_tokens, llm_prompt_tokens)
    times = {"ttft_s": ttft_s, "prefill_s": prefill_s, "generate_s": generate_s, "sample_s": sample_s}
    record = _record("vllm", grids, counts, stages, times, output_tokens)
    record["items"] = [dataclasses.asdict(item) for item in items]  # each video and image: tokens in / out
    if methods is not None and not any(item.compressed for item in items):
        record["note"] = NO_VIDEO
    return record


SUMMED = ("visual_tokens_in", "llm_visual_tokens", "visual_tokens_out", "prompt_tokens", "llm_prompt_tokens")
TIMED = ("ttft_s", "prefill_s", "sample_s", "generate_s")


def summarize(records: Iterable[dict[str, Any] | None]) -> dict[str, Any]:
    """Means per document of the token counts and times, and the measured retention (visual tokens the LLM saw
    at its input and at its last layer, over those the model produced, summed over documents). Documents without
    a vtc record (another model's samples) are counted in `docs_without_record`."""
    records = list(records)
    present = [r for r in records if r]
    summary: dict[str, Any] = {"docs": len(records), "docs_without_record": len(records) - len(present)}
    if not present:
        return summary
    for key in SUMMED + TIMED:
        values = [float(r[key]) for r in present if r.get(key) is not None]
        summary[key] = sum(values) / len(values) if values else None
    produced = sum(r["visual_tokens_in"] for r in present)
    summary["retention_llm_input"] = sum(r["llm_visual_tokens"] for r in present) / produced if produced else 1.0
    summary["retention_last_layer"] = sum(r["visual_tokens_out"] for r in present) / produced if produced else 1.0
    return summary


def records_of(samples: Iterable[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """The vtc record of each logged lmms-eval sample (None where a sample has none)."""
    out = []
    for sample in samples:
        counts = [c for c in sample.get("token_counts") or [] if isinstance(c, dict)]
        out.append(next((c["vtc"] for c in counts if "vtc" in c), None))
    return out
