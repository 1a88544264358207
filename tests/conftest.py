"""Shared fixtures: one tiny pipeline, compiled and saved once per session.

Compiling is the slow part (tens of seconds per graph on a 2-core CPU), so
the session builds one saved pipeline *before any image is generated* and
every test reuses its registry and graphs folder. Tests that count compiles
read the registry's counters before and after what they do.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.file_order import pytest_collection_modifyitems  # noqa: F401 - the slowest test files first

# Graph trust is machine-local state: keep the tests' own, never the user's.
_TRUST_DIR = tempfile.mkdtemp(prefix="keepfast-trust-")
os.environ.setdefault("KEEPFAST_TRUST_FILE", os.path.join(_TRUST_DIR, "trusted.json"))


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
    from compiler.file_lock import held
    from compiler.testing.tiny_models import tiny_sd_pipeline

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
