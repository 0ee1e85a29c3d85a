"""Method discovery: built-in methods and third-party ones from the entry-point group `vtc`.

One registry (name -> method class) feeds string specs (`vtc.patch(model, "divprune+fastv")`), the CLI
(`vtc methods`), the benchmark, the conformance matrix and the docs table. A method class is found, not
announced: every `@vtc.method` class defined in a module of the `vtc_plugins` package is a built-in, and a
third-party package names its module (or a class) in the entry-point group `vtc`. Nothing is imported before
the registry is first used. `vtc.register(cls)` adds a class in-process (a notebook, a test).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil
import warnings
from typing import Any

from vtc.core.method import Method, MethodCard


def builtin_plugin_modules() -> list[str]:
    """Every module of the `vtc_plugins` package holds built-in methods (drop a file in `plugins/` to add one)."""
    import vtc_plugins

    return sorted(f"vtc_plugins.{m.name}" for m in pkgutil.iter_modules(vtc_plugins.__path__))


def method_classes(obj: Any) -> list[type[Method]]:
    """The method classes an entry point names: the class itself, or those a module defines (not imports)."""
    if inspect.isclass(obj):
        return [obj] if _is_method(obj) else []
    if inspect.ismodule(obj):
        package = obj.__name__ + "." if hasattr(obj, "__path__") else None  # a package: its modules' classes too
        return [
            c
            for c in vars(obj).values()
            if _is_method(c) and (c.__module__ == obj.__name__ or (package and c.__module__.startswith(package)))
        ]
    return []


def _is_method(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(obj, Method) and isinstance(obj.__dict__.get("card"), MethodCard)


class Registry:
    """Name -> method class."""

    def __init__(self) -> None:
        self._methods: dict[str, type[Method]] = {}

    def add(self, cls: type[Method]) -> None:
        if not _is_method(cls):
            raise TypeError(f"a registered method is a class decorated with @vtc.method, got {cls!r}")
        name = cls.card.name
        if name in self._methods and self._methods[name] is not cls:
            other = self._methods[name]
            raise ValueError(
                f"method {name!r} is defined twice: {other.__module__}.{other.__qualname__} and "
                f"{cls.__module__}.{cls.__qualname__}"
            )
        self._methods[name] = cls

    def remove(self, name: str) -> None:
        self._methods.pop(name, None)

    def __getitem__(self, name: str) -> type[Method]:
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

    def classes(self) -> list[type[Method]]:
        return [self._methods[n] for n in self.names()]

    def cards(self) -> list[MethodCard]:
        return [c.card for c in self.classes()]


def _third_party(reg: Registry) -> None:
    """Add the methods of every `vtc` entry point. One that fails to import, defines no method or clashes with
    a known name is skipped with a RuntimeWarning naming its package, so it cannot break vtc for everyone."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="vtc"):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "unknown distribution"
        origin = f"vtc plugin {ep.name!r} (package {dist!r}, {ep.value})"
        try:
            classes = method_classes(ep.load())
            clashes = sorted(c.card.name for c in classes if c.card.name in reg and reg[c.card.name] is not c)
            if clashes:
                raise ValueError(f"method(s) {', '.join(clashes)} are already registered")
        except Exception as err:  # noqa: BLE001 - any error of a third-party plugin
            warnings.warn(
                f"{origin} failed to load and is skipped: {type(err).__name__}: {err}", RuntimeWarning, stacklevel=3
            )
            continue
        if not classes:
            warnings.warn(
                f"{origin} defines no method: the entry point must name a module defining (or a class that is) "
                "a class decorated with @vtc.method",
                RuntimeWarning,
                stacklevel=3,
            )
        for cls in classes:
            reg.add(cls)


@functools.lru_cache(maxsize=None)
def registry() -> Registry:
    """The process-wide method registry (built on first use, never at import time): the built-ins, then the
    `vtc` entry points unless `VTC_DISABLE_PLUGIN_AUTOLOAD` is set."""
    reg = Registry()
    for module_name in builtin_plugin_modules():
        for cls in method_classes(importlib.import_module(module_name)):
            reg.add(cls)
    if not os.environ.get("VTC_DISABLE_PLUGIN_AUTOLOAD"):
        _third_party(reg)
    return reg


def register(cls: type[Method]) -> type[Method]:
    """Add a `@vtc.method` class to the process-wide registry, so string specs name it (returns the class, so
    it works as a decorator under `@vtc.method`). `vtc.patch(model, [MyMethod()])` needs no registration."""
    registry().add(cls)
    return cls
