"""The conformance matrix: what every token-reducing method must do on every family it supports.

vtc's own test suite runs it on every registered method; a third-party plugin package runs the same matrix on
its methods, offline, in a few lines of pytest:

    import pytest
    from vtc.testing import conformance

    @pytest.mark.parametrize("case", conformance.cases(["keepnorm"]), ids=str)
    def test_conformance(case):
        conformance.run(case)

A method opts out of a check by saying why in `@vtc.method(..., exempt={check: reason})`, and gives
parameters that fit the tiny test models in `@vtc.method(..., test_params=...)` (its `TestHints`). The checks
(`vtc.core.method.CONFORMANCE_CHECKS`):

  identity_at_full_retention  retention 1.0 gives the unpatched model's logits and greedy tokens
  retention                   at retention r (0.5, 0.25) the LLM sees r of the visual tokens, at the count the
                              method's `retention_reference` names, within its granularity (a method that warns
                              that r is below what it can reach must keep more, not less)
  retention_fixed             the same with `fixed_count=True`, for methods with that switch
  planned_count               the count at the last layer equals `retained_count` (fixed) or, for methods acting
                              in the LLM, what the method reported (`ctx.report(kept=...)`); fewer than given
  fixed_count                 `retained_count`, computed from the processor outputs before any model runs, is the
                              count the LLM sees, alone, after `random` and before it (compositions)
  original_positions          tokens that reach a layer carry their original RoPE rows; text is untouched
  ordered_positions           ... in increasing original order
  generate                    `generate` runs and decodes, batch of two
  unpatch                     unpatch restores the model exactly: outputs, hooks, attributes, attention config
  padded_batch                a left-padded batch equals its prompts run one by one
  decode_continues            decoding with the cache equals re-running the whole sequence (methods acting
                              only before the LLM and not reading the question)
  bf16                        runs in bfloat16 (identity at retention 1.0 included)
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Iterable

import torch

from vtc.api import patch
from vtc.core.method import CONFORMANCE_CHECKS, MethodCard
from vtc.core.pipeline import Pipeline
from vtc.core.registry import registry
from vtc.hf.adapters import resolve_adapter
from vtc.testing.fixtures import (
    NUM_FRAMES,
    QUESTIONS,
    batch_inputs,
    mixed_inputs,
    model_and_processor,
    single_inputs,
    token_grids,
    videos,
)

RETENTION = 0.3
RETENTIONS = (0.5, 0.25)


@dataclasses.dataclass(frozen=True)
class Case:
    check: str
    method: str
    family: str

    def __str__(self) -> str:
        return f"{self.check}-{self.method}-{self.family}"


def applies(check: str, info: MethodCard) -> bool:
    """Whether a check concerns a method at all (exemptions aside)."""
    if check == "retention_fixed":
        return info.fixed_count_mode == "optional"
    if check == "fixed_count":
        return info.fixed_count
    if check == "decode_continues":
        return not info.query_aware and info.stages == ("connect",)
    return True


def cases(
    methods: Iterable[str] | None = None, families: Iterable[str] | None = None, checks: Iterable[str] | None = None
) -> list[Case]:
    """Every (check, method, family) case for token-reducing `methods` (default: all registered that `vtc.patch`
    runs; stream-only methods are checked by their own stream tests), on the `families` each method runs on (default:
    every registered family it supports, `supported_families`), minus the checks a method declares itself exempt
    from."""
    reg = registry()
    names = (
        list(methods)
        if methods is not None
        else [c.name for c in reg.cards() if c.reduces_tokens and not c.stream_only]
    )
    chosen = list(checks) if checks is not None else list(CONFORMANCE_CHECKS)
    unknown = sorted(set(chosen) - set(CONFORMANCE_CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; checks: {', '.join(CONFORMANCE_CHECKS)}")
    out = []
    for name in names:
        info = reg[name].card
        if not info.reduces_tokens:
            raise ValueError(f"{name} does not reduce tokens; the conformance matrix is for token-reducing methods")
        if info.stream_only:
            raise ValueError(f"{name} runs only in vtc.stream; the conformance matrix checks vtc.patch")
        wanted = supported_families(name)
        if families is not None:
            wanted = [f for f in families if f in wanted]
        for family in wanted:
            for check in chosen:
                if applies(check, info) and check not in reg[name].testing.exemptions:
                    out.append(Case(check, name, family))
    return out


def supported_families(method: str) -> list[str]:
    """The registered families on which `method` runs (its card's families: every feature it requires, every
    vision-tower statistic it reads) and reduces the LLM's visual tokens (ToMe on LLaVA saves tower compute only)."""
    cls = registry()[method]
    return [f for f in cls.card.families if cls().reduces_llm_tokens(f)]


def run(case: Case) -> None:
    """Run one case; raises AssertionError (with what went wrong) when the method breaks the contract."""
    if case.check not in CHECKS:
        raise ValueError(f"unknown check {case.check!r}; checks: {', '.join(CHECKS)}")
    CHECKS[case.check](case.method, case.family)


def check_method(method: str, families: Iterable[str] | None = None) -> None:
    """Run the whole matrix for one method (a script-friendly alternative to the pytest form above)."""
    for case in cases([method], families):
        run(case)


# --- helpers ----------------------------------------------------------------------------------------------------
def _info(method: str) -> MethodCard:
    return registry()[method].card


def _exempt(method: str) -> dict[str, str]:
    return registry()[method].testing.exemptions


def _test_params(spec: str) -> dict:
    """Every method's test parameters, qualified by method name (`holitom.k`)."""
    params = {}
    for name in spec.split("+"):
        params.update({f"{name}.{k}": v for k, v in registry()[name].testing.params.items()})
    return params


def _patch(model, spec: str, retention: float, **params):
    return patch(model, spec, retention=retention, **{**_test_params(spec), **params})


def _inputs(handle, family: str, which: int | None):
    """Processor inputs: through `handle.prepare` when a method of the spec has a sample stage (it scores frames
    there), else the cached ones. `which`: 0 or 1 for one prompt, None for the padded batch of both."""
    if not any("sample" in e.card.stages for e in handle.pipeline.entries):
        return batch_inputs(family) if which is None else single_inputs(family, which)
    _, processor = model_and_processor(family)
    if which is None:
        return handle.prepare(processor, list(videos()), list(QUESTIONS), num_frames=NUM_FRAMES, fps=8)
    return handle.prepare(processor, videos()[which], QUESTIONS[which], num_frames=NUM_FRAMES, fps=8)


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _greedy(model, inputs, tokens: int = 4) -> torch.Tensor:
    # exactly `tokens` new tokens: a random-weight model may pick its end-of-sequence token first, which would end
    # a one-prompt generation early (the checks ask whether generation runs, not when the model stops)
    out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[:, inputs["input_ids"].shape[1] :]


@functools.lru_cache(maxsize=None)
def _reference(family: str, what: str, dtype: torch.dtype = torch.float32):
    """The unpatched model's outputs, computed once per family: they depend on the family alone (every check
    leaves the cached model exactly as it found it, which `check_unpatch` verifies). what: "single" / "batch"
    logits, "greedy" tokens of the batch, "layers" (what every decoder layer receives for the single prompt)."""
    model, _ = model_and_processor(family, dtype)
    single = _cast(single_inputs(family), dtype)
    if what == "single":
        return _logits(model, single)
    if what == "batch":
        return _logits(model, batch_inputs(family))
    if what == "greedy":
        return _greedy(model, batch_inputs(family))
    if what == "layers":
        records, handles = _probe_layers(model)
        try:
            _logits(model, single)
        finally:
            for h in handles:
                h.remove()
        return records
    raise ValueError(what)


def _cast(inputs: dict, dtype: torch.dtype) -> dict:
    """Processor outputs with floating tensors (pixels) in `dtype`."""
    if dtype == torch.float32:
        return inputs
    return {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}


def hook_counts(model) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(getattr(m, "_forward_hooks_with_kwargs", {}))
        for m in model.modules()
    )


def _fixed_switch(info: MethodCard) -> dict:
    return {"fixed_count": True} if info.fixed_count_mode == "optional" else {}


def _tolerance(grid: tuple[int, int, int], info: MethodCard) -> float:
    """How far a method's count may miss retention * N: per-frame rounding (one token per frame, or the
    method's coarser step), relative to the tokens of a frame."""
    _, h, w = grid
    return (info.retention_granularity + 0.5) / (h * w) + 0.005


# --- checks -----------------------------------------------------------------------------------------------------
def check_identity(method: str, family: str) -> None:
    model, _ = model_and_processor(family)
    single, batch = single_inputs(family), batch_inputs(family)
    ref_single, ref_batch = _reference(family, "single"), _reference(family, "batch")
    ref_tokens = _reference(family, "greedy")
    with _patch(model, method, 1.0) as handle:
        assert torch.equal(_logits(model, single), ref_single), f"{method} at retention 1.0 changed the logits"
        assert torch.equal(_logits(model, batch), ref_batch), f"{method} at retention 1.0 changed a batch's logits"
        assert torch.equal(_greedy(model, batch), ref_tokens), f"{method} at retention 1.0 changed generate"
        stats = handle.stats()
        assert stats.visual_tokens_out == stats.visual_tokens_in > 0


def _check_retention(method: str, family: str, extra: dict) -> None:
    info = _info(method)
    model, _ = model_and_processor(family)
    for retention in RETENTIONS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with _patch(model, method, retention, **extra) as handle:
                _logits(model, _inputs(handle, family, 0))
                stats = handle.stats()
        measured = stats.retention_at(info.retention_reference)
        tol = _tolerance(stats.grids[0], info)
        floor = any(issubclass(w.category, RuntimeWarning) and "retention" in str(w.message) for w in caught)
        where = f"{method} on {family} at retention {retention} ({info.retention_reference})"
        if floor:  # the method said it cannot go that low: it must keep more, never less
            assert measured >= retention - tol, f"{where}: warned of a floor but kept {measured:.3f}"
        else:
            assert abs(measured - retention) <= tol, f"{where}: the LLM sees {measured:.3f} (tolerance {tol:.3f})"


def check_retention(method: str, family: str) -> None:
    _check_retention(method, family, {})


def check_retention_fixed(method: str, family: str) -> None:
    _check_retention(method, family, {"fixed_count": True})


def _planned(handle, stats, method: str) -> int:
    counts = [handle.retained_count(i.grid, i.kind) for i in stats.items if i.compressed]
    if all(c is not None for c in counts):
        return sum(counts)
    kept = stats.reports.get(method, {}).get("kept")
    if kept is not None:  # what the method says it kept (per batch row)
        return sum(kept)
    info = _info(method)
    assert not info.acts_in_llm or info.retention_reference == "llm_input", (
        f"{method} acts in the LLM with an adaptive count but reports no ctx.report(kept=...)"
    )
    return stats.llm_tokens_in  # decided before the LLM: what the connect stage handed over (checked by vtc)


def check_planned_count(method: str, family: str) -> None:
    """The last layer keeps the planned count: on one prompt, and on a prompt with a video and an image (a method
    that takes images compresses the image to its own count; a temporal one runs with images=False, and the image
    passes whole; a spec with a sampler gets the padded batch instead, its frames chosen by `handle.prepare`)."""
    info = _info(method)
    model, _ = model_and_processor(family)
    sampler = "sample" in info.stages
    with _patch(model, method, RETENTION, images=info.acts_on_images) as handle:
        for which in (0, None):
            inputs = _inputs(handle, family, which) if which == 0 or sampler else mixed_inputs(family)
            _logits(model, inputs)
            stats = handle.stats()
            assert stats.visual_tokens_out == _planned(handle, stats, method), (
                f"{method} on {family}: the last layer has {stats.visual_tokens_out} visual tokens, the plan says "
                f"{_planned(handle, stats, method)}"
            )
            assert stats.visual_tokens_out < stats.visual_tokens_in
            if which is None and not sampler:
                images = [i for i in stats.items if i.kind == "image"]
                assert images and all(i.compressed == info.acts_on_images for i in images), (
                    f"{method} on {family}: images {'should' if info.acts_on_images else 'should not'} be compressed"
                )


def check_fixed_count(method: str, family: str) -> None:
    """The serving contract: the count, computed from the grid before any model runs, is what the LLM sees."""
    info = _info(method)
    model, _ = model_and_processor(family)
    specs = [method] + (["random+" + method] if not info.whole_frames else []) + [method + "+random"]
    for spec in specs:
        if "random" in spec and method == "random":
            continue
        params = {f"{method}.{k}": v for k, v in _fixed_switch(info).items()}
        for retention in (RETENTION, 0.15):
            promise = Pipeline(spec, retention, {**_test_params(spec), **params}, family=family)
            with _patch(model, spec, retention, **params) as handle:
                for which in (0, None):
                    inputs = _inputs(handle, family, which)
                    promised = [promise.retained_count(grid) for grid in token_grids(model, inputs)]
                    _logits(model, inputs)
                    stats = handle.stats()
                    if spec != method and None in promised:
                        continue  # the method admits it cannot promise a count after another one (documented)
                    assert None not in promised, f"{spec} gives no fixed count on {family}"
                    assert stats.visual_tokens_out == sum(promised) < stats.visual_tokens_in, (
                        f"{spec} on {family} at {retention}: promised {promised} before the model ran, the LLM kept "
                        f"{stats.visual_tokens_out}"
                    )


def _probe_layers(model):
    """Record (hidden states, RoPE cos) entering every decoder layer; registered after vtc's hooks, so it sees
    what the layer really gets."""
    records: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        records.append((hidden[0].detach().clone(), kwargs["position_embeddings"][0][0].detach().clone()))

    layers = resolve_adapter(model).decoder_layers
    return records, [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]


def _rows_in(rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """For each row of `rows`, the index of an identical row in `table` (-1 if none)."""
    equal = (rows[:, None, :] == table[None, :, :]).all(-1)
    found = equal.any(1)
    return torch.where(found, equal.float().argmax(1), torch.full_like(found, -1, dtype=torch.long))


@functools.lru_cache(maxsize=2)
def _patched_layers(method: str, family: str):
    """What every decoder layer receives with `method` patched in (positions="keep" on every family; renumbering
    on LLaVA is checked by the API tests), shared by the two position checks."""
    model, _ = model_and_processor(family)
    with _patch(model, method, RETENTION, positions="keep") as handle:
        records, handles = _probe_layers(model)
        try:
            _logits(model, _inputs(handle, family, 0))
        finally:
            for h in handles:
                h.remove()
    return records


def _positions(method: str, family: str, ordered: bool) -> None:
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    original = _reference(family, "layers")
    records = _patched_layers(method, family)
    records = records[-len(original) :]  # a sampler running the model itself (QuoTA) records its passes first
    first = next(i for i, (hid, _) in enumerate(records) if hid.shape[0] != original[i][0].shape[0])
    hidden, cos = records[first]
    ref_hidden, ref_cos = original[first]
    same_hidden = (hidden[:, None, :] == ref_hidden[None, :, :]).all(-1)
    same_cos = (cos[:, None, :] == ref_cos[None, :, :]).all(-1)
    matched = same_hidden.any(1)  # tokens that reach this layer unchanged are found by their hidden state
    assert bool((same_hidden & same_cos).any(1)[matched].all()), f"{method}: an unchanged token lost its position"
    if first == 0:  # text tokens are never dropped: each keeps its hidden state and position
        text = inputs["input_ids"][0] != resolve_adapter(model).video_token_id
        assert bool((same_hidden & same_cos).any(0)[text].all()), f"{method}: a text token moved or changed"
    for _, cos_l in records[first:]:
        where = _rows_in(cos_l, ref_cos)
        assert bool((where >= 0).all()), f"{method}: a token carries a position that was not in the prompt"
        if ordered:
            assert bool((where[1:] > where[:-1]).all()), f"{method}: tokens are not in their original order"


def check_original_positions(method: str, family: str) -> None:
    _positions(method, family, ordered=False)


def check_ordered_positions(method: str, family: str) -> None:
    _positions(method, family, ordered=True)


def check_generate(method: str, family: str) -> None:
    model, processor = model_and_processor(family)
    with _patch(model, method, RETENTION) as handle:
        new = _greedy(model, _inputs(handle, family, None), tokens=5)
    assert new.shape == (2, 5)
    texts = processor.batch_decode(new, skip_special_tokens=True)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


def check_unpatch(method: str, family: str) -> None:
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    ref = _reference(family, "single")
    hooks_before = hook_counts(model)
    text = resolve_adapter(model).text_model
    attrs_before = {name: set(vars(m)) for name, m in model.named_modules()}
    attn_before = text.config._attn_implementation
    handle = _patch(model, method, RETENTION)
    assert not torch.equal(_logits(model, _inputs(handle, family, 0))[:, -1], ref[:, -1]), f"{method} changed nothing"
    handle.unpatch()
    assert torch.equal(_logits(model, inputs), ref), f"{method}: the unpatched model gives different logits"
    assert hook_counts(model) == hooks_before, f"{method}: hooks left after unpatch"
    assert {name: set(vars(m)) for name, m in model.named_modules()} == attrs_before, f"{method}: attributes left"
    assert text.config._attn_implementation == attn_before, f"{method}: attention implementation not restored"
    handle.unpatch()  # a second unpatch is a no-op


def check_padded_batch(method: str, family: str) -> None:
    model, _ = model_and_processor(family)
    with _patch(model, method, RETENTION) as handle:
        batch = _inputs(handle, family, None)
        assert bool((batch["attention_mask"] == 0).any()), "the batch must contain padding"
        out = _logits(model, batch)[:, -1]
        batch_kept = handle.stats().visual_tokens_out
        singles, kept = [], 0
        for which in (0, 1):
            singles.append(_logits(model, _inputs(handle, family, which))[0, -1])
            kept += handle.stats().visual_tokens_out
    assert batch_kept == kept, f"{method}: the batch kept {batch_kept} tokens, its prompts one by one {kept}"
    for row in (0, 1):
        torch.testing.assert_close(out[row], singles[row], atol=2e-5, rtol=1e-4)


def check_decode_continues(method: str, family: str) -> None:
    """Decoding with the cache equals re-running the whole (prompt + generated) sequence, which the patch
    compresses the same way."""
    model, _ = model_and_processor(family)
    inputs = single_inputs(family)
    with _patch(model, method, RETENTION):
        out = model.generate(
            **inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        full = dict(inputs)
        new = out.sequences[:, inputs["input_ids"].shape[1] :]
        full["input_ids"] = out.sequences[:, :-1]
        full["attention_mask"] = torch.ones_like(full["input_ids"])
        if "mm_token_type_ids" in full:
            full["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(new[:, :-1])], 1)
        with torch.no_grad():
            recomputed = model(**full, use_cache=False).logits[:, -1]
    torch.testing.assert_close(out.logits[-1], recomputed, atol=2e-5, rtol=1e-4)


def check_bf16(method: str, family: str) -> None:
    model, _ = model_and_processor(family, torch.bfloat16)

    def bf16(inputs):
        return _cast(inputs, torch.bfloat16)

    inputs = bf16(single_inputs(family))
    ref = _reference(family, "single", torch.bfloat16)
    if "identity_at_full_retention" not in _exempt(method):
        with _patch(model, method, 1.0):
            assert torch.equal(_logits(model, inputs), ref), f"{method} at retention 1.0 changed bf16 logits"
    with _patch(model, method, RETENTION) as handle:
        # the cached processor outputs are float32 pixels; a sampler builds its own, converted the same way
        prepared = bf16(_inputs(handle, family, 0)) if handle.pipeline.has_stage("sample") else inputs
        out = _logits(model, prepared)
        assert torch.isfinite(out).all(), f"{method}: non-finite bf16 logits"
        assert handle.stats().visual_tokens_out < handle.stats().visual_tokens_in
        new = _greedy(model, prepared, tokens=3)
    assert new.shape == (1, 3)


CHECKS: dict[str, Callable[[str, str], None]] = {
    "identity_at_full_retention": check_identity,
    "retention": check_retention,
    "retention_fixed": check_retention_fixed,
    "planned_count": check_planned_count,
    "fixed_count": check_fixed_count,
    "original_positions": check_original_positions,
    "ordered_positions": check_ordered_positions,
    "generate": check_generate,
    "unpatch": check_unpatch,
    "padded_batch": check_padded_batch,
    "decode_continues": check_decode_continues,
    "bf16": check_bf16,
}
assert set(CHECKS) == set(CONFORMANCE_CHECKS), "every declared check has an implementation"


# --- command line -----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """`python -m vtc.testing.conformance --family NAME [--method M ...] [--check C ...] [--register module:FAMILY]`:
    run the matrix of every method that supports the family (or those named), print one line per case, exit 1
    when one fails. `--register` adds a family not installed yet (`vtc.core.families.register_family`)."""
    import argparse
    import os
    import time
    import traceback

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vtc.core.families import family_names, load_object, register_family

    parser = argparse.ArgumentParser(prog="python -m vtc.testing.conformance", description=main.__doc__)
    parser.add_argument("--family", action="append", required=True, help="family to check (repeatable)")
    parser.add_argument("--method", action="append", help="only these methods (default: all that support it)")
    parser.add_argument("--check", action="append", choices=CONFORMANCE_CHECKS, help="only these checks")
    parser.add_argument("--register", action="append", default=[], help="'module:FAMILY' to register first")
    parser.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing case")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    for path in args.register:
        register_family(load_object(path, "--register"), replace=True)
    unknown = [f for f in args.family if f not in family_names()]
    if unknown:
        parser.error(f"unknown family {', '.join(unknown)}; known families: {', '.join(family_names())}")
    selected = cases(args.method, args.family, args.check)
    if not selected:
        print(f"no method supports {', '.join(args.family)}")
        return 1
    failed = 0
    start = time.perf_counter()
    for case in selected:
        t0 = time.perf_counter()
        try:
            run(case)
        except Exception as err:  # noqa: BLE001 - report every failing case, then fail
            failed += 1
            print(f"FAIL {case} ({time.perf_counter() - t0:.1f} s): {type(err).__name__}: {err}", flush=True)
            if os.environ.get("VTC_CONFORMANCE_TRACEBACK"):
                traceback.print_exc()
            if args.exitfirst:
                break
        else:
            print(f"ok   {case} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{len(selected) - failed} passed, {failed} failed in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
