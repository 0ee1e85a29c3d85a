"""Method discovery: built-in plugins and third-party ones from the entry-point group `vtc`.

One registry feeds `vtc.patch`, the CLI (`vtc methods`), the benchmark, the conformance matrix and the docs
table. Everything vtc needs to know about a method before instantiating it is declared on its `MethodInfo`;
what the plugin object then offers is the `vtc.core.contract.MethodPlugin` protocol.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import warnings
from typing import Any, Callable

import pluggy

from vtc.core import hookspecs

# Model families an adapter exists for; a method lists the subset it supports.
ALL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "llava_next_video")

# which visual-token count `retention` sets, for methods that act inside the LLM (see `MethodInfo`)
RETENTION_REFERENCES = {
    "llm_input": "the visual tokens entering the LLM",
    "last_layer": "the visual tokens alive at the last LLM layer",
    "layer_mean": "the mean number of visual tokens over the LLM layers (a FLOPs budget)",
}

# the checks of the conformance matrix (`vtc.testing.conformance`) a method may declare itself exempt from
CONFORMANCE_CHECKS = (
    "identity_at_full_retention",  # retention 1.0 gives the unpatched model's logits
    "retention",  # at retention r the declared count is r of the visual tokens (within granularity)
    "retention_fixed",  # the same in fixed-count mode (methods with a `fixed_count` switch)
    "planned_count",  # the count matches retained_count (fixed) or what the method reported (adaptive)
    "fixed_count",  # fixed-count mode honours retained_count exactly, before the model exists
    "original_positions",  # survivors carry their original RoPE rows
    "ordered_positions",  # ... in increasing original order
    "generate",  # generate runs and decodes
    "unpatch",  # unpatch restores the model exactly
    "padded_batch",  # a left-padded batch equals its prompts run one by one
    "decode_continues",  # decoding with the cache equals re-running the whole sequence
    "bf16",  # runs in bfloat16
)


def builtin_plugin_modules() -> list[str]:
    """Every module of the `vtc_plugins` package is a built-in method (drop a file in `plugins/` to add one)."""
    import pkgutil

    import vtc_plugins

    return sorted(f"vtc_plugins.{m.name}" for m in pkgutil.iter_modules(vtc_plugins.__path__) if not m.ispkg)


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    """Everything vtc needs to know about a method before instantiating it.

    factory: called as `factory(params, retention)`; returns the plugin object (`vtc.core.contract.MethodPlugin`).
    params:  the dataclass of the method's parameters, defaults = the official ones.
    stages:  the stage hooks the plugin implements ("sample", "encode", "connect", "prefill").
    owns:    decisions only one plugin of a pipeline may take (e.g. "frame_selection").
    position_policy: "keep" (survivors keep original positions) or "compact" (renumbered), as the official
             code does on LLaVA; Qwen M-RoPE families always default to "keep".
    reduces_tokens: the method removes or merges visual tokens (samplers do not).
    query_aware: the method's decisions depend on the question or the prompt's last tokens.

    Capabilities, each matching a method of the plugin object that vtc calls only when declared here:
    fixed_count: `retained_count(num_tokens, grid, family)` can give the exact count (serving needs it; with
             a `fixed_count` parameter in `params`, only when that parameter is on).
    vision_stats: `vision_stats(family)` lists vision-tower attention statistics the connect hook reads.
    prepool: the connect hook reads the frame features before the LLaVA pooling (`ctx.prepool`).
    acts_during_decode: `vtc_prefill` is also called on decode steps (`state.phase == "decode"`).
    needs_whole_frames: the connect hook needs every token of every frame, so no connect method may run
             before it (refused at `vtc.patch`).
    streams: the connect hook is causal: `vtc.stream` may call it on consecutive chunks of one endless video
             (frames in order, each chunk a `VideoTokens` of its own), and what it needs of earlier frames it
             keeps in `ctx.store`, which lives as long as the stream (in `vtc.patch` it is fresh per prompt).
    stream_memory: the method decides what a stream remembers: its plugin's `stream_memory(config)` returns
             the memory (`vtc.stream.memory.StreamMemory`) a `vtc.stream` session stores tokens in and answers
             from. At most one per pipeline (it owns "stream_memory").
    stream_only: the method exists only as a stream (its memory is the method), so `vtc.patch` refuses it and
             names `vtc.stream`.
    retention_reference: which count `retention` sets: "llm_input", "last_layer" or "layer_mean"
             (`RETENTION_REFERENCES`); methods acting only before the LLM use "llm_input".
    retention_note: where the method cannot honour `retention` exactly, and what it does instead.
    retention_granularity: the count moves in steps of this many tokens per frame (1: per-frame rounding), so
             retention is honoured within one step per frame.
    conformance_exemptions: check name (`CONFORMANCE_CHECKS`) -> why the method is exempt from it.
    test_params: parameters that fit the tiny offline test models (4 LLM layers, 2-layer vision towers).
    """

    name: str
    factory: Callable[..., Any]
    params: type
    stages: tuple[str, ...]
    paper: str
    url: str = ""
    summary: str = ""
    families: tuple[str, ...] = ALL_FAMILIES
    owns: frozenset[str] = frozenset()
    position_policy: str = "keep"
    reduces_tokens: bool = True
    query_aware: bool = False
    fixed_count: bool = False
    vision_stats: bool = False
    prepool: bool = False
    acts_during_decode: bool = False
    needs_whole_frames: bool = False
    streams: bool = False
    stream_memory: bool = False
    stream_only: bool = False
    retention_reference: str = "llm_input"
    retention_note: str = ""
    retention_granularity: int = 1
    conformance_exemptions: dict[str, str] = dataclasses.field(default_factory=dict, hash=False, compare=False)
    test_params: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self):
        def bad(message: str):
            raise ValueError(f"method {self.name!r}: {message}")

        unknown = [s for s in self.stages if s not in hookspecs.STAGES]
        if unknown or not self.stages:
            bad(f"unknown stage(s) {unknown or '(none)'}; stages are {', '.join(hookspecs.STAGES)}")
        if self.position_policy not in ("keep", "compact"):
            bad("position_policy must be 'keep' or 'compact'")
        if self.retention_reference not in RETENTION_REFERENCES:
            bad(f"retention_reference must be one of {', '.join(RETENTION_REFERENCES)}")
        if self.retention_reference != "llm_input" and "prefill" not in self.stages:
            bad("only methods acting in the LLM (stage 'prefill') count retention past the LLM input")
        for flag in ("vision_stats", "prepool", "needs_whole_frames"):
            if getattr(self, flag) and "connect" not in self.stages:
                bad(f"{flag} is a connect-stage capability, but the method has no connect stage")
        if self.streams and "connect" not in self.stages:
            bad("streams=True describes a connect hook, but the method has no connect stage")
        if self.stream_only and not self.stream_memory:
            bad("stream_only methods are streaming memories: declare stream_memory=True with a stream_memory()")
        if self.acts_during_decode and "prefill" not in self.stages:
            bad("acts_during_decode needs the prefill stage (its hook is vtc_prefill)")
        unknown = sorted(set(self.conformance_exemptions) - set(CONFORMANCE_CHECKS))
        if unknown:
            bad(f"unknown conformance check(s) {unknown}; checks are {', '.join(CONFORMANCE_CHECKS)}")
        if not dataclasses.is_dataclass(self.params):
            bad("params must be a dataclass of the method's parameters")

    # --- derived --------------------------------------------------------------------------------------------
    @property
    def acts_in_llm(self) -> bool:
        return "prefill" in self.stages

    @property
    def fixed_count_mode(self) -> str:
        """ "always" (every run keeps `retained_count`), "optional" (with `fixed_count=True`) or "no"."""
        if not self.fixed_count:
            return "no"
        return "optional" if "fixed_count" in {f.name for f in dataclasses.fields(self.params)} else "always"

    def capabilities(self) -> dict[str, Any]:
        """What `vtc methods --json` prints for this method."""
        return {
            "name": self.name,
            "stages": list(self.stages),
            "paper": self.paper,
            "url": self.url,
            "summary": self.summary,
            "families": list(self.families),
            "reduces_tokens": self.reduces_tokens,
            "fixed_count": self.fixed_count_mode,
            "fixed_count_counts": ("last_layer" if self.acts_in_llm else "llm_input") if self.fixed_count else None,
            "query_aware": self.query_aware,
            "position_policy": self.position_policy,
            "owns": sorted(self.owns),
            "acts_in_llm": self.acts_in_llm,
            "acts_during_decode": self.acts_during_decode,
            "needs_whole_frames": self.needs_whole_frames,
            "streams": self.streams or self.stream_memory,
            "stream_memory": self.stream_memory,
            "stream_only": self.stream_only,
            "vision_stats": self.vision_stats,
            "prepool": self.prepool,
            "retention_reference": self.retention_reference,
            "retention_note": self.retention_note,
            "retention_granularity": self.retention_granularity,
            "conformance_exemptions": dict(self.conformance_exemptions),
            "parameters": {f.name: _default(f) for f in dataclasses.fields(self.params)},
        }


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return None
    return list(value) if isinstance(value, tuple) else value


class Registry:
    """Name -> MethodInfo, filled through the `vtc_register_methods` hook."""

    def __init__(self) -> None:
        self._methods: dict[str, MethodInfo] = {}

    def add(self, info: MethodInfo) -> None:
        if not isinstance(info, MethodInfo):
            raise TypeError(f"registry.add expects a vtc.MethodInfo, got {type(info).__name__}")
        if info.name in self._methods and self._methods[info.name] is not info:
            raise ValueError(f"method {info.name!r} is registered twice")
        self._methods[info.name] = info

    def __getitem__(self, name: str) -> MethodInfo:
        try:
            return self._methods[name]
        except KeyError:
            known = ", ".join(sorted(self._methods))
            raise ValueError(f"unknown method {name!r}; known methods: {known}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._methods

    def __len__(self) -> int:
        return len(self._methods)

    def names(self) -> list[str]:
        return sorted(self._methods)

    def infos(self) -> list[MethodInfo]:
        return [self._methods[n] for n in self.names()]


def make_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("vtc")
    pm.add_hookspecs(hookspecs)
    return pm


def _third_party_modules() -> list[tuple[str, str, Any]]:
    """(entry-point name, distribution, loaded object) of every `vtc` entry point that imports; one that
    fails is skipped with a warning naming its package and the error, so it cannot break vtc for everyone."""
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group="vtc"):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "unknown distribution"
        try:
            loaded.append((ep.name, dist, ep.load()))
        except Exception as err:  # noqa: BLE001 - any import error of a third-party plugin
            warnings.warn(
                f"vtc plugin {ep.name!r} (package {dist!r}, {ep.value}) failed to import and is skipped: "
                f"{type(err).__name__}: {err}",
                RuntimeWarning,
                stacklevel=3,
            )
    return loaded


def _register(pm: pluggy.PluginManager, reg: Registry, plugin: Any, name: str, origin: str) -> None:
    """Register one plugin module and collect its methods, all or nothing; a module that fails or adds nothing
    warns and leaves no trace."""
    own = Registry()
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
        others = [p for p in pm.get_plugins() if p is not plugin]
        pm.subset_hook_caller("vtc_register_methods", remove_plugins=others)(registry=own)
        clashes = sorted(n for n in own.names() if n in reg)
        if clashes:
            raise ValueError(f"method(s) {', '.join(clashes)} are already registered")
    except Exception as err:  # noqa: BLE001 - a broken plugin must not break the others
        if pm.is_registered(plugin):
            pm.unregister(plugin)
        warnings.warn(
            f"vtc plugin {name!r} ({origin}) failed to register and is skipped: {type(err).__name__}: {err}",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    if not len(own):
        warnings.warn(
            f"vtc plugin {name!r} ({origin}) registered no method: it needs a `vtc_register_methods(registry)` "
            "hook (decorated with vtc.hookimpl) that calls registry.add(MethodInfo(...))",
            RuntimeWarning,
            stacklevel=3,
        )
    for info in own.infos():
        reg.add(info)


@functools.lru_cache(maxsize=None)
def registry() -> Registry:
    """The process-wide method registry (built on first use, never at import time).

    Built-ins come from the `vtc_plugins` package; third-party packages from the entry-point group `vtc`
    (unless `VTC_DISABLE_PLUGIN_AUTOLOAD` is set). A third-party plugin that fails to import or to register,
    or that registers nothing, is skipped with a RuntimeWarning that names it."""
    pm = make_plugin_manager()
    reg = Registry()
    for module_name in builtin_plugin_modules():
        pm.register(importlib.import_module(module_name), name=module_name)
    pm.check_pending()
    pm.hook.vtc_register_methods(registry=reg)
    if not os.environ.get("VTC_DISABLE_PLUGIN_AUTOLOAD"):
        for name, dist, module in _third_party_modules():
            if pm.is_registered(module):
                continue
            _register(pm, reg, module, f"{dist}:{name}", f"package {dist!r}")
    return reg
