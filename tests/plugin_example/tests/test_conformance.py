# the package's own test, as docs/write-a-plugin.md shows it (run with the package installed)
import pytest

from vtc.testing import conformance


@pytest.mark.parametrize("case", conformance.cases(["keepnorm"]), ids=str)
def test_conformance(case):
    conformance.run(case)
