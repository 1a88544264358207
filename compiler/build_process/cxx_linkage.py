"""Inductor's C++ builds link the C++ runtime (libstdc++) as a shared library, or no package is built.

Root cause of the GPU machines' loader crash (2026-11-27, H200, torch 2.11+cu130, `.ci/gpu_session.sh`): on
their image, g++ linked libstdc++ *statically* into every AOTInductor model library. The library's dynamic
section names no libstdc++.so.6 but ld-linux (as `-static-libstdc++` gives), and it defines libstdc++'s own
symbols (`std::codecvt<char16_t>::do_unshift`, the regex and locale code). Loaded into a process that already
has libstdc++.so.6 (every Python with torch), some of its calls bind to the process's copy and others stay in
its own, so the locale facets the two copies index disagree: the model container's constructor
(`torch::aot_inductor::parse_device_str`, a std::regex) died with SIGSEGV in `regex_traits::transform_primary`,
for CUDA and CPU packages alike, torch's own example included. Reproduced here on a CPU with a g++ that adds
`-static-libstdc++` to shared links: the same dynamic section, and the same constructor fails (std::bad_cast
from the locale, with this machine's GCC 12).

So before a package is built, a few-line shared object is linked with the compiler Inductor will use and its
dynamic section is read (no loading: a static runtime would crash this process). Where the runtime came in
statically, a folder is made (beside the ISA probe's) holding `libstdc++.so`, a link to the libstdc++.so.6 the
compiler or this process has, and a wrapper of the compiler that puts that folder first on shared links; the
check is repeated with the wrapper, and Inductor is given it (`config.cpp.cxx`). Where even that links
statically, no package is built: the compile fails with the reason and the call runs eager or torch.compile.

Loaded by path in the build process (build_process/child.py): standard library and torch only.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import List, NamedTuple, Optional

PROBE_SOURCE = """#include <stdexcept>
extern "C" void keepfast_linkage_probe(int fail) { if (fail) throw std::runtime_error("keepfast"); }
"""
RUNTIMES = ("libstdc++", "libc++")  # a shared C++ runtime in the library's NEEDED entries
TIMEOUT_S = 120.0


class Linkage(NamedTuple):
    compiler: str  # what Inductor is to run: the compiler, or the pack's wrapper of it
    state: str  # "shared" (as the compiler links), "linked" (through the wrapper), "static", "unknown"
    reason: str  # why, where it is not plainly "shared"

    @property
    def label(self) -> str:
        return f"libstdc++ {self.state}"


class StaticCxxRuntime(RuntimeError):
    """The compiler links the C++ runtime statically, which crashes torch's package loader."""


def needed_libraries(path: Path) -> List[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object (what `readelf -d` lists), read here."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names: List[str] = []
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != 6:  # SHT_DYNAMIC; its sh_link is the string table it names
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strings + value)
                names.append(data[strings + value:end].decode())
    return names


def _link_probe(compiler: str, work: Path) -> List[str]:
    source, library = work / "probe.cpp", work / "probe.so"
    source.write_text(PROBE_SOURCE)
    library.unlink(missing_ok=True)
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O0", str(source), "-o", str(library)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} could not link a shared object: {(done.stderr or done.stdout).strip()[-400:]}")
    return needed_libraries(library)


def _shares_runtime(needed: List[str]) -> bool:
    return any(name.startswith(RUNTIMES) for name in needed)


def _shared_runtime(compiler: str) -> Optional[str]:
    """The libstdc++.so.6 to link against: the compiler's own, else the one this process has loaded."""
    try:
        named = subprocess.run([compiler, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True,
                               timeout=TIMEOUT_S).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        named = ""
    if os.path.isabs(named) and os.path.isfile(named):
        return os.path.realpath(named)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if os.path.basename(path).startswith("libstdc++.so.6") and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


def _make_wrapper(compiler: str, runtime: str, root: Path) -> str:
    """`root/<hash>/` with `libstdc++.so` -> `runtime` and a wrapper of `compiler` (same file name, so Inductor
    still sees a g++ or a clang++) that adds `-L` that folder to shared links. Written into a temporary folder
    and renamed: two build processes making it at once both end with one whole folder."""
    real = shutil.which(compiler) or compiler
    folder = root / hashlib.sha256(f"{real}\0{runtime}".encode()).hexdigest()[:16]
    script = ("#!/bin/sh\n"
              "# Made by keepfast (compiler/build_process/cxx_linkage.py): this compiler linked libstdc++\n"
              "# statically into shared objects, which crashes torch's AOTInductor package loader.\n"
              'case " $* " in\n'
              f"  *\" -shared \"*) exec '{real}' -L'{folder}' \"$@\" ;;\n"
              "esac\n"
              f"exec '{real}' \"$@\"\n")
    return publish_wrapper(folder, os.path.basename(compiler), script,
                           lambda staging: (staging / "libstdc++.so").symlink_to(runtime))


def publish_wrapper(folder: Path, name: str, script: str, prepare=None) -> str:
    """`folder/name`, a compiler wrapper running `script` (`prepare(staging)` adds what else the folder holds),
    made once: written into a temporary folder beside it and renamed, so two build processes making it at once
    both end with one whole folder."""
    wrapper = folder / name
    if wrapper.is_file():
        return str(wrapper)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".making-", dir=folder.parent))
    if prepare is not None:
        prepare(staging)
    (staging / name).write_text(script)
    (staging / name).chmod(0o755)
    try:
        os.rename(staging, folder)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    return str(wrapper)


@functools.lru_cache(maxsize=8)
def check(compiler: str, root: str) -> Linkage:
    """How `compiler` links the C++ runtime into a shared object; a wrapper under `root` where it links it
    statically and a shared one can be named (module docstring)."""
    try:
        with tempfile.TemporaryDirectory(prefix="keepfast-linkage-") as work:
            needed = _link_probe(compiler, Path(work))
            if _shares_runtime(needed):
                return Linkage(compiler, "shared", "")
            static = (f"{compiler} links the C++ runtime statically into shared objects (a probe's NEEDED: "
                      f"{', '.join(needed) or 'none'}), which crashes torch's AOTInductor package loader")
            runtime = _shared_runtime(compiler)
            if runtime is None:
                return Linkage(compiler, "static", f"{static}; no libstdc++.so.6 was found to link against")
            wrapper = _make_wrapper(compiler, runtime, Path(root))
            if _shares_runtime(_link_probe(wrapper, Path(work))):
                return Linkage(wrapper, "linked", f"{static}; packages are linked against {runtime} instead "
                                                  f"(through {wrapper})")
            return Linkage(compiler, "static", f"{static}; linking against {runtime} did not help either")
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as error:
        return Linkage(compiler, "unknown", f"the C++ runtime's linkage could not be checked: {error}")


def inductor_compiler() -> str:
    """The C++ compiler Inductor runs (its own search: CXX, else g++)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


def apply(root) -> Linkage:
    """Make Inductor's builds in this process link the C++ runtime as a shared library (module docstring);
    raises StaticCxxRuntime where they cannot. An unknown linkage (the check itself failed) builds as before.
    `root`: the folder for the wrapper (a str or a Path)."""
    import torch._inductor.config as inductor_config

    try:
        compiler = inductor_compiler()
    except Exception as error:  # noqa: BLE001 - no compiler: Inductor's build says so in its own words
        return Linkage("", "unknown", f"no C++ compiler found: {type(error).__name__}: {error}")
    if os.path.dirname(compiler) and Path(compiler).parent.parent == Path(root):
        return Linkage(compiler, "linked", "already the pack's wrapper")
    linkage = check(compiler, str(root))
    if linkage.state == "static":
        raise StaticCxxRuntime(linkage.reason)
    if linkage.state == "linked":
        inductor_config.cpp.cxx = (None, linkage.compiler)
    return linkage
