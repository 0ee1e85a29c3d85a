"""The package layout: each floor of `vtc/` imports only from itself and the floors below, `vtc.core` never
imports a backend (transformers, vLLM, `vtc.hf`, ...), `vtc.vllm` uses only public names of `vtc.hf`, nothing in
the package imports a plugin, plugins import no backend, and the old flat module paths are gone."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import vtc

ROOT = Path(vtc.__file__).parent
REPO = ROOT.parent
# bottom to top; a module may import from its own floor and the floors before it
FLOORS = ["core", "media", "hf", "vllm", "streaming", "api", "lmms_eval", "testing", "tools"]
# what backend-neutral code (vtc.core, plugins) must not import
BACKENDS = ("vtc.hf", "vtc.vllm", "vtc.streaming", "vtc.tools", "transformers")
# plugins that still import a backend, as (file under plugins/, banned module): being moved off them; empty it as
# they are fixed. A new offender fails the test; an entry that no longer offends is reported (a warning) for removal.
# the flat paths of the first waves, before the move into vtc/core, vtc/hf, vtc/media, vtc/tools, vtc/testing
OLD_PATHS = (
    "vtc.hookspecs", "vtc.registry", "vtc.pipeline", "vtc.tokens", "vtc.stats", "vtc.vision", "vtc.sequence",
    "vtc.patching", "vtc.prepool", "vtc.llm", "vtc.adapters", "vtc.video", "vtc.inputs", "vtc.cli", "vtc.run",
    "vtc.bench", "vtc.timing", "vtc.tools.timing", "vtc.loading", "vtc.tiny",
)  # fmt: skip


def floor_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "vtc" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in FLOORS else None


def is_under(module: str, prefixes) -> str | None:
    """The prefix of `prefixes` that `module` is (or is inside), else None."""
    return next((p for p in prefixes if module == p or module.startswith(p + ".")), None)


def import_nodes(path: Path):
    """(module, names) of every absolute import in the file, at any depth (lazy imports inside functions too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [alias.name for alias in node.names]


def imported_modules(path: Path) -> list[str]:
    return [module for module, _ in import_nodes(path)]


def package_files():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        floor = rel.parts[0].removesuffix(".py")
        if floor in FLOORS:
            yield floor, path


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("floor,path", list(package_files()), ids=lambda x: str(x).split("vtc/")[-1])
def test_imports_respect_floors(floor, path):
    allowed = set(FLOORS[: FLOORS.index(floor) + 1])
    for module in imported_modules(path):
        target = floor_of(module)
        assert target is None or target in allowed, f"{path.relative_to(ROOT)} imports {module} (floor {target})"
        if floor == "core":
            assert not module.startswith(("transformers", "vllm")), f"vtc/core must not import {module}"


def test_core_imports_no_backend():
    """vtc/core is what every backend builds on: it never reaches up into one, nor into transformers or vLLM."""
    banned = BACKENDS + ("vllm",)
    found = [
        f"{rel(path)} imports {module}"
        for path in sorted((ROOT / "core").rglob("*.py"))
        for module in imported_modules(path)
        if is_under(module, banned)
    ]
    assert not found, "vtc/core must not import a backend: " + "; ".join(found)


def test_vllm_uses_only_public_names_of_hf():
    """The vLLM backend may share the HF backend's public helpers, never its private ones (move shared code down
    to a floor both import, as `vtc.core.vision_stats.frame_stats`)."""
    found = []
    for path in sorted((ROOT / "vllm").rglob("*.py")):
        for module, names in import_nodes(path):
            if not is_under(module, ("vtc.hf",)):
                continue
            private = [p for p in module.split(".") if p.startswith("_")] + [n for n in names if n.startswith("_")]
            found += [f"{rel(path)} imports {name} from {module}" for name in private]
    assert not found, "; ".join(found)


def test_package_imports_no_plugin():
    """Backends, clients and tools get a method through the registry, never by importing `vtc_plugins`; pure
    helpers they share with a plugin live in vtc (e.g. `vtc.media.relevance`). Exempt: the registry's discovery of
    the built-ins, and vtc/testing (fixtures and conformance checks of the plugins)."""
    exempt = {ROOT / "core" / "registry.py"}
    found = [
        f"{rel(path)} imports {module}"
        for path in sorted(ROOT.rglob("*.py"))
        if path not in exempt and "testing" not in path.relative_to(ROOT).parts
        for module in imported_modules(path)
        if is_under(module, ("vtc_plugins",))
    ]
    assert not found, "; ".join(found)


def test_plugins_import_no_backend():
    """A plugin gets what it needs of the model through the context and the state the backend hands it."""
    plugins = REPO / "plugins"
    found = {
        (str(path.relative_to(plugins)), prefix)
        for path in sorted(plugins.rglob("*.py"))
        for module in imported_modules(path)
        if (prefix := is_under(module, BACKENDS))
    }
    assert not found, f"plugins import a backend ({', '.join(BACKENDS)}): {sorted(found)}"
    # pretrained weights a method needs come through vtc.core.loading, registered by the backend
    from vtc.core.loading import LOADERS

    assert {"vlm", "siglip_vision"} <= set(LOADERS)


def test_old_flat_module_paths_are_gone():
    """The alias finder that kept the old paths importable is removed, and nothing in the repository uses them."""
    assert not (ROOT / "_moved.py").exists()
    assert not [f for f in sys.meta_path if getattr(f, "__module__", "").startswith("vtc")]
    for old in ("vtc.inputs", "vtc.adapters.base", "vtc.tiny"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    found = [
        f"{rel(path)} imports {module}"
        for folder in ("vtc", "plugins", "kernels", "tests", "eval", "benchmarks")
        for path in sorted((REPO / folder).rglob("*.py"))
        for module in imported_modules(path)
        if is_under(module, OLD_PATHS)
    ]
    assert not found, "old module paths: " + "; ".join(found)


def test_a_family_is_one_file_found_through_its_entry_point():
    """The family registry (vtc/core/families.py) is backend-neutral: it names adapters and tiny builders as strings
    and imports neither transformers nor a backend, not even lazily; each built-in family is declared by one
    `vtc.families` entry point into the one file that holds its `Family` record and its adapter; and nothing loads
    the entry points at `import vtc`."""
    import configparser
    import subprocess

    path = ROOT / "core" / "families.py"
    allowed = ("vtc.core", "__future__", "dataclasses", "importlib", "threading", "warnings", "typing")
    found = [module for module in imported_modules(path) if not is_under(module, allowed)]
    assert not found, f"vtc/core/families.py imports {found}"
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    declared = dict(line.split(" = ") for line in config["options.entry_points"]["vtc.families"].strip().splitlines())
    assert "internvl" in declared
    for name, target in declared.items():
        module, attribute = target.split(":")
        assert (module, attribute) == (f"vtc.hf.adapters.{name}", "FAMILY"), target
        family = importlib.import_module(module).FAMILY
        assert family.name == name and family.adapter.startswith(f"{module}:")
    code = "import vtc, vtc.core.families as f; assert f._FAMILIES is None, 'family entry points loaded at import vtc'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
