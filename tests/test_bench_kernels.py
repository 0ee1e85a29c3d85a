"""`vtc bench-kernels` on CPU at small sizes (every op, official baseline against vtc's reference, JSON shape and
statistics), its argument errors, where it lives (the repository's `benchmarks/`, not the installed package, and
what it says without a checkout), and the GPU check scripts in their CPU modes (eval/gpu_prefill.py --tiny,
eval/gpu_check.sh --dry-run). No timing thresholds: the timings only have to be well formed."""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import pathlib
import subprocess

import pytest
import torch

from tests.kernel_checks import needs_triton
from vtc.tools import cli
from vtc.tools.cli import benchmark_module, main

ROOT = pathlib.Path(__file__).resolve().parents[1]
bench_kernels = benchmark_module("bench_kernels")


@pytest.fixture(scope="module")
def small_report(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("bench-kernels") / "kernels.json"
    assert main(["bench-kernels", "--sizes", "small", "--repeats", "2", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_every_op_runs_and_agrees_with_the_official_code(small_report):
    results = {r["op"]: r for r in small_report["results"]}
    assert list(results) == list(bench_kernels.CASES)
    for op, r in results.items():
        assert "error" not in r, f"{op}: {r.get('error')}"
        assert r["agree"] is True
        assert r["official_source"] and r["shapes"] and r["bytes"] > 0 and r["bytes_formula"]
        assert len(r["per_repeat"]) == 2


def test_json_statistics_are_ordered_and_ratios_paired(small_report):
    assert small_report["device"] == "cpu" and small_report["repeats"] == 2 and small_report["sizes"] == "small"
    for r in small_report["results"]:
        for key, s in r["spread"].items():
            assert s["min"] <= s["median"] <= s["max"], (r["op"], key, s)
        for rep in r["per_repeat"]:  # each ratio from the two times of the same repeat
            assert rep["speedup"] == pytest.approx(rep["official_s"] / rep["vtc_s"])


def test_markdown_table_has_a_row_per_op(small_report):
    table = bench_kernels.markdown_table(small_report)
    assert table.count("\n") == 2 + len(bench_kernels.CASES)
    assert "| official / vtc |" in table.splitlines()[0]


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run covers this path on CUDA")
def test_triton_path_checks_contracts_and_reports_bandwidth_under_the_interpreter():
    """The --device cuda path (Triton against the reference, bytes / time) through Triton's CPU interpreter, on
    ops whose outputs are checked in three different ways (custom matching compare, exact dataclass, allclose)."""
    ops = ["best_match+merge", "quantize_groups", "adjacent_frame_similarity"]
    report = bench_kernels.bench_kernels(ops=ops, size="small", repeats=1, device="cpu", triton=True, peak_override=1)
    assert report["triton"] is True
    for r in report["results"]:
        assert "error" not in r, f"{r['op']}: {r.get('error')}"
        assert r["triton_kernels"] and "triton_s" in r["spread"] and r["spread"]["gbps"]["median"] > 0
        assert 0 < r["peak_fraction"]["median"]
    header, rows = bench_kernels.table_rows(report)
    assert "torch / triton" in header and len(rows) == len(ops)


def test_unknown_op_is_an_error_listing_the_allowed(capsys):
    assert main(["bench-kernels", "--ops", "sinkhorn,warp_drive", "--sizes", "small"]) == 2
    out = capsys.readouterr().out
    assert "warp_drive" in out and "max_min_select" in out and "attention_rows" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_cuda_is_an_error(capsys):
    assert main(["bench-kernels", "--device", "cuda", "--sizes", "small", "--ops", "sinkhorn"]) == 2
    assert "CUDA is not available" in capsys.readouterr().out


def test_benchmarks_live_in_the_repository_not_the_package():
    """The official codes' copies are benchmark baselines: in benchmarks/ of the checkout, never installed."""
    assert pathlib.Path(bench_kernels.__file__).resolve() == ROOT / "benchmarks" / "bench_kernels.py"
    assert pathlib.Path(bench_kernels.official.__file__).resolve() == ROOT / "benchmarks" / "kernel_baselines.py"
    assert not (ROOT / "vtc" / "tools" / "bench_kernels.py").exists()
    assert not (ROOT / "vtc" / "tools" / "kernel_baselines.py").exists()
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    packages = setup["options"]["packages"].split()
    assert "benchmarks" not in packages and not any(p.startswith("benchmarks.") for p in packages)
    assert "benchmarks" not in setup["options"].get("package_dir", "")


def test_without_a_checkout_the_command_says_it_needs_one(tmp_path, monkeypatch, capsys):
    """An installed wheel has no benchmarks/ next to the `vtc` package."""
    monkeypatch.setattr(cli, "BENCHMARKS", tmp_path / "site-packages" / "benchmarks")
    assert main(["bench-kernels", "--sizes", "small", "--ops", "sinkhorn"]) == 2
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "vtc bench-kernels needs a checkout of the vtc repository" in out
    assert "benchmarks/bench_kernels.py" in out and "pip install -e ." in out


def test_peak_bandwidth_by_device_name():
    assert bench_kernels.peak_gbps("NVIDIA H200") == 4800.0
    assert bench_kernels.peak_gbps("NVIDIA GH200 480GB") == 4000.0
    assert bench_kernels.peak_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert bench_kernels.peak_gbps("Some Future GPU") is None
    assert bench_kernels.peak_gbps("Some Future GPU", override=1234) == 1234.0
    with pytest.raises(ValueError, match="positive"):
        bench_kernels.peak_gbps("NVIDIA H200", override=0)


def _load_gpu_prefill():
    spec = importlib.util.spec_from_file_location("gpu_prefill", ROOT / "eval" / "gpu_prefill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_prefill_runs_tiny_on_cpu(tmp_path):
    """The prefill check of eval/gpu_check.sh, on vtc's tiny model: the same code path as the 7B GPU run."""
    gpu_prefill = _load_gpu_prefill()
    path = tmp_path / "prefill.json"
    argv = ["--tiny", "--frames", "2", "--repeats", "1", "--warmup", "0", "--methods", "fastv,framefusion"]
    argv += ["--json", str(path)]
    assert gpu_prefill.main(argv) == 0
    report = json.loads(path.read_text())
    assert report["failures"] == 0
    sdpa = report["attention"]["sdpa"]
    assert set(sdpa) == {"none", "fastv", "framefusion"}
    for method in ("fastv", "framefusion"):
        entry = sdpa[method]
        assert entry["tokens_out"] > 0 and entry["prefill_ratio"]["median"] > 0 and entry["efficiency"]["median"] > 0
    # flash_attention_2 is measured where flash_attn imports and reported as skipped (with the reason) elsewhere
    fa2 = report["attention"]["flash_attention_2"]
    assert "skipped" in fa2 or "none" in fa2


def test_gpu_encode_runs_tiny_on_cpu(tmp_path):
    """The encode-stage check of eval/gpu_check.sh on vtc's tiny model: every method of the 7B GPU run runs, the LLM
    gets a quarter of the tokens, and the static clip's tau = 0 rule reports what it kept."""
    spec = importlib.util.spec_from_file_location("gpu_encode", ROOT / "eval" / "gpu_encode.py")
    gpu_encode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_encode)
    path = tmp_path / "encode.json"
    assert (
        gpu_encode.main(["--tiny", "--frames", "8", "--repeats", "1", "--attention", "sdpa", "--json", str(path)]) == 0
    )
    sdpa = json.loads(path.read_text())["attention"]["sdpa"]
    none = sdpa.pop("none")
    static = sdpa.pop("pixelprune tau=0 (static clip)")
    assert set(sdpa) == set(gpu_encode.METHODS)
    for label, entry in sdpa.items():  # 8 frames of 112 px: 4 temporal patches of 12 x 12 units, a quarter kept
        slack = 4 if label == "pixelprune+tome" else 0  # ToMe rounds each frame's half of what PixelPrune left
        assert abs(entry["tokens"] - 4 * 144 // 4) <= slack and entry["ttft_x"]["median"] > 0, label
    assert none["vision_ms"]["median"] > 0 and 0 < static["kept_fraction"] < 1


def test_gpu_prefill_7b_shapes_are_qwen25_vl_7b():
    gpu_prefill = _load_gpu_prefill()
    text, vision = gpu_prefill.QWEN25_VL_7B_TEXT, gpu_prefill.QWEN25_VL_7B_VISION
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]) == (3584, 28, 28)
    assert text["num_key_value_heads"] == 4 and text["intermediate_size"] == 18944
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2
    assert vision["out_hidden_size"] == text["hidden_size"]


def test_gpu_check_dry_run_lists_every_step(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(ROOT / "eval" / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for step in ("environment", "kernel-tests", "bench-kernels", "prefill"):
        assert f"=== {step} " in done.stdout
    assert "--device cuda" in done.stdout and "tests/test_kernels" in done.stdout
