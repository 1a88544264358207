"""The GPU machines' loader crash: g++ linked libstdc++ statically into AOTInductor's model libraries
(backends/cxx_linkage.py). Reproduced here with compilers that link it as that machine's did."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from compiler.build_process import cxx_linkage

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles


def _static_archive() -> str:
    path = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path):
        pytest.skip("this g++ has no libstdc++.a to link statically")
    return path


def _compiler(folder: Path, body: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "g++"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def archive_only_gxx(tmp_path):
    """A g++ whose first library folder holds libstdc++.a and no libstdc++.so, as the GPU image's /opt/gcc had
    (`g++ -print-file-name=libstdc++.so` answered a bare "libstdc++.so" there)."""
    libs = tmp_path / "gcc-lib"
    libs.mkdir()
    (libs / "libstdc++.a").symlink_to(_static_archive())
    return _compiler(tmp_path / "archive-only", f'exec g++ "$@" -L{libs}')


@pytest.fixture
def forced_static_gxx(tmp_path):
    """A g++ that always links libstdc++ statically into shared objects: no wrapper can help."""
    _static_archive()
    return _compiler(tmp_path / "forced", 'case " $* " in *" -shared "*) exec g++ "$@" -static-libstdc++ ;; esac\n'
                                          'exec g++ "$@"')


def test_the_machine_s_compiler_links_the_shared_runtime():
    linkage = cxx_linkage.check(cxx_linkage.inductor_compiler(), "/nonexistent-never-made")
    assert linkage.state == "shared" and linkage.label == "libstdc++ shared"


def test_a_compiler_that_finds_only_the_static_runtime_is_wrapped_to_link_the_shared_one(archive_only_gxx, tmp_path):
    root = tmp_path / "cxx-link"
    linkage = cxx_linkage.check(archive_only_gxx, str(root))
    assert linkage.state == "linked", linkage
    assert "links the C++ runtime statically" in linkage.reason and linkage.compiler.startswith(str(root))
    assert os.path.realpath(Path(linkage.compiler).with_name("libstdc++.so")).split("/")[-1].startswith("libstdc++.so.6")
    work = tmp_path / "probe"
    work.mkdir()
    assert not any(n.startswith("libstdc++") for n in cxx_linkage._link_probe(archive_only_gxx, work))
    assert any(n.startswith("libstdc++") for n in cxx_linkage._link_probe(linkage.compiler, work))
    assert cxx_linkage.check(archive_only_gxx, str(root)) == linkage  # made once


def test_a_compiler_that_forces_the_static_runtime_builds_no_package(forced_static_gxx, tmp_path, monkeypatch):
    linkage = cxx_linkage.check(forced_static_gxx, str(tmp_path / "cxx-link"))
    assert linkage.state == "static" and "did not help" in linkage.reason
    monkeypatch.setattr(cxx_linkage, "inductor_compiler", lambda: forced_static_gxx)
    with pytest.raises(cxx_linkage.StaticCxxRuntime, match="statically"):
        cxx_linkage.apply(tmp_path / "cxx-link")


def test_apply_gives_inductor_the_wrapper(archive_only_gxx, tmp_path):
    import torch._inductor.config as inductor_config

    # Inductor's own patch, not monkeypatch.setattr: pytest's undo deletes the entry from torch's config proxy
    # (torch 2.13), and every later compile in the process then failed with "config.cpp.cxx does not exist"
    # (tests/test_load_stages.py after this file in one worker).
    with inductor_config.patch({"cpp.cxx": (None, archive_only_gxx)}):
        linkage = cxx_linkage.apply(tmp_path / "cxx-link")
        assert linkage.state == "linked" and inductor_config.cpp.cxx == (None, linkage.compiler)
        assert cxx_linkage.apply(tmp_path / "cxx-link").reason == "already the pack's wrapper"
    assert inductor_config.cpp.cxx[1] != linkage.compiler


def test_needed_libraries_refuses_what_is_not_an_elf_file(tmp_path):
    (tmp_path / "x.so").write_bytes(b"not elf")
    with pytest.raises(ValueError, match="not a 64-bit"):
        cxx_linkage.needed_libraries(tmp_path / "x.so")


def test_a_package_built_where_g_plus_plus_links_the_static_runtime_loads_and_matches_eager(archive_only_gxx,
                                                                                          tmp_path, monkeypatch):
    """The whole path on such a machine: the build process wraps the compiler, the package loads (without the
    wrapper torch's loader fails in the model container's constructor: std::bad_cast here, SIGSEGV on the GPU
    image) and serves the call."""
    from compiler.serving.compiled_forward import CompileOptions
    from compiler.diffusers_api import compile_module
    from compiler.store.registry import GraphRegistry
    from compiler.keys.shapes import ShapeRange

    from compiler.builds import spares

    monkeypatch.setenv("CXX", archive_only_gxx)  # the build process's Inductor reads it at its start, so no spare
    monkeypatch.setenv(spares.SPARE_ENV, "0")  # build process started before this test may take the build
    spares._stop_spares()
    monkeypatch.setenv("KEEPFAST_ISA_CACHE", str(tmp_path / "isa" / "probe"))  # the wrapper's folder is beside
    monkeypatch.setenv("KEEPFAST_LOADER_VERDICTS", str(tmp_path / "verdicts.json"))
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = module(x)
    registry = GraphRegistry()
    forward = compile_module(module, CompileOptions(shape_range=ShapeRange(batch=(1, 4)), label="static-runtime"),
                             registry)
    with torch.no_grad():
        got = module(x)
    assert forward.last_status == "compiled graph", forward.last_status
    assert len(registry.compiles) == 1 and torch.allclose(got, want, atol=1e-5)
    assert list((tmp_path / "isa" / "cxx-link").glob("*/g++")), "the build process made no wrapper"


def test_without_a_compiler_the_build_goes_on_to_say_so_itself(monkeypatch, tmp_path):
    def none():
        raise RuntimeError("no g++")

    monkeypatch.setattr(cxx_linkage, "inductor_compiler", none)
    assert cxx_linkage.apply(tmp_path).state == "unknown"
