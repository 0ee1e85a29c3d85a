"""vtc inside a stock lmms-eval: the `vtc` model through the `lmms_eval.models` entry point, on the local task
`tests/lmms_task` (generated clips with known answers), `vtc eval` grids, and the vLLM backend through lmms-eval's
own `vllm_generate` model with vtc's `additional_config`."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vtc.core.pipeline import Pipeline
from vtc.testing import tiny

TASK_DIR = str(Path(__file__).parent / "lmms_task")
TASK = "vtc_clips"
DOCS = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny random-weight checkpoints on disk (lmms-eval loads models by path)."""
    root = tmp_path_factory.mktemp("lmms_models")
    paths = {}
    for family in ("qwen2_5_vl", "llava_onevision"):
        paths[family] = str(root / family)
        tiny.save(family, paths[family])
    return paths


@pytest.fixture(scope="module")
def task_manager():
    from lmms_eval.tasks import TaskManager

    return TaskManager(verbosity="ERROR", include_path=TASK_DIR, model_name="vtc")


def evaluate(lm, task_manager, limit=None):
    from lmms_eval.evaluator import simple_evaluate

    lm.keep_loaded = True
    return simple_evaluate(model=lm, tasks=[TASK], batch_size=1, limit=limit, task_manager=task_manager)


def vtc_records(results):
    from vtc.lmms_eval.efficiency import records_of

    return records_of(results["samples"][TASK])


def test_import_vtc_does_not_import_lmms_eval():
    code = "import sys, vtc; vtc.registry(); assert 'lmms_eval' not in sys.modules, 'lmms_eval imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_entry_point_registers_the_vtc_chat_model():
    from lmms_eval.models import get_model

    from vtc.lmms_eval.model import VtcModel

    assert get_model("vtc") is VtcModel and VtcModel.is_simple is False


def test_lmms_eval_cli_end_to_end(saved, tmp_path):
    """The real client: `lmms-eval --model vtc ...` in a fresh process, task metric and vtc's counts in the files."""
    out = tmp_path / "out"
    # a method parameter rides along as a model arg (fixed_count: the promised count, checkable here)
    args = f"pretrained={saved['qwen2_5_vl']},methods=vidcom2,retention=0.5,num_frames=8,fixed_count=True"
    cmd = ["lmms-eval", "--model", "vtc", "--model_args", args, "--tasks", TASK, "--include_path", TASK_DIR]
    cmd += ["--device", "cpu", "--batch_size", "1", "--log_samples", "--output_path", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(Path(glob.glob(f"{out}/**/*_results.json", recursive=True)[0]).read_text())
    assert "accuracy,none" in results["results"][TASK]
    samples = [json.loads(line) for line in open(glob.glob(f"{out}/**/*_samples_{TASK}.jsonl", recursive=True)[0])]
    assert len(samples) == DOCS
    pipeline = Pipeline("vidcom2", retention=0.5, params={"fixed_count": True}, family="qwen2_5_vl")
    for sample in samples:
        (counts,) = sample["token_counts"]
        record = counts["vtc"]
        (grid,) = record["grids"]
        assert record["visual_tokens_in"] == math.prod(grid)
        assert record["llm_visual_tokens"] == record["visual_tokens_out"] == pipeline.retained_count(tuple(grid))
        assert [s["plugin"] for s in record["stages"]] == ["vidcom2"]
        assert record["llm_prompt_tokens"] == record["prompt_tokens"] - (math.prod(grid) - record["llm_visual_tokens"])
        assert counts["input_tokens"] == record["llm_prompt_tokens"] and counts["output_tokens"] >= 1
        assert record["ttft_s"] > 0 and record["prefill_s"] > 0 and record["generate_s"] >= record["ttft_s"]
    throughput = results["throughput"]
    assert throughput["avg_vtc_retention_llm_input"] == pytest.approx(0.5, abs=0.01)
    assert throughput["avg_vtc_visual_tokens_in"] == pytest.approx(
        sum(s["token_counts"][0]["vtc"]["visual_tokens_in"] for s in samples) / DOCS
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_retention_one_answers_like_the_uncompressed_model(saved, task_manager, family):
    from vtc.lmms_eval.model import VtcModel

    lm = VtcModel(pretrained=saved[family], num_frames=8, device="cpu")
    base = evaluate(lm, task_manager)
    lm.configure("vidcom2", 1.0)
    same = evaluate(lm, task_manager)
    lm.configure("vidcom2", 0.25, {"fixed_count": True})
    small = evaluate(lm, task_manager)

    answers = [s["resps"] for s in base["samples"][TASK]]
    assert [s["resps"] for s in same["samples"][TASK]] == answers
    assert base["results"][TASK]["accuracy,none"] == same["results"][TASK]["accuracy,none"]
    pipeline = Pipeline("vidcom2", retention=0.25, params={"fixed_count": True}, family=family)
    for b, s, c in zip(vtc_records(base), vtc_records(same), vtc_records(small)):
        assert b["stages"] == [] and b["visual_tokens_in"] == b["llm_visual_tokens"] == b["visual_tokens_out"] > 0
        assert s["visual_tokens_in"] == s["llm_visual_tokens"] == b["visual_tokens_in"]
        assert s["llm_prompt_tokens"] == b["llm_prompt_tokens"] == b["prompt_tokens"]
        (grid,) = c["grids"]
        assert c["visual_tokens_in"] == b["visual_tokens_in"]
        assert c["llm_visual_tokens"] == pipeline.retained_count(tuple(grid)) < b["visual_tokens_in"]
    lm.keep_loaded = False
    lm.clean()
    assert lm.handle is None and not hasattr(lm, "model")


def test_the_task_brings_its_own_messages(saved):
    """The chat goes to the model as the task wrote it (text before the video here, and a system prompt), rendered
    by the model's own template, not vtc's "video, then question" prompt."""
    from vtc.lmms_eval.model import VtcModel

    lm = VtcModel(pretrained=saved["qwen2_5_vl"], methods="vidcom2", retention=0.5, num_frames=8, device="cpu")
    lm.system_prompt = "Answer in one letter."
    seen = []
    generate = lm.model.generate

    def spy(**kwargs):
        seen.append(kwargs["input_ids"][0])
        return generate(**kwargs)

    lm.model.generate = spy
    video = str(Path(TASK_DIR) / "data" / "clip0.mp4")
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Watch closely."}, {"type": "video", "url": video}]}
    ]
    text, record = lm.answer(messages, {"max_new_tokens": 3, "until": ["\n\n"]})
    prompt = lm.processor.tokenizer.decode(seen[0])
    assert prompt.index("Answer in one letter.") < prompt.index("Watch closely.") < prompt.index("<|video_pad|>")
    expected = lm.processor.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": "Answer in one letter."}]}]
        + [{"role": "user", "content": [{"type": "text", "text": "Watch closely."}, {"type": "video"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.replace("<|video_pad|>", "") == expected.replace("<|video_pad|>", "")
    # generate gets the full prompt; vtc compresses inside the forward
    assert prompt.count("<|video_pad|>") == record["visual_tokens_in"] == 2 * record["llm_visual_tokens"]


def test_a_sampler_runs_per_document_with_the_tasks_question_and_the_record_shows_its_frames(saved):
    """Issue 19: the `vtc` model runs a sampler on each document with the task's own question; the logged record
    lists the frames the model was shown (indices, times, scores)."""
    from tests.probes import ColourEncoder
    from vtc.lmms_eval.model import VtcModel

    encoder = ColourEncoder()
    lm = VtcModel(
        pretrained=saved["qwen2_5_vl"],
        methods="bolt+vidcom2",
        retention=0.5,
        num_frames=4,
        device="cpu",
        **{"bolt.encoder": encoder},
    )
    video = str(Path(TASK_DIR) / "data" / "clip0.mp4")
    messages = [{"role": "user", "content": [{"type": "video", "url": video}, {"type": "text", "text": "a red ball?"}]}]
    _, record = lm.answer(messages, {"max_new_tokens": 1})
    (frames,) = record["frames"]
    assert frames["method"] == "bolt" and len(frames["indices"]) == 4 and encoder.images_encoded > 0
    assert frames["indices"] == sorted(frames["indices"]) and len(frames["scores"]) == 4
    assert all(s is not None for s in frames["scores"]) and len(frames["timestamps"]) == 4
    assert record["llm_visual_tokens"] == record["visual_tokens_in"] // 2
    lm.handle.unpatch()


def test_an_image_document_is_compressed_or_passes_whole_and_says_so(saved):
    """images=true (default): the document's image reaches the LLM with its promised count, listed in the record;
    images=false: it passes whole, with a warning and a note."""
    from PIL import Image

    from vtc.lmms_eval.model import VtcModel

    lm = VtcModel(pretrained=saved["qwen2_5_vl"], methods="vidcom2", retention=0.5, fixed_count=True, device="cpu")
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    messages = [{"role": "user", "content": [{"type": "image", "url": image}, {"type": "text", "text": "Colour?"}]}]
    _, record = lm.answer(messages, {"max_new_tokens": 2})
    (item,) = record["items"]
    assert item["kind"] == "image" and item["compressed"] and record["visual_tokens_in"] == item["tokens_in"] == 4
    promised = lm.handle.retained_count(tuple(item["grid"]), "image")
    assert record["llm_visual_tokens"] == item["tokens_out"] == promised == 2
    assert record["llm_prompt_tokens"] == record["prompt_tokens"] - 2

    lm.args.images = False
    lm.configure("vidcom2", 0.5, {"fixed_count": True})
    with pytest.warns(UserWarning, match=r"no video in this document, so vidcom2 compresses nothing \(images=false\)"):
        text, record = lm.answer(messages, {"max_new_tokens": 2})
    assert record["note"].startswith("no video") and record["stages"] == [] and record["visual_tokens_in"] == 0
    assert record["llm_prompt_tokens"] == record["prompt_tokens"] > 4  # the image's tokens, uncompressed


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_every_family_answers_a_task_chat_with_its_promised_counts(family, tmp_path):
    """One document of the local task on each of the five families: the record's counts are the pipeline's."""
    from vtc.lmms_eval.model import VtcModel

    path = str(tmp_path / family)
    tiny.save(family, path)
    lm = VtcModel(pretrained=path, methods="vidcom2", retention=0.5, fixed_count=True, num_frames=8, device="cpu")
    video = str(Path(TASK_DIR) / "data" / "clip1.mp4")
    messages = [{"role": "user", "content": [{"type": "video", "url": video}, {"type": "text", "text": "Colour?"}]}]
    text, record = lm.answer(messages, {"max_new_tokens": 2})
    (grid,) = record["grids"]
    assert record["visual_tokens_in"] == math.prod(grid) and grid[0] >= 2
    assert record["llm_visual_tokens"] == lm.pipeline.retained_count(tuple(grid)) < record["visual_tokens_in"]
    assert (
        record["llm_prompt_tokens"]
        == record["prompt_tokens"] - record["visual_tokens_in"] + record["llm_visual_tokens"]
    )
    assert record["output_tokens"] >= 1 and isinstance(text, str)


@pytest.mark.parametrize(
    "args, match",
    [
        ({"methods": "vidcom2", "retention": 0.5, "speling": 1}, r"speling.*num_frames"),
        ({"k": 3}, r"unknown model args \['k'\].*methods="),
        ({"retention": 0.5}, r"retention.*methods="),
        ({"methods": "nosuch"}, r"nosuch"),
        ({"methods": "vidcom2", "retention": 1.5}, r"retention"),
        ({"methods": "vidcom2", "num_frames": 0}, r"num_frames"),
        ({"backend": "sglang"}, r"backend must be one of hf, vllm"),
        ({"max_pixels": 40000, "_family": "llava_onevision"}, r"max_pixels: Qwen families only"),
        ({"backend": "vllm", "device_map": "cpu"}, r"device_map: only with backend=hf"),
        ({"vllm_args": '{"max_model_len": 4096}'}, r"vllm_args: only with backend=vllm"),
        ({"backend": "vllm", "vllm_args": "{max_model_len: 4096}"}, r"vllm_args must be a JSON object"),
        ({"candidate_frames": 64}, r"candidate_frames: only with backend=vllm"),
        ({"backend": "vllm", "candidate_frames": 0}, r"candidate_frames must be a positive integer"),
        ({"backend": "vllm", "methods": "fastv", "retention": 0.5}, r"fastv.*vidcom2"),
    ],
)
def test_bad_model_args_name_the_allowed_values(saved, args, match):
    from vtc.lmms_eval.model import VtcModel

    family = args.pop("_family", "qwen2_5_vl")
    with pytest.raises(ValueError, match=match):
        VtcModel(pretrained=saved[family], device="cpu", **args)


def test_a_batch_size_above_one_is_said_to_change_nothing(saved):
    from vtc.lmms_eval.model import VtcModel

    with pytest.warns(UserWarning, match="one document at a time.*batch_size=4"):
        VtcModel(pretrained=saved["qwen2_5_vl"], device="cpu", batch_size=4)


def test_model_args_from_the_command_line_are_parsed():
    from vtc.lmms_eval.model import split_model_args

    parsed, params = split_model_args(
        {"pretrained": "p", "methods": "quota", "num_frames": "none", "retention": "None", "k": 3}
    )
    assert parsed.num_frames is None and parsed.retention is None and params == {"k": 3}
    parsed, _ = split_model_args({"pretrained": "p", "backend": "vllm", "vllm_args": '{"max_model_len": 4096}'})
    assert parsed.vllm_args == {"max_model_len": 4096}


def test_vtc_eval_grid_table_plots_resume_and_a_failing_cell(saved, tmp_path, monkeypatch):
    from vtc.tools import eval as vtc_eval

    calls, failed_once = [], []
    real = vtc_eval.run_cell

    def run_cell(lm, cell, *rest):
        calls.append(cell.name)
        if cell.name == "vtc_clips__random__r0.25" and not failed_once:
            failed_once.append(cell.name)
            raise RuntimeError("out of memory (simulated)")
        return real(lm, cell, *rest)

    monkeypatch.setattr(vtc_eval, "run_cell", run_cell)
    kwargs = dict(
        model=saved["qwen2_5_vl"],
        tasks=[TASK],
        methods=["vidcom2", "random"],
        retentions=[0.5, 0.25],
        out_dir=str(tmp_path / "grid"),
        include_path=TASK_DIR,
        num_frames=8,
        limit=4,
        model_args={"device": "cpu"},
    )
    report = vtc_eval.evaluate_grid(**kwargs)
    status = {(c["methods"], c["retention"]): c["status"] for c in report["cells"]}
    assert status == {
        (None, None): "ok",
        ("vidcom2", 0.5): "ok",
        ("vidcom2", 0.25): "ok",
        ("random", 0.5): "ok",
        ("random", 0.25): "error",
    }
    failed = next(c for c in report["cells"] if c["status"] == "error")
    assert "out of memory (simulated)" in failed["error"]
    table = (tmp_path / "grid" / "table.md").read_text()
    assert "| vtc_clips | baseline | 1 |" in table and "| vtc_clips | vidcom2 | 0.25 |" in table
    assert (tmp_path / "grid" / "pareto.png").stat().st_size > 10_000
    rows = vtc_eval.table_rows(report)
    by_cell = {(r["methods"], r["retention"]): r for r in rows}
    assert by_cell[("vidcom2", 0.25)]["measured"] == pytest.approx(0.25, abs=0.01)
    assert by_cell[("baseline", 1.0)]["speedup"] == pytest.approx(1.0)
    assert by_cell[("vidcom2", 0.5)]["docs"] == 4

    # a rerun computes only the failed cell
    calls.clear()
    report = vtc_eval.evaluate_grid(**kwargs)
    assert calls == ["vtc_clips__random__r0.25"]
    assert all(c["status"] == "ok" for c in report["cells"])
    # the same directory with other settings would mix results: refused
    with pytest.raises(ValueError, match=r"other settings \(num_frames: 8 then, 16 now\)"):
        vtc_eval.evaluate_grid(**{**kwargs, "num_frames": 16})


def test_vtc_eval_takes_samplers_and_frame_budgets_as_grid_axes(saved, tmp_path):
    """`vtc eval --methods bolt --num-frames 4,8`: every frame budget gets its own baseline and sampler cells, the
    documents are shown that many frames (chosen per document by the sampler), and the table has a frames column."""
    from vtc.tools import eval as vtc_eval

    report = vtc_eval.evaluate_grid(
        model=saved["qwen2_5_vl"],
        tasks=[TASK],
        methods=["bolt"],
        retentions=[None],
        out_dir=str(tmp_path / "grid"),
        include_path=TASK_DIR,
        num_frames=[4, 8],
        limit=2,
        params={"bolt.encoder": "vtc-tiny-clip", "bolt.encoder_pretrained": None},
        model_args={"device": "cpu"},
    )
    cells = {(c["methods"], c["frames"]): c for c in report["cells"]}
    assert set(cells) == {(None, 4), ("bolt", 4), (None, 8), ("bolt", 8)}
    assert all(c["status"] == "ok" for c in cells.values())
    for frames in (4, 8):
        samples = (tmp_path / "grid" / "samples" / f"{TASK}__bolt__rdefault__f{frames}.jsonl").read_text().splitlines()
        records = [json.loads(line)["token_counts"][0]["vtc"] for line in samples]
        assert [len(r["frames"][0]["indices"]) for r in records] == [frames] * 2
        assert all(r["frames"][0]["method"] == "bolt" for r in records)
    table = (tmp_path / "grid" / "table.md").read_text()
    assert "| frames |" in table and f"| {TASK} | 8 | bolt |" in table
    with pytest.raises(ValueError, match="positive integers"):
        vtc_eval.parse_frame_counts("8,0")
    assert vtc_eval.parse_frame_counts("8,16,none") == [8, 16, None]


def test_vtc_eval_on_the_vllm_backend_starts_one_engine_per_cell(saved, tmp_path):
    from vtc.tools.eval import evaluate_grid

    out = tmp_path / "grid"
    report = evaluate_grid(
        saved["qwen2_5_vl"],
        [TASK],
        ["vidcom2"],
        [0.25],
        str(out),
        include_path=TASK_DIR,
        num_frames=8,
        limit=2,
        model_args={"backend": "vllm", "vllm_args": {"max_model_len": 4096}},
    )
    assert [c["status"] for c in report["cells"]] == ["ok", "ok"]
    assert report["model"].endswith("[vllm]")
    compressed = report["cells"][1]["efficiency"]
    assert compressed["retention_llm_input"] == pytest.approx(0.25, abs=0.01)
    samples = [json.loads(line) for line in open(out / "samples" / "vtc_clips__vidcom2__r0.25.jsonl")]
    assert {s["token_counts"][0]["vtc"]["backend"] for s in samples} == {"vllm"}


def test_vtc_eval_refuses_bad_grids_before_loading_anything(tmp_path):
    from vtc.tools.eval import evaluate_grid, parse_methods, parse_retentions

    with pytest.raises(ValueError, match=r"\(0, 1\].*'1.5'.*'x'"):
        parse_retentions("0.5,1.5,x")
    with pytest.raises(ValueError, match="nosuch"):
        parse_methods("vidcom2,nosuch")
    assert parse_methods("none,vidcom2,uniform+fastv") == ["vidcom2", "uniform+fastv"]
    assert parse_retentions("default, 0.25") == [None, 0.25]
    from vtc.tools.eval import Cell

    assert Cell("t", "aot", None).name == "t__aot__rdefault" and Cell("t", None, None).name == "t__baseline"
    with pytest.raises(ValueError, match=r"'vtc_clip'.*close: vtc_clips"):
        evaluate_grid(None, ["vtc_clip"], ["vidcom2"], [0.5], str(tmp_path / "grid"), include_path=TASK_DIR)
    assert not (tmp_path / "grid").exists()


FAMILY_OF_CHECKPOINT = {"qwen2.5-vl": "qwen2_5_vl", "qwen3-vl": "qwen3_vl", "llava": "llava_onevision"}


def test_the_recipes_in_docs_eval_are_valid_commands():
    """Every `lmms-eval --model vtc` command of docs/eval.md parses into vtc's model args and a pipeline the
    checkpoint's family accepts, and every `vtc eval` line passes the CLI's checks (weights and datasets are not
    available here)."""
    from lmms_eval.tasks import TaskManager
    from lmms_eval.utils import simple_parse_args_string

    from vtc.lmms_eval.model import split_model_args
    from vtc.tools import eval as vtc_eval
    from vtc.tools.cli import main

    text = (Path(__file__).parents[1] / "docs" / "eval.md").read_text().replace("\\\n", " ")
    commands = []
    for start in (m.end() for m in re.finditer(r"lmms-eval --model vtc ", text)):
        found = re.compile(r"--model_args (?:'([^']+)'|([^ `]+))").search(text, start)
        commands.append(found.group(1) or found.group(2))
    assert len(commands) >= 20
    for model_args in commands:
        args, params = split_model_args(simple_parse_args_string(model_args))
        family = next(f for key, f in FAMILY_OF_CHECKPOINT.items() if key in args.pretrained.lower())
        Pipeline(args.methods or "uniform", retention=args.retention, params=params, family=family)
    manager = TaskManager(verbosity="ERROR")
    grids = [line for line in text.splitlines() if line.startswith("vtc eval ")]
    assert len(grids) >= 4
    for line in grids:
        seen = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(vtc_eval, "evaluate_grid", lambda seen=seen, **kw: seen.append(kw) or {"cells": []})
            assert main(shlex.split(line)[1:]) == 0, line
        vtc_eval.check_tasks(seen[0]["tasks"], manager)
        for key, value in seen[0]["params"].items():  # every --param belongs to a method of the grid
            assert any(vtc_eval.params_for(spec, {key: value}) for spec in seen[0]["methods"]), (key, line)


def test_a_group_without_aggregate_scores_as_the_mean_of_its_subtasks():
    from vtc.tools.eval import leaf_tasks, primary_metric

    results = {
        "results": {"mvbench": {"alias": "mvbench"}, "mvbench_a": {"acc,none": 0.5}, "mvbench_b": {"acc,none": 0.7}},
        "group_subtasks": {"mvbench": ["mvbench_a", "mvbench_b"]},
        "configs": {
            "mvbench_a": {"metric_list": [{"metric": "acc"}]},
            "mvbench_b": {"metric_list": [{"metric": "acc"}]},
        },
    }
    assert leaf_tasks(results, "mvbench") == ["mvbench_a", "mvbench_b"]
    assert primary_metric(results, "mvbench") == ("mean of 2 subtasks' acc", pytest.approx(0.6))
    assert primary_metric(results, "mvbench_b") == ("acc", 0.7)


def test_pareto_front():
    from vtc.tools.eval import pareto_front

    assert pareto_front([(1.0, 0.5), (0.5, 0.4), (0.7, 0.3), (0.2, 0.1), (1.2, 0.5)]) == [
        (0.2, 0.1),
        (0.5, 0.4),
        (1.0, 0.5),
    ]


def stock_lmms_vllm(name: str, path: str, vtc_config: dict, options: str, limits: dict, limit: int) -> dict:
    """lmms-eval's own vLLM model `name` on the local task, with vtc's config in its additional_config (in this
    process, fp32 on CPU) -> lmms-eval's results."""
    from vtc.testing.serving import CPU_ENV, shutdown

    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.models import get_model
    from lmms_eval.tasks import TaskManager

    args = (
        f"model={path},additional_config={json.dumps({'vtc': vtc_config})},{options},dtype=float32,"
        "enforce_eager=True,max_model_len=8192,distributed_executor_backend=uni,kv_cache_memory_bytes=268435456,"
        f"limit_mm_per_prompt={json.dumps(limits)}"
    )
    lm = get_model(name).create_from_arg_string(args, {})
    manager = TaskManager(verbosity="ERROR", include_path=TASK_DIR)
    try:
        return simple_evaluate(model=lm, tasks=[TASK], batch_size=1, limit=limit, task_manager=manager)
    finally:
        shutdown(lm.client)


def test_vllm_backend_through_lmms_eval_agrees_with_the_hf_backend(tmp_path):
    """lmms-eval's own `vllm_generate` model (it sends videos as videos) with vtc's additional_config: vLLM keeps
    per document the counts the HF backend keeps on the same task. Qwen3-VL: lmms-eval 0.7.3's vllm_generate
    passes video metadata to vLLM only for Qwen3-VL, and vLLM 0.32 requires it for every Qwen family."""
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.tasks import TaskManager

    from vtc.lmms_eval.model import VtcModel
    from vtc.vllm import models as served

    path = str(tmp_path / "qwen3_vl")
    tiny.save("qwen3_vl", path)
    served.LAST_KEPT.clear()
    stock_lmms_vllm(
        "vllm_generate",
        path,
        {"methods": "vidcom2", "retention": 0.5},
        "nframes=8,max_new_tokens=4",
        {"video": 1, "image": 0},
        limit=4,
    )
    kept = [(tuple(k["grid"]), len(k["cells"])) for k in served.LAST_KEPT]

    hf = VtcModel(pretrained=path, methods="vidcom2", retention=0.5, num_frames=8, device="cpu")
    hf.keep_loaded = True
    manager = TaskManager(verbosity="ERROR", include_path=TASK_DIR)
    results = simple_evaluate(model=hf, tasks=[TASK], batch_size=1, limit=4, task_manager=manager)
    hf_kept = [(tuple(r["grids"][0]), r["llm_visual_tokens"]) for r in vtc_records(results)]
    # the 4 documents ask 2 questions on each of 2 clips: vLLM encodes (and compresses) each clip once
    assert len(kept) == 2 and sorted(set(kept)) == sorted(set(hf_kept)) and len(hf_kept) == 4
    assert all(n == g[0] * g[1] * g[2] // 2 for g, n in kept)


def test_lmms_evals_own_vllm_model_gets_the_frames_it_sends_as_images_compressed(saved):
    """lmms-eval's `vllm` model (its chat version) sends a video's frames as images (OpenAI chat parts); with vtc's
    additional_config each frame is an image the server compresses: on LLaVA-OneVision every view of every frame
    keeps the image pipeline's count, and the answers come back."""
    from vtc.vllm import models as served
    from vtc.vllm.config import ServeConfig

    config = {"methods": "divprune", "retention": 0.25}
    served.LAST_KEPT_IMAGES.clear()
    # the chat model (is_simple False): OpenAI messages, a video as its frames
    results = stock_lmms_vllm(
        "vllm", saved["llava_onevision"], config, "nframes=2,max_new_tokens=2", {"image": 2, "video": 0}, limit=2
    )
    pipeline = ServeConfig.from_dict(config).pipeline("llava_onevision").for_images()
    views = list(served.LAST_KEPT_IMAGES)
    assert len(views) >= 4 and {v["view"] for v in views} == {"base", "crops"}  # 2 frames, 2 views each, per clip
    assert all(len(v["cells"]) == pipeline.retained_count(v["grid"]) < math.prod(v["grid"]) for v in views)
    assert len(results["samples"][TASK]) == 2


def test_vllm_backend_of_the_vtc_model_compresses_an_image_document_view_by_view(saved):
    """`--model vtc` with backend=vllm on an image document (LLaVA-OneVision): the server compresses each view of the
    image to the image pipeline's count, and the record lists them (images=false: whole, with the note)."""
    from PIL import Image

    from vtc.lmms_eval.model import VtcModel

    lm = VtcModel(
        pretrained=saved["llava_onevision"],
        methods="divprune",
        retention=0.25,
        backend="vllm",
        vllm_args={"max_model_len": 4096, "limit_mm_per_prompt": {"image": 1, "video": 0}},
    )
    image = Image.new("RGB", (140, 112), (200, 30, 30))
    messages = [{"role": "user", "content": [{"type": "image", "url": image}, {"type": "text", "text": "Colour?"}]}]
    try:
        _, record = lm.answer(messages, {"max_new_tokens": 2})
        items = record["items"]
        assert [(i["kind"], i["view"]) for i in items] == [("image", "base"), ("image", "crops")]
        image_pipeline = lm.pipeline.for_images()
        assert all(
            i["compressed"] and i["tokens_out"] == image_pipeline.retained_count(tuple(i["grid"])) for i in items
        )
        dropped = sum(i["tokens_in"] - i["tokens_out"] for i in items)
        assert record["llm_prompt_tokens"] == record["prompt_tokens"] - dropped > 0
        assert record["visual_tokens_in"] == sum(i["tokens_in"] for i in items) and "note" not in record

        lm.args.images = False
        lm.configure("divprune", 0.25, {})
        with pytest.warns(UserWarning, match=r"compresses nothing \(images=false\)"):
            _, record = lm.answer(messages, {"max_new_tokens": 2})
        assert record["note"].startswith("no video") and not any(i["compressed"] for i in record["items"])
        assert record["llm_prompt_tokens"] == record["prompt_tokens"]
    finally:
        lm.keep_loaded = False
        lm.clean()


def test_vllm_backend_of_the_vtc_model_matches_the_hf_backend_document_by_document(saved, task_manager):
    """`--model vtc` with backend=vllm: the same frames and prompt to vLLM with vtc's serving config, on Qwen2.5-VL
    (where lmms-eval's own vllm_generate fails): per document the same grid, visual tokens in and out, and prompt
    length after compression as the HF backend; vLLM's request metrics give TTFT."""
    from vtc.lmms_eval.model import VtcModel

    # min/max_pixels reach the processor on both backends: the 112 px clips stay 112 px (4x4 tokens a frame pair)
    # instead of being upscaled to the tiny processor's default floor (4x12x12)
    common = dict(
        pretrained=saved["qwen2_5_vl"],
        methods="vidcom2",
        retention=0.25,
        num_frames=8,
        min_pixels=3136,
        max_pixels=40000,
    )
    served = VtcModel(backend="vllm", vllm_args={"max_model_len": 4096}, **common)
    try:
        vllm_results = evaluate(served, task_manager, limit=4)
    finally:
        served.keep_loaded = False
        served.clean()
    assert served.llm is None
    hf = VtcModel(device="cpu", fixed_count=True, **common)
    hf_results = evaluate(hf, task_manager, limit=4)
    keys = ("grids", "visual_tokens_in", "llm_visual_tokens", "visual_tokens_out", "prompt_tokens", "llm_prompt_tokens")
    served_records, hf_records = vtc_records(vllm_results), vtc_records(hf_results)
    assert len(served_records) == 4
    for v, h in zip(served_records, hf_records):
        assert {k: v[k] for k in keys} == {k: h[k] for k in keys}
        assert v["grids"] == [[4, 4, 4]] and v["visual_tokens_in"] == 64
        assert v["backend"] == "vllm" and v["stages"][0]["tokens_out"] == v["llm_visual_tokens"] == 16
        assert v["ttft_s"] > 0 and v["prefill_s"] > 0
    assert "avg_vtc_ttft_s" in vllm_results["throughput"]


def test_vllm_backend_runs_the_sampler_on_the_server_with_the_task_question(saved, task_manager):
    """backend=vllm with bolt+vidcom2: the client sends candidate frames, vLLM's prompt processor chooses
    num_frames of them against the document's question; each record carries the chosen frames (the video's own
    frame numbers), and its grid and counts are those of the chosen frames, as on the HF backend."""
    from vtc.lmms_eval.model import VtcModel
    from vtc.vllm import sampling

    common = dict(
        pretrained=saved["qwen2_5_vl"],
        methods="bolt+vidcom2",
        retention=0.5,
        num_frames=4,
        min_pixels=3136,
        max_pixels=40000,
        encoder="vtc-tiny-clip",
        encoder_pretrained=None,
    )
    sampling.LAST_FRAMES.clear()
    served = VtcModel(backend="vllm", vllm_args={"max_model_len": 4096}, candidate_frames=24, **common)
    try:
        results = evaluate(served, task_manager, limit=4)
    finally:
        served.keep_loaded = False
        served.clean()
    records = vtc_records(results)
    hf_records = vtc_records(evaluate(VtcModel(device="cpu", fixed_count=True, **common), task_manager, limit=4))
    assert len(records) == 4 and len(sampling.LAST_FRAMES) == 4
    questions = [entry["question"] for entry in sampling.LAST_FRAMES]
    assert len(set(questions)) == 2  # two questions per clip in the task, each sampled against its own
    for record, entry, hf in zip(records, sampling.LAST_FRAMES, hf_records):
        (frames,) = record["frames"]
        assert frames["method"] == "bolt" and frames["indices"] == entry["frames"] and len(frames["indices"]) == 4
        assert record["grids"] == hf["grids"] == [[2, 4, 4]]
        assert record["llm_visual_tokens"] == hf["llm_visual_tokens"] == 16
