"""AOTInductor's precompiled headers made on a thread from a build's start (compiler/build_process/precompiled_headers.py):
the build then finds them made, under its own settings, and makes no other; a failure leaves the build to make them.
On a fresh machine each header took about 6 s of the first build's C++ phase (this CPU, torch 2.11 and 2.13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiler.backends import aot_build
from compiler.builds import package_builds
from compiler.build_process import precompiled_headers

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles

ROOT = Path(__file__).resolve().parents[2]

# In a fresh process whose temporary folder is new: Inductor keeps its headers in
# $TMPDIR/torchinductor_<user>/precompiled_headers, named by a hash of their flags.
BUILD = r"""
import json, os, sys, tempfile
sys.path.insert(0, {root!r})
import torch
from torch._inductor import codecache, config
from compiler.backends import aot_build
from compiler.build_process import precompiled_headers
program = torch.export.export(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), (torch.randn(2, 8),))
configs = dict(aot_build.PACKAGE_CONFIG)
with config.patch(configs):
    warm = precompiled_headers.start("cpu").wait()
    made = sorted(name for name in os.listdir(codecache._HEADER_DIR) if name.endswith(".gch"))
    torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(tempfile.mkdtemp(), "g.pt2"),
                                             inductor_configs=configs)
info = codecache._precompile_header.cache_info()
after = sorted(name for name in os.listdir(codecache._HEADER_DIR) if name.endswith(".gch"))
print(json.dumps({{"report": warm.report(), "headers": warm.headers, "made": made, "after": after,
                  "hits": info.hits, "misses": info.misses}}))
"""


@pytest.fixture(scope="module")
def built_early(tmp_path_factory):
    """A new temporary folder (so no header is made yet) and what BUILD found there."""
    folder = tmp_path_factory.mktemp("headers")
    done = subprocess.run([sys.executable, "-c", BUILD.format(root=str(ROOT))], env={**os.environ, "TMPDIR": str(folder)},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder, json.loads(done.stdout.strip().splitlines()[-1])


def test_headers_made_early_are_the_ones_the_build_uses(built_early):
    _, found = built_early
    assert found["report"].get("precompiled_header_s", 0) > 0, found
    assert len(found["headers"]) == 2 and len(found["made"]) == 2, found  # a CPU program: wrapper and kernels
    assert found["after"] == found["made"], found  # the build made no header of its own
    assert found["hits"] == 2 and found["misses"] == 2, found  # and asked for exactly the ones made


def test_a_failure_leaves_the_headers_to_the_build(monkeypatch):
    def broken(device):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(precompiled_headers, "_header_calls", broken)
    warm = precompiled_headers.start("cpu").wait()
    assert warm.thread is None and warm.headers == []
    assert warm.error == "RuntimeError: no compiler here" and warm.report() == {"precompiled_header_failed": 1.0}


def test_nothing_is_made_where_inductor_would_not_use_them():
    from torch._inductor import config

    # torch's own patch: pytest's monkeypatch.setattr on the config's proxy deletes the setting when it undoes
    # (pytest 9.2 reads the old value from the proxy's __dict__), and every later AOTInductor compile in the
    # process then failed "config.aot_inductor.precompile_headers does not exist"
    with config.patch({"aot_inductor.precompile_headers": False}):
        warm = precompiled_headers.start("cpu").wait()
    assert warm.thread is None and warm.report() == {}
    assert config.aot_inductor.precompile_headers


def test_a_build_process_reports_the_seconds_it_spent_on_its_headers(tmp_path):
    program = torch.export.export(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()).eval(),
                                  (torch.randn(2, 8),))
    build = package_builds.start(program, dict(aot_build.PACKAGE_CONFIG), now=True)
    build.result(timeout=600)
    figures = build.usage["phase_s"]
    assert "precompiled_header_failed" not in figures, figures
    assert figures["precompiled_header_s"] >= 0, figures  # seconds: near 0 where this machine had them made


# The headers BUILD made, cut short (a build process killed while it made them), then a build in a new process:
# AOTInductor's compile fails on them as they are; through compile_with_sound_headers they are made again and the
# build succeeds.
CUT_SHORT = r"""
import json, os, sys, tempfile
sys.path.insert(0, {root!r})
import torch
from torch._inductor import codecache, config
from compiler.backends import aot_build
from compiler.build_process import precompiled_headers
program = torch.export.export(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), (torch.randn(2, 8),))
configs = dict(aot_build.PACKAGE_CONFIG)
compile_once = lambda: torch._inductor.aoti_compile_and_package(
    program, package_path=os.path.join(tempfile.mkdtemp(), "g.pt2"), inductor_configs=configs)
with config.patch(configs):
    try:
        compile_once()
        plain = "built"
    except Exception as error:
        plain = str(error)
    precompiled_headers.compile_with_sound_headers(compile_once)
sizes = [os.path.getsize(os.path.join(codecache._HEADER_DIR, n)) for n in os.listdir(codecache._HEADER_DIR)
         if n.endswith(".gch")]
print(json.dumps({{"plain": plain[-2000:], "sizes": sizes}}))
"""


def test_a_header_cut_short_is_made_again_and_the_build_succeeds(built_early):
    folder, found = built_early
    headers = [path for name in found["made"] for path in folder.rglob(name)]
    assert len(headers) == 2, (found, headers)  # a CPU program's two
    for path in headers:
        with open(path, "r+b") as handle:
            handle.truncate(100_000)
    done = subprocess.run([sys.executable, "-c", CUT_SHORT.format(root=str(ROOT))],
                          env={**os.environ, "TMPDIR": str(folder)}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(marker in built["plain"] for marker in precompiled_headers.UNREADABLE), built["plain"]
    assert len(built["sizes"]) == 2 and min(built["sizes"]) > 1_000_000, built  # made again, whole
