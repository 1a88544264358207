"""Cold start on a fresh machine: saved graphs load with no compiler and leave nothing in TMPDIR.

The graphs are the session's saved tiny pipeline (one compile, shared). The
"fresh machine" is benchmarks.fresh_machine: empty TMPDIR, empty Inductor
cache, and a C++ compiler that records each call and fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from compiler import GraphRefused, GraphRegistry, GraphStore, ShapeRange, load_pipe
from compiler.machine import machine_fit
from compiler.backends import aot, aot_loading
from benchmarks.fresh_machine import FreshMachine
from compiler.store.manifest import Manifest, ManifestError

ROOT = Path(__file__).resolve().parents[2]
PACK_NAMES = ("keepfast-", "aotinductor_")  # the pack's folder, and torch's own unpacking folders


def _pack_leftovers(machine: FreshMachine) -> list:
    return [name for name in machine.tmpdir_entries() if name.split("/")[0].startswith(PACK_NAMES)]


def _run(module: str, graphs: Path, env: dict) -> dict:
    result = subprocess.run([sys.executable, "-m", module, str(graphs)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _start_server(graphs: Path, env: dict) -> tuple:
    process = subprocess.Popen([sys.executable, "-m", "tests.support.serve_and_wait", str(graphs)], cwd=ROOT,
                               env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)
    line = process.stdout.readline()
    assert line, f"the serving process exited with {process.wait()}"
    report = json.loads(line)
    assert report["compiles"] == 0 and report["loads"] >= 1 and report["max_diff"] < 1e-4, report
    return process, report


@pytest.fixture
def fresh(tmp_path) -> FreshMachine:
    return FreshMachine(tmp_path / "machine").setup()


def test_graphs_load_and_serve_on_a_machine_without_compiler_or_caches(saved_pipe, fresh):
    report = _run("tests.support.load_check", saved_pipe.graphs, fresh.env(os.environ))
    assert fresh.compiler_calls() == []
    assert report["compiles"] == 0, report
    assert report["loads"] >= 2 and report["fallbacks"] == [] and report["problems"] == [], report
    assert report["max_diff"] < 1e-4, report
    assert fresh.cache_entries() == []  # loading wrote nothing into the Inductor cache
    assert _pack_leftovers(fresh) == []  # a normal exit removes the process's unpacked packages


def test_stopped_and_killed_processes_leave_nothing_once_the_next_one_started(saved_pipe, fresh):
    env = fresh.env(os.environ)
    terminated, killed, live = (_start_server(saved_pipe.graphs, env) for _ in range(3))
    folders = {name: Path(report["run_folder"]) for name, (_, report) in
               (("terminated", terminated), ("killed", killed), ("live", live))}
    for folder in folders.values():
        assert folder.is_dir() and any(folder.iterdir())  # each unpacked its graphs there
    terminated[0].send_signal(signal.SIGTERM)
    killed[0].send_signal(signal.SIGKILL)
    assert terminated[0].wait(60) == -signal.SIGTERM and killed[0].wait(60) == -signal.SIGKILL
    assert folders["terminated"].is_dir() and folders["killed"].is_dir()  # what a stopped process leaves

    report = _run("tests.support.load_check", saved_pipe.graphs, env)  # the next process
    assert report["compiles"] == 0 and report["max_diff"] < 1e-4, report
    assert not folders["terminated"].exists() and not folders["killed"].exists()
    assert folders["live"].is_dir() and any(folders["live"].iterdir())  # a live process's files are kept
    process = live[0]
    process.stdin.write("again\n")
    process.stdin.flush()
    again = json.loads(process.stdout.readline())
    assert again["max_diff"] < 1e-4 and again["compiles"] == 0, again

    process.send_signal(signal.SIGKILL)
    process.wait(60)
    _run("tests.support.load_check", saved_pipe.graphs, env)
    assert _pack_leftovers(fresh) == []
    assert fresh.compiler_calls() == []


def _copy_store(saved_pipe, tmp_path) -> Path:
    copy = tmp_path / "graphs"
    shutil.copytree(saved_pipe.graphs, copy)
    return copy


def _edit_manifests(folder: Path, change) -> list:
    paths = sorted(folder.rglob("*.json"))
    for path in paths:
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
    return paths


def test_saved_graphs_record_what_they_need_of_the_machine(saved_pipe):
    graphs = GraphStore(saved_pipe.graphs).graphs()
    assert graphs
    for stored in graphs:
        needs = stored.manifest.info.needs
        assert needs["machine"] == machine_fit.machine() and needs["device"] == "cpu", needs
        assert machine_fit.why_not_here(needs) is None
        if needs["march"] in machine_fit.X86_LEVELS:  # a named level: its instructions are all needed
            assert machine_fit.X86_LEVELS[needs["march"]] <= set(needs["cpu_features"])
        if machine_fit.machine() == "x86_64" and "avx2" in (machine_fit.host_cpu_features() or ()):
            assert needs["march"] in ("x86-64-v3", "x86-64-v4"), needs  # not -march=native


@pytest.mark.parametrize("edit, reason", [
    (lambda n: n["cpu_features"].append("keepfast_test_instruction"), "keepfast_test_instruction"),
    (lambda n: n.update(machine="aarch64" if machine_fit.machine() != "aarch64" else "x86_64"), "CPUs"),
    (lambda n: n.update(device="cuda", compute_capability="990"), "GPU"),
], ids=["cpu-instruction", "cpu-architecture", "gpu"])
def test_a_graph_this_machine_cannot_run_is_refused_before_it_is_loaded(saved_pipe, tmp_path, monkeypatch,
                                                                         edit, reason):
    folder = _copy_store(saved_pipe, tmp_path)
    _edit_manifests(folder, lambda data: edit(data["needs"]))
    loaders = []
    real = aot_loading._new_loader
    monkeypatch.setattr(aot_loading, "_new_loader", lambda *args: loaders.append(args) or real(*args))
    store = GraphStore(folder)
    stored = store.graphs()[0]
    unpacked = set(aot.extraction.run_folder().iterdir())
    with pytest.raises(GraphRefused) as refused:
        store.load(stored)
    assert "cannot run on this machine" in str(refused.value) and reason in str(refused.value)
    assert loaders == []  # refused before torch's loader saw the package
    assert set(aot.extraction.run_folder().iterdir()) == unpacked  # and its unpacked files are gone


def test_format_1_manifests_still_load_and_a_newer_format_is_refused_by_name(saved_pipe, tmp_path):
    from compiler.diffusers_api import compiled_parts
    from compiler.demo.tiny_models import tiny_sd_pipeline
    from tests.support.inputs import unet_sweep_worst_difference

    folder = _copy_store(saved_pipe, tmp_path)
    paths = _edit_manifests(folder, lambda data: (data.update(format_version=1), data.pop("needs")))
    assert all(Manifest.read(p).info.needs == {} for p in paths)
    registry = GraphRegistry()
    pipe = tiny_sd_pipeline(seed=0)
    report = load_pipe(pipe, folder, shape_range=ShapeRange(batch=(1, 4), spatial=(8, 24), sequence=(1, 160)),
                       ignores=("vae.encoder",), registry=registry)
    assert report.problems == [] and len(registry.loads) >= 2
    assert unet_sweep_worst_difference(pipe.unet, compiled_parts(pipe)["unet"].eager) < 1e-4
    assert len(registry.compiles) == 0

    data = json.loads(paths[0].read_text())
    data["format_version"] = 5
    with pytest.raises(ManifestError, match="format 5.*reads formats 1, 2, 3, 4"):
        Manifest.from_json(data)


def test_sweep_removes_what_dead_processes_left_and_keeps_what_live_ones_hold(tmp_path, monkeypatch):
    import fcntl
    import tempfile

    from compiler.store import extraction

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = extraction.root()
    root.mkdir()
    for name in ("run-1-dead", "run-2-live", "run-3-nolock"):
        (root / name).mkdir()
        (root / name / "package.so").write_bytes(b"x")
    (root / "run-1-dead.lock").touch()
    (root / "run-4-half.new").touch()  # a lock whose process died while setting it up
    held = os.open(root / "run-2-live.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = extraction.sweep()
        assert sorted(p.name for p in removed) == ["run-1-dead", "run-3-nolock", "run-4-half.new"]
        assert sorted(p.name for p in root.iterdir()) == ["run-2-live", "run-2-live.lock"]
    finally:
        os.close(held)  # the live process is gone now
    assert [p.name for p in extraction.sweep()] == ["run-2-live"]
    assert not root.exists()
