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
    """save_pipe on a pipeline that has never run: it compiles UNet and VAE decoder itself."""
    from compiler import GraphRegistry, save_pipe
    from compiler.testing.tiny_models import tiny_sd_pipeline

    registry = GraphRegistry()
    pipe = tiny_sd_pipeline(seed=0)
    graphs = tmp_path_factory.mktemp("saved") / "graphs"
    report = save_pipe(pipe, graphs, shape_range=test_range, ignores=("vae.encoder",), registry=registry)
    return SavedPipe(pipe, registry, graphs, report)
