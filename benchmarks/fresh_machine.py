"""A "new container" for a child process: empty TMPDIR, empty Inductor cache, no C++ compiler.

What a serverless worker or a rebooted machine gives a restarted ComfyUI:
TMPDIR and the Inductor cache (which lives in /tmp) are empty, and a slim
image has no compiler. The compiler is replaced by a program that records
each call and fails, found first on PATH under every usual name and named by
CC and CXX, so whatever would build C++ on the load path shows up in
`compiler_calls()` instead of quietly working. The benchmark's fresh-machine
restart and the cold-start tests use this same setup.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict, List, Mapping

COMPILER_NAMES = ("cc", "c++", "gcc", "g++", "clang", "clang++")

_RECORDER = """#!/bin/sh
# Stands in for a C++ compiler on a machine that has none: records the call, fails.
printf '%s\\n' "$0 $*" >> '{log}'
exit 1
"""


class FreshMachine:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.tmpdir = self.folder / "tmp"
        self.inductor_cache = self.folder / "inductor-cache"
        self.bin = self.folder / "no-compiler-bin"
        self.log = self.folder / "compiler-calls.log"

    def setup(self) -> "FreshMachine":
        """(Re)create the empty folders and the recording compiler."""
        for path in (self.tmpdir, self.inductor_cache, self.bin):
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        self.log.unlink(missing_ok=True)
        recorder = self.bin / "recorder"
        recorder.write_text(_RECORDER.format(log=str(self.log).replace("'", "'\\''")))
        recorder.chmod(0o755)
        for name in COMPILER_NAMES:
            (self.bin / name).symlink_to("recorder")
        return self

    def env(self, base: Mapping[str, str]) -> Dict[str, str]:
        return {**base, "TMPDIR": str(self.tmpdir), "TORCHINDUCTOR_CACHE_DIR": str(self.inductor_cache),
                "CC": str(self.bin / "cc"), "CXX": str(self.bin / "c++"),
                "PATH": str(self.bin) + os.pathsep + base.get("PATH", os.defpath)}

    def compiler_calls(self) -> List[str]:
        try:
            return [line for line in self.log.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def tmpdir_entries(self) -> List[str]:
        """What is left in TMPDIR (names, recursively, relative to it)."""
        return sorted(str(p.relative_to(self.tmpdir)) for p in self.tmpdir.rglob("*"))

    def cache_entries(self) -> List[str]:
        return sorted(str(p.relative_to(self.inductor_cache)) for p in self.inductor_cache.rglob("*"))
