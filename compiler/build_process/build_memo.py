"""A folder of packages already built from the same program: a build process that meets its program there again
copies the package instead of compiling it. Off unless KEEPFAST_BUILD_MEMO names the folder.

Why: AOTInductor keeps no cache of its own for a package (torch's FX graph cache is skipped in AOT mode), so a
program built twice costs its whole compile twice: 30-90 s for a small UNet on a 2-core CPU. A user meets a program
once per graphs folder (graphs are keyed by structure and shared by checkpoints), but the test suite starts every
test from an empty folder, on purpose, and measured in a run of 2026-12-02 rebuilt an identical program in 37 of
97 builds. The test suite sets the folder for its run (tests/conftest.py); a developer rerunning builds of one
model may set it too.

What a hit still does: the build process starts, reads its job, loads the copied package in its own process where
the loader check asks for it, and reports the phases of the build that made the package (with `memo_hit` 1) --
everything but the compile. What decides a hit: the program's bytes (written without its weights), the job as the
parent wrote it (the weights' layout, the examples, Inductor's settings after the CPU-level probe), torch's version
and the Python running the build. Nothing else is read, so the folder must be one this machine's builds wrote: the
parent passes it in the job only where its own environment names it, never from a graphs folder.

The standard library and compiler/settings.py only (the build process imports it: build_process/child.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from typing import Optional

from ..settings import BUILD_MEMO, build_memo

MEMO_ENV = BUILD_MEMO.name
# Job fields that say how fast the build runs, not what it builds (the CPU-level probe's verdict is in the final
# settings; the folders that keep the ISA probe's and the C++ linkage's verdicts stay in the key).
_NOT_THE_PROGRAM = ("nice", "compile_threads", "probe", "memo")


def folder_for_job() -> str:
    """What the parent writes in a job: the folder KEEPFAST_BUILD_MEMO names now ("" where unset)."""
    return build_memo()


def key(program_path: str, job: dict, configs: dict, torch_version: str) -> str:
    """The program's identity: its bytes, what the job says of it, the final settings, torch and Python."""
    digest = hashlib.sha256()
    with open(program_path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    described = {k: v for k, v in job.items() if k not in _NOT_THE_PROGRAM}
    described["configs"] = configs
    digest.update(json.dumps(described, sort_keys=True, default=str).encode())
    digest.update(f"{torch_version} {sys.version} {sys.executable}".encode())
    return digest.hexdigest()


def fetch(memo: str, found: str, target: str) -> Optional[dict]:
    """Copy the package kept under `found` to `target` and return the phases of the build that made it; None
    where none is kept (or it cannot be read: then the build compiles)."""
    package, phases = os.path.join(memo, found + ".pt2"), os.path.join(memo, found + ".json")
    try:
        with open(phases) as handle:
            recorded = json.load(handle)
        shutil.copyfile(package, target)
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else {}


def keep(memo: str, found: str, package: str, phases: dict) -> None:
    """Keep `package` under `found`: written under a temporary name and renamed, the phases last (a reader
    that finds the phases finds the whole package). Failing to keep it only loses the next build's hit."""
    try:
        os.makedirs(memo, exist_ok=True)
        for suffix, write in ((".pt2", lambda path: shutil.copyfile(package, path)),
                              (".json", lambda path: _write_json(path, phases))):
            handle, temporary = tempfile.mkstemp(dir=memo, prefix=".partial-")
            os.close(handle)
            try:
                write(temporary)
                os.replace(temporary, os.path.join(memo, found + suffix))
            finally:
                if os.path.exists(temporary):
                    os.unlink(temporary)
    except OSError:
        pass


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle)
