"""The package layout: each floor of `vtc/` imports only from itself and the floors below, `vtc.core` never
imports transformers, and the old flat module paths still resolve to the moved modules."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

import vtc

ROOT = Path(vtc.__file__).parent
# bottom to top; a module may import from its own floor and the floors before it
FLOORS = ["core", "media", "hf", "vllm", "streaming", "api", "lmms_eval", "testing", "tools"]


def floor_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "vtc" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in FLOORS else None


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def package_files():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        floor = rel.parts[0].removesuffix(".py")
        if floor in FLOORS:
            yield floor, path


@pytest.mark.parametrize("floor,path", list(package_files()), ids=lambda x: str(x).split("vtc/")[-1])
def test_imports_respect_floors(floor, path):
    allowed = set(FLOORS[: FLOORS.index(floor) + 1])
    for module in imported_modules(path):
        target = floor_of(module)
        assert target is None or target in allowed, f"{path.relative_to(ROOT)} imports {module} (floor {target})"
        if floor == "core":
            assert not module.startswith(("transformers", "vllm")), f"vtc/core must not import {module}"


def test_old_module_paths_resolve_to_the_moved_modules():
    from vtc._moved import MOVED

    for old, new in MOVED.items():
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        target = importlib.import_module(new)
        assert module is target or module._target is target  # vtc.registry stays callable (see below)
    sys.modules.pop("vtc.registry", None)
    with pytest.warns(DeprecationWarning, match="vtc.registry moved to vtc.core.registry"):
        from vtc.registry import MethodInfo
    assert MethodInfo is vtc.MethodInfo
    # importing the old module path rebinds `vtc.registry`; the function must keep working
    assert "prunevid" in vtc.registry() and vtc.registry.MethodInfo is vtc.MethodInfo
