"""AOTInductor's runtime interface compiled once and joined into every package's wrapper
(compiler/build_process/interface_object.py): the cut, the compiler wrapper's paths (made, reused, compiled whole),
and real packages built through the build process that compute as eager."""

from __future__ import annotations

import ctypes
import io
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from compiler.backends import aot_build
from compiler.build_process import interface_object
from compiler.builds import kept_folders, package_builds

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles

# A stand-in for torch's interface.cpp, in plain C++: includes, a helper, the entry points' extern "C" block.
INTERFACE = """// the runtime interface
#include <cstdio>
static int helper() { return 2; }
#define DOUBLED(x) (2 * (x))
extern "C" {
int entry_one() { return helper(); }
int entry_two() { return DOUBLED(helper()); }
} // extern "C"
"""
HEAD = "#include <cstddef>\n"


def _source(model: str) -> str:
    return HEAD + INTERFACE + model


def test_a_wrapper_is_cut_into_the_interface_and_the_model_without_its_entry_points():
    units = interface_object.split(_source("extern \"C\" int model_value() { return DOUBLED(helper()) + 1; }\n"), INTERFACE)
    assert units.interface == HEAD + INTERFACE
    assert "entry_one" not in units.model and "extern \"C\" int model_value()" in units.model
    assert "#define DOUBLED" in units.model and "static int helper()" in units.model  # what the model may use stays
    assert units.model.startswith(HEAD)


def test_a_source_without_the_interface_once_is_not_cut():
    assert interface_object.split("int f() { return 1; }\n", INTERFACE) is None
    assert interface_object.split(_source(INTERFACE), INTERFACE) is None  # twice
    assert interface_object.split(_source(""), INTERFACE.replace('extern "C" {', "")) is None  # no block


def test_only_the_compile_of_one_aoti_wrapper_is_taken():
    take = interface_object.wrapper_compile
    command = take(["-O1", "-include", "h.h", "a.wrapper.cpp", "-fPIC", "-c", "-o", "a.wrapper.o"])
    assert command == interface_object.Command("a.wrapper.cpp", "a.wrapper.o", ["-O1", "-include", "h.h", "-fPIC", "-c"])
    assert take(["-O3", "a.kernel.cpp", "-c", "-o", "a.kernel.o"]) is None  # the kernels
    assert take(["a.wrapper.o", "a.kernel.o", "-shared", "-o", "a.wrapper.so"]) is None  # the package's link
    assert take(["-O3", "probe.cpp", "-shared", "-o", "probe.so"]) is None  # Inductor's ISA probe
    assert take(["a.wrapper.cpp", "b.wrapper.cpp", "-c", "-o", "x.o"]) is None


def _wrapper(tmp_path: Path, real: str = "g++") -> tuple:
    interface = tmp_path / "interface.cpp"
    interface.write_text(INTERFACE)
    wrapper = interface_object.make_wrapper(os.path.abspath(_which(real)), str(interface), tmp_path / "root", "test")
    return wrapper, Path(wrapper).parent / "objects"


def _which(name: str) -> str:
    return shutil.which(name) or name


def _compile_and_call(wrapper: str, folder: Path, name: str, model: str, log: Path) -> dict:
    """Compile `model`'s wrapper source through `wrapper`, link it as Inductor would, call its functions."""
    source = folder / f"{name}.wrapper.cpp"
    source.write_text(_source(model))
    obj, library = folder / f"{name}.wrapper.o", folder / f"{name}.so"
    env = {**os.environ, interface_object.LOG_ENV: str(log)}
    subprocess.run([wrapper, "-O1", "-fPIC", "-c", str(source), "-o", str(obj)], check=True, env=env)
    subprocess.run([wrapper, str(obj), "-shared", "-o", str(library)], check=True, env=env)
    loaded = ctypes.CDLL(str(library))
    return {symbol: getattr(loaded, symbol)() for symbol in ("entry_one", "entry_two", "model_value")}


def test_the_interface_is_compiled_once_and_every_object_holds_the_entry_points_and_the_model(tmp_path):
    wrapper, objects = _wrapper(tmp_path)
    assert Path(wrapper).name == "g++"  # Inductor tells g++ from clang++ by the name
    log = tmp_path / "interface.log"
    first = _compile_and_call(wrapper, tmp_path, "first", "extern \"C\" int model_value() { return 10; }\n", log)
    second = _compile_and_call(wrapper, tmp_path, "second", "extern \"C\" int model_value() { return DOUBLED(helper()) + 1; }\n",
                               log)
    assert first == {"entry_one": 2, "entry_two": 4, "model_value": 10}
    assert second == {"entry_one": 2, "entry_two": 4, "model_value": 5}
    outcomes = [json.loads(line)["outcome"] for line in log.read_text().splitlines()]
    assert outcomes == ["made", "reused"], outcomes
    assert len(list(objects.glob("*.o"))) == 1 and not [p for p in objects.iterdir() if p.is_dir()]
    assert interface_object.read_log(str(log)) == {"interface_made": 1, "interface_reused": 1, "interface_whole": 0}
    # the same flags again: the same object; other flags: another one
    _compile_and_call(wrapper, tmp_path, "third", "extern \"C\" int model_value() { return 7; }\n", tmp_path / "other.log")
    assert len(list(objects.glob("*.o"))) == 1
    source = tmp_path / "fourth.wrapper.cpp"
    source.write_text(_source("extern \"C\" int model_value() { return 7; }\n"))
    subprocess.run([wrapper, "-O0", "-fPIC", "-c", str(source), "-o", str(tmp_path / "fourth.o")], check=True)
    assert len(list(objects.glob("*.o"))) == 2


def test_a_failing_join_compiles_the_original_command_and_says_why(tmp_path):
    real = tmp_path / "bin" / "g++"  # a g++ that cannot make relocatable objects
    real.parent.mkdir()
    real.write_text('#!/bin/sh\ncase " $* " in *" -r "*) echo "no -r here" >&2; exit 1 ;; esac\n'
                    f'exec {_which("g++")} "$@"\n')
    real.chmod(0o755)
    wrapper, _ = _wrapper(tmp_path, str(real))
    log = tmp_path / "interface.log"
    called = _compile_and_call(wrapper, tmp_path, "whole", "extern \"C\" int model_value() { return 3; }\n", log)
    assert called == {"entry_one": 2, "entry_two": 4, "model_value": 3}  # the original command's object
    counts = interface_object.read_log(str(log))
    assert counts["interface_whole"] == 1 and "joining the objects failed" in counts["interface_whole_reason"], counts
    assert "no -r here" in counts["interface_whole_reason"]


def test_a_source_without_the_interface_passes_through(tmp_path):
    wrapper, objects = _wrapper(tmp_path)
    source = tmp_path / "plain.wrapper.cpp"
    source.write_text("extern \"C\" int entry_one() { return 9; }\n")
    log = tmp_path / "interface.log"
    subprocess.run([wrapper, "-fPIC", "-c", str(source), "-o", str(tmp_path / "plain.o")], check=True,
                   env={**os.environ, interface_object.LOG_ENV: str(log)})
    counts = interface_object.read_log(str(log))
    assert counts["interface_whole"] == 1 and "does not hold interface.cpp once" in counts["interface_whole_reason"]
    assert not objects.exists() or not list(objects.glob("*.o"))


def test_turned_off_inductor_keeps_its_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv(interface_object.OFF_ENV, "0")
    assert interface_object.apply(tmp_path) == ("off", f"{interface_object.OFF_ENV}=0")


def _package_computes(data: bytes, module: torch.nn.Module, x: torch.Tensor, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.pt2"
    path.write_bytes(data)
    compiled = torch._inductor.aoti_load_package(str(path))
    compiled.load_constants(module.state_dict(), check_full_update=True, user_managed=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)


def test_packages_built_by_the_build_process_share_one_interface_object_and_compute_as_eager(tmp_path, monkeypatch):
    monkeypatch.setenv(kept_folders.ISA_CACHE_ENV, str(tmp_path / "isa" / "probe"))  # a fresh object folder
    modules = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval(),
               torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.SiLU()).eval()]
    inputs = [torch.randn(3, 8), torch.randn(2, 3, 8, 8)]
    usages = []
    for index, (module, x) in enumerate(zip(modules, inputs)):
        build = package_builds.start(torch.export.export(module, (x,)), dict(aot_build.PACKAGE_CONFIG), now=True)
        data = build.result(timeout=600)
        usages.append(build.usage["phase_s"])
        _package_computes(data, module, x, tmp_path, f"p{index}")
        with zipfile.ZipFile(io.BytesIO(data)) as archive:  # torch's own wrapper source, as Inductor wrote it
            wrappers = [n for n in archive.namelist() if n.endswith(".wrapper.cpp")]
            assert wrappers and 'extern "C" {' in archive.read(wrappers[0]).decode()
    assert usages[0].get("interface_made") == 1.0 and "interface_whole" not in usages[0], usages[0]
    assert usages[1].get("interface_reused") == 1.0 and "interface_whole" not in usages[1], usages[1]
    objects = list(kept_folders.interface_object_folder().rglob("*.o"))
    assert len(objects) == 1, objects


def test_a_forced_header_counts_by_its_text_not_its_name(tmp_path):
    """Inductor forces its precompiled header in under a name that differs between programs whose header text
    does not: the interface's object is keyed and compiled by the text."""
    wrapper, objects = _wrapper(tmp_path)
    for index, name in enumerate(("a", "b")):
        header = tmp_path / f"{name}.h"
        header.write_text("#include <cstddef>\n")
        source = tmp_path / f"{name}.wrapper.cpp"
        source.write_text(_source(f"extern \"C\" int model_value() {{ return {index}; }}\n"))
        subprocess.run([wrapper, "-include", str(header), "-fPIC", "-c", str(source), "-o", str(tmp_path / f"{name}.o")],
                       check=True)
    assert len(list(objects.glob("*.o"))) == 1
    (tmp_path / "c.h").write_text("#include <cstdint>\n")
    subprocess.run([wrapper, "-include", str(tmp_path / "c.h"), "-fPIC", "-c", str(tmp_path / "a.wrapper.cpp"), "-o",
                    str(tmp_path / "c.o")], check=True)
    assert len(list(objects.glob("*.o"))) == 2
