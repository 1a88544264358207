"""The `graphs` commands given the wrong folder say which folder to give (exit status 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _graphs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compiler", "graphs", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("command", ["verify", "ls"])
def test_a_folder_holding_a_graphs_folder_names_it(saved_pipe, command):
    parent = saved_pipe.graphs.parent  # as the demo's --out folder holds graphs/
    result = _graphs(command, str(parent))
    assert result.returncode == 2, result
    assert f"give {saved_pipe.graphs}" in result.stderr
    assert "package without a manifest" not in result.stdout + result.stderr


def test_the_graphs_folder_itself_verifies(saved_pipe):
    result = _graphs("verify", str(saved_pipe.graphs))
    assert result.returncode == 0, result.stdout + result.stderr
    assert ", 0 problems" in result.stdout


def test_a_folder_without_graphs_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("not a graph")
    (tmp_path / "workflows").mkdir()
    (tmp_path / "workflows" / "txt2img.json").write_text('{"nodes": []}')  # JSON, but no graph manifest
    result = _graphs("verify", str(tmp_path))
    assert result.returncode == 2
    assert "holds no graphs" in result.stderr and "OUT/graphs" in result.stderr
    missing = _graphs("ls", str(tmp_path / "missing"))
    assert missing.returncode == 2 and "no such folder" in missing.stderr
