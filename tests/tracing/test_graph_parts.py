"""Whole-model graphs built in parts, side by side (compiler/tracing/program_split.py, aot_parts.py).

A tiny SD UNet is cut into two parts (KEEPFAST_GRAPH_PARTS=2; real models are cut by their size and the
cores): its graph compiles once, serves every size, batch and prompt length of its range equal to eager, is
saved as one package whose manifest says which values each part takes and makes, and loads in a fresh process
with another checkpoint's weights with 0 compiles. A manifest whose parts do not fit together is refused; a
part whose build process dies fails the graph with the reason and leaves nothing behind; a program that
cannot be cut is built whole.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiler import CompileOptions
from compiler.backends import aot_build, aot_parts
from compiler.builds import slots
from compiler.tracing import program_split
from compiler.tracing.program_split import CannotSplit, Wiring
from compiler.diffusers_api import compile_module
from compiler.store.manifest import Manifest, ManifestError
from compiler.store.registry import GraphRegistry
from compiler.demo.tiny_models import tiny_unet
from tests.support.background import RANGE, build_folders, served_difference

ROOT = Path(__file__).resolve().parents[2]


def _check(graphs: Path, seed: int) -> dict:
    env = {**os.environ, program_split.PARTS_ENV: "2"}
    done = subprocess.run([sys.executable, "-m", "tests.support.parts_check", str(graphs), str(seed)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    graphs = tmp_path_factory.mktemp("parts-graphs")
    return {"graphs": graphs, "first": _check(graphs, seed=0), "again": _check(graphs, seed=7)}


def test_a_graph_in_parts_serves_every_size_equal_to_eager(built):
    first = built["first"]
    assert first["compiles"] == 1 and first["parts"] == [2.0], first
    assert first["eager"] == [] and first["mismatches"] == 0 and first["max_diff"] < 1e-4, first


def test_it_is_saved_as_one_package_with_its_parts_in_the_manifest(built):
    (manifest_path,) = list(built["graphs"].glob("*/*.json"))
    manifest = Manifest.read(manifest_path)
    data = json.loads(manifest_path.read_text())
    assert data["format_version"] == 3 and len(data["parts"]["parts"]) == 2
    wiring = Wiring.from_json(data["parts"])
    assert set(wiring.parts[1][0]) - set(wiring.inputs) <= set(wiring.parts[0][1])  # part 1 takes part 0's values
    assert manifest.info.wiring == data["parts"]
    assert len(list(built["graphs"].glob("*/*.pt2"))) == 1


def test_a_fresh_process_with_other_weights_loads_it_and_compiles_nothing(built):
    again = built["again"]
    assert again["compiles"] == 0 and again["loads"] == 1, again
    assert again["eager"] == [] and again["mismatches"] == 0 and again["max_diff"] < 1e-4, again


def test_a_manifest_whose_parts_do_not_fit_together_is_refused(built):
    (manifest_path,) = list(built["graphs"].glob("*/*.json"))
    data = json.loads(manifest_path.read_text())
    data["parts"]["parts"][0]["outputs"] = data["parts"]["parts"][0]["outputs"][1:]  # a value no part makes
    with pytest.raises(ManifestError, match="no earlier part makes|made by no part"):
        Manifest.from_json(data)


def test_values_are_freed_after_their_last_part():
    wiring = Wiring(("x", "t"), ("out",), ((("x", "t"), ("a", "b")), (("a", "t"), ("c",)), (("b", "c"), ("out",))))
    assert wiring.last_uses() == [["x"], ["a", "t"], ["b", "c"]]


def test_a_part_whose_build_process_dies_fails_the_graph_with_the_reason(monkeypatch):
    from tests.builds.test_compiler_crash import Killer

    monkeypatch.setenv(program_split.PARTS_ENV, "2")
    unet = tiny_unet(seed=3)
    twin = copy.deepcopy(unet)
    registry = GraphRegistry()
    forward = compile_module(unet, CompileOptions(shape_range=RANGE), registry)
    killer = Killer(signal.SIGSEGV)
    killer.start()
    assert served_difference(unet, twin, 2, 16) == 0.0
    killer.join(timeout=600)
    assert killer.killed is not None
    assert forward.last.eager and "the build process died (SIGSEGV)" in forward.last.reason, forward.last.reason
    assert registry.compiles == [] and build_folders() == []


def test_a_program_that_cannot_be_cut_is_built_whole(monkeypatch):
    monkeypatch.setenv(program_split.PARTS_ENV, "2")

    def cannot(program, count):
        raise CannotSplit("a test says so")

    monkeypatch.setattr(program_split, "split_program", cannot)
    unet = tiny_unet(seed=4)
    twin = copy.deepcopy(unet)
    registry = GraphRegistry()
    forward = compile_module(unet, CompileOptions(shape_range=RANGE), registry)
    assert served_difference(unet, twin, 2, 16) < 1e-4 and not forward.last.eager
    (compiled,) = registry.compiles
    assert "parts" not in compiled.detail["phase_s"]


def test_parts_built_side_by_side_report_the_slowest_part_s_phases_and_every_part_s_kernels():
    usages = [{"peak_rss_mb": 900.0, "phase_s": {"codegen_s": 40.0, "startup_s": 0.5, "kernels": 300.0}},
              {"peak_rss_mb": 700.0, "phase_s": {"codegen_s": 55.0, "startup_s": 6.0, "kernels": 250.0}}]
    usage = aot_parts._parts_usage(usages)
    assert usage["peak_rss_mb"] == 900.0
    assert usage["phase_s"] == {"codegen_s": 55.0, "startup_s": 6.0, "kernels": 550.0, "parts": 2.0}


def test_a_gpu_program_s_trace_starts_a_spare_for_each_part_it_will_likely_be_cut_into(monkeypatch):
    """The H200's SD1.5 UNet was cut into 2 parts; its second part found no spare and started in 9.6 s."""
    monkeypatch.setattr(slots, "gpu_part_builders", lambda: 2)
    big = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(485)])  # the SD1.5 UNet's leaf modules
    small = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(100)])
    assert aot_build.spares_for(big, "cuda:0") == 2  # 485 leaves, about 1309 operations: 3 parts' worth, 2 builders
    assert aot_build.spares_for(small, "cuda") == 1  # one part
    assert aot_build.spares_for(big, "cpu") == 1  # a CPU program's spares would take the trace's cores
    monkeypatch.setattr(slots, "gpu_part_builders", lambda: 4)
    assert aot_build.spares_for(big, "cuda") == 3
