"""The aot backend's package builds: an exported program's AOTInductor package, weights left out, built in a build
process (package_builds.py), whole or in parts side by side (aot_parts.py), or in this process where the program
cannot travel; and the package built, read here (`read_package`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import List, NamedTuple, Optional, Tuple

import torch

from ..build_process import cxx_linkage, gpu_reductions
from ..builds import job_folder, kept_folders, package_builds, slots, spares
from ..machine import machine_fit
from ..store import extraction
from ..tracing import program_split
from . import aot_loading, aot_parts
from .aot_export import _first_line
from .aot_loading import _package_metadata
from .base import UNLABELLED, BuildInProcess, BuildLabel, CompileFailed, Progress, no_progress

log = logging.getLogger("keepfast")

# Weights stay out of the package; tiny tensors are not inlined as literals
# (they would silently ignore another checkpoint's values).
PACKAGE_CONFIG = {
    "aot_inductor.package_constants_in_so": False,
    "always_keep_tensor_constants": True,
}


class Built(NamedTuple):
    """A package built here: its bytes, the weight names it binds, what it needs of a machine, and its build's
    peak memory and phase times (`usage`, {} when built in this process)."""

    package: bytes
    names: List[str]
    needs: dict
    usage: dict
    wiring: Optional[dict] = None  # a graph built in parts: which values each part takes and makes


def build_package(ep: "torch.export.ExportedProgram", progress: Progress = no_progress,
                  label: BuildLabel = UNLABELLED, parts: bool = False) -> Built:
    """AOTInductor package of an exported program, weights left out: the one place packages are built and
    waited for (whole models and transformer blocks).

    Built in a child process (package_builds.py), even while the caller waits: a compiler that crashes
    (SIGSEGV, killed for memory, a stack overflow) fails this graph with its reason and this process lives on;
    the child picks the CPU level (so the graph runs on every CPU of that level) with the ISA probe kept per
    machine. Where the program cannot travel to a child (BuildInProcess) it is built here, as before.
    `parts`: a large program is cut into parts built side by side, one per core (program_split.py).
    """
    count = program_split.part_count(ep, _part_builders(ep)) if parts else 1
    if count > 1:
        try:
            return _build_in_parts(ep, count, progress, label)
        except program_split.CannotSplit as why:
            log.info("%s: built whole: %s", label.owner, why)
    try:
        build = package_builds.start(ep, dict(PACKAGE_CONFIG), label, probe=True, now=True)
    except BuildInProcess as why:
        log.info("building the package in this process: %s", why)
        return _build_here(ep, progress)
    progress("compiling with AOTInductor in a build process", 0.3)
    try:
        return read_built(build)
    except BaseException:
        build.cancel()  # interrupted (a cancelled prompt): nothing left running or on disk
        raise


def _part_builders(ep: "torch.export.ExportedProgram") -> int:
    """Parts that may build side by side: one per core for a CPU program (its kernels are C++, one compiler
    call each); for a GPU program, as many as leave each part its own Triton compile workers."""
    if job_folder.program_device(ep) != "cpu":
        return slots.gpu_part_builders()
    return os.cpu_count() or 1


OPERATIONS_PER_LEAF = 2.7  # the SD1.5 UNet's program: 1312 operations from 485 leaf modules


def spares_for(module: torch.nn.Module, device: str) -> int:
    """Build processes to start ahead while `module` is traced for `device`: one, or for a GPU program the parts it
    will likely be cut into (`_part_builders`; program_split.part_count's rule, its operations guessed from the
    module's leaf modules): the parts start at once, and one that finds no spare starts its own process (9.6 s for
    the SD1.5 UNet's second part on the H200). A CPU program's parts are one per core, where spares would take
    the cores the trace uses."""
    if spares.host_kind(device) == "cpu":
        return 1
    leaves = sum(1 for sub in module.modules() if next(sub.children(), None) is None)
    guessed = int(leaves * OPERATIONS_PER_LEAF) // program_split.NODES_PER_PART
    return max(1, min(slots.gpu_part_builders(), guessed))


def _build_in_parts(ep: "torch.export.ExportedProgram", count: int, progress: Progress,
                    label: BuildLabel) -> Built:
    """The program cut into `count` parts, each built in its own process at once, joined into one package."""
    split_parts, wiring = program_split.split_program(ep, count)
    progress(f"compiling with AOTInductor in {count} parts, side by side", 0.3)
    builds: List[package_builds.PackageBuild] = []
    try:
        for index, part in enumerate(split_parts):
            builds.append(package_builds.start(part.program, dict(PACKAGE_CONFIG),
                                               label._replace_what(f"{label.what} part {index + 1} of {count}"),
                                               probe=True, now=True, beside=count))
        packages = [build.result() for build in builds]
    except BuildInProcess as why:
        raise program_split.CannotSplit(str(why)) from None
    except BaseException:
        for build in builds:
            build.cancel()
        raise
    probe = builds[0].probe or {}
    vec = (probe["vec_isa"], probe.get("vec_flags")) if probe.get("vec_isa") else None
    with aot_parts.temporary_folder(extraction.run_folder()) as work:
        try:
            package = aot_parts.join_packages(packages, Path(work))
        except Exception as error:  # noqa: BLE001 - torch's packager, or a part without a model
            raise CompileFailed(f"the graph's parts could not be joined: {type(error).__name__}: "
                                f"{_first_line(error)}") from error
    usage = aot_parts._parts_usage([build.usage for build in builds])
    return read_package(package, probe.get("march"), progress, vec, wiring.to_json())._replace(usage=usage)


def _build_here(ep: "torch.export.ExportedProgram", progress: Progress) -> Built:
    """The package built in this process (for the CPU level `package_configs` picks)."""
    gpu = job_folder.program_device(ep) != "cpu"
    march, configs = package_configs(gpu=gpu)
    heuristics = {}
    if gpu:
        configs.update(job_folder.gpu_program_settings(ep))
        heuristics = job_folder.gpu_program_heuristics(ep)
    try:
        cxx_linkage.apply(kept_folders.cxx_link_folder())
    except cxx_linkage.StaticCxxRuntime as error:
        raise CompileFailed(f"no package is built on this machine: {error}") from error
    with tempfile.TemporaryDirectory(prefix="keepfast-aoti-", dir=extraction.run_folder()) as folder:
        target = os.path.join(folder, "graph.pt2")
        try:
            with gpu_reductions.fixed_size_persistent_reductions(
                    bool(heuristics.get("fixed_size_persistent_reductions"))):
                torch._inductor.aoti_compile_and_package(ep, package_path=target, inductor_configs=configs)
        except Exception as error:
            raise CompileFailed(f"AOTInductor failed: {type(error).__name__}: {_first_line(error)}") from error
        package = Path(target).read_bytes()
    return read_package(package, march, progress)


def read_built(build: "package_builds.PackageBuild") -> Built:
    """The package of a build started with `probe=True` (built for the CPU level its process picked), read here;
    CompileFailed with the build's reason when it failed."""
    package = build.result()
    probe = build.probe or {}
    vec = (probe["vec_isa"], probe.get("vec_flags")) if probe.get("vec_isa") else None
    return read_package(package, probe.get("march"), vec=vec)._replace(usage=dict(build.usage))


def package_configs(gpu: bool = False) -> Tuple[Optional[str], dict]:
    """(the CPU level packages are built for, Inductor's settings for a weight-free package); for a GPU program
    no level (machine_fit.gpu_host_build: its host code needs none, and picking one runs the ISA probe)."""
    if gpu:
        march, settings = machine_fit.gpu_host_build()
        return march, {**PACKAGE_CONFIG, **settings}
    march = machine_fit.build_march()
    return march, {**PACKAGE_CONFIG, **({"cpp.march": march} if march else {})}


def read_package(package: bytes, march: Optional[str], progress: Progress = no_progress,
                 vec: Optional[tuple] = None, wiring: Optional[dict] = None) -> Built:
    """(bytes, weight names, machine needs) of a package built here (in this process or a build process;
    `vec`: the build process's vector ISA and flags, so no probe runs here; `wiring`: a graph in parts)."""
    progress("loading the compiled package", 0.95)
    folder = extraction.extract(package, "compiled")
    try:
        needs = machine_fit.needs_of_package(_package_metadata(folder), march, built_here=True, vec=vec)
        try:
            runner = aot_loading._load_runner(folder, package, wiring)
            names = sorted(runner.get_constant_fqns())
        except Exception as error:
            raise CompileFailed(f"the compiled package does not load: {type(error).__name__}: "
                                f"{_first_line(error)}") from error
        del runner
    finally:
        extraction.remove(folder)
    return Built(package, names, needs, {}, wiring)
