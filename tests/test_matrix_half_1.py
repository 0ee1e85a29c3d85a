"""The conformance matrix (`vtc.testing.conformance`) on half of the families: every first family of the
registry (tests/test_matrix_half_2.py runs the others, tests/test_invariants.py checks the coverage). Two files, so
pytest-xdist's two workers (one file each) share the matrix."""

from __future__ import annotations

import pytest

from tests.probes import matrix_half
from vtc.testing import conformance


@pytest.mark.parametrize("case", matrix_half(0), ids=str)
def test_conformance(case):
    conformance.run(case)
