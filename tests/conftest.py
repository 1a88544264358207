"""Shared fixtures: one tiny pipeline, compiled and saved once per session.

Compiling is the slow part (tens of seconds per graph on a 2-core CPU), so
the session builds one saved pipeline *before any image is generated* and
every test reuses its registry and graphs folder. Tests that count compiles
read the registry's counters before and after what they do.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.file_order import pytest_collection_modifyitems  # noqa: F401 - the slowest test files first
from tests.support.torch_trace_log import pytest_runtest_call, pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401,E501

# Graph trust is machine-local state: keep the tests' own, never the user's.
_TRUST_DIR = tempfile.mkdtemp(prefix="keepfast-trust-")
os.environ.setdefault("KEEPFAST_TRUST_FILE", os.path.join(_TRUST_DIR, "trusted.json"))

# Packages built in this run, found again by a build of the same program (compiler/build_process/build_memo.py): every
# test starts from an empty graphs folder, so without it many builds compiled a program an earlier test had built
# (the same program file in 37 of 97 builds of a partial run, 2026-12-02). Made where the run starts (xdist's
# workers inherit it), removed at its end. A test about the compile itself (its phases, its headers, its kernels) turns it off: `no_build_memo`.
if "KEEPFAST_BUILD_MEMO" not in os.environ:
    _MEMO_DIR = tempfile.mkdtemp(prefix="keepfast-build-memo-")
    os.environ["KEEPFAST_BUILD_MEMO"] = _MEMO_DIR
    atexit.register(shutil.rmtree, _MEMO_DIR, True)


@pytest.fixture
def no_build_memo(monkeypatch):
    """Builds in this test compile, whatever an earlier test built (a test of the compile itself)."""
    monkeypatch.delenv("KEEPFAST_BUILD_MEMO", raising=False)


@dataclass
class SavedPipe:
    pipe: object
    registry: object
    graphs: Path
    report: object


@pytest.fixture(scope="session")
def test_range():
    from compiler import ShapeRange

    return ShapeRange(batch=(1, 4), spatial=(8, 24), sequence=(1, 160))


@pytest.fixture(scope="session")
def saved_pipe(tmp_path_factory, test_range) -> SavedPipe:
    """save_pipe on a pipeline that has never run: the UNet and VAE decoder compiled and saved, once per run.

    pytest-xdist runs two workers, each with this fixture of its own. The first to need it compiles and saves into
    its own folder and leaves a copy where the other can see it; the other, in turn under a lock, starts its own
    folder from that copy, so its save_pipe of the same pipeline loads those graphs and compiles nothing (the same
    machine wrote them: the workers share the trust list, KEEPFAST_TRUST_FILE). Tests read compile counts as
    differences, so either is the same to them. Each worker keeps a folder of its own: tests that write into it
    never meet the other worker's."""
    import shutil

    from compiler import GraphRegistry, save_pipe
    from compiler.store.file_lock import held
    from compiler.demo.tiny_models import tiny_sd_pipeline

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this run's, common to its workers
    first = shared / "saved-pipe-first"
    graphs = tmp_path_factory.mktemp("saved") / "graphs"
    with held(shared / "saved-pipe.lock"):
        if (first / "complete").is_file():
            shutil.copytree(first / "graphs", graphs)
        registry = GraphRegistry()
        pipe = tiny_sd_pipeline(seed=0)
        report = save_pipe(pipe, graphs, shape_range=test_range, ignores=("vae.encoder",), registry=registry)
        if not (first / "complete").is_file() and report.problems == []:
            shutil.copytree(graphs, first / "graphs", dirs_exist_ok=True)
            (first / "complete").write_text("")
    return SavedPipe(pipe, registry, graphs, report)
