"""Keeps pytest's log capture off torch's structured-trace logger, so torch does not build its trace for nobody.

pytest (8.4 and later) attaches its capture handlers to every logger that does not propagate, for each phase of each
test. torch's `torch.__trace` logger does not propagate and is always at DEBUG, and torch computes each structured
trace event (graphs printed, JSON dumped and hashed: `torch._logging.trace_structured`) whenever that logger has a
handler. Under pytest it always had one, so every export, trace and compile in a test process built its trace for the
captured log, where its records said nothing (their message is empty: "DEBUG torch.__trace:structured.py:28").
Outside pytest the logger has no handler unless TORCH_TRACE is set, as for users.

The hook runs inside the logging plugin's (it is the last wrapper to start) and takes pytest's handlers off that one
logger for the phase; the logging plugin removes them again at the phase's end.
"""

from __future__ import annotations

import logging
import os

import pytest

TRACE_LOGGER = "torch.__trace"


def _detach() -> None:
    if os.environ.get("KEEPFAST_TEST_TORCH_TRACE") == "1":  # torch's trace wanted (a test run read with tlparse)
        return
    trace_log = logging.getLogger(TRACE_LOGGER)
    for handler in list(trace_log.handlers):
        if type(handler).__module__.startswith("_pytest"):
            trace_log.removeHandler(handler)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item):
    _detach()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item):
    _detach()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    _detach()
    return (yield)
