"""A third-party plugin package, as a user writes it from docs/write-a-plugin.md (tests/plugin_example), is
found through the `vtc` entry-point group, listed, refused nowhere, and passes vtc's public conformance matrix
on all five families; a broken one is skipped with a warning instead of breaking vtc."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import vtc
from tests.conftest import FAMILIES
from tests.probes import fake_distribution
from vtc.core.method import CONFORMANCE_CHECKS
from vtc.core.registry import registry
from vtc.testing import conformance

EXAMPLE = Path(__file__).parent / "plugin_example"


@pytest.fixture(scope="module")
def keepnorm_installed(tmp_path_factory):
    """The example package installed (its source and a dist-info on sys.path), with plugin autoload on."""
    site = tmp_path_factory.mktemp("site")
    fake_distribution(site, "vtc_keepnorm", "vtc_keepnorm", "keepnorm")
    patcher = pytest.MonkeyPatch()
    patcher.syspath_prepend(str(EXAMPLE))
    patcher.syspath_prepend(str(site))
    patcher.delenv("VTC_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    registry.cache_clear()
    yield registry()
    registry.cache_clear()
    patcher.undo()
    sys.modules.pop("vtc_keepnorm", None)


def test_the_docs_show_the_package_verbatim():
    """docs/write-a-plugin.md's example is the package's code, line for line (after its docstring)."""
    source = (EXAMPLE / "vtc_keepnorm" / "__init__.py").read_text()
    code = source.split('"""\n', 2)[2].strip()
    docs = (Path(__file__).parents[1] / "docs" / "write-a-plugin.md").read_text()
    assert code in docs
    lines = [line for line in code.splitlines() if line.strip() and not line.strip().startswith(('"""', "#"))]
    assert len(lines) <= 20, len(lines)


def test_the_package_is_discovered_and_listed(keepnorm_installed, capsys):
    card = keepnorm_installed["keepnorm"].card
    assert card.paper == "(example)" and card.fixed_count_mode == "always" and card.stages == ("connect",)
    assert "keepnorm" in [c.name for c in vtc.methods()]
    from vtc.tools.cli import main

    assert main(["methods", "--json"]) == 0
    assert '"name": "keepnorm"' in capsys.readouterr().out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("check", CONFORMANCE_CHECKS)
def test_the_package_passes_the_conformance_matrix(keepnorm_installed, check, family):
    cases = conformance.cases(["keepnorm"], [family], [check])
    if check in ("retention_fixed", "decode_continues"):  # no fixed_count switch; it reads no question
        assert cases == [] if check == "retention_fixed" else len(cases) == 1
    for case in cases:
        conformance.run(case)


def test_a_wrong_count_is_caught_on_the_first_forward(keepnorm_installed):
    """The trap a plugin author fell into: counting from tokens.grid (the original grid) instead of the tokens
    an earlier method left. vtc compares the promise with the output on every forward."""
    from vtc_keepnorm import KeepNorm

    model, _ = conformance.model_and_processor("qwen2_vl")

    def from_grid(self, num_tokens, grid, family):  # the bug: the original grid, not what is left
        t, h, w = grid
        return max(1, round(t * h * w * self.fraction()))

    def connect(self, tokens, ctx):  # the hook itself counts right
        return tokens.select(top_norm(tokens.embeds, max(1, round(len(tokens) * self.fraction()))))

    from vtc_keepnorm import top_norm

    with pytest.MonkeyPatch.context() as m:
        m.setattr(KeepNorm, "retained_count", from_grid)
        m.setattr(KeepNorm, "connect", connect)
        with vtc.patch(model, "random+keepnorm", retention=0.25):
            with pytest.raises(RuntimeError, match="'keepnorm' promised 288 tokens .* but returned 144"):
                conformance._logits(model, conformance.single_inputs("qwen2_vl"))


def test_broken_or_empty_packages_are_skipped_with_a_warning(tmp_path, monkeypatch):
    fake_distribution(
        tmp_path, "vtc_broken_plugin", "vtc_broken", "broken", "raise ImportError('needs a GPU library')\n"
    )
    fake_distribution(tmp_path, "vtc_empty_plugin", "vtc_empty", "empty", "# registers nothing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VTC_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    registry.cache_clear()
    try:
        with pytest.warns(RuntimeWarning) as caught:
            names = [c.name for c in vtc.methods()]
        messages = " | ".join(str(w.message) for w in caught)
        assert "'broken'" in messages and "vtc_broken" in messages and "needs a GPU library" in messages
        assert "'empty'" in messages and "vtc_empty" in messages and "defines no method" in messages
        assert "random" in names  # vtc itself keeps working
    finally:
        registry.cache_clear()
        sys.modules.pop("vtc_broken_plugin", None)
        sys.modules.pop("vtc_empty_plugin", None)
