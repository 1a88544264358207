"""`aot`: torch.export over a declared shape range, packaged by AOTInductor.

The package is built with the weights left out and always-kept tensor
constants, so it is small, holds no checkpoint, and is bound at run time to
whichever module's tensors it should use (bind before the first call: an
unbound package crashes the process). Export records the shape guards the
graph relies on; the AOTInductor runtime does not check them, so the guards
travel in the manifest and are checked before each call.

Loading needs no C++ compiler and no Inductor cache: the package is unpacked
into the pack's own folder (compiler/store/extraction.py) and handed to torch's
package loader directly, below `torch._inductor.aoti_load_package`, whose
`load_pt2` probes the CPU's vector ISA with a C++ compiler only to warn when
it differs from the package's. What the package needs of the machine is
checked by the pack instead, from the manifest, before the library is loaded
(compiler/machine/machine_fit.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ..keys import alignment
from ..store import extraction
from ..machine import machine_fit, torch_support
from ..machine.environment import kind_type
from ..tracing.flat_module import MODULE_PREFIX, FlatForward, dump_out_spec, load_out_spec
from ..tracing.module_snapshot import snapshot_of
from ..keys.guards import GuardSet, GuardSyntaxError, readable, size_ref
from ..keys.graph_keys import GraphKey
from ..keys.probes import cloned, narrowed_to_one, pinned_example, smallest_served, trace_example
from ..keys.shapes import SPATIAL, leaf_bounds
from ..keys.signature import FlatCall
from ..tracing.subclass_weights import unwrap_subclass_weights
from ..serving.verify import compare
from . import aot_parts, loader_check, package_loader
from ..build_process import cxx_linkage, gpu_reductions
from ..builds import package_builds
from ..tracing import program_split, weight_inputs
from .base import (
    UNLABELLED, Backend, BuildInProcess, BuildLabel, CompileFailed, CompiledGraph, PackageInfo, PendingGraph,
    Progress, WeightsElsewhere, call_device, no_progress, weights_elsewhere,
)
from .cuda_graphs import Replays
from .borrowed_weights import bind, borrowed_views
from ..build_process.build_profile import SLOWEST_KERNELS
from .flat_runner import FlatRunner
from ..build_process.stack_traces import without_stack_traces
from ..tracing.export_guards import exported_shapes, guard_texts

log = logging.getLogger("keepfast")

# Weights stay out of the package; tiny tensors are not inlined as literals
# (they would silently ignore another checkpoint's values).
PACKAGE_CONFIG = {
    "aot_inductor.package_constants_in_so": False,
    "always_keep_tensor_constants": True,
}


@contextlib.contextmanager
def _export_settings():
    """Keep size-1 dims and equal-sized dims symbolic while tracing.

    Size-oblivious tracing assumes a size is never 1 without recording a guard, so one graph serves 1 and
    up (a range of 1 to 2 is traced up to 3, `_traced_high`). As a safety net `AotBackend.compile` runs a
    graph whose guards accept a size of 1 once at 1 and gives 1 a graph of its own where they differ.
    Tracing honestly (backed_size_oblivious=False) would
    split every SD UNet's range at batch 1 and at sequence 1, a graph more for each.
    """
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False), without_stack_traces():
        yield


def _guards_from(ep: "torch.export.ExportedProgram", call: FlatCall) -> List[str]:
    """The exported program's sizes, ranges and guards as text the pack checks before each call.

    CompileFailed when one cannot be checked, or when the guards reject the
    very call the graph was traced from: the graph is refused now, with the
    reason, instead of a call failing on it later.
    """
    guards = guard_texts(exported_shapes(ep))
    try:
        failed = GuardSet(guards).first_failure(call.shapes)
    except GuardSyntaxError as error:
        raise CompileFailed(f"torch.export recorded a shape guard the pack cannot check ({error})") from None
    if failed is not None:
        raise CompileFailed("the graph's guard " + readable(failed, call.tensor_paths)
                            + " does not hold for the call it was traced from; the pack cannot check it")
    return guards


def _traced_high(low: int, high: int) -> int:
    """The upper bound a dynamic size is traced with: 3 where the range is 1 to 2.

    Size-oblivious tracing assumes a size is not 1, so a range of 1 to 2 is 2
    only to Inductor, which then builds the graph for 2 alone: its outputs
    had 2 rows for a call with 1 (a Conv2d traced over batch 1 to 2). The
    graph's own guards still bound it, and the declared range bounds the calls.
    """
    return 3 if low < 2 and high == 2 else high


def export_program(module, forward_fn, call: FlatCall, shape_range) -> tuple:
    """(exported program, its FlatForward): the call traced over the declared range.

    The one place the aot backend traces; the guard tests export through it too.
    """
    from torch.export import Dim

    flat = FlatForward(module, forward_fn, call)
    roles = [t.dims for t in call.signature.tensors]
    bounds = leaf_bounds(call.shapes, roles, shape_range)
    dynamic = [{d: Dim.AUTO(min=lo, max=_traced_high(lo, hi)) for d, (lo, hi) in b.items()} for b in bounds]
    for leaf, dims in enumerate(roles):  # the first tensor with spatial sizes: traced on the model's multiple
        spatial = [d for d, role in enumerate(dims) if role == SPATIAL]
        if spatial:
            aligned = alignment.spatial_multiples(module, call.shapes[leaf], spatial, bounds[leaf],
                                                   shape_range.spatial_multiple)
            for d, (multiple, k_low, k_high) in aligned.items():
                dynamic[leaf][d] = multiple * Dim(f"spatial{d}_over_{multiple}", min=k_low, max=k_high)
            break
    try:
        with _export_settings(), torch.no_grad():
            ep = unwrap_subclass_weights(
                torch.export.export(flat, (list(call.tensors),), dynamic_shapes=(dynamic,), strict=False))
    except Exception as error:  # export failures are many and varied
        raise CompileFailed(f"torch.export failed: {type(error).__name__}: {_first_line(error)}") from error
    return ep, flat


class Traced(NamedTuple):
    ep: Any  # torch.export.ExportedProgram
    flat: FlatForward
    guards: List[str]
    widened: str  # the sizes of 1 of the call that were traced at 2 ("" if none)
    seconds: float = 0.0  # the trace's wall time (torch.export, with any retry)


def trace(module, forward_fn, call: FlatCall, shape_range, widen: bool = True) -> Traced:
    """`call` traced with no dynamic size of 1 (unless `widen` is False).

    The example is `probes.trace_example(call)`: each size of 1 that can move
    is traced at 2, and the graph must still serve `call` itself by its
    guards. Where it does not, or the widened call does not export, or
    `widen` is False, the call is traced as it is with its sizes of 1 pinned
    (the graph then serves 1 there only, which is what it computes right).
    """
    started = time.perf_counter()
    bounds = leaf_bounds(call.shapes, [t.dims for t in call.signature.tensors], shape_range)
    example = trace_example(call, bounds) if widen else pinned_example(call, bounds)
    if example.widened:
        try:
            ep, flat = export_program(module, forward_fn, example.call, shape_range)
            guards = _guards_from(ep, example.call) + example.pin_guards()
            failed = GuardSet(guards).first_failure(call.shapes)
            if failed is None:
                return Traced(ep, flat, guards, example.describe(call.tensor_paths), time.perf_counter() - started)
            why = "its guard " + readable(failed, call.tensor_paths) + " rejects the call"
        except CompileFailed as error:
            why = str(error)
        log.info("traced at 2 where %s is 1, the graph does not serve the call (%s); tracing it as it is, "
                 "serving 1 there only", example.describe(call.tensor_paths), why)
        example = pinned_example(call, bounds)
    ep, flat = export_program(module, forward_fn, example.call, shape_range)
    return Traced(ep, flat, _guards_from(ep, example.call) + example.pin_guards(), "", time.perf_counter() - started)


def trace_for_build(module, forward_fn, call: FlatCall, shape_range) -> Tuple[Any, dict]:
    """`trace` as a background build's trace process runs it: (program, the JSON-able rest of what it found)."""
    result = trace(module, forward_fn, call, shape_range)
    if result.flat.out_spec is None:
        raise CompileFailed("the model's output structure was not seen while tracing")
    return result.ep, {"guards": result.guards, "widened": result.widened,
                       "out_spec": dump_out_spec(result.flat.out_spec), "export_s": result.seconds}


def size_one_disagreement(graph: "AotGraph", module, flat: FlatForward, call: FlatCall) -> Optional[str]:
    """How a graph disagrees with the model at a call with a size of 1 it was not traced at (None: it agrees).

    Tracing is size-oblivious (`_export_settings`), so nothing in the graph's
    guards says whether it computes right at 1: run it there once, and the
    model, each on copies of the call's tensors cut to the smallest image the
    graph serves (`probes.smallest_served`: a range corner's own size made
    this one run of the model the first call's longest part), and compare.
    """
    small = smallest_served(call, lambda smaller: graph.why_not(smaller) is None)  # the question is not the size's
    with torch.no_grad():
        try:
            reference = flat(list(cloned(small).tensors))
            call = small
        except Exception:  # noqa: BLE001 - a model that takes no smaller image is asked at the call's own
            try:
                reference = flat(list(cloned(call).tensors))
            except Exception:  # noqa: BLE001 - the model itself does not take a 1 there: nothing to serve
                return None
        try:
            output = pytree.tree_leaves(graph.run(module, cloned(call)))
        except Exception as error:  # noqa: BLE001 - a graph that fails at 1 does not serve 1
            return f"the graph fails there ({type(error).__name__}: {_first_line(error)})"
    agreement = compare(output, list(reference))
    return None if agreement.ok else agreement.describe()


def _placed(tensors: Dict[str, torch.Tensor], names: List[str], device: torch.device) -> Dict[str, torch.Tensor]:
    """The module's tensors a graph reads, by name; CompileFailed names one the module lacks, WeightsElsewhere one
    elsewhere than the call's `device` (the call then runs eager)."""
    try:
        chosen = {name: tensors[name] for name in names}
    except KeyError as missing:
        raise CompileFailed(f"the module has no tensor {missing.args[0][len(MODULE_PREFIX):]}") from None
    misplaced = weights_elsewhere(chosen, device)
    if misplaced:
        raise WeightsElsewhere(misplaced)
    return chosen


class AotGraph(CompiledGraph):
    def __init__(self, key: GraphKey, package_bytes: bytes, info: PackageInfo, origin: str):
        self.key = key
        self.origin = origin
        self.info = info
        self._package_bytes = package_bytes
        self._guards = GuardSet(info.guards)
        self._out_spec = load_out_spec(info.out_spec)
        if self._out_spec is None:
            raise CompileFailed("the graph's output structure is unknown (it could not be serialised)")
        self._names = list(info.constant_names)
        self.weight_inputs = list(info.weight_inputs)  # a block graph's weights, passed after the call's tensors
        self._lock = threading.Lock()
        # One runner per device index the graph is called on (a GPU graph's kernels are loaded onto one device),
        # and per runner a token of whose tensors it holds now (this graph's run and blocks/binding.py alike).
        self._runners: Dict[int, Any] = {}
        self._bound: Dict[int, object] = {}
        self._replays: Dict[int, Replays] = {}  # per runner: its CUDA graphs, where calls ask for them
        self._home = -1
        self.build_usage: dict = {}  # a graph built here: its build's peak memory and phase times
        # The unpacked package lives as long as this graph (CUDA kernels are read from it lazily; a runner for
        # another device is loaded from it when a call first comes from there).
        folder = extraction.extract(package_bytes, key.id[:16])
        self._folder = folder
        self._remove_files = weakref.finalize(self, extraction.remove, folder)
        try:
            # Manifests written before needs were recorded: the package's own metadata says the ISA.
            machine_fit.check(info.needs or machine_fit.needs_of_package(_package_metadata(folder)))
            self._home = _home_index(key.family.device)
            runner = _load_runner(folder, package_bytes, info.wiring, self._home)
            expected = set(runner.get_constant_fqns())
            if expected != set(self._names):
                raise CompileFailed(
                    "the package's weight names do not match its manifest "
                    f"({len(expected)} in the package, {len(self._names)} in the manifest)"
                )
            self._runners[self._home] = runner
        except BaseException:
            self._runners.clear()
            self._remove_files()
            raise

    @property
    def nbytes(self) -> int:
        return len(self._package_bytes)

    @property
    def persistent(self) -> bool:
        return True

    def why_not(self, call: FlatCall) -> Optional[str]:
        failed = self._guards.first_failure(call.shapes)
        if failed is None:
            return None
        return "shape guard " + readable(failed, call.tensor_paths) + " does not hold"

    def runner_on(self, index: int) -> Any:
        """The package loaded for device `index` (-1: the device it was first loaded for), loaded the first time a
        call comes from there. Call with the graph's lock held.

        torch's loader loads a GPU package's kernels onto one device, so a module on cuda:1 needs a runner of its
        own: one runner on cuda:0 would launch its kernels there, on memory of another device.
        """
        index = self._home if index < 0 else index
        runner = self._runners.get(index)
        if runner is None:
            runner = _load_runner(self._folder, self._package_bytes, self.info.wiring, index)
            self._runners[index] = runner
        return runner

    def _bind(self, module: torch.nn.Module, index: int, device: torch.device) -> Any:
        """The runner for device `index` with `module`'s tensors bound (not again when they are bound already); a
        tensor elsewhere than the call's `device` is never bound (`WeightsElsewhere`: the call runs eager)."""
        runner = self.runner_on(index)
        snapshot = snapshot_of(module)  # the module's tensors, walked again only where they changed
        token = snapshot.token
        if token != self._bound.get(index):
            chosen = _placed(snapshot.tensors(), self._names, device)
            bind(runner, borrowed_views(chosen), check_full_update=True)  # by pointer, never kept (borrowed_weights.py)
            self._bound[index] = token
        return runner

    def _with_weights(self, module: torch.nn.Module, inputs: List[torch.Tensor], device: torch.device) -> list:
        """A graph taking its weights as inputs: the call's tensors, then `module`'s weights (nothing bound)."""
        weights = _placed(snapshot_of(module).tensors(), self.weight_inputs, device)
        return weight_inputs.with_weights(inputs, weights, self.weight_inputs)

    def run(self, module: torch.nn.Module, call: FlatCall, replay: bool = False) -> Any:
        with self._lock:
            device = call_device(call.tensors)
            index = index_of(device)
            # The package was traced with contiguous inputs and does not check strides:
            # a non-contiguous input would give wrong results silently.
            inputs = [t if t.is_contiguous() else t.contiguous() for t in call.tensors]
            if self.weight_inputs:  # a block graph: nothing bound, and no CUDA graphs for blocks (replay_notes.py)
                outputs = self.runner_on(index)(self._with_weights(module, inputs, device))
            elif replay and device.type == "cuda":
                runner = self._bind(module, index, device)
                replays = self._replays.setdefault(index, Replays())
                outputs = replays.run(runner, inputs, self._bound.get(index))
            else:
                outputs = self._bind(module, index, device)(inputs)
        if isinstance(outputs, torch.Tensor):
            outputs = [outputs]
        return pytree.tree_unflatten(list(outputs), self._out_spec)

    def replay_state(self) -> Dict[str, Any]:
        """Per device index the graph ran on with CUDA graphs asked for: captures, replays, and why replay is off."""
        return {str(index): {"captures": r.captures, "replays": r.replays, "off": r.reason}
                for index, r in self._replays.items()}

    def restricted(self, guards: List[str]) -> "AotGraph":
        """The same package with more guards (a narrower range): a new graph variant."""
        info = dataclasses.replace(self.info, guards=self.info.guards + guards)
        graph = AotGraph(self.key.with_variant(info.guards), self._package_bytes, info, origin=self.origin)
        graph.build_usage = self.build_usage
        return graph

    def write_package(self, path: Path) -> PackageInfo:
        Path(path).write_bytes(self._package_bytes)
        return self.info


def _package_metadata(folder: Path) -> Dict[str, str]:
    """The AOTI_* metadata torch wrote into an unpacked package (platform, machine, ISA, device)."""
    found = sorted(folder.glob("*/data/aotinductor/*/*_metadata.json"))
    found.sort(key=lambda p: not p.name.endswith("wrapper_metadata.json"))  # the one torch's loader reads
    if not found:
        raise CompileFailed("the package has no AOTInductor model metadata (not an AOTInductor package?)")
    return {str(k): str(v) for k, v in json.loads(found[0].read_text()).items()}


def index_of(device: torch.device) -> int:
    """A runner's index for calls on `device`: its GPU index; -1 for the CPU."""
    return -1 if device.type == "cpu" or device.index is None else int(device.index)


def device_index(tensors) -> int:
    """The index of the device a call's tensors are on (`base.call_device`: the first one not on the CPU)."""
    return index_of(call_device(tensors))


def _home_index(kind: str) -> int:
    """The device a graph's package is first loaded for: this process's current CUDA device for a CUDA graph (the
    index a call from there names, so its runner is found again), else -1 (the CPU)."""
    return torch.cuda.current_device() if kind_type(kind) == "cuda" else -1


_new_loader = package_loader.new_loader  # the loader for one device (package_loader.py)


def _package_kind(folder: Path) -> str:
    """The device kind an unpacked package computes on (its AOTI_DEVICE_KEY); "cpu" where it does not say."""
    try:
        return _package_metadata(folder).get("AOTI_DEVICE_KEY", "cpu") or "cpu"
    except CompileFailed:
        return "cpu"


def refuse_where_the_loader_crashes(device: str) -> None:
    """CompileFailed with the reason where torch's package loader crashed on this machine for `device`'s kind
    (loader_check.py): a graph that cannot be loaded is not traced and built (minutes) for nothing."""
    reason = loader_check.refusal(loader_check.kind_of(device))  # a family's device: "cuda-sm90"
    if reason:
        raise CompileFailed(reason)


def _load_runner(folder: Path, package_bytes: bytes, wiring: Optional[dict] = None, index: int = -1):
    """Load an unpacked package (verified bytes, in the pack's own folder) for device `index` without probing the
    CPU; a graph in parts (`wiring`) as one runner of its parts (aot_parts.py).

    torch >= 2.13 loads the unpacked folder in place; an older torch loads only
    a .pt2 file and unpacks it again into a folder of its own.
    """
    from torch._inductor.package.package import AOTICompiledModel

    kind = _package_kind(folder)
    if loader_check.applies(kind):  # loaded in a process of its own first, until one loaded on this machine
        path = folder / "graph.pt2"
        if loader_check.known(kind) is None and not path.is_file():  # a check process reads a .pt2 file
            path.write_bytes(package_bytes)
        refused = loader_check.before_load(kind, path)
        if refused:
            raise CompileFailed(refused)

    def load(model: str):
        try:
            return FlatRunner(AOTICompiledModel(_new_loader(str(folder), model, index)))
        except RuntimeError as error:
            if "zip" not in str(error).lower():
                raise
            path = folder / "graph.pt2"
            if not path.is_file():
                path.write_bytes(package_bytes)
            return FlatRunner(AOTICompiledModel(_new_loader(str(path), model, index)))

    if wiring is None:
        return load("model")
    return aot_parts.ChainedRunner(load, program_split.Wiring.from_json(wiring))


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
    if package_builds.program_device(ep) != "cpu":
        return package_builds.gpu_part_builders()
    return os.cpu_count() or 1


OPERATIONS_PER_LEAF = 2.7  # the SD1.5 UNet's program: 1312 operations from 485 leaf modules


def spares_for(module: torch.nn.Module, device: str) -> int:
    """Build processes to start ahead while `module` is traced for `device`: one, or for a GPU program the parts it
    will likely be cut into (`_part_builders`; program_split.part_count's rule, its operations guessed from the
    module's leaf modules): the parts start at once, and one that finds no spare starts its own process (9.6 s for
    the SD1.5 UNet's second part on the H200). A CPU program's parts are one per core, where spares would take
    the cores the trace uses."""
    if package_builds.host_kind(device) == "cpu":
        return 1
    leaves = sum(1 for sub in module.modules() if next(sub.children(), None) is None)
    guessed = int(leaves * OPERATIONS_PER_LEAF) // program_split.NODES_PER_PART
    return max(1, min(package_builds.gpu_part_builders(), guessed))


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
    usage = _parts_usage([build.usage for build in builds])
    return read_package(package, probe.get("march"), progress, vec, wiring.to_json())._replace(usage=usage)


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


def _build_here(ep: "torch.export.ExportedProgram", progress: Progress) -> Built:
    """The package built in this process (for the CPU level `package_configs` picks)."""
    gpu = package_builds.program_device(ep) != "cpu"
    march, configs = package_configs(gpu=gpu)
    heuristics = {}
    if gpu:
        configs.update(package_builds.gpu_program_settings(ep))
        heuristics = package_builds.gpu_program_heuristics(ep)
    try:
        cxx_linkage.apply(package_builds.cxx_link_folder())
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
            runner = _load_runner(folder, package, wiring)
            names = sorted(runner.get_constant_fqns())
        except Exception as error:
            raise CompileFailed(f"the compiled package does not load: {type(error).__name__}: "
                                f"{_first_line(error)}") from error
        del runner
    finally:
        extraction.remove(folder)
    return Built(package, names, needs, {}, wiring)


class AotBackend(Backend):
    name = "aot"
    persistent = True
    package_suffix = ".pt2"

    def unavailable_reason(self) -> Optional[str]:
        return torch_support.refusal()

    def compile(self, module, forward_fn, call: FlatCall, key: GraphKey,
                progress: Progress = no_progress) -> AotGraph:
        refuse_where_the_loader_crashes(key.family.device)
        progress("tracing with torch.export", 0.05)
        # its build processes start Python and torch while this traces
        package_builds.prestart(key.family.device, spares_for(module, key.family.device))
        traced = trace(module, forward_fn, call, key.shape_range)
        graph = self._build(traced, call, key, progress)
        if traced.widened:
            disagreement = size_one_disagreement(graph, module, traced.flat, call)
            if disagreement is not None:
                # The graph serves 2 and up right (its guards say so); 1 needs a graph of its own.
                log.info("%s: traced at 2 where %s is 1, the graph computes differently at 1 (%s); tracing it as "
                         "it is, serving 1 there only", key.family.architecture, traced.widened, disagreement)
                progress("tracing again at the call's own sizes", 0.6)
                traced = trace(module, forward_fn, call, key.shape_range, widen=False)
                graph = self._build(traced, call, key, progress)
        return self._checked_at_one(graph, traced.flat, module, call, key)

    def start_compile(self, module, forward_fn, call: FlatCall, key: GraphKey,
                      label: Optional[BuildLabel] = None) -> "AotPending":
        """Trace and build the package off this process: the trace in a fork of it where one can (it reads the
        module as it is now: forked_trace.py), else in a spawned process (spawned_trace.py: the trace travels
        pickled, so it is a partial of a module-level function), else here; the package in a child process
        (package_builds.py)."""
        refuse_where_the_loader_crashes(key.family.device)
        traced = functools.partial(trace_for_build, module, forward_fn, call, key.shape_range)
        # The CPU level is picked in the build process (Inductor's probe compiles test programs: not here).
        build = package_builds.start_traced(traced, list(call.tensors), dict(PACKAGE_CONFIG), label or UNLABELLED,
                                            probe=True)
        return AotPending(self, module, forward_fn, call, key, build)

    def _checked_at_one(self, graph: "AotGraph", flat: FlatForward, module, call: FlatCall,
                        key: GraphKey) -> "AotGraph":
        """The graph, told to serve 2 and up where its guards accept a size of 1 it computes differently.

        A graph traced from a batch of 2 accepts 1 by its guards (tracing is size-oblivious); for each
        such role the graph runs once at 1 and is compared with the model, and where they differ it gets
        a guard `>= 2` there (a call with 1 then gets a graph of its own).
        """
        extra: List[str] = []
        for role, narrowed, where in narrowed_to_one(call, leaf_bounds(call.shapes, [t.dims for t in call.signature.tensors], key.shape_range)):
            if graph.why_not(narrowed) is not None:
                continue
            disagreement = size_one_disagreement(graph, module, flat, narrowed)
            if disagreement is not None:
                log.info("%s: the graph traced at %s %s computes differently at 1 (%s); it serves 2 and up",
                         key.family.architecture, role, narrowed.shapes, disagreement)
                extra += [f"{size_ref(leaf, dim)} >= 2" for leaf, dim in where]
        return graph.restricted(extra) if extra else graph

    def _build(self, traced: Traced, call: FlatCall, key: GraphKey, progress: Progress) -> AotGraph:
        if traced.flat.out_spec is None:
            raise CompileFailed("the model's output structure was not seen while tracing")
        progress("compiling with AOTInductor", 0.3)
        return _graph(traced, call, key, build_package(traced.ep, progress,
                                                          BuildLabel(key.family.architecture, "graph", key.family.id),
                                                          parts=True))

    def finish_compile(self, pending: "AotPending", module) -> AotGraph:
        """The graph of a background build, checked as `compile` checks one (the rare second trace at 1 runs
        here, in the caller's process)."""
        built = read_built(pending.build)  # first: a failed trace raises its reason here
        traced, call, key = pending.traced(module), pending.call, pending.key
        graph = _graph(traced, call, key, built)
        if traced.widened and size_one_disagreement(graph, module, traced.flat, call) is not None:
            traced = trace(module, pending.forward_fn, call, key.shape_range, widen=False)
            graph = self._build(traced, call, key, no_progress)
        return self._checked_at_one(graph, traced.flat, module, call, key)

    def load_bytes(self, package_bytes: bytes, key: GraphKey, info: PackageInfo) -> AotGraph:
        return AotGraph(key, package_bytes, info, origin="loaded")


def _graph(traced: Traced, call: FlatCall, key: GraphKey, built: Built) -> AotGraph:
    info = PackageInfo(guards=traced.guards, out_spec=dump_out_spec(traced.flat.out_spec),
                       input_paths=call.tensor_paths, wiring=built.wiring)
    info.constant_names, info.needs = built.names, built.needs
    graph = AotGraph(key.with_variant(traced.guards), built.package, info, origin="compiled")
    graph.build_usage = with_phases(built.usage, {"export_s": round(traced.seconds, 2)})
    return graph


def with_phases(usage: dict, before: dict, after: Optional[dict] = None) -> dict:
    """A build's usage (peak memory, its process's phases) with the phases around it in order: what ran before
    the build process (the trace, a wait) and after it (taking the package in). The one shape of a compile event's
    `phase_s`, whole model or block, built in the caller or beside others."""
    return {**usage, "phase_s": {**before, **usage.get("phase_s", {}), **(after or {})}}


class AotPending(PendingGraph):
    """A graph traced (in a fork of this process, or here) whose package builds in a child process."""

    def __init__(self, backend: AotBackend, module, forward_fn, call: FlatCall, key: GraphKey,
                 build: "package_builds.PackageBuild"):
        # No module held: a build kept by the process (build_book.py) must not keep its model alive.
        self.backend, self.forward_fn, self.call, self.key = backend, forward_fn, call, key
        self.build = build

    def traced(self, module) -> Traced:
        """What the trace found (once the build finished), for `module`: its program stays with the build."""
        found = self.build.traced or {}
        flat = FlatForward(module, self.forward_fn, self.call)
        flat._seen.out_spec = load_out_spec(found.get("out_spec"))
        return Traced(None, flat, list(found.get("guards", [])), found.get("widened", ""),
                      float(found.get("export_s", 0.0)))

    @property
    def seconds(self) -> float:
        return self.build.seconds

    def done(self) -> bool:
        return self.build.done()

    def finish(self, module) -> AotGraph:
        return self.backend.finish_compile(self, module)

    def cancel(self) -> None:
        self.build.cancel()

    @property
    def stopper(self):
        return self.build.cancel

    @property
    def usage(self):
        return self.build.usage


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
