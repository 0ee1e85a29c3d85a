"""The command line: `vtc methods`, `vtc run` and `vtc bench` on tiny models (no timing assertions)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import vtc
from vtc.tools.bench import RATIO_KEYS, TIMING_KEYS, spread
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
    # what the model was shown: the sampler's frames, printed and in the JSON
    (frames,) = stats["frames"]
    assert frames["method"] == "uniform" and len(frames["indices"]) == 4
    assert f"frames shown (uniform; frame (time, score)): {frames['indices'][0]} (0.0 s)" in printed


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
                "2",
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
    # issue 10: every time and ratio as min / median / max of the per-repeat values, in the JSON and the tables
    assert report["repeats"] == 2 and report["aggregate"] == "median" and "median (min–max) of 2 repeats" in out
    assert len(report["environment"]["load_1m_per_repeat"]) == 2
    markdown = (tmp_path / "bench.md").read_text()
    for row in report["results"]:
        assert len(row["per_repeat"]) == 2
        for key in TIMING_KEYS + RATIO_KEYS:
            s = row["spread"][key]
            assert s == spread([r[key] for r in row["per_repeat"]]), key
            assert s["min"] <= s["median"] <= s["max"] and row[key] == s["median"], key
        eff = row["spread"]["efficiency"]
        cell = f"{eff['median']:.2f} ({eff['min']:.2f}–{eff['max']:.2f})"
        assert cell in out and cell in markdown


def test_a_toy_tower_gets_no_ttft_figures_and_a_released_shape_gets_ttft_by_stage(tmp_path, capsys, monkeypatch):
    """Issue 19: TTFT figures only with a vision tower of a released shape; there, every row splits TTFT into
    sample, decode + processor, vision tower, connect and prefill, with the vision share and the LLM-side ceiling,
    and a sampler at retention r shows r x frames frames. The released shape is faked with the tiny one (the real
    ones take 1.6 B parameters), marked released with an LLM of 2 of 8 layers built (LLM time x4)."""
    import dataclasses

    from vtc.testing import tiny

    released = tiny.SIZES["qwen2.5-vl-7b"]  # Qwen/Qwen2.5-VL-7B-Instruct's config.json
    tower = released.vision_config({"depth": 4, "hidden_size": 64, "out_hidden_size": released.hidden})
    assert (tower["depth"], tower["hidden_size"], tower["intermediate_size"], tower["num_heads"]) == (
        32,
        1280,
        3420,
        16,
    )
    assert tower["fullatt_block_indexes"] == [7, 15, 23, 31] and tower["out_hidden_size"] == 3584
    assert (released.hidden, released.released_layers, released.layer_scale) == (3584, 28, 7.0)
    assert "LLM 4 of its 28 layers built, LLM time x7" in released.describe()
    whole = tiny.SIZES["qwen2-vl-2b"]  # Qwen/Qwen2-VL-2B-Instruct's config.json, every LLM layer built
    assert (whole.hidden, whole.layers, whole.heads, whole.kv_heads, whole.intermediate) == (1536, 28, 12, 2, 8960)
    assert whole.layer_scale == 1.0 and "LLM at its full 28 layers" in whole.describe()
    assert whole.vision_config({}) == tiny.SIZES["qwen2-vl-7b"].vision_config({})  # one tower for 2B and 7B
    with pytest.raises(ValueError, match="Qwen2.5-VL-7B-Instruct, a qwen2_5_vl model, not llava_onevision"):
        tiny.build("llava_onevision", "qwen2.5-vl-7b")

    argv = ["bench", "--frames", "4", "--repeats", "1", "--methods", "random,uniform", "--retentions", "0.5"]
    assert main([*argv, "--size", "tiny", "--out", str(tmp_path / "toy")]) == 0
    out = capsys.readouterr().out
    assert "no TTFT figures" in out and "TTFT x" not in out and "vision %" not in out
    toy = json.loads((tmp_path / "toy" / "bench.json").read_text())
    assert toy["released_tower"] is False and "TTFT" not in (tmp_path / "toy" / "bench.md").read_text()

    fake = dataclasses.replace(
        tiny.SIZES["tiny"], layers=2, family="qwen2_vl", checkpoint="fake/ckpt", released_layers=8
    )
    monkeypatch.setitem(tiny.SIZES, "fake-released", fake)
    assert main([*argv, "--size", "fake-released", "--out", str(tmp_path / "released")]) == 0
    out = capsys.readouterr().out
    assert "no TTFT figures" not in out and "LLM-side ceiling" in out and "LLM time x4" in out
    report = json.loads((tmp_path / "released" / "bench.json").read_text())
    assert report["released_tower"] is True and report["layer_scale"] == 4.0
    rows = {r["method"]: r for r in report["results"]}
    assert rows["none"]["frames_shown"] == 4 and rows["uniform"]["frames_shown"] == 2  # a sampler: half the frames
    assert rows["random"]["frames_shown"] == 4 and rows["uniform"]["tokens_out"] == rows["random"]["tokens_out"]
    for row in report["results"]:
        for rep in row["per_repeat"]:
            parts = rep["sample_s"] + rep["decode_s"] + rep["vision_s"] + rep["connect_s"] + rep["prefill_s"]
            assert 0 < parts <= rep["ttft_s"] * 1.0001  # the stages are inside TTFT (the rest: embedding, hooks)
            assert 0 < rep["vision_share"] < 1 and rep["llm_ceiling"] > 0
    # prefill is the 2 built layers' time x 4; TTFT holds the scaled prefill
    none = rows["none"]["per_repeat"][0]
    assert none["ttft_s"] >= none["prefill_s"] + none["vision_s"]
    assert "| vision % |" in (tmp_path / "released" / "bench.md").read_text()


def test_stream_demo_asks_at_the_given_times(tmp_path, capsys, monkeypatch):
    import vtc.tools.stream
    from vtc.media.video import synthetic_video, write_video
    from vtc.testing import tiny

    monkeypatch.setattr(vtc.tools.stream, "build_random_model", lambda family, size, dtype: tiny.build(family))
    video = str(tmp_path / "long.mp4")
    write_video(video, synthetic_video(40, 112, 112), fps=1.0)  # 40 s
    out = tmp_path / "stream.json"
    argv = ["stream", "--video", video, "--fps", "0.5", "--methods", "streamingtom", "--retention", "0.25"]
    argv += ["--ask", "What moved?", "--ask-at", "8,20,99", "--max-new-tokens", "2", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "asks (streamingtom)" in printed and "TTFT" in printed
    result = json.loads(out.read_text())
    asks = result["asks"]
    assert [a["at_s"] for a in asks] == [8.0, 20.0, 99.0]
    # at 0.5 fps, 8 s = 4 frames and 20 s = 10 frames; 99 s is past the end (20 frames): asked at the end
    assert [a["frames_seen"] for a in asks] == [4, 10, 20]
    assert all(a["question"] == "What moved?" and a["ttft_s"] > 0 for a in asks)
    assert result["stats"]["frames_encoded"] == 20 and result["stats"]["memory"] == "streamingtom"


def test_stream_errors_are_clear(capsys):
    assert main(["stream", "--methods", "holitom", "--size", "tiny", "--ask-at", "10"]) == 2
    assert "cannot stream" in capsys.readouterr().out
    assert main(["stream", "--ask-at", "30,10"]) == 2
    assert "increasing" in capsys.readouterr().out


def test_bench_on_an_image_prompt(tmp_path, capsys):
    """`vtc bench --image slide`: the request is one generated image (576 tokens on the Qwen towers); pixelprune and
    tome act on it before and inside the tower and keep a quarter; an image beside --video, or on the vLLM bench,
    is refused."""
    args = ["bench", "--size", "tiny", "--family", "qwen2_5_vl", "--image", "slide", "--repeats", "1"]
    args += ["--methods", "pixelprune,tome", "--retentions", "0.25", "--out", str(tmp_path)]
    assert main(args) == 0
    assert "image: slide, 576 visual" in capsys.readouterr().out
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["video"] == "image: slide" and report["frames"] == 0 and report["visual_tokens"] == 576
    assert {(r["method"], r["tokens_llm"], r["frames_shown"]) for r in report["results"]} == {
        ("none", 576, 0),
        ("pixelprune", 144, 0),
        ("tome", 144, 0),
    }
    assert main(["bench", "--size", "tiny", "--image", "slide", "--video", "static"]) == 2
    assert "one video or one image, not both" in capsys.readouterr().out
    assert main(["bench", "--backend", "vllm", "--image", "slide"]) == 2
    assert "--image: only with --backend hf" in capsys.readouterr().out


def test_bench_stream_writes_table_json_and_plot(tmp_path, monkeypatch, capsys):
    import vtc.tools.bench_stream
    from vtc.testing import tiny

    monkeypatch.setattr(vtc.tools.bench_stream, "build_random_model", lambda family, size, dtype: tiny.build(family))
    out = tmp_path / "bs"
    argv = ["bench", "--stream", "--frames", "32", "--methods", "none,streamingtom,lifestream", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "bench-stream.json").read_text())
    assert result["checkpoints"] == [16, 32]
    assert set(result["methods"]) == {"none", "streamingtom", "lifestream"}
    naive = result["methods"]["none"]["rows"]
    # naive streaming stores every token: twice the frames, twice the tokens
    assert naive[1]["stored_tokens"] == 2 * naive[0]["stored_tokens"] == result["tokens_per_patch"] * 16
    assert (out / "bench-stream.png").stat().st_size > 0
    assert "KV compression" in (out / "bench-stream.md").read_text()


def test_viz_writes_the_three_pictures_with_no_arguments_but_a_size(tmp_path, capsys):
    """`vtc viz` (the offline demo, here on the tiny model): the frame timeline with BOLT's scores and chosen
    frames, the chosen frames with their kept tokens, and tokens per LLM layer; each PNG opens, has the expected
    size and is not blank. With a prefill method the layer picture shows the drop inside the LLM."""
    from PIL import Image

    from vtc.tools.viz import viz

    assert main(["viz", "--size", "tiny", "--num-frames", "4", "--out", str(tmp_path / "demo")]) == 0
    printed = capsys.readouterr().out
    assert "frames shown:" in printed
    shown = json.loads(printed.split("frames shown: ")[1].split(" (bolt)")[0])
    # one 352-px panel per distinct chosen frame (BOLT repeats frames the question matches)
    sizes = {"timeline": (1210, 396), "kept_tokens": (352 * len(set(shown)), 330), "layers": (880, 374)}
    for name, size in sizes.items():
        image = np.asarray(Image.open(tmp_path / "demo" / f"{name}.png").convert("L"), dtype=np.float32)
        assert image.shape[::-1] == size, name
        assert image.std() > 10, f"{name}.png is blank"

    result = viz(methods="uniform+fastv", retention=0.5, num_frames=4, size="tiny", out=str(tmp_path / "fastv"))
    assert len(result["frames"]) == 4 and set(result["paths"]) == set(sizes)
