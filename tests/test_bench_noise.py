"""`vtc bench` reports its noise: every ratio as median with min-max over repeats, formed repeat by repeat
(issue 10). Statistics on known inputs and the CLI's default; the table / JSON / plot of a real run (a tiny
model at 2 repeats) are checked in test_cli.py's bench test, so the suite runs the bench once."""

from __future__ import annotations

import pytest

import vtc.tools.bench
from vtc.tools.bench import RATIO_KEYS, TIMING_KEYS, spread, summarize, with_range
from vtc.tools.cli import main


def test_spread_on_known_values():
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert spread([4.0, 1.0, 3.0, 2.0]) == {"min": 1.0, "median": 2.5, "max": 4.0}  # even count: middle two
    assert spread([0.9, 1.3, 1.0, 5.0, 1.1]) == {"min": 0.9, "median": 1.1, "max": 5.0}  # an outlier moves no median
    assert spread([7.0]) == {"min": 7.0, "median": 7.0, "max": 7.0}
    with pytest.raises(ValueError):
        spread([])


def _repeat(prefill: float, ttft: float, limit: float, connect: float = 0.0) -> dict:
    row = dict.fromkeys(TIMING_KEYS, 0.0)
    row.update(prefill_s=prefill, ttft_s=ttft, limit_s=limit, limit_final_s=limit, connect_s=connect)
    row.update(overhead_s=connect, tokens_out=10, layer_tokens=[10, 10])
    return row


def test_ratios_are_paired_by_repeat_then_summarized():
    # the machine is twice as slow in repeat 2, for the baseline and the method alike: paired ratios stay at 2
    # in every repeat (min = max), where ratios across repeats would range from 10 / 10 = 1 to 20 / 5 = 4
    base = [_repeat(10.0, 11.0, 9.0), _repeat(20.0, 22.0, 18.0), _repeat(12.0, 13.0, 10.0)]
    base[0]["peak_mb"] = 100.0  # measured in the first repeat only
    rows = [_repeat(4.0, 5.5, 4.5, connect=1.0), _repeat(9.0, 11.0, 9.0, connect=1.0), _repeat(5.0, 6.5, 5.4, 1.0)]
    rows[0]["peak_mb"] = 40.0
    row = summarize(rows, base)
    per = row["per_repeat"]
    assert [r["speedup"] for r in per] == [2.0, 2.0, 2.0]
    assert [r["ttft_speedup"] for r in per] == [2.0, 2.0, 2.0]
    assert [r["efficiency"] for r in per] == pytest.approx([0.9, 0.9, 0.9])
    assert [r["overhead_share"] for r in per] == pytest.approx([0.1, 0.05, 1 / 12])
    assert row["spread"]["overhead_share"] == pytest.approx({"min": 0.05, "median": 1 / 12, "max": 0.1})
    assert row["spread"]["prefill_s"] == {"min": 4.0, "median": 5.0, "max": 9.0}
    for key in TIMING_KEYS + RATIO_KEYS:  # the plain keys (read by older tools) are the medians
        s = row["spread"][key]
        assert s["min"] <= s["median"] <= s["max"] and row[key] == s["median"], key
    assert row["repeats"] == 3 and row["tokens_out"] == 10 and row["peak_mb"] == 40.0
    with pytest.raises(ValueError):
        summarize(rows, base[:2])


def test_ranges_in_the_table_cells():
    row = {"repeats": 3, "spread": {"speedup": spread([2.40, 2.44, 2.50]), "overhead_share": spread([0.0, 0.001])}}
    assert with_range(row, "speedup", ".2f", "x") == "2.44x (2.40–2.50)"
    assert with_range(row, "overhead_share", ".1f", "%", scale=100) == "0.1% (0.0–0.1%)"
    assert with_range({**row, "repeats": 1}, "speedup", ".2f", "x") == "2.44x"  # one repeat: no range


def test_bench_default_repeats(monkeypatch, capsys):
    with pytest.raises(ValueError, match="repeats must be at least 1"):  # checked before any model is built
        vtc.tools.bench.bench(size="tiny", repeats=0)
    seen = []
    monkeypatch.setattr(vtc.tools.bench, "bench", lambda **kw: seen.append(kw))
    assert main(["bench"]) == 0 and main(["bench", "--repeats", "3"]) == 0
    assert [kw["repeats"] for kw in seen] == [vtc.tools.bench.DEFAULT_REPEATS, 3]
