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

Here the backend and its graphs; the steps in modules of their own: aot_export.py (the trace and its guards),
aot_build.py (the package built), aot_loading.py (a package loaded for a device) and aot_parts.py (a graph in parts).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.utils._pytree as pytree

from ..store import extraction
from ..machine import machine_fit, torch_support
from ..tracing.flat_module import MODULE_PREFIX, FlatForward, dump_out_spec, load_out_spec
from ..tracing.module_snapshot import snapshot_of
from ..keys.guards import GuardSet, readable, size_ref
from ..keys.graph_keys import GraphKey
from ..keys.probes import narrowed_to_one
from ..keys.shapes import leaf_bounds
from ..keys.signature import FlatCall
from ..builds import package_builds, spares
from ..tracing import weight_inputs
from . import aot_export, aot_loading
from .aot_build import PACKAGE_CONFIG, Built, build_package, read_built, spares_for
from .aot_export import Traced
from .aot_loading import _home_index, _package_metadata, index_of, refuse_where_the_loader_crashes
from .base import (
    UNLABELLED, Backend, BuildLabel, CompileFailed, CompiledGraph, PackageInfo, PendingGraph, Progress,
    WeightsElsewhere, call_device, no_progress, weights_elsewhere,
)
from .cuda_graphs import Replays
from .borrowed_weights import bind, borrowed_views

log = logging.getLogger("keepfast")


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
            runner = aot_loading._load_runner(folder, package_bytes, info.wiring, self._home)
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
            runner = aot_loading._load_runner(self._folder, self._package_bytes, self.info.wiring, index)
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
        spares.prestart(key.family.device, spares_for(module, key.family.device))
        traced = aot_export.trace(module, forward_fn, call, key.shape_range)
        graph = self._build(traced, call, key, progress)
        if traced.widened:
            disagreement = aot_export.size_one_disagreement(graph, module, traced.flat, call)
            if disagreement is not None:
                # The graph serves 2 and up right (its guards say so); 1 needs a graph of its own.
                log.info("%s: traced at 2 where %s is 1, the graph computes differently at 1 (%s); tracing it as "
                         "it is, serving 1 there only", key.family.architecture, traced.widened, disagreement)
                progress("tracing again at the call's own sizes", 0.6)
                traced = aot_export.trace(module, forward_fn, call, key.shape_range, widen=False)
                graph = self._build(traced, call, key, progress)
        return self._checked_at_one(graph, traced.flat, module, call, key)

    def start_compile(self, module, forward_fn, call: FlatCall, key: GraphKey,
                      label: Optional[BuildLabel] = None) -> "AotPending":
        """Trace and build the package off this process: the trace in a fork of it where one can (it reads the
        module as it is now: forked_trace.py), else in a spawned process (spawned_trace.py: the trace travels
        pickled, so it is a partial of a module-level function), else here; the package in a child process
        (package_builds.py)."""
        refuse_where_the_loader_crashes(key.family.device)
        traced = functools.partial(aot_export.trace_for_build, module, forward_fn, call, key.shape_range)
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
            disagreement = aot_export.size_one_disagreement(graph, module, flat, narrowed)
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
        if traced.widened and aot_export.size_one_disagreement(graph, module, traced.flat, call) is not None:
            traced = aot_export.trace(module, pending.forward_fn, call, key.shape_range, widen=False)
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


