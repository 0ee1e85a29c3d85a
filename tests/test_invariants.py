"""The plugin x family matrix: `vtc.testing.conformance` on every registered token-reducing method and every
family it supports (identity at retention 1.0, retention honoured, planned and fixed counts, original positions,
generate, unpatch, padded batch, decode, bf16), minus what each method declares itself exempt from.

The cases run in tests/test_matrix_half_1.py and test_matrix_half_2.py (half of the families each, so the two
pytest-xdist workers share them); this file checks what the matrix covers."""

from __future__ import annotations

import pytest

import vtc
from tests.conftest import FAMILIES
from tests.probes import matrix_half
from vtc.core.method import CONFORMANCE_CHECKS
from vtc.testing import conformance

CASES = conformance.cases()


def test_matrix_covers_every_family_method_and_check():
    from vtc.hf.adapters import SUPPORTED_FAMILIES

    assert set(FAMILIES) == set(SUPPORTED_FAMILIES)
    reducing = {c.name for c in vtc.methods() if c.reduces_tokens and not c.stream_only}
    assert {c.method for c in CASES} == reducing
    assert {c.family for c in CASES} == set(FAMILIES)
    assert {c.check for c in CASES} == set(CONFORMANCE_CHECKS)
    halves = [matrix_half(0), matrix_half(1)]
    assert sorted(map(str, halves[0] + halves[1])) == sorted(map(str, CASES))  # the two files run every case once
    # every exemption is explained, and every method is checked on most of the matrix
    for cls in vtc.registry().classes():
        info = cls.card
        assert all(reason.strip() for reason in cls.testing.exemptions.values())
        if info.reduces_tokens and not info.stream_only:
            assert sum(c.method == info.name for c in CASES) >= 6 * len(conformance.supported_families(info.name))


def test_exempt_checks_are_not_run():
    holitom = {c.check for c in CASES if c.method == "holitom"}
    assert "ordered_positions" not in holitom and "retention" not in holitom and "retention_fixed" in holitom
    assert "decode_continues" not in {c.check for c in CASES if c.method == "fastv"}  # acts in the LLM


def test_unknown_check_and_non_reducing_method_are_refused():
    with pytest.raises(ValueError, match="unknown check"):
        conformance.cases(["random"], checks=["speed"])
    with pytest.raises(ValueError, match="does not reduce tokens"):
        conformance.cases(["uniform"])
