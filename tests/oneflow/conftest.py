"""OneFlow backend tests: a summary of the numbers they measured (diffs, build times).

test_oneflow_backend.py needs the Python 3.10 environment .ci/setup_oneflow.sh
builds; elsewhere it skips with the reason printed (or, with
KEEPFAST_REQUIRE_ONEFLOW=1 as in CI, fails). test_oneflow_unavailable.py runs
where oneflow does not import and checks that the reason is said plainly.
"""

from __future__ import annotations

import pytest

_NUMBERS: list = []


@pytest.fixture(scope="session")
def numbers():
    """Append (label, value) pairs; they are printed at the end of the run."""
    return _NUMBERS


def pytest_terminal_summary(terminalreporter):
    if _NUMBERS:
        terminalreporter.section("oneflow backend numbers")
        for label, value in _NUMBERS:
            terminalreporter.write_line(f"{label}: {value}")
