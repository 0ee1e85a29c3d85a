"""Spec parsing (`"framefusion+quota"`), parameter routing, stage ordering, validation and stage execution.

A `Pipeline` is backend-neutral: a backend (the HF patch, later vLLM) binds it to a model family, then calls
`run_sample`, `run_connect` (the connect engine: plugins in order, each output checked) and `run_prefill`.
Everything a pipeline can refuse it refuses when it is built, before any model runs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Iterable

from vtc.core import hookspecs
from vtc.core.contract import CAPABILITY_METHODS, LEGACY_ATTRIBUTES
from vtc.core.registry import ALL_FAMILIES, MethodInfo, Registry, make_plugin_manager, registry
from vtc.core.stats import StatsRecorder
from vtc.core.tokens import Context, VideoTokens

STAGE_ORDER = {stage: i for i, stage in enumerate(hookspecs.STAGES)}


def parse_spec(spec: str | Iterable[str]) -> list[str]:
    """`"a+b"` or `["a", "b"]` -> `["a", "b"]` (whitespace ignored, case-insensitive)."""
    names = spec.split("+") if isinstance(spec, str) else list(spec)
    names = [n.strip().lower() for n in names]
    if not names or any(not n for n in names):
        raise ValueError(f"invalid method spec {spec!r}: expected names joined by '+', e.g. 'uniform+fastv'")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"method(s) {', '.join(duplicates)} appear twice in spec {spec!r}")
    return names


def validate_retention(retention: float | None) -> float | None:
    if retention is None:
        return None
    if isinstance(retention, bool) or not isinstance(retention, (int, float)) or math.isnan(retention):
        raise ValueError(f"retention must be a number in (0, 1], got {retention!r}")
    if not 0.0 < float(retention) <= 1.0:
        raise ValueError(f"retention must be in (0, 1] (fraction of visual tokens the LLM sees), got {retention}")
    return float(retention)


def validate_grid(grid: Any) -> tuple[int, int, int]:
    """A token grid (T, H, W) of positive integers, or a ValueError naming what is wrong."""
    try:
        values = tuple(grid)
        integral = len(values) == 3 and all(not isinstance(v, (bool, str)) and int(v) == v for v in values)
    except (TypeError, ValueError):
        integral = False
    if not integral:
        raise ValueError(f"a token grid is (T, H, W): three positive integers, got {grid!r}")
    t, h, w = (int(v) for v in values)
    if min(t, h, w) < 1:
        raise ValueError(f"a token grid is (T, H, W) with every entry >= 1, got {grid!r}")
    return t, h, w


@dataclasses.dataclass
class Entry:
    info: MethodInfo
    params: Any
    retention: float | None
    plugin: Any


def _route_params(infos: list[MethodInfo], params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Send each `field=value` (or `method.field=value`) to the method that declares it."""
    routed: dict[str, dict[str, Any]] = {info.name: {} for info in infos}
    fields = {info.name: {f.name for f in dataclasses.fields(info.params)} for info in infos}
    for key, value in params.items():
        if "." in key:
            method, field = key.split(".", 1)
            if method not in fields:
                raise ValueError(f"parameter {key!r} names method {method!r}, which is not in this pipeline")
            if field not in fields[method]:
                allowed = ", ".join(sorted(fields[method])) or "(none)"
                raise ValueError(f"method {method!r} has no parameter {field!r}; its parameters: {allowed}")
            routed[method][field] = value
            continue
        owners = [name for name, names in fields.items() if key in names]
        if not owners:
            allowed = "; ".join(f"{n}: {', '.join(sorted(f)) or '(none)'}" for n, f in fields.items())
            raise ValueError(f"unknown parameter {key!r} for this pipeline; parameters by method -> {allowed}")
        if len(owners) > 1:
            hint = ", ".join(f"'{o}.{key}'" for o in owners)
            raise ValueError(f"parameter {key!r} belongs to several methods; name one: {hint}")
        routed[owners[0]][key] = value
    return routed


def check_capabilities(info: MethodInfo, plugin: Any) -> None:
    """The plugin object offers exactly what its MethodInfo declares (nothing vtc would silently ignore)."""
    for flag, method in CAPABILITY_METHODS.items():
        declared, offered = getattr(info, flag), callable(getattr(plugin, method, None))
        if declared and not offered:
            raise TypeError(f"method {info.name!r} declares {flag}=True but its plugin has no {method}() method")
        if offered and not declared:
            raise TypeError(
                f"method {info.name!r}: its plugin defines {method}() but its MethodInfo does not declare "
                f"{flag}=True, so vtc would never call it; declare it (or remove the method)"
            )
    for attribute, field in LEGACY_ATTRIBUTES.items():
        if hasattr(plugin, attribute):
            raise TypeError(
                f"method {info.name!r}: the plugin attribute {attribute!r} is not read any more; declare "
                f"MethodInfo({field}=True) instead"
            )
    for stage in info.stages:
        if not callable(getattr(plugin, f"vtc_{stage}", None)):
            raise TypeError(f"method {info.name!r} declares the {stage} stage but its plugin has no vtc_{stage} hook")


def streaming_methods(methods: Registry | None = None) -> list[str]:
    """Names of the methods `vtc.stream` can run (causal connect hooks and streaming memories)."""
    return [i.name for i in (methods or registry()).infos() if i.streams or i.stream_memory]


def check_streaming(infos: list[MethodInfo], streaming: bool, methods: Registry | None = None) -> None:
    """A stream runs only causal connect hooks and one streaming memory; `vtc.patch` runs no stream-only method."""
    if not streaming:
        only = [i.name for i in infos if i.stream_only]
        if only:
            raise ValueError(
                f"{', '.join(only)} is a streaming method (its memory of the stream is the method): run it with "
                f"vtc.stream(model, processor, {'+'.join(only)!r}, ...) or `vtc stream`, not vtc.patch"
            )
        return
    bad = [i.name for i in infos if not (i.streams or i.stream_memory)]
    if bad:
        raise ValueError(
            f"{', '.join(bad)} cannot stream: a stream sees frames one chunk at a time, with no future frames, no "
            f"frame sampling (the caller feeds the frames) and no whole-prompt LLM stage. Methods that stream: "
            f"{', '.join(streaming_methods(methods))}"
        )


class Pipeline:
    """An ordered list of method plugins built from a spec, with their parameters.

    Plugins are ordered by the earliest stage each acts in, then by their place in the spec (see
    `vtc.core.hookspecs`). The overall `retention` is split evenly (geometrically) over the token-reducing
    plugins, so that composing two of them still leaves `retention` of the visual tokens; a method's own
    parameters override this mapping. `family` binds the pipeline to a model family: `retained_count` needs it
    (a count is a pure function of the family, the grid and the parameters), and methods that do not support
    the family are refused.
    """

    def __init__(
        self,
        spec: str | Iterable[str],
        retention: float | None = None,
        params: dict[str, Any] | None = None,
        methods: Registry | None = None,
        family: str | None = None,
        streaming: bool = False,
    ) -> None:
        methods = methods or registry()
        names = parse_spec(spec)
        infos = [methods[name] for name in names]
        self.spec = "+".join(names)
        self.retention = validate_retention(retention)
        self.family: str | None = None
        self._check_conflicts(infos)
        check_streaming(infos, streaming, methods)
        encoders = [info.name for info in infos if "encode" in info.stages]
        if encoders:
            # the hook exists for third-party plugins to target, but no backend calls it yet
            raise ValueError(
                f"method(s) {', '.join(encoders)} act in the encode stage, which this vtc version does not run "
                "yet; supported stages: sample, connect, prefill"
            )

        routed = _route_params(infos, params or {})
        reducers = [info for info in infos if info.reduces_tokens]
        share = self.retention ** (1.0 / len(reducers)) if (self.retention is not None and reducers) else None

        self.pm = make_plugin_manager()
        ranked = sorted(enumerate(infos), key=lambda p: (min(STAGE_ORDER[s] for s in p[1].stages), p[0]))
        self.entries: list[Entry] = []
        for _, info in ranked:
            try:
                p = info.params(**routed[info.name])
            except TypeError as err:
                raise ValueError(f"bad parameters for method {info.name!r}: {err}") from None
            plugin_retention = share if info.reduces_tokens else None
            plugin = info.factory(p, plugin_retention)
            check_capabilities(info, plugin)
            self.pm.register(plugin, name=info.name)
            self.entries.append(Entry(info, p, plugin_retention, plugin))
        self.pm.check_pending()
        self._check_order()
        self._stores: dict[str, dict[str, Any]] = {}
        self.begin_prompt()
        if family is not None:
            self.bind(family)

    @staticmethod
    def _check_conflicts(infos: list[MethodInfo]) -> None:
        owners: dict[str, str] = {}
        for info in infos:
            for decision in info.owns:
                if decision in owners:
                    raise ValueError(
                        f"methods {owners[decision]!r} and {info.name!r} both decide {decision.replace('_', ' ')}; "
                        "a pipeline can have only one of them"
                    )
                owners[decision] = info.name

    def _check_order(self) -> None:
        """A method that needs whole frames must see them: no connect method may run before it."""
        connect = self.stage_entries("connect")
        for i, e in enumerate(connect):
            if e.info.needs_whole_frames and i > 0:
                before = ", ".join(x.info.name for x in connect[:i])
                raise ValueError(
                    f"{e.info.name} needs whole frames (every token of every frame it gets), but {before} would "
                    f"run before it and remove tokens inside frames; put {e.info.name} first among the connect "
                    f"methods, e.g. '{'+'.join([e.info.name] + [x.info.name for x in connect if x is not e])}'"
                )

    # --- binding ---------------------------------------------------------------------------------------------
    def bind(self, family: str) -> None:
        """Bind to a model family: every method must support it."""
        if family not in ALL_FAMILIES:
            raise ValueError(f"unknown family {family!r}; families: {', '.join(ALL_FAMILIES)}")
        for e in self.entries:
            if family not in e.info.families:
                raise ValueError(
                    f"method {e.info.name!r} does not support {family}; it supports {', '.join(e.info.families)}"
                )
        self.family = family

    # --- introspection -------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return [e.info.name for e in self.entries]

    def stage_entries(self, stage: str) -> list[Entry]:
        return [e for e in self.entries if stage in e.info.stages]

    def has_stage(self, stage: str) -> bool:
        return bool(self.stage_entries(stage))

    def vision_stats(self, family: str) -> set:
        """Every vision-tower statistic the connect plugins declared."""
        stats: set = set()
        for e in self.stage_entries("connect"):
            if e.info.vision_stats:
                stats.update(e.plugin.vision_stats(family))
        return stats

    @property
    def needs_prepool(self) -> bool:
        return any(e.info.prepool for e in self.stage_entries("connect"))

    @property
    def acts_during_decode(self) -> bool:
        return any(e.info.acts_during_decode for e in self.stage_entries("prefill"))

    def position_policy(self, override: str | None, mrope: bool) -> str:
        """'keep' or 'compact' for the connect stage, from the plugins (or the user's override)."""
        if override is not None:
            if override not in ("keep", "compact"):
                raise ValueError(f"positions must be 'keep' or 'compact', got {override!r}")
            if override == "compact" and mrope:
                raise ValueError(
                    "positions='compact' is only supported on 1-D RoPE families (llava_onevision, "
                    "llava_next_video); Qwen M-RoPE families keep each token's original (t, h, w) position"
                )
            return override
        if mrope:
            return "keep"
        connect = self.stage_entries("connect")
        return connect[-1].info.position_policy if connect else "keep"

    def _plugin_count(self, e: Entry, num_tokens: int, grid: tuple[int, int, int], family: str) -> int | None:
        if not e.info.fixed_count:
            return None
        count = e.plugin.retained_count(num_tokens, grid, family)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise TypeError(f"method {e.info.name!r}: retained_count must return an int >= 0 or None, got {count!r}")
        return count

    def retained_count(self, grid: tuple[int, int, int], family: str | None = None) -> int | None:
        """Visual tokens the LLM keeps for a video with token grid `grid` = (T, H, W): the count at the last LLM
        layer when a method acts in the LLM, else the count entering it. None when a method decides from the
        content. A pure function of (family, grid, parameters): `family` defaults to the bound one."""
        t, h, w = validate_grid(grid)
        family = family or self.family
        if family is None:
            raise ValueError(
                "retained_count depends on the model family: bind one with Pipeline(spec, family=...) "
                f"or pass family=...; families: {', '.join(ALL_FAMILIES)}"
            )
        count: int | None = t * h * w
        in_llm = None  # a method whose count is a last-layer count: nothing may reduce after its connect stage
        for e in self.entries:
            if not e.info.reduces_tokens:
                continue
            if in_llm is not None and "connect" in e.info.stages:
                return None  # e thins what in_llm's connect stage left, before in_llm acts in the LLM
            count = self._plugin_count(e, count, (t, h, w), family)
            if count is None:
                return None
            if e.info.acts_in_llm:
                in_llm = e
        return count

    # --- execution -----------------------------------------------------------------------------------------
    def begin_prompt(self) -> None:
        """Start a new prompt: every plugin gets a fresh `ctx.store`."""
        self._stores = {e.info.name: {} for e in self.entries}

    def _call(self, e: Entry, hook: str, ctx: Context, recorder: StatsRecorder | None, **kwargs: Any) -> Any:
        """Call one plugin hook with its own `ctx.store`, then hand what it reported to the recorder."""
        ctx.store = self._stores.setdefault(e.info.name, {})
        ctx.reports = {}
        out = getattr(e.plugin, hook)(ctx=ctx, **kwargs)
        if recorder is not None:
            recorder.report(e.info.name, ctx.reports)
        return out

    def run_sample(self, video, ctx: Context) -> list[int] | None:
        for e in self.stage_entries("sample"):
            return self._call(e, "vtc_sample", ctx, None, video=video)
        return None

    def run_connect(self, tokens: VideoTokens, ctx: Context, recorder: StatsRecorder | None) -> VideoTokens:
        """The connect engine: one video's tokens through every connect plugin, in order, each output checked."""
        for e in self.stage_entries("connect"):
            n_in = len(tokens)
            start = time.perf_counter()
            out = self._call(e, "vtc_connect", ctx, recorder, tokens=tokens)
            seconds = time.perf_counter() - start
            self._check_output(e, tokens, out, ctx)
            if out is not tokens:
                out.log.append((e.info.name, n_in, len(out)))
            if recorder is not None:
                recorder.record("connect", e.info.name, n_in, len(out), seconds)
            tokens = out
        return tokens

    def _check_output(self, e: Entry, tokens: VideoTokens, out: Any, ctx: Context) -> None:
        name = e.info.name
        if not isinstance(out, VideoTokens):
            raise TypeError(f"plugin {name!r}: vtc_connect must return VideoTokens, got {type(out).__name__}")
        if out is tokens:
            return
        out.validate()
        if len(tokens) and not len(out):
            raise RuntimeError(f"plugin {name!r} returned no tokens for a video of {len(tokens)}: keep at least one")
        if out.grid != tokens.grid:
            raise RuntimeError(f"plugin {name!r} changed the video's grid {tokens.grid} -> {out.grid}; keep it")
        if e.info.reduces_tokens and e.info.fixed_count and not e.info.acts_in_llm and ctx.family is not None:
            promised = self._plugin_count(e, len(tokens), tokens.grid, ctx.family)
            if promised is not None and promised != len(out):
                raise RuntimeError(
                    f"plugin {name!r} promised {promised} tokens (retained_count({len(tokens)}, {tokens.grid}, "
                    f"{ctx.family!r})) but returned {len(out)}; note that tokens.grid is the original grid while "
                    "num_tokens is what earlier methods left"
                )

    def run_prefill(self, state, ctx: Context, recorder: StatsRecorder | None, decoding: bool = False) -> None:
        for e in self.stage_entries("prefill"):
            if decoding and not e.info.acts_during_decode:
                continue
            start = time.perf_counter()
            self._call(e, "vtc_prefill", ctx, recorder, state=state)
            if recorder is not None:
                recorder.add_seconds("prefill", e.info.name, time.perf_counter() - start)
