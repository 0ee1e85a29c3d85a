"""Spec parsing (`"framefusion+quota"`), parameter routing, stage ordering, validation and stage execution."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Iterable

from vtc.core import hookspecs
from vtc.core.registry import MethodInfo, Registry, make_plugin_manager, registry
from vtc.core.stats import StatsRecorder
from vtc.core.tokens import Context, VideoTokens


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


class Pipeline:
    """An ordered list of method plugins built from a spec, with their parameters.

    Plugins run in stage order (sample, encode, connect, prefill), and within a stage in the order the
    spec names them. The overall `retention` is split evenly (geometrically) over the token-reducing
    plugins, so that composing two of them still leaves `retention` of the visual tokens; a method's own
    parameters override this mapping.
    """

    def __init__(
        self,
        spec: str | Iterable[str],
        retention: float | None = None,
        params: dict[str, Any] | None = None,
        methods: Registry | None = None,
    ) -> None:
        methods = methods or registry()
        names = parse_spec(spec)
        infos = [methods[name] for name in names]
        self.spec = "+".join(names)
        self.retention = validate_retention(retention)
        self._check_conflicts(infos)
        encoders = [info.name for info in infos if "encode" in info.stages]
        if encoders:
            # the hook exists for third-party plugins to target, but no adapter calls it yet
            raise ValueError(
                f"method(s) {', '.join(encoders)} act in the encode stage, which this vtc version does not run "
                "yet; supported stages: sample, connect, prefill"
            )

        routed = _route_params(infos, params or {})
        reducers = [info for info in infos if info.reduces_tokens]
        share = self.retention ** (1.0 / len(reducers)) if (self.retention is not None and reducers) else None

        self.pm = make_plugin_manager()
        order = {stage: i for i, stage in enumerate(hookspecs.STAGES)}
        ranked = sorted(enumerate(infos), key=lambda p: (min(order[s] for s in p[1].stages), p[0]))
        self.entries: list[Entry] = []
        for _, info in ranked:
            try:
                p = info.params(**routed[info.name])
            except TypeError as err:
                raise ValueError(f"bad parameters for method {info.name!r}: {err}") from None
            plugin_retention = share if info.reduces_tokens else None
            plugin = info.factory(p, plugin_retention)
            self.pm.register(plugin, name=info.name)
            self.entries.append(Entry(info, p, plugin_retention, plugin))
        self.pm.check_pending()

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

    # --- introspection -------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return [e.info.name for e in self.entries]

    def stage_entries(self, stage: str) -> list[Entry]:
        return [e for e in self.entries if stage in e.info.stages]

    def has_stage(self, stage: str) -> bool:
        return bool(self.stage_entries(stage))

    def check_family(self, family: str) -> None:
        for e in self.entries:
            if family not in e.info.families:
                raise ValueError(
                    f"method {e.info.name!r} does not support {family}; it supports {', '.join(e.info.families)}"
                )

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

    def retained_count(self, grid: tuple[int, int, int]) -> int | None:
        """Visual tokens the LLM keeps for a video with token grid `grid`, or None if data-dependent."""
        t, h, w = grid
        count: int | None = t * h * w
        for e in self.entries:
            if not e.info.reduces_tokens:
                continue
            fn = getattr(e.plugin, "retained_count", None)
            if fn is None:
                return None
            count = fn(count, grid)
            if count is None:
                return None
        return count

    # --- execution -----------------------------------------------------------------------------------------
    def run_sample(self, video, ctx: Context) -> list[int] | None:
        for e in self.stage_entries("sample"):
            return e.plugin.vtc_sample(video=video, ctx=ctx)
        return None

    def run_connect(self, tokens: VideoTokens, ctx: Context, recorder: StatsRecorder | None) -> VideoTokens:
        for e in self.stage_entries("connect"):
            n_in = len(tokens)
            start = time.perf_counter()
            out = e.plugin.vtc_connect(tokens=tokens, ctx=ctx)
            seconds = time.perf_counter() - start
            if not isinstance(out, VideoTokens):
                raise TypeError(f"plugin {e.info.name!r}: vtc_connect must return VideoTokens, got {type(out)}")
            if out is not tokens:
                out.validate()
                out.log.append((e.info.name, n_in, len(out)))
            if recorder is not None:
                recorder.record("connect", e.info.name, n_in, len(out), seconds)
            tokens = out
        return tokens

    def run_prefill(self, state, ctx: Context, recorder: StatsRecorder | None, decoding: bool = False) -> None:
        for e in self.stage_entries("prefill"):
            if decoding and not getattr(e.plugin, "acts_during_decode", False):
                continue
            start = time.perf_counter()
            e.plugin.vtc_prefill(state=state, ctx=ctx)
            if recorder is not None:
                recorder.add_seconds("prefill", e.info.name, time.perf_counter() - start)
