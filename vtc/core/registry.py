"""Method discovery: built-in plugins and third-party ones from the entry-point group `vtc`.

One registry feeds `vtc.patch`, the CLI (`vtc methods`), the benchmark and the docs table.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Any, Callable

import pluggy

from vtc.core import hookspecs

# Model families an adapter exists for; a method lists the subset it supports.
ALL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "llava_next_video")


def builtin_plugin_modules() -> list[str]:
    """Every module of the `vtc_plugins` package is a built-in method (drop a file in `plugins/` to add one)."""
    import pkgutil

    import vtc_plugins

    return sorted(f"vtc_plugins.{m.name}" for m in pkgutil.iter_modules(vtc_plugins.__path__) if not m.ispkg)


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    """Everything vtc needs to know about a method before instantiating it.

    factory: called as `factory(params, retention)` and returns the plugin object.
    params:  the dataclass of the method's parameters, defaults = the official ones.
    owns:    decisions only one plugin of a pipeline may take (e.g. "frame_selection").
    fixed_count: the method can produce exactly `retained_count(grid)` tokens (needed for serving).
    position_policy: "keep" (survivors keep original positions) or "compact" (renumbered), as the
             official code does on LLaVA; Qwen M-RoPE families always default to "keep".
    reduces_tokens: the method removes or merges visual tokens (samplers do not).
    query_aware: the method's decisions depend on the question or the prompt's last tokens.
    """

    name: str
    factory: Callable[..., Any]
    params: type
    stages: tuple[str, ...]
    paper: str
    url: str = ""
    summary: str = ""
    families: tuple[str, ...] = ALL_FAMILIES
    fixed_count: bool = False
    owns: frozenset[str] = frozenset()
    position_policy: str = "keep"
    reduces_tokens: bool = True
    query_aware: bool = False  # reads the question (prompt text) to decide

    def __post_init__(self):
        bad = [s for s in self.stages if s not in hookspecs.STAGES]
        if bad:
            raise ValueError(f"method {self.name!r}: unknown stage(s) {bad}; stages are {', '.join(hookspecs.STAGES)}")
        if self.position_policy not in ("keep", "compact"):
            raise ValueError(f"method {self.name!r}: position_policy must be 'keep' or 'compact'")


class Registry:
    """Name -> MethodInfo, filled through the `vtc_register_methods` hook."""

    def __init__(self) -> None:
        self._methods: dict[str, MethodInfo] = {}

    def add(self, info: MethodInfo) -> None:
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

    def names(self) -> list[str]:
        return sorted(self._methods)

    def infos(self) -> list[MethodInfo]:
        return [self._methods[n] for n in self.names()]


def make_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("vtc")
    pm.add_hookspecs(hookspecs)
    return pm


@functools.lru_cache(maxsize=None)
def registry() -> Registry:
    """The process-wide method registry (built on first use, never at import time)."""
    pm = make_plugin_manager()
    for module_name in builtin_plugin_modules():
        pm.register(importlib.import_module(module_name), name=module_name)
    if not os.environ.get("VTC_DISABLE_PLUGIN_AUTOLOAD"):
        pm.load_setuptools_entrypoints("vtc")
    pm.check_pending()
    reg = Registry()
    pm.hook.vtc_register_methods(registry=reg)
    return reg
