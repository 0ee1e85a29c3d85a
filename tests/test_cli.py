"""The command line: `vtc methods`, `vtc run` and `vtc bench` on tiny models (no timing assertions)."""

from __future__ import annotations

import json

import vtc
from vtc.tools.cli import main, parse_params


def test_methods_table_and_json(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in ("uniform", "random", "fastv", "framefusion"):
        assert name in out
    assert main(["methods", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {info.name for info in vtc.methods()}
    keys = {
        "stages",
        "fixed_count",
        "query_aware",
        "position_policy",
        "owns",
        "acts_in_llm",
        "acts_during_decode",
        "needs_whole_frames",
        "vision_stats",
        "prepool",
        "retention_reference",
        "retention_note",
        "retention_granularity",
        "conformance_exemptions",
        "parameters",
    }
    for info in vtc.methods():  # every method's capabilities, as MethodInfo.capabilities() gives them
        row = rows[info.name]
        assert keys <= set(row), (info.name, keys - set(row))
        assert row == json.loads(json.dumps(info.capabilities(), default=str)), info.name
        assert row["fixed_count"] in ("always", "optional", "no")
    assert rows["random"]["stages"] == ["connect"] and rows["random"]["fixed_count"] == "always"
    assert rows["random"]["acts_in_llm"] is False and rows["random"]["retention_reference"] == "llm_input"
    assert rows["framefusion"]["stages"] == ["prefill"] and rows["framefusion"]["fixed_count"] == "no"
    assert rows["framefusion"]["retention_reference"] == "layer_mean"
    assert rows["framefusion"]["parameters"]["num_layers"] is None
    assert rows["framefusion"]["owns"] == ["llm_token_schedule"]
    assert rows["fastv"]["fixed_count"] == "always" and rows["fastv"]["retention_reference"] == "last_layer"
    assert rows["prunevid"]["fixed_count"] == "optional" and rows["prunevid"]["stages"] == ["connect", "prefill"]
    assert rows["prunevid"]["parameters"]["fixed_count"] is False
    dycoke = rows["dycoke"]
    assert dycoke["acts_during_decode"] is True and dycoke["position_policy"] == "compact" and dycoke["query_aware"]
    assert dycoke["parameters"]["shifted_pairs"] is False and "floor" in dycoke["retention_note"]
    assert "ordered_positions" in dycoke["conformance_exemptions"]
    assert rows["holitom"]["needs_whole_frames"] is True and rows["quota"]["needs_whole_frames"] is True
    assert rows["uniform"]["parameters"] == {"num_frames": 16, "rule": None}
    assert rows["uniform"]["fixed_count"] == "no" and rows["uniform"]["reduces_tokens"] is False


def test_param_parsing():
    assert parse_params(["k=3", "fastv.ratio=0.25", "x=none", "flag=true", "name=abc"]) == {
        "k": 3,
        "fastv.ratio": 0.25,
        "x": None,
        "flag": True,
        "name": "abc",
    }


def test_run_demo_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert (
        main(
            [
                "run",
                "--size",
                "tiny",
                "--frames",
                "4",
                "--max-new-tokens",
                "2",
                "--methods",
                "uniform+fastv",
                "--retention",
                "0.3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "random weights" in printed and "speedup" in printed and "fastv" in printed
    result = json.loads(out.read_text())
    stats = result["stats"]
    assert result["demo"] is True
    assert stats["visual_tokens_out"] == round(stats["visual_tokens_in"] * 0.3)
    assert result["prefill_s"]["baseline"] > 0 and result["prefill_s"]["compressed"] > 0


def test_run_errors_are_clear(capsys):
    assert main(["run", "--model", "some/model"]) == 2
    assert "--video and --question are required" in capsys.readouterr().out
    assert main(["run", "--size", "tiny", "--frames", "4", "--methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().out


def test_bench_writes_table_json_and_plot(tmp_path, capsys):
    assert (
        main(
            [
                "bench",
                "--size",
                "tiny",
                "--frames",
                "4",
                "--repeats",
                "1",
                "--methods",
                "random,fastv",
                "--retentions",
                "0.5",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "speedup" in out and "effic." in out and "overhead" in out
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.md").read_text().count("\n| fastv | 0.50 |") == 1
    assert (tmp_path / "bench.png").stat().st_size > 0
    rows = {(r["method"], r["retention"]): r for r in report["results"]}
    assert set(rows) == {("none", 1.0), ("random", 0.5), ("fastv", 0.5)}
    visual = report["visual_tokens"]
    assert rows[("none", 1.0)]["tokens_out"] == visual
    assert rows[("random", 0.5)]["tokens_out"] == round(visual * 0.5)
    fastv = rows[("fastv", 0.5)]
    assert fastv["layer_tokens"][:2] == [visual, visual] and fastv["layer_tokens"][2:] == [round(visual * 0.5)] * 2
    for row in report["results"]:
        for key in ("prefill_s", "ttft_s", "peak_mb", "limit_s", "limit_final_s", "speedup", "efficiency"):
            assert row[key] > 0, key
