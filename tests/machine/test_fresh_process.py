"""Saved graphs load in a fresh process with zero compiles and equal outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_in_a_fresh_process_compiles_nothing(saved_pipe):
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.load_check", str(saved_pipe.graphs)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["compiles"] == 0, report
    assert report["loads"] >= 2, report
    assert report["fallbacks"] == [], report
    assert report["problems"] == [], report
    assert report["max_diff"] < 1e-4, report
