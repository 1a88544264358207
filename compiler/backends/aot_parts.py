"""A graph built in parts (program_split.py): one package holding a model per part, served one after another.

The parts are built as ordinary packages in parallel build processes and joined into one `.pt2` with
torch's own packager (`package_aoti`, a model named `part0`, `part1`, ... each), so a graph on disk is still
one file with one checksum, and torch's single package loader opens each part by name. `ChainedRunner` has
the interface of one loaded package (weight names, weights bound, a call on the flat inputs), so the rest of
the aot backend serves a graph in parts as it serves a whole one. `_parts_usage`: the parts' builds reported as
one build.
"""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch

from ..build_process.build_profile import SLOWEST_KERNELS
from ..tracing.program_split import Wiring

MODEL_FOLDER = "/data/aotinductor/"


def part_name(index: int) -> str:
    return f"part{index}"


def join_packages(packages: Sequence[bytes], work: Path) -> bytes:
    """One package holding each of `packages` (each built with a single model) as model `part<i>`."""
    from torch._inductor.package import package_aoti

    files: Dict[str, List[str]] = {}
    for index, package in enumerate(packages):
        folder = work / part_name(index)
        folder.mkdir(parents=True)
        source = folder / "part.pt2"
        source.write_bytes(package)
        names: List[str] = []
        with zipfile.ZipFile(source) as archive:
            for entry in archive.infolist():
                _, found, rest = entry.filename.partition(MODEL_FOLDER)
                if not found or entry.is_dir() or "/" not in rest:
                    continue
                target = folder / Path(rest.split("/", 1)[1]).name
                target.write_bytes(archive.read(entry))
                names.append(str(target))
        if not names:
            raise ValueError(f"part {index}'s package holds no AOTInductor model")
        files[part_name(index)] = names
    joined = work / "graph.pt2"
    package_aoti(str(joined), files)
    return joined.read_bytes()


class ChainedRunner:
    """The parts' runners as one: weight names (all parts'), weights bound (each part its own), and a call on
    the program's inputs that runs the parts in order, freeing each value after its last use."""

    def __init__(self, load: Callable[[str], object], wiring: Wiring):
        self.wiring = wiring
        self.runners = [load(part_name(index)) for index in range(len(wiring.parts))]
        self._names = [set(runner.get_constant_fqns()) for runner in self.runners]
        self._free = wiring.last_uses()

    def get_constant_fqns(self) -> List[str]:
        return sorted(set().union(*self._names))

    def load_constants(self, tensors: Dict[str, torch.Tensor], check_full_update: bool = True,
                       user_managed: bool = True) -> None:
        for runner, names in zip(self.runners, self._names):
            runner.load_constants({name: tensors[name] for name in names}, check_full_update=check_full_update,
                                  user_managed=user_managed)

    def __call__(self, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
        values: Dict[str, torch.Tensor] = dict(zip(self.wiring.inputs, inputs))
        for runner, (takes, makes), free in zip(self.runners, self.wiring.parts, self._free):
            made = runner([values[name] for name in takes])
            if isinstance(made, torch.Tensor):
                made = [made]
            values.update(zip(makes, made))
            for name in free:
                values.pop(name, None)
        return [values[name] for name in self.wiring.outputs]


def temporary_folder(parent: Path) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="keepfast-join-", dir=parent)


# Phases that add up over parts built at once (counts, CPU seconds, processes, cores); the others are times.
_SUMMED_OVER_PARTS = ("kernels", "compile_cpu_s", "compile_processes_max", "compile_cores_busy", "hints_restored",
                      "interface_made", "interface_reused", "interface_whole")
_SUMMED_PREFIX = "triton_"  # the Triton kernels' counts and build seconds (build_profile.KernelBuilds)


def _parts_usage(usages: List[dict]) -> dict:
    """The parts' builds as one: the largest peak memory; per phase, the slowest part's (they ran at once), but
    the kernels, CPU seconds, processes and busy cores of all parts; the slowest part's main-thread samples."""
    out: dict = {}
    for key in ("peak_rss_mb", "compiler_peak_rss_mb"):
        values = [u[key] for u in usages if key in u]
        if values:
            out[key] = max(values)
    phases: Dict[str, float] = {}
    for usage in usages:
        for name, value in usage.get("phase_s", {}).items():
            summed = name in _SUMMED_OVER_PARTS or name.startswith(_SUMMED_PREFIX)
            phases[name] = round(phases.get(name, 0.0) + value, 2) if summed else max(phases.get(name, 0.0), value)
    out["phase_s"] = {**phases, "parts": float(len(usages))}
    # each part's own phases too: whether one part's kernels kept the others waiting (the H200's SD1.5, fifth
    # session: 62.8 s waiting for Triton's builds with 3 parts of 5 workers each, each part's share not recorded)
    out["parts_phase_s"] = [dict(u.get("phase_s", {})) for u in usages]
    kernels = sorted((k for u in usages for k in u.get("slowest_kernels", [])), key=lambda k: -k[1])
    if kernels:  # the longest kernel builds over every part
        out["slowest_kernels"] = kernels[:SLOWEST_KERNELS]
    slowest = max(usages, key=lambda u: u.get("phase_s", {}).get("inductor_s", 0.0), default={})
    if slowest.get("main_thread"):
        out["main_thread"] = slowest["main_thread"]
    return out
