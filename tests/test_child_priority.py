"""Build and trace processes lower their priority by KEEPFAST_BUILD_NICE (default 10; 0: the caller's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parent.parent / "compiler" / "backends" / "child_priority.py"
# As a build process does it: the module loaded by its path, with nothing of the pack imported.
LOWERED = (f"import importlib.util, os, sys; spec = importlib.util.spec_from_file_location('p', {str(MODULE)!r}); "
           "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m.lower(); "
           "print(os.nice(0), 'compiler' in sys.modules)")


@pytest.mark.parametrize("setting, step", [(None, 10), ("0", 0), ("3", 3), ("19", 19), ("25", 10), ("x", 10)])
def test_a_child_lowers_its_priority_by_the_setting(setting, step):
    env = {k: v for k, v in os.environ.items() if k != "KEEPFAST_BUILD_NICE"}
    if setting is not None:
        env["KEEPFAST_BUILD_NICE"] = setting
    here = os.nice(0)
    out = subprocess.run([sys.executable, "-c", LOWERED], env=env, capture_output=True, text=True, check=True)
    niceness, imported_the_pack = out.stdout.split()
    assert int(niceness) == min(19, here + step)
    assert imported_the_pack == "False"
