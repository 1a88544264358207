"""Example sizes torch's loader leaves out of a saved program, given back in the build process
(compiler/build_process/program_hints.py). A size exported as a multiple of a symbol (`8*s6`: the pack's spatial
sizes) came back with a hint for `8*s6` and none for `s6`, so AOTInductor's trace in the build process could not
decide a check relating `s6` to another input's size: ComfyUI's Wan VAE encode chunks failed to build that way
(GuardOnDataDependentSymNode "Eq(4*s55, s33)") and ran eager."""

from __future__ import annotations

import os

import pytest
import torch
from torch.export import Dim

from compiler.backends import aot_build
from compiler.builds import package_builds
from compiler.build_process import program_hints

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles


class PooledWithCache(torch.nn.Module):
    """Pools a sequence to a quarter and joins it to a cache of that length (the shape of a video VAE's chunk)."""

    def forward(self, tensors):
        x, cache = tensors
        pooled = torch.nn.functional.avg_pool1d(torch.nn.functional.avg_pool1d(x, 2), 2)
        return torch.cat([cache, pooled], dim=1) * 2


def _exported(length: int = 64):
    x, cache = torch.randn(1, 4, length), torch.randn(1, 3, length // 4)
    dynamic = ([{2: 8 * Dim("k", min=2, max=32)}, {2: Dim.AUTO(min=2, max=128)}],)  # as aot_export.export_program does
    return torch.export.export(PooledWithCache(), ([x, cache],), dynamic_shapes=dynamic, strict=False)


def _loaded(program, tmp_path):
    path = os.path.join(tmp_path, "program.pt2")
    torch.export.save(program, path)
    return torch.export.load(path)


def test_a_symbol_seen_only_in_a_multiple_gets_its_example_back(tmp_path):
    loaded = _loaded(_exported(64), tmp_path)
    given = program_hints.restore_hints(loaded)
    assert list(given.values()) == [8], given  # 8*k = 64
    assert program_hints.restore_hints(loaded) == {}  # nothing missing any more


def test_a_program_without_missing_hints_is_left_alone():
    program = torch.export.export(torch.nn.ReLU(), (torch.randn(2, 3),), dynamic_shapes=({0: Dim.AUTO},))
    assert program_hints.restore_hints(program) == {}


def test_the_build_process_builds_it_and_the_graph_serves_other_lengths(tmp_path):
    build = package_builds.start(_exported(64), dict(aot_build.PACKAGE_CONFIG), now=True)
    package = tmp_path / "graph.pt2"
    package.write_bytes(build.result(timeout=600))  # failed before: GuardOnDataDependentSymNode in the build
    assert build.usage["phase_s"]["hints_restored"] == 1.0, build.usage["phase_s"]  # k, reported with the phases
    runner = torch._inductor.aoti_load_package(str(package))
    for length in (64, 40, 200):
        x, cache = torch.randn(1, 4, length), torch.randn(1, 3, length // 4)
        got = runner([x, cache])
        torch.testing.assert_close(got, PooledWithCache()([x, cache]))
