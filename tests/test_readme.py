"""Every example in the README (and the docs' Python examples) runs.

Hub checkpoints cannot be downloaded here, so `from_pretrained` / the CLI's loaders are pointed at tiny
random-weight models of the same family, and `clip.mp4` is a generated clip; everything else runs exactly
as written."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

import vtc
from vtc.media.video import synthetic_video, write_video
from vtc.testing import tiny

ROOT = Path(__file__).resolve().parents[1]


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def family_for(name: str) -> str:
    lowered = name.lower()
    for key, family in (
        ("qwen3-vl", "qwen3_vl"),
        ("qwen2.5-vl", "qwen2_5_vl"),
        ("qwen2-vl", "qwen2_vl"),
        ("next-video", "llava_next_video"),
        ("llava", "llava_onevision"),
    ):
        if key in lowered:
            return family
    raise AssertionError(f"no tiny stand-in for {name}")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Stand-ins for downloads: tiny models for hub ids, a generated clip.mp4 in the working directory."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import vtc.tools.bench
    import vtc.tools.loading
    import vtc.tools.run
    import vtc.tools.stream
    import vtc.tools.viz

    built: dict[str, tuple] = {}

    def get(name):
        family = family_for(name)
        if family not in built:
            built[family] = tiny.build(family)
        return built[family]

    def stand_in(cls, index):
        real = cls.from_pretrained  # local checkpoints (vtc eval's saved demo model) load for real

        return classmethod(lambda cls, n, **kw: real(n, **kw) if Path(n).is_dir() else get(n)[index])

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", stand_in(AutoModelForImageTextToText, 0))
    monkeypatch.setattr(AutoProcessor, "from_pretrained", stand_in(AutoProcessor, 1))
    load = lambda name, **kw: get(name)  # noqa: E731
    small = lambda family, size, dtype="float32": tiny.build(family, size="tiny")  # noqa: E731
    for module in (vtc.tools.run, vtc.tools.bench, vtc.tools.stream, vtc.tools.viz):
        monkeypatch.setattr(module, "load_model", load)
        monkeypatch.setattr(module, "build_random_model", small)
    # `vtc bench` as written, at 2 repeats: the default's extra repeats only multiply the run time (~30 s each
    # on 2 cores), and the per-repeat statistics are tested in test_cli.py / test_bench_noise.py
    monkeypatch.setattr(vtc.tools.bench, "DEFAULT_REPEATS", 2)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests").symlink_to(ROOT / "tests")  # the local lmms-eval task, at the README's relative path
    write_video(tmp_path / "clip.mp4", synthetic_video(24, 112, 112), fps=8)
    return tmp_path


def run_python(block: str, namespace: dict) -> None:
    exec(compile(block, "<example>", "exec"), namespace)  # noqa: S102


def run_shell(block: str) -> int:
    """Run each `vtc ...` command of a bash block; `vtc serve` / `vllm serve` lines are checked up to the point where
    vLLM would start (the server itself is tested in test_serve.py)."""
    from vtc.tools.cli import main
    from vtc.vllm.config import KEY, ServeConfig

    ran = 0
    for line in block.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for command in line.split("&&"):
            argv = shlex.split(command.strip())
            if argv[:2] == ["vllm", "serve"]:
                config = json.loads(argv[argv.index("--additional-config") + 1])[KEY]
                ServeConfig.from_dict(config).pipeline("qwen2_5_vl")
                ran += 1
                continue
            if argv[:2] == ["vtc", "serve"]:
                started = []
                with pytest.MonkeyPatch.context() as mp:
                    import vllm.entrypoints.cli.main as vllm_cli

                    mp.setattr(vllm_cli, "main", lambda started=started: started.append(list(sys.argv)))
                    mp.setattr(sys, "argv", list(sys.argv))
                    assert main(argv[1:]) == 0, command
                assert started and started[0][:3] == ["vllm", "serve", argv[2]]
                assert json.loads(started[0][4])[KEY]["methods"] == "vidcom2"
                ran += 1
                continue
            if argv[:2] == ["vtc", "eval"] and "--model" in argv:
                # a hub checkpoint on a hub dataset: checked up to the grid (arguments, task names), not run
                from lmms_eval.tasks import TaskManager

                from vtc.tools import eval as vtc_eval

                seen = []
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(vtc_eval, "evaluate_grid", lambda seen=seen, **kw: seen.append(kw) or {"cells": []})
                    assert main(argv[1:]) == 0, command
                vtc_eval.check_tasks(seen[0]["tasks"], TaskManager(verbosity="ERROR"))
                ran += 1
                continue
            if argv and argv[0] == "vtc":
                assert main(argv[1:]) == 0, command
                ran += 1
    return ran


def test_readme_python_examples(offline, capsys):
    blocks = code_blocks(ROOT / "README.md", "python")
    assert len(blocks) >= 2
    model, processor = tiny.build("qwen2_5_vl")
    namespace = {"vtc": vtc, "model": model, "processor": processor}
    for block in blocks:
        run_python(block, namespace)
    handle = namespace["handle"]
    assert not handle.active  # the `with` block unpatched
    assert handle.stats().visual_tokens_out == round(handle.stats().visual_tokens_in * 0.3)
    assert "per LLM layer" in capsys.readouterr().out
    stream = namespace["s"]  # the streaming example: closed by its `with` block, its answers recorded
    assert stream.closed and len(stream.asks) == 1 and stream.stats().frames_encoded == 6
    assert stream.stats().stored_tokens <= 12544


def test_readme_commands(offline):
    ran = sum(run_shell(block) for block in code_blocks(ROOT / "README.md", "bash"))
    assert ran >= 8  # vtc run (twice), vtc serve, vllm serve, vtc eval (three), vtc methods, vtc run, vtc bench, ...


def test_docs_examples(offline, capsys):
    model, processor = tiny.build("qwen2_5_vl")
    run_python(
        code_blocks(ROOT / "docs" / "quickstart.md", "python")[0], {"vtc": vtc, "model": model, "processor": processor}
    )
    for block in code_blocks(ROOT / "docs" / "quickstart.md", "bash"):
        run_shell(block)
    uniform = code_blocks(ROOT / "docs" / "methods" / "uniform.md", "python")[0]
    run_python(uniform, {"vtc": vtc, "processor": processor})
    namespace: dict = {}
    run_python(code_blocks(ROOT / "docs" / "kernels.md", "python")[1], namespace)  # [0] declares an op: a sketch
    assert namespace["calls"] == [("max_min_select", "torch")] and namespace["picks"].shape == (8,)


def test_write_a_plugin_example_registers_and_passes(offline):
    namespace: dict = {}
    blocks = [
        b
        for b in code_blocks(ROOT / "docs" / "write-a-plugin.md", "python")
        if "PatchSelector" not in b and "TowerMerger" not in b
    ]
    assert len(blocks) == 4
    run_python(blocks[0], namespace)
    registry = vtc.registry()
    try:
        vtc.register(namespace["KeepNorm"])
        model, processor = tiny.build("qwen2_vl")
        inputs = vtc.prepare_inputs(processor, "clip.mp4", "What happens?", num_frames=4)
        with torch.no_grad():
            ref = model(**inputs).logits
        with vtc.patch(model, "uniform+keepnorm", retention=1.0):
            with torch.no_grad():
                assert torch.equal(model(**inputs).logits, ref)
        with vtc.patch(model, "uniform+keepnorm", retention=0.25) as handle:
            with torch.no_grad():
                model(**inputs)
            assert handle.stats().visual_tokens_out == handle.retained_count(handle.stats().grids[0])
        # the page's other examples: using it (one patch at a time), tiny models and clips, the conformance matrix
        for line in blocks[1].strip().splitlines():
            handle = eval(line.split("#")[0].strip(), {"vtc": vtc, "model": model, "KeepNorm": namespace["KeepNorm"]})
            with torch.no_grad():
                model(**inputs)
            assert handle.stats().visual_tokens_out < handle.stats().visual_tokens_in
            handle.unpatch()
        run_python(blocks[2], {})
        matrix: dict = {}
        run_python(blocks[3], matrix)
        cases = [c for c in matrix["conformance"].cases(["keepnorm"]) if c.family == "qwen2_vl"]
        assert {c.check for c in cases} >= {"identity_at_full_retention", "retention", "fixed_count"}
        for case in cases[:3]:
            matrix["test_conformance"](case)
    finally:
        registry.remove("keepnorm")


def test_write_a_plugin_encode_example_runs_the_tower_on_the_survivors(offline):
    (block,) = [b for b in code_blocks(ROOT / "docs" / "write-a-plugin.md", "python") if "PatchSelector" in b]
    namespace: dict = {}
    run_python(block, namespace)
    registry = vtc.registry()
    try:
        vtc.register(namespace["KeepBusy"])
        model, processor = tiny.build("qwen2_vl")
        inputs = vtc.prepare_inputs(processor, "clip.mp4", "What happens?", num_frames=4)
        with torch.no_grad():
            ref = model(**inputs).logits
        with vtc.patch(model, "keepbusy", retention=1.0):
            with torch.no_grad():
                assert torch.equal(model(**inputs).logits, ref)
        with vtc.patch(model, "keepbusy+divprune", retention=0.25) as handle:
            with torch.no_grad():
                model(**inputs)
            stats = handle.stats()
        n = stats.visual_tokens_in
        assert [(r.stage, r.plugin, r.tokens_in, r.tokens_out) for r in stats.stages][0] == (
            "encode",
            "keepbusy",
            n,
            round(0.5 * n),
        )
        assert stats.visual_tokens_out == handle.retained_count(stats.grids[0])
    finally:
        registry.remove("keepbusy")


def test_write_a_plugin_tower_example_folds_repeated_tokens_between_blocks(offline):
    (block,) = [b for b in code_blocks(ROOT / "docs" / "write-a-plugin.md", "python") if "TowerMerger" in b]
    namespace: dict = {}
    run_python(block, namespace)
    registry = vtc.registry()
    try:
        vtc.register(namespace["FoldRepeats"])
        from vtc.media.video import static_clip
        from vtc.testing.fixtures import model_and_processor

        model, processor = model_and_processor("qwen2_vl")
        inputs = vtc.prepare_inputs(processor, static_clip(8, 112, 112), "What moves?", num_frames=8, fps=8)
        with torch.no_grad(), vtc.patch(model, "foldrepeats") as handle:  # the still background folds away
            model(**inputs)
            stats = handle.stats()
        t, h, w = stats.grids[0]
        assert h * w < stats.llm_tokens_in < stats.visual_tokens_in / 2  # the first frame whole, then mostly the object
        assert [(r.stage, r.plugin) for r in stats.stages] == [("encode", "foldrepeats")]
        with pytest.raises(ValueError, match="foldrepeats.*encode_units"):
            vtc.patch(model_and_processor("llava_onevision")[0], "foldrepeats")
    finally:
        registry.remove("foldrepeats")


def test_every_method_has_a_row_in_the_methods_table_and_a_page():
    """`vtc methods` and the README agree: each built-in method is a row of the methods table, whose docs link
    is a page that exists and names the method."""
    import re

    import vtc

    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([^`]+)` \|.*\[[^\]]+\]\((docs/methods/[^)]+\.md)\) \|$", readme, re.M))
    builtin = [card.name for card in vtc.methods() if card.cls.__module__.startswith("vtc_plugins.")]
    missing = [name for name in builtin if name not in rows]
    assert not missing, f"methods without a README row: {missing}"
    for name in builtin:
        page = ROOT / rows[name]
        assert page.exists(), f"{name}: {rows[name]} does not exist"
        assert name in page.read_text(), f"{page} does not name {name}"
