"""AOTInductor's precompiled headers, built while the build process reads and traces its program, not after.

AOTInductor builds every package's C++ wrapper against a precompiled header of its runtime (for a CPU program a
second one for its kernels), which it makes the first time a machine, compiler and set of flags meet it and keeps
in `/tmp/torchinductor_<user>/precompiled_headers` (torch 2.11 to 2.14: codecache `_precompile_header`, in
`AotCodeCompiler.compile`, after code generation and the wait for every Triton kernel). On this 2-core CPU each
header took 6.0 s to make (torch 2.11, the CUDA header and the CPU one alike; 0.4 s of it the preprocessing and
hashing every build repeats), and a GPU machine lent for one session starts with none: each lane's first build paid
it in its C++ build phase (Flux's blocks: 24.4 s of C++ build on the H200, fourth session).

`start(device)` makes the same headers on a thread at the start of a build, under the build's own Inductor settings
(the caller holds them in force, `config.patch`, from before this call to the end of the build: a patch made and
undone on the thread would undo the build's own where the two interleave), so that AOTInductor's own call finds them made: torch caches `_precompile_header` per process by its
arguments, which are computed here as AotCodeCompiler computes them for a package without weights in its library
(this pack's). A header made here that the build does not ask for is a wasted compile, never a wrong package: the
header's file name hashes its flags, so a build uses only a header made for its own. Anything that fails here is
left to the build, which makes its headers as it always did.

A header is written in place by the compiler (`CppBuilder.build`, no temporary name), so a build process killed
while one is being made (a cancelled build: its process group gets SIGKILL) leaves it cut short, and GCC then
fails every later build with the same flags on that machine ("while reading precompiled header"; seen here with
GCC 12 on a header cut to 100 kB). `compile_with_sound_headers` runs a build once more after removing the headers
when its compile failed so: one build pays for making them again, no build fails for it.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, TypeVar

log = logging.getLogger("keepfast")
T = TypeVar("T")

# What GCC says of a precompiled header it cannot read (a file cut short: GCC 12 "while reading precompiled header"
# is an error, not the fallback to the header's text that an unusable one gets)
UNREADABLE = ("while reading precompiled header", "too short to be a PCH file")


@dataclass
class HeaderWarmup:
    """The headers a build asked to be made early, how long making them took, and why not, where it failed."""

    headers: List[str] = field(default_factory=list)
    seconds: Optional[float] = None
    error: str = ""
    thread: Optional[threading.Thread] = None

    def wait(self, timeout: Optional[float] = None) -> "HeaderWarmup":
        """Block until the headers are made (tests, and a build that wants its report)."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self

    def report(self) -> Dict[str, float]:
        """What a build's phases record (numbers only, as every phase): seconds spent on the thread, or 1 under
        `precompiled_header_failed` where it made none (the reason is in `error`, which the build logs)."""
        if self.error:
            return {"precompiled_header_failed": 1.0}
        return {} if self.seconds is None else {"precompiled_header_s": round(self.seconds, 2)}


def _header_calls(device: str) -> List[Dict[str, Any]]:
    """The `_precompile_header` calls AotCodeCompiler.compile makes for a package of `device` whose weights are not
    in its library, with the arguments it passes (torch 2.11-2.14), under the settings in force now."""
    from torch._inductor import codecache, config
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.utils import determine_aoti_mmap_flags

    vec_isa = pick_vec_isa()
    command_line = CppBuilder(name="o", sources="i",
                              BuildOption=CppTorchDeviceOptions(vec_isa=vec_isa, device_type=device, aot_mode=True))
    cpp_command = repr(command_line.get_command_line())
    use_external_weights, use_mmap_weights = determine_aoti_mmap_flags(0)
    compile_command = {"aot_mode": True, "device_type": device, "use_mmap_weights": use_mmap_weights,
                       "use_mmap_weights_external": use_external_weights,
                       "use_relative_path": bool(config.is_fbcode() and device == "cpu"), "vec_isa": vec_isa}
    calls = [{"header": codecache._get_cpp_wrapper_header(device, aot_mode=True), "cmd": cpp_command,
              "options": {"min_optimize": not config.aot_inductor.package_cpp_only, **compile_command}}]
    prefix = codecache._get_cpp_prefix_header(device)
    if prefix:
        calls.append({"header": prefix, "cmd": cpp_command, "options": dict(compile_command)})
    return calls


def start(device: str) -> HeaderWarmup:
    """Make the precompiled headers a package for `device` ("cpu" or "cuda") will be built with, on a thread,
    under the Inductor settings in force (the build's: the caller keeps them so until the build ends). Returns at
    once; nothing is made where AOTInductor would not use precompiled headers (its setting off, or Windows) or where
    torch lacks what this reads."""
    warmup = HeaderWarmup()
    try:
        import sys

        from torch._inductor import codecache, config

        if sys.platform == "win32" or not config.aot_inductor.precompile_headers:
            return warmup
        calls = _header_calls(device.split(":")[0])
    except Exception as error:  # noqa: BLE001 - the build makes its headers itself
        warmup.error = f"{type(error).__name__}: {error}"
        return warmup
    warmup.headers = [call["header"] for call in calls]

    def build() -> None:
        began = time.perf_counter()
        try:
            for call in calls:
                codecache._precompile_header(call["header"], call["cmd"], **call["options"])
            warmup.seconds = time.perf_counter() - began
        except Exception as error:  # noqa: BLE001 - the build makes its headers itself
            warmup.error = f"{type(error).__name__}: {error}"

    warmup.thread = threading.Thread(target=build, name="keepfast-precompiled-headers", daemon=True)
    warmup.thread.start()
    return warmup


def header_folder() -> Optional[str]:
    """Where this torch's Inductor keeps its precompiled headers (None where it has no such folder)."""
    try:
        from torch._inductor import codecache
    except ImportError:
        return None
    return getattr(codecache, "_HEADER_DIR", None)


def discard_headers() -> int:
    """Remove every precompiled header of this machine's folder (made again by the next build that needs one) and
    this process's record of them; the number removed. A compile that has one open keeps reading it (Linux)."""
    folder = header_folder()
    removed = 0
    for path in glob.glob(os.path.join(folder, "*.gch")) if folder else []:
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    try:
        from torch._inductor import codecache

        codecache._precompile_header.cache_clear()
    except (ImportError, AttributeError):
        pass
    return removed


def compile_with_sound_headers(compile_once: Callable[[], T]) -> T:
    """`compile_once()`, and once more after discarding the precompiled headers where it failed because GCC could
    not read one (a header cut short by a killed build)."""
    try:
        return compile_once()
    except Exception as error:  # noqa: BLE001 - re-raised unless it names an unreadable header
        if not any(marker in str(error) for marker in UNREADABLE):
            raise
        removed = discard_headers()
        log.warning("a precompiled C++ header could not be read (cut short by a build that was stopped?): removed "
                    "%d header(s); compiling again", removed)
        return compile_once()
