"""A program built before is copied from the build memo, not compiled again (compiler/build_process/build_memo.py), and
the copy serves equal to eager; without the memo folder, or for another program, the build compiles."""

from __future__ import annotations

import torch

from compiler import CompileOptions, GraphRegistry, ShapeRange, compile_module
from compiler.build_process import build_memo

RANGE = ShapeRange(batch=(1, 4), spatial=(4, 16), sequence=(1, 16))


class Mixer(torch.nn.Module):
    def __init__(self, seed: int, width: int = 16):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = torch.nn.Linear(width, 32), torch.nn.Linear(32, width)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))).softmax(-1)


def _first_build(module: torch.nn.Module):
    """(the first call's compile event, the output's largest difference from eager)."""
    registry = GraphRegistry()
    forward = compile_module(module, CompileOptions(shape_range=RANGE), registry)
    x = torch.randn(2, 8, module.a.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = module(x), forward.eager(x)
    (event,) = registry.compiles
    assert forward.last_status == "compiled graph", forward.last_status
    return event.detail["phase_s"], float((got - want).abs().max())


def test_the_same_program_again_is_copied_and_serves_equal_to_eager(tmp_path, monkeypatch):
    monkeypatch.setenv(build_memo.MEMO_ENV, str(tmp_path / "memo"))
    first, first_difference = _first_build(Mixer(seed=0))
    assert "memo_hit" not in first and first["inductor_s"] > 0  # compiled, and kept
    assert len(list((tmp_path / "memo").glob("*.pt2"))) == 1
    again, difference = _first_build(Mixer(seed=5))  # the same structure, other weights: the same program
    assert again.get("memo_hit") == 1.0, again
    assert first_difference < 1e-5 and difference < 1e-5


def test_the_key_is_the_program_its_job_and_settings_not_how_fast_it_builds(tmp_path):
    program, other = tmp_path / "program.pt2", tmp_path / "other.pt2"
    program.write_bytes(b"a program")
    other.write_bytes(b"another program")
    job = {"weights": {"w": [[2, 2], [2, 1], "float32", "cpu", True]}, "configs": {}, "cxx_link": "/kept",
           "nice": 0, "compile_threads": None, "memo": "/memo"}
    key = build_memo.key(str(program), job, {"a": 1}, "2.13.0")
    assert key == build_memo.key(str(program), {**job, "nice": 10, "compile_threads": 4, "memo": "/m"}, {"a": 1},
                                 "2.13.0")
    assert key != build_memo.key(str(other), job, {"a": 1}, "2.13.0")
    assert key != build_memo.key(str(program), job, {"a": 2}, "2.13.0")
    assert key != build_memo.key(str(program), job, {"a": 1}, "2.11.0")
    assert key != build_memo.key(str(program), {**job, "cxx_link": "/elsewhere"}, {"a": 1}, "2.13.0")
    assert key != build_memo.key(str(program), {**job, "weights": {"w": [[2, 3], [3, 1], "float32", "cpu", True]}},
                                 {"a": 1}, "2.13.0")


def test_the_memo_is_offered_only_where_the_environment_names_it_and_no_limit_bounds_the_build(tmp_path, monkeypatch):
    """No folder, no memo; a build under a memory limit (or writing its stacks) is about its compile: no memo."""
    from compiler.builds import job_folder
    from compiler.build_process.memory_bound import MEMORY_ENV
    from compiler.build_process.stack_reports import STACKS_ENV

    monkeypatch.delenv(build_memo.MEMO_ENV, raising=False)
    assert job_folder._memo_folder() == ""
    monkeypatch.setenv(build_memo.MEMO_ENV, str(tmp_path / "memo"))
    assert job_folder._memo_folder() == str(tmp_path / "memo")
    monkeypatch.setenv(MEMORY_ENV, "100000")
    assert job_folder._memo_folder() == ""
    monkeypatch.delenv(MEMORY_ENV)
    monkeypatch.setenv(STACKS_ENV, str(tmp_path))
    assert job_folder._memo_folder() == ""


def test_a_kept_package_that_cannot_be_read_is_no_hit(tmp_path):
    (tmp_path / "k.pt2").write_bytes(b"x")  # its phases never written: a keep cut short
    assert build_memo.fetch(str(tmp_path), "k", str(tmp_path / "out.pt2")) is None
    build_memo.keep(str(tmp_path), "k", str(tmp_path / "k.pt2"), {"inductor_s": 1.0})
    assert build_memo.fetch(str(tmp_path), "k", str(tmp_path / "out.pt2")) == {"inductor_s": 1.0}
    assert (tmp_path / "out.pt2").read_bytes() == b"x" and not list(tmp_path.glob(".partial-*"))
