"""`vtc eval`: accuracy and speed of methods x retentions on lmms-eval tasks, with the uncompressed baseline.

    vtc eval --model Qwen/Qwen2.5-VL-7B-Instruct --tasks videomme --methods vidcom2,framefusion \\
        --retentions 0.5,0.25,0.1 --out eval-qwen

The model is loaded once (lmms-eval's `vtc` model) and re-patched for every cell; each cell is one
`lmms_eval.evaluator.simple_evaluate` call on one task. Every cell's result goes to `DIR/cells/<cell>.json`
as soon as it ends (its logged samples to `DIR/samples/`), so a rerun skips finished cells, and a cell that
fails is recorded with its error while the grid goes on. At the end: `DIR/table.md`, `DIR/grid.json` and
`DIR/pareto.png` (accuracy against retention and against TTFT). Without `--model`: a random-weight model
built offline (for trying the command; its accuracy is noise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import re
import traceback
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from vtc.core.pipeline import Pipeline
from vtc.lmms_eval.efficiency import records_of, summarize
from vtc.tools.bench import params_for
from vtc.tools.progress import progress_bar


@dataclasses.dataclass(frozen=True)
class Cell:
    task: str
    methods: str | None  # None: the uncompressed baseline
    retention: float | None  # None with methods: the methods' official defaults
    frames: int | None = None  # with several --num-frames: this cell's frame budget (None: the one --num-frames)

    @property
    def name(self) -> str:
        spec = self.methods or "baseline"
        tail = "" if self.methods is None else "__rdefault" if self.retention is None else f"__r{self.retention:g}"
        tail += "" if self.frames is None else f"__f{self.frames}"
        return re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{self.task}__{spec}{tail}")

    @property
    def label(self) -> str:
        return "baseline" if self.methods is None else self.methods


def parse_retentions(text: str) -> list[float | None]:
    """Comma-separated retentions, all in (0, 1], or `default` (None: each method's official defaults, or the
    parameters given with --param); the error names every invalid entry."""
    values: list[float | None] = []
    bad = []
    for item in (t.strip() for t in text.split(",")):
        if item == "default":
            values.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            bad.append(item)
            continue
        if not 0 < value <= 1:
            bad.append(item)
        else:
            values.append(value)
    if bad or not values:
        raise ValueError(
            f"--retentions must be numbers in (0, 1] (the fraction of visual tokens kept) or default, got {bad}"
        )
    return values


def parse_methods(text: str) -> list[str]:
    """Comma-separated method specs ("none" entries dropped: the baseline is always run); each checked now."""
    specs = [m.strip() for m in text.split(",") if m.strip() and m.strip() != "none"]
    for spec in specs:
        Pipeline(spec)  # raises naming the known methods
    return specs


def check_tasks(tasks: list[str], task_manager) -> None:
    known = set(task_manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        hints = {t: difflib.get_close_matches(t, known, n=3) for t in unknown}
        described = "; ".join(f"{t!r} (close: {', '.join(h) or 'none'})" for t, h in hints.items())
        raise ValueError(f"lmms-eval does not know the task(s) {described}; `lmms-eval --tasks list` lists them")


def parse_frame_counts(text: Any) -> list[int | None]:
    """`--num-frames`: one frame budget or several (a grid axis), comma-separated positive integers; `none` leaves
    it to the sampler's own rule."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    counts: list[int | None] = []
    for item in items:
        if item.lower() == "none":
            counts.append(None)
        elif item.isdigit() and int(item) > 0:
            counts.append(int(item))
        else:
            raise ValueError(f"--num-frames takes positive integers (e.g. 8,16,32) or none, got {item!r} in {text!r}")
    if not counts:
        raise ValueError("--num-frames needs at least one frame count")
    return counts


def grid_cells(
    tasks: list[str], methods: list[str], retentions: list[float | None], frame_counts: list[int | None] | None = None
) -> list[Cell]:
    """Baseline and methods x retentions per task, and per frame budget when there are several (an axis: each
    budget gets its own baseline)."""
    axis = frame_counts if frame_counts is not None and len(frame_counts) > 1 else [None]
    cells = []
    for task in tasks:
        for frames in axis:
            cells.append(Cell(task, None, None, frames))
            cells += [Cell(task, spec, r, frames) for spec in methods for r in retentions]
    return cells


def leaf_tasks(results: dict[str, Any], task: str) -> list[str]:
    """The tasks lmms-eval ran for `task`: itself, or a group's subtasks (nested groups flattened)."""
    groups = results.get("group_subtasks") or {}
    if not groups.get(task):
        return [task]
    return [leaf for sub in groups[task] for leaf in leaf_tasks(results, sub)]


def primary_metric(results: dict[str, Any], task: str) -> tuple[str, float | None]:
    """The task's first metric (its YAML's metric_list order), as lmms-eval reports it. A group without an
    aggregate of its own (MVBench) gets the mean of its subtasks' first metrics, as the papers report it."""
    config = (results.get("configs") or {}).get(task) or {}
    wanted = [m.get("metric") for m in config.get("metric_list") or [] if isinstance(m, dict)]
    scores = (results.get("results") or {}).get(task) or (results.get("groups") or {}).get(task) or {}
    numeric = {k: v for k, v in scores.items() if isinstance(v, (int, float)) and "stderr" not in k and k != "samples"}
    for metric in wanted:
        for key, value in numeric.items():
            if key.split(",")[0] == metric:
                return metric, float(value)
    if numeric:
        key, value = next(iter(numeric.items()))
        return key.split(",")[0], float(value)
    leaves = leaf_tasks(results, task)
    if leaves != [task]:
        scored = [primary_metric(results, leaf) for leaf in leaves]
        values = [v for _, v in scored if v is not None]
        if values:
            return f"mean of {len(values)} subtasks' {scored[0][0]}", sum(values) / len(values)
    return "metric", None


def run_cell(lm, cell: Cell, task_manager, limit: int | None, params: dict[str, Any]) -> dict[str, Any]:
    from lmms_eval.evaluator import simple_evaluate

    if cell.frames is not None:
        lm.args.num_frames = cell.frames
    lm.configure(cell.methods, cell.retention, params_for(cell.methods, params) if cell.methods else {})
    results = simple_evaluate(
        model=lm,
        tasks=[cell.task],
        batch_size=1,
        limit=limit,
        log_samples=True,
        task_manager=task_manager,
        verbosity="WARNING",
    )
    if results is None:
        raise RuntimeError("lmms-eval returned no results")
    logged = results.get("samples") or {}
    samples = [sample for leaf in leaf_tasks(results, cell.task) for sample in logged.get(leaf, [])]
    metric, value = primary_metric(results, cell.task)
    return {
        "metric": metric,
        "value": value,
        "efficiency": summarize(records_of(samples)),
        "results": results.get("results", {}).get(cell.task, {}),
        "_samples": samples,
    }


def evaluate_grid(
    model: str | None,
    tasks: list[str],
    methods: list[str],
    retentions: list[float | None],
    out_dir: str,
    include_path: str | None = None,
    num_frames: int | None | list[int | None] = 32,
    limit: int | None = None,
    params: dict[str, Any] | None = None,
    model_args: dict[str, Any] | None = None,
    family: str = "qwen2_5_vl",
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the grid (skipping cells already finished in `out_dir`) and write the table and plots. `num_frames` may
    be a list: a grid axis (each cell runs with its own frame budget, each budget with its own baseline)."""
    console = console or Console()
    frame_counts = list(num_frames) if isinstance(num_frames, (list, tuple)) else [num_frames]
    from lmms_eval.tasks import TaskManager

    task_manager = TaskManager(verbosity="ERROR", include_path=include_path, model_name="vtc")
    check_tasks(tasks, task_manager)
    out = Path(out_dir)
    settings = {
        "model": model or f"random-weight {family} (offline demo)",
        "num_frames": frame_counts if len(frame_counts) > 1 else frame_counts[0],
        "limit": limit,
        "params": params or {},
        "model_args": model_args or {},
    }
    _check_settings(out, settings)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    (out / "samples").mkdir(exist_ok=True)
    _write_json(out / "settings.json", settings)
    cells = grid_cells(tasks, methods, retentions, frame_counts)
    todo = [c for c in cells if _load_cell(out, c).get("status") != "ok"]
    console.print(f"vtc eval: {len(cells)} cells, {len(cells) - len(todo)} already finished in {out}")
    if todo:
        lm = _build_model(model, family, frame_counts[0], model_args or {}, out, console)
        with progress_bar(console) as progress, contextlib.ExitStack() as cleanup:
            if lm.args.backend == "hf":  # the grid leaves the model as it was loaded (unpatched)
                cleanup.callback(lm.configure, None)
            bar = progress.add_task("cells", total=len(todo))
            for cell in todo:
                progress.update(bar, description=f"{cell.task}: {cell.label} r={_retention_text(cell)}")
                record: dict[str, Any] = {"task": cell.task, "methods": cell.methods, "retention": cell.retention}
                if cell.frames is not None:
                    record["frames"] = cell.frames
                try:
                    result = run_cell(lm, cell, task_manager, limit, params or {})
                    samples = result.pop("_samples")
                    _write_jsonl(out / "samples" / f"{cell.name}.jsonl", samples)
                    record.update(status="ok", **result)
                except Exception as err:  # one failing cell must not stop the grid
                    record.update(status="error", error=f"{type(err).__name__}: {err}", trace=traceback.format_exc())
                    console.print(f"[red]cell {cell.name} failed:[/red] {record['error']}")
                _write_json(out / "cells" / f"{cell.name}.json", record)
                progress.advance(bar)
    backend = settings["model_args"].get("backend", "hf")
    report = {"model": f"{settings['model']} [{backend}]", "cells": [_load_cell(out, c) for c in cells]}
    _write_json(out / "grid.json", report)
    rows = table_rows(report)
    (out / "table.md").write_text(markdown_table(report, rows))
    console.print(rich_table(report, rows))
    plot(report, rows, str(out / "pareto.png"))
    failed = [c for c in report["cells"] if c.get("status") != "ok"]
    if failed:
        console.print(f"[red]{len(failed)} cell(s) failed[/red] (rerun the command to retry them):")
        for c in failed:
            console.print(
                f"  {c.get('task')} {c.get('methods') or 'baseline'} r={c.get('retention')}: {c.get('error')}"
            )
    console.print(f"wrote {out / 'table.md'}, {out / 'grid.json'} and {out / 'pareto.png'}")
    return report


def _check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Finished cells are reused only by a run with the same model and settings."""
    path = out / "settings.json"
    if not path.exists():
        return
    before = json.loads(path.read_text())
    changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
    if changed:
        described = "; ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in changed.items())
        raise ValueError(f"{out} holds a grid run with other settings ({described}); use another --out")


def _build_model(model, family, num_frames, model_args, out: Path, console: Console):
    from vtc.lmms_eval.model import VtcModel

    if model is None:
        from vtc.testing import tiny

        model = str(out / f"demo-model-{family}")
        if not (out / f"demo-model-{family}" / "config.json").exists():
            with console.status(f"building a random-weight {family} model (offline demo)"):
                tiny.save(family, model)
        console.print(f"[bold red]random weights[/bold red]: {model} (accuracy is noise; tokens and times are real)")
    with console.status(f"loading {model}"):
        lm = VtcModel(pretrained=model, num_frames=num_frames, **model_args)
    lm.keep_loaded = True  # one load for the whole grid
    return lm


def _retention_text(cell: Cell) -> str:
    if cell.methods is None:
        return "1"
    return "default" if cell.retention is None else f"{cell.retention:g}"


def _load_cell(out: Path, cell: Cell) -> dict[str, Any]:
    path = out / "cells" / f"{cell.name}.json"
    if not path.exists():
        missing = {"task": cell.task, "methods": cell.methods, "retention": cell.retention, "status": "missing"}
        return {**missing, "frames": cell.frames} if cell.frames is not None else missing
    return json.loads(path.read_text())


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    os.replace(tmp, path)


# --- the table and the plots ----------------------------------------------------------------------------------


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per finished cell, with its TTFT speedup over its task's baseline."""
    rows = []
    ok = [c for c in report["cells"] if c.get("status") == "ok"]
    base_ttft = {(c["task"], c.get("frames")): c["efficiency"].get("ttft_s") for c in ok if c["methods"] is None}
    for c in ok:
        eff = c["efficiency"]
        base = base_ttft.get((c["task"], c.get("frames")))
        ttft = eff.get("ttft_s")
        rows.append(
            {
                "task": c["task"],
                "frames": c.get("frames"),
                "methods": c["methods"] or "baseline",
                # one curve per method (and frame budget, with that axis)
                "series": (c["methods"] or "baseline") + (f" @ {c['frames']} frames" if c.get("frames") else ""),
                # requested; a cell run at the methods' defaults shows what it kept at the LLM's last layer
                "retention": c["retention"] if c["retention"] is not None else 1.0 if c["methods"] is None else None,
                "plotted_retention": c["retention"] or eff.get("retention_last_layer"),
                "metric": c["metric"],
                "value": c["value"],
                "llm_visual_tokens": eff.get("llm_visual_tokens"),
                "visual_tokens_in": eff.get("visual_tokens_in"),
                "measured": eff.get("retention_last_layer"),
                "ttft_s": ttft,
                "speedup": base / ttft if base and ttft else None,
                "prefill_s": eff.get("prefill_s"),
                "docs": eff.get("docs"),
            }
        )
    return rows


COLUMNS = [
    ("task", lambda r: r["task"]),
    ("frames", lambda r: _num(r["frames"], "d")),
    ("methods", lambda r: r["methods"]),
    ("retention", lambda r: "default" if r["retention"] is None else f"{r['retention']:g}"),
    ("score", lambda r: "-" if r["value"] is None else f"{r['value']:.4g} ({r['metric']})"),
    (
        "visual tokens to LLM",
        lambda r: _num(r["llm_visual_tokens"], ".0f") + " / " + _num(r["visual_tokens_in"], ".0f"),
    ),
    ("kept at last layer", lambda r: _num(r["measured"], ".1%")),
    ("TTFT s", lambda r: _num(r["ttft_s"], ".3f")),
    ("TTFT x", lambda r: _num(r["speedup"], ".2f") + "x" if r["speedup"] else "-"),
    ("prefill s", lambda r: _num(r["prefill_s"], ".3f")),
    ("docs", lambda r: _num(r["docs"], ".0f")),
]


def _columns(rows: list[dict[str, Any]]):
    """The table's columns: "frames" only when the grid has a frame-budget axis."""
    if any(r.get("frames") is not None for r in rows):
        return COLUMNS
    return [c for c in COLUMNS if c[0] != "frames"]


def _num(value, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def markdown_table(report: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"Model: {report['model']}. Visual tokens and times are means per document; TTFT x is the speedup over "
        "the task's baseline measured in the same run.",
        "",
        "| " + " | ".join(name for name, _ in _columns(rows)) + " |",
        "|" + "|".join("---" for _ in _columns(rows)) + "|",
    ]
    lines += ["| " + " | ".join(fmt(r) for _, fmt in _columns(rows)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def rich_table(report: dict[str, Any], rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"vtc eval: {report['model']}")
    for name, _ in _columns(rows):
        table.add_column(name, justify="left" if name in ("task", "methods") else "right")
    for r in rows:
        table.add_row(*(fmt(r) for _, fmt in _columns(rows)))
    return table


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both cost (x, lower is better) and score (y, higher is better)."""
    front, best = [], -math.inf
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return front


def plot(report: dict[str, Any], rows: list[dict[str, Any]], path: str) -> None:
    """Per task: score against retention, and score against TTFT (with the Pareto front)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows)) or ["(no finished cells)"]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 4 * len(tasks)), squeeze=False)
    for (ax_r, ax_t), task in zip(axes, tasks):
        task_rows = [r for r in rows if r["task"] == task and r["value"] is not None]
        for label in dict.fromkeys(r["series"] for r in task_rows):
            mine = sorted((r for r in task_rows if r["series"] == label), key=lambda r: r["plotted_retention"] or 1)
            baseline = mine[0]["methods"] == "baseline"
            style = {"marker": "*", "markersize": 14, "linestyle": "none"} if baseline else {"marker": "o"}
            ax_r.plot([r["plotted_retention"] for r in mine], [r["value"] for r in mine], label=label, **style)
            timed = [r for r in mine if r["ttft_s"] is not None]
            ax_t.plot([r["ttft_s"] for r in timed], [r["value"] for r in timed], label=label, **style)
        front = pareto_front([(r["ttft_s"], r["value"]) for r in task_rows if r["ttft_s"] is not None])
        if len(front) > 1:
            ax_t.plot(*zip(*front), color="grey", linestyle="--", linewidth=1, label="Pareto front")
        metric = task_rows[0]["metric"] if task_rows else "score"
        ax_r.set(
            xlabel="retention (fraction of visual tokens kept)", ylabel=metric, title=f"{task}: {metric} vs retention"
        )
        ax_t.set(xlabel="TTFT (s, mean per document)", ylabel=metric, title=f"{task}: {metric} vs TTFT")
        for ax in (ax_r, ax_t):
            ax.grid(alpha=0.3)
            if task_rows:
                ax.legend(fontsize=8)
    fig.suptitle(report["model"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
