"""AOTInductor's runtime interface compiled once per compiler, flags and torch, not again inside every package.

Why: AOTInductor pastes torch's `aoti_runtime/interface.cpp` (the C entry points torch's package loader calls:
AOTInductorModelContainerCreate, ...Run and 40 others) into every wrapper it writes, so g++ compiles the same
code generation again for every package. Measured on this 2-core CPU with torch 2.13 (2026-12-02): a package of
a Linear and a GELU took 8.3 s to compile its wrapper, 4.7 s of it for the interface alone and 4.8 s for the rest;
the eight builds of tests/keys/test_size_one.py spent 67.5 s in their six wrapper compiles against 25.7 s for their
kernels. Every cold build, on a user's CPU or a GPU machine's host, paid it.

How: Inductor is given a wrapper of its C++ compiler (`config.cpp.cxx`, as cxx_linkage.py does; the same file
name, so Inductor still sees a g++ or a clang++). Every command passes through unchanged except the compile of an
AOTInductor wrapper (`-c X.wrapper.cpp -o X.wrapper.o`) whose source holds torch's interface.cpp verbatim. That
source is cut in two translation units:
- the interface: everything up to and including interface.cpp's text. Its object is kept, named by a hash of
  that text, every flag of the command and the compiler binary, and reused by every later package;
- the model: the same source without interface.cpp's `extern "C" { ... }` block (its includes, macros and
  helpers stay, so whatever the model's code uses of them is still there).
The two objects are joined into the `X.wrapper.o` Inductor asked for with a relocatable link (`-r`), so its own
link of the package is unchanged. Anything unexpected (the text not found once, a compile or the join failing)
compiles the original command as Inductor wrote it: the package is the same either way, only slower to make.

`KEEPFAST_INTERFACE_OBJECT=0` turns it off. A build that sets KEEPFAST_INTERFACE_LOG to a file gets a line per
wrapper compile there ({"outcome": "made" | "reused" | "whole", ...}), which the build's phases report.

Standalone, the standard library only (and compiler/settings.py, loaded by its path where there is no package): the
build process imports it, and the compiler wrapper runs it as a script
(`python -S -E interface_object.py REAL INTERFACE OBJECTS -- ARGS...`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence, Tuple


def _settings():
    """compiler/settings.py: imported with the package, or loaded by its path where this file runs as the compiler
    wrapper script (no package there; the standard library only, as this file)."""
    if __package__:
        from .. import settings

        return settings
    import importlib.util

    name = "keepfast_settings"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "settings.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


OFF_ENV = _settings().INTERFACE_OBJECT.name
LOG_ENV = _settings().INTERFACE_LOG.name
WRAPPER_SUFFIX = ".wrapper.cpp"  # AOTInductor's name for a package's wrapper source
BLOCK_START = 'extern "C" {'
BLOCK_END = '} // extern "C"'


class Units(NamedTuple):
    interface: str  # the source up to and including interface.cpp: the same for every package of one build setup
    model: str  # the source without interface.cpp's entry points


def split(source: str, interface: str) -> Optional[Units]:
    """The two translation units of a wrapper source, or None where it is not one this can cut: interface.cpp's
    text must occur exactly once, and hold one `extern "C" {` block."""
    at = source.find(interface)
    if not interface or at < 0 or source.find(interface, at + 1) >= 0:
        return None
    start, end = interface.find(BLOCK_START), interface.rfind(BLOCK_END)
    if start < 0 or end < start or interface.find(BLOCK_START, start + 1) >= 0:
        return None
    end += len(BLOCK_END)
    head = source[:at]
    return Units(head + interface, head + interface[:start] + interface[end:] + source[at + len(interface):])


class Command(NamedTuple):
    source: str  # the one .wrapper.cpp compiled
    output: str  # its -o
    flags: List[str]  # every other argument, in order


def wrapper_compile(args: Sequence[str]) -> Optional[Command]:
    """The command's source, output and other flags where it compiles one AOTInductor wrapper to an object
    (`-c`, one source, one `-o`); None for anything else (a link, a probe, a kernel's compile)."""
    if "-c" not in args or args.count("-o") != 1:
        return None
    sources = [a for a in args if a.endswith((".cpp", ".cc", ".cxx", ".c"))]
    if len(sources) != 1 or not sources[0].endswith(WRAPPER_SUFFIX):
        return None
    out_at = args.index("-o")
    if out_at + 1 >= len(args):
        return None
    output = args[out_at + 1]
    flags = [a for i, a in enumerate(args) if i not in (out_at, out_at + 1) and a != sources[0]]
    return Command(sources[0], output, flags)


def without_forced_includes(flags: Sequence[str]) -> Tuple[List[str], str]:
    """(the flags without their `-include FILE` pairs, those files' text in order): the interface's object is
    compiled with the text in place of the flag, the same source to the compiler. Inductor forces its precompiled
    header in, whose name (a hash of a command line that also names the program's own settings) differs between
    programs whose headers do not; with the flag in the key, no two programs shared an object."""
    kept: List[str] = []
    text: List[str] = []
    at = 0
    while at < len(flags):
        if flags[at] == "-include" and at + 1 < len(flags):
            with open(flags[at + 1]) as handle:
                text.append(handle.read())
            at += 2
            continue
        kept.append(flags[at])
        at += 1
    return kept, "".join(part if part.endswith("\n") else part + "\n" for part in text)


def compiler_identity(real: str) -> str:
    """The compiler's resolved path, size and modification time: another compiler, or an upgraded one, is another
    key."""
    path = os.path.realpath(real)
    try:
        stat = os.stat(path)
        return f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    except OSError:
        return path


def object_name(real: str, flags: Sequence[str], interface_unit: str) -> str:
    digest = hashlib.sha256()
    for part in (compiler_identity(real), *flags, interface_unit):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32] + ".o"


def _compile(real: str, flags: Sequence[str], text: str, output: str, work: str, name: str) -> subprocess.Popen:
    """Starts compiling `text` (written into `work` as `name`) to `output`, with the command's flags."""
    source = os.path.join(work, name)
    with open(source, "w") as handle:
        handle.write(text)
    return subprocess.Popen([real, *flags, "-c", source, "-o", output], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _finished(process: subprocess.Popen, what: str) -> None:
    out, _ = process.communicate()
    if process.returncode != 0:
        tail = (out or b"").decode(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"compiling the {what} failed (exit {process.returncode}): {' | '.join(tail)}")


def compile_split(real: str, interface_path: str, objects: str, command: Command) -> Tuple[str, str]:
    """Compile `command` as two units (module docstring); ("made" | "reused", "") when done, ("whole", why)
    when the caller is to run the original command."""
    try:
        with open(command.source) as handle:
            source = handle.read()
        with open(interface_path) as handle:
            interface = handle.read()
    except OSError as error:
        return "whole", f"could not read the sources: {error}"
    units = split(source, interface)
    if units is None:
        return "whole", f"the wrapper does not hold {os.path.basename(interface_path)} once"
    try:
        interface_flags, forced = without_forced_includes(command.flags)
    except OSError as error:
        return "whole", f"could not read a header the command forces in: {error}"
    interface_unit = forced + units.interface
    kept = os.path.join(objects, object_name(real, interface_flags, interface_unit))
    outcome = "reused" if os.path.isfile(kept) else "made"
    try:
        os.makedirs(objects, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="keepfast-split-", dir=objects) as work:
            making = None
            if outcome == "made":  # the interface and the model compile side by side
                making = _compile(real, interface_flags, interface_unit, os.path.join(work, "interface.o"), work,
                                  "interface.cpp")
            model = _compile(real, command.flags, units.model, os.path.join(work, "model.o"), work, "model.cpp")
            try:
                _finished(model, "model's part")
            finally:
                if making is not None:
                    _finished(making, "interface")
            if making is not None:
                os.replace(os.path.join(work, "interface.o"), kept)  # whole, or not there (two builds at once)
            joined = os.path.join(work, "joined.o")
            done = subprocess.run([real, "-r", "-nostdlib", kept, os.path.join(work, "model.o"), "-o", joined],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                raise RuntimeError(f"joining the objects failed: {done.stdout.decode(errors='replace')[-300:]}")
            os.replace(joined, command.output)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return "whole", str(error)
    return outcome, ""


def _log(outcome: str, reason: str, began: float) -> None:
    path = _settings().interface_log()
    if not path:
        return
    try:
        with open(path, "a") as handle:
            handle.write(json.dumps({"outcome": outcome, "reason": reason,
                                     "seconds": round(time.perf_counter() - began, 2)}) + "\n")
    except OSError:
        pass


def main(argv: List[str]) -> int:
    """The compiler wrapper: REAL INTERFACE OBJECTS -- ARGS (module docstring)."""
    real, interface_path, objects, args = argv[0], argv[1], argv[2], argv[4:]
    command = wrapper_compile(args) if _settings().interface_object() else None
    if command is not None:
        began = time.perf_counter()
        outcome, reason = compile_split(real, interface_path, objects, command)
        _log(outcome, reason, began)
        if outcome != "whole":
            return 0
    os.execv(real, [real, *args])
    return 1  # not reached


def read_log(path: str) -> dict:
    """{"interface_made": n, "interface_reused": n, "interface_whole": n} from a build's log (LOG_ENV); the
    first reason a wrapper compiled whole as "interface_whole_reason"."""
    counts = {"interface_made": 0, "interface_reused": 0, "interface_whole": 0}
    reason = ""
    try:
        with open(path) as handle:
            for line in handle:
                entry = json.loads(line)
                counts["interface_" + entry["outcome"]] += 1
                reason = reason or entry.get("reason", "")
    except (OSError, ValueError, KeyError):
        pass
    return {**counts, **({"interface_whole_reason": reason} if reason else {})}


def interface_source() -> Optional[str]:
    """torch's interface.cpp, the one AOTInductor pastes into its wrappers (None where this torch has none)."""
    import torch._inductor.codegen as codegen

    path = os.path.join(os.path.dirname(codegen.__file__), "aoti_runtime", "interface.cpp")
    return path if os.path.isfile(path) else None


def make_wrapper(real: str, interface_path: str, root: Path, torch_version: str) -> str:
    """`root/<hash>/<name of the real compiler>`: a shell script running this file as the compiler wrapper.
    The folder is named by the compiler, this file's text, the interface's path and torch's version; it also
    holds the kept objects. Written into a temporary folder and renamed: two build processes making it at once
    both end with one whole folder."""
    this = os.path.abspath(__file__)
    with open(this, "rb") as handle:
        own = hashlib.sha256(handle.read()).hexdigest()
    key = hashlib.sha256("\0".join((compiler_identity(real), own, interface_path, torch_version,
                                    sys.executable)).encode()).hexdigest()[:16]
    folder = root / key
    script = ("#!/bin/sh\n"
              "# Made by keepfast (compiler/build_process/interface_object.py): compiles torch's AOTInductor\n"
              "# runtime interface once and reuses it in every package's wrapper.\n"
              f"exec '{sys.executable}' -S -E '{this}' '{real}' '{interface_path}' '{folder / 'objects'}' "
              '-- "$@"\n')
    return _cxx_linkage().publish_wrapper(folder, os.path.basename(real), script)


def _cxx_linkage():
    """cxx_linkage.py beside this file: imported with the package, or by its path where this file runs as the
    compiler wrapper script (no package there)."""
    if __package__:
        from . import cxx_linkage

        return cxx_linkage
    import importlib.util

    name = "keepfast_cxx_linkage"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cxx_linkage.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def apply(root) -> Tuple[str, str]:
    """Give Inductor, in this process, the wrapper of the compiler it would run (after cxx_linkage.apply, whose
    wrapper it then wraps). ("on", wrapper) or ("off", why). `root`: the folder for wrappers and objects."""
    if not _settings().interface_object():
        return "off", f"{OFF_ENV}=0"
    if sys.platform != "linux":
        return "off", f"not on {sys.platform}"
    try:
        import torch
        import torch._inductor.config as inductor_config
        from torch._inductor.cpp_builder import get_cpp_compiler

        real = get_cpp_compiler()
        interface_path = interface_source()
    except Exception as error:  # noqa: BLE001 - no compiler: Inductor's build says so in its own words
        return "off", f"no C++ compiler found: {type(error).__name__}: {error}"
    if interface_path is None:
        return "off", "this torch has no aoti_runtime/interface.cpp"
    if Path(real).parent.parent == Path(root):
        return "on", real  # already this wrapper
    real = os.path.abspath(shutil.which(real) or real)
    try:
        wrapper = make_wrapper(real, interface_path, Path(root), torch.__version__)
    except OSError as error:
        return "off", f"could not write the compiler wrapper: {error}"
    inductor_config.cpp.cxx = (None, wrapper)
    return "on", wrapper


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
