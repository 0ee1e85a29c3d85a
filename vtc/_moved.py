"""Old module paths of the flat `vtc/` package, kept importable after the move into `vtc/core`, `vtc/hf`,
`vtc/media`, `vtc/tools` and `vtc/testing` (`from vtc.registry import MethodInfo` still works, with a
DeprecationWarning naming the new path). Nothing is imported until an old path is asked for."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    "vtc.hookspecs": "vtc.core.hookspecs",
    "vtc.registry": "vtc.core.registry",
    "vtc.pipeline": "vtc.core.pipeline",
    "vtc.tokens": "vtc.core.tokens",
    "vtc.stats": "vtc.core.stats",
    "vtc.vision": "vtc.hf.vision",
    "vtc.sequence": "vtc.hf.sequence",
    "vtc.patching": "vtc.hf.patching",
    "vtc.prepool": "vtc.hf.prepool",
    "vtc.llm": "vtc.hf.llm",
    "vtc.llm.runtime": "vtc.hf.llm.runtime",
    "vtc.llm.attention": "vtc.hf.llm.attention",
    "vtc.adapters": "vtc.hf.adapters",
    "vtc.adapters.base": "vtc.hf.adapters.base",
    "vtc.adapters.qwen2_vl": "vtc.hf.adapters.qwen2_vl",
    "vtc.adapters.qwen2_5_vl": "vtc.hf.adapters.qwen2_5_vl",
    "vtc.adapters.qwen3_vl": "vtc.hf.adapters.qwen3_vl",
    "vtc.adapters.llava_onevision": "vtc.hf.adapters.llava_onevision",
    "vtc.adapters.llava_next_video": "vtc.hf.adapters.llava_next_video",
    "vtc.video": "vtc.media.video",
    "vtc.inputs": "vtc.media.inputs",
    "vtc.cli": "vtc.tools.cli",
    "vtc.run": "vtc.tools.run",
    "vtc.bench": "vtc.tools.bench",
    "vtc.timing": "vtc.hf.timing",
    "vtc.tools.timing": "vtc.hf.timing",
    "vtc.loading": "vtc.tools.loading",
    "vtc.tiny": "vtc.testing.tiny",
}


class _CallableAlias(types.ModuleType):
    """An old module path whose name is also a callable of the parent package (`vtc.registry` the module and
    `vtc.registry()` the function): importing the path rebinds the package attribute to the module, so the alias
    stays callable and reads its attributes from the moved module."""

    def __init__(self, name: str, target: types.ModuleType, function) -> None:
        super().__init__(name, target.__doc__)
        self._target = target
        self._function = function

    def __getattr__(self, attr: str):
        return getattr(self._target, attr)

    def __call__(self, *args, **kwargs):
        return self._function(*args, **kwargs)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path to the module at its new path (the same module object, not a copy)."""

    def find_spec(self, fullname, path, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=3)
        module = importlib.import_module(new)
        parent, _, child = spec.name.rpartition(".")
        shadowed = getattr(sys.modules.get(parent), child, None)
        if isinstance(shadowed, _CallableAlias):  # imported before: keep the function it stands for
            shadowed = shadowed._function
        if callable(shadowed) and not isinstance(shadowed, types.ModuleType):
            return _CallableAlias(spec.name, module, shadowed)
        return module

    def exec_module(self, module) -> None:
        pass  # already executed at its new path


def install() -> None:
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())
