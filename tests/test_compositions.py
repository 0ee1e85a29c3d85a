"""Methods composed across stages (`"framefusion+quota"`, `"uniform+visionzip+fastv"`, ...) on every family:
the retention is split between the reducing methods, each acts on what the previous one left, and the
composition keeps the matrix's guarantees (identity at retention 1.0, planned counts, padded batch = single
prompts, generate, clean unpatch)."""

from __future__ import annotations

import pytest
import torch

import vtc
from tests.conftest import model_and_processor, single_inputs
from vtc.testing.conformance import _greedy as greedy
from vtc.testing.conformance import _inputs as prepared
from vtc.testing.conformance import _logits as logits
from vtc.testing.conformance import _patch, hook_counts

COMPOSITIONS = [
    "framefusion+quota",  # sample + connect (QuoTA) then prefill (FrameFusion)
    "uniform+visionzip+fastv",  # sample, connect, prefill
    "vidcom2+prunevid",  # connect, then PruneVid's static/dynamic merge (connect) and layer prune (prefill)
    "aot+framefusion",
    "fastvid+dycoke",  # two connect methods, then DyCoke's decode-time KV pruning
    "divprune+fastv",
    "uniform+pixelprune+vidcom2",  # sample, encode (before the tower), connect on the survivors
]
RETENTION = 0.25


def compose(model, spec: str, retention: float):
    return _patch(model, spec, retention)


def reallocates(spec: str) -> bool:
    """A method of the spec redistributes a budget instead of keeping everything at retention 1.0 (QuoTA)."""
    return any("identity_at_full_retention" in vtc.registry()[m].testing.exemptions for m in spec.split("+"))


@pytest.mark.parametrize("spec", COMPOSITIONS)
def test_composition(spec, family):
    model, processor = model_and_processor(family)
    unsupported = [m for m in spec.split("+") if family not in vtc.registry()[m].card.families]
    if unsupported:  # e.g. FastVID on InternVL: refused at vtc.patch, naming the method, and nothing installed
        hooks = hook_counts(model)
        with pytest.raises(ValueError, match=f"method '{unsupported[0]}'"):
            compose(model, spec, RETENTION)
        assert hook_counts(model) == hooks
        return
    single = single_inputs(family)
    ref = logits(model, single)
    hooks_before = hook_counts(model)

    if not reallocates(spec):
        with compose(model, spec, 1.0) as handle:
            assert torch.equal(logits(model, single), ref)
            assert handle.stats().visual_tokens_out == handle.stats().visual_tokens_in

    with compose(model, spec, RETENTION) as handle:
        shares = [e.retention for e in handle.pipeline.entries if e.card.reduces_tokens]
        assert shares == pytest.approx([RETENTION ** (1 / len(shares))] * len(shares))
        batch = prepared(handle, family, None)
        out = logits(model, batch)[:, -1]
        stats = handle.stats()
        assert 0 < stats.visual_tokens_out < stats.visual_tokens_in
        batch_kept = stats.visual_tokens_out
        kept = 0
        for which in (0, 1):
            single_out = logits(model, prepared(handle, family, which))[0, -1]
            stats = handle.stats()
            kept += stats.visual_tokens_out
            torch.testing.assert_close(out[which], single_out, atol=2e-5, rtol=1e-4)
            # the encode and connect plugins ran in pipeline order, each on what the one before it left
            connect = [r for r in stats.stages if r.stage == "connect"]
            assert [r.plugin for r in connect] == [e.card.name for e in handle.pipeline.stage_entries("connect")]
            chain = [r for r in stats.stages if r.stage in ("encode", "connect")]
            assert chain[0].tokens_in == stats.visual_tokens_in
            assert all(a.tokens_out == b.tokens_in for a, b in zip(chain, chain[1:]))
            assert chain[-1].tokens_out == stats.llm_tokens_in
        assert batch_kept == kept
        new = greedy(model, prepared(handle, family, None), tokens=3)
        assert new.shape == (2, 3)
        assert all(isinstance(t, str) for t in processor.batch_decode(new, skip_special_tokens=True))

    assert torch.equal(logits(model, single), ref)
    assert hook_counts(model) == hooks_before


@pytest.mark.parametrize("spec", ["uniform+visionzip+vidcom2", "vidcom2+divprune"])
def test_fixed_count_composition_keeps_the_product(spec, family):
    """Two fixed-count methods in a row keep exactly what their chained `retained_count` promises."""
    model, _ = model_and_processor(family)
    params = {f"{m}.fixed_count": True for m in spec.split("+") if m == "vidcom2"}
    with vtc.patch(model, spec, retention=RETENTION, **params) as handle:
        logits(model, prepared(handle, family, None))
        stats = handle.stats()
        planned = [handle.retained_count(grid) for grid in stats.grids]
        assert None not in planned
        assert stats.visual_tokens_out == sum(planned)


def test_order_errors_are_clear_and_come_at_patch_time():
    model, _ = model_and_processor("qwen2_vl")
    hooks = hook_counts(model)
    for spec in ("random+holitom", "vidcom2+divprune+holitom"):
        with pytest.raises(ValueError, match="holitom needs whole frames.*put holitom first"):
            vtc.patch(model, spec, retention=RETENTION)
    assert hook_counts(model) == hooks  # refused before anything was installed
    with pytest.raises(ValueError, match="both decide llm token schedule"):
        vtc.patch(model, "fastv+framefusion", retention=RETENTION)
    # QuoTA also needs whole frames, but it samples frames, so its connect hook runs first whatever the spec says
    assert [e.card.name for e in vtc.core.pipeline.Pipeline("vidcom2+quota").stage_entries("connect")] == [
        "quota",
        "vidcom2",
    ]
    with vtc.patch(model, "holitom+random", retention=RETENTION, **{"holitom.k": 2}) as handle:
        assert [e.card.name for e in handle.pipeline.stage_entries("connect")] == ["holitom", "random"]
