"""One block structure -> one weight-free AOTInductor graph over declared token ranges.

The block is exported with torch.export (batch and token dimensions dynamic
with the bounds `tokens.role_bounds` gives), packaged by AOTInductor without
its weights, and returned as the aot backend's own `AotGraph`, so the graph
store saves and loads it like any other graph; each instance's weights are
passed as inputs after the call's tensors (backends/weight_inputs.py).

Tracing uses backed sizes from a probe call whose dynamic sizes are all >= 2
and differ from each other (`tokens.probe_dims`). Export then assumes those
sizes are >= 2 (it specialises 0 and 1); with size-oblivious tracing instead
(what the whole-model path uses) a Flux block's `flatten`/`.contiguous()`
adds a "batch != 1" guard, so either way a graph would exclude batch 1 or
one text token, and the usual cure is a second graph per structure. A graph
traced at >= 2 computes the same at 1 for these blocks (the guard decides
view vs copy, not values), so the `>= 2` guards where the declared range
starts at 1 are widened to 1 after running the graph at those sizes against
the block's eager forward (`check_unit_sizes`); if they differ, they stay and
size 1 runs eager with the reason. One compile per block structure.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from ..builds import package_builds, spares
from ..tracing import weight_inputs
from ..backends.aot import AotGraph, with_phases
from ..backends.aot_build import PACKAGE_CONFIG, Built, build_package, read_built
from ..backends.aot_export import _guards_from
from ..backends.aot_loading import refuse_where_the_loader_crashes
from ..build_process.stack_traces import without_stack_traces
from ..serving.quiet import third_party_quiet
from ..backends.base import BuildLabel, CompileFailed, PackageInfo
from ..tracing.flat_module import FlatForward, dump_out_spec
from ..keys.graph_keys import GraphKey
from ..keys.signature import FlatCall
from ..tracing.subclass_weights import unwrap_subclass_weights

log = logging.getLogger("keepfast")

Bounds = List[Dict[int, Tuple[int, int]]]
Progress = Callable[[str, float], None]


def none_to_empty(output):
    """A block's output with None entries (SD3's last block returns no text stream) as empty tuples.

    Graph outputs are tensors; an empty tuple has no leaves, so the graph's
    output structure keeps the place and `empty_to_none` restores it.
    """
    if isinstance(output, (tuple, list)):
        return type(output)(() if item is None else none_to_empty(item) for item in output)
    return output


def empty_to_none(output):
    if isinstance(output, (tuple, list)):
        return type(output)(None if isinstance(item, tuple) and not item else empty_to_none(item) for item in output)
    return output


def _own_forward(module: torch.nn.Module, *args, **kwargs):
    return type(module).forward(module, *args, **kwargs)


def _as_it_is(module: torch.nn.Module) -> ContextManager:
    """The default `tracing`: the block traced as it is (module-level, so a trace can be pickled)."""
    return contextlib.nullcontext()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__


@contextlib.contextmanager
def _trace_settings():
    """Keep equal-sized dims apart (no duck shapes); sizes are backed by the probe's."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(use_duck_shape=False, backed_size_oblivious=False), without_stack_traces():
        yield


UnitCheck = Callable[[AotGraph, Dict[str, Tuple[int, int]]], Optional[str]]


@dataclass
class TracedBlock:
    """A block traced by torch.export, before AOTInductor: what packaging it needs."""

    program: Any  # torch.export.ExportedProgram
    guards: List[str]
    out_spec: str
    call: FlatCall
    bounds: Bounds
    key: GraphKey
    weight_inputs: List[str] = field(default_factory=list)  # the weights the graph takes after the call's tensors


def trace_block(module: torch.nn.Module, call: FlatCall, bounds: Bounds, key: GraphKey,
                forward: Callable = _own_forward,
                tracing: Callable[[torch.nn.Module], ContextManager] = _as_it_is
                ) -> TracedBlock:
    """Export one block over its bounds (in the caller's process: it reads the module); CompileFailed says why not.

    `tracing(module)` is entered around torch.export only (the family's stored-weight forms, quantised.py):
    checks that run the block eagerly afterwards see it as ComfyUI left it.
    """
    from torch.export import Dim

    def traced(block, *args, **kwargs):
        return none_to_empty(forward(block, *args, **kwargs))

    flat = FlatForward(module, traced, call)
    dynamic = [{d: Dim.AUTO(min=lo, max=hi) for d, (lo, hi) in b.items()} for b in bounds]
    try:
        with _trace_settings(), torch.no_grad(), tracing(module):
            program = unwrap_subclass_weights(
                torch.export.export(flat, (list(call.tensors),), dynamic_shapes=(dynamic,), strict=False))
    except Exception as error:  # export failures are many and varied
        raise CompileFailed(f"torch.export failed: {type(error).__name__}: {_first_line(error)}") from error
    if flat.out_spec is None:
        raise CompileFailed("the block's output structure was not seen while tracing")
    try:
        inline_code_constants(program)
    except Exception as error:  # the package would then ask for them as weights: say so here
        raise CompileFailed(f"the tensors the block's code creates cannot be built into the graph: "
                            f"{type(error).__name__}: {_first_line(error)}") from error
    try:
        guards = _guards_from(program, call)
    except CompileFailed:
        raise
    except Exception as error:
        raise CompileFailed(f"the graph's shape guards cannot be written down: {_first_line(error)}") from error
    out_spec = dump_out_spec(flat.out_spec)
    if out_spec is None:
        raise CompileFailed("the block's output structure cannot be saved")
    try:  # after the guards: they read the call's own inputs
        program, names = weight_inputs.lift_weights(program)
    except weight_inputs.CannotLift as why:
        log.info("%s: weights kept as constants, bound per call: %s", key.family.architecture, why)
        names = []
    return TracedBlock(program, guards, out_spec, call, bounds, key, names)


def package_block(traced: TracedBlock, built: Built,
                  progress: Progress = lambda stage, fraction: None,
                  check_unit_sizes: Optional["UnitCheck"] = None) -> Tuple[AotGraph, List[str]]:
    """The graph of a traced block from its built package (`build_package` here, or a background build)."""
    package, names, needs = built.package, built.names, built.needs
    call, key, guards = traced.call, traced.key, traced.guards

    def build(guard_list: List[str]) -> AotGraph:
        info = PackageInfo(guards=list(guard_list), out_spec=traced.out_spec, input_paths=call.tensor_paths,
                           constant_names=names, needs=needs, weight_inputs=list(traced.weight_inputs))
        return AotGraph(key.with_variant(guard_list), package, info, origin="compiled")

    try:
        graph = build(guards)
    except CompileFailed:
        raise
    except Exception as error:  # e.g. a guard form the guard checker does not read
        raise CompileFailed(f"the graph's shape guards cannot be checked: {type(error).__name__}: "
                            f"{_first_line(error)}") from error
    notes: List[str] = []
    units = unit_guards(graph, traced.bounds)
    if units and check_unit_sizes is not None:
        progress("checking sizes of 1 against eager", 0.95)
        candidate = build([g.replace(" >= 2", " >= 1") if g in units else g for g in guards])
        problem = check_unit_sizes(candidate, units)
        if problem is None:
            graph = candidate
        else:
            notes.append(f"sizes of 1 run eager: {problem}")
    return graph, notes


def export_block(module: torch.nn.Module, call: FlatCall, bounds: Bounds, key: GraphKey,
                 progress: Progress = lambda stage, fraction: None,
                 check_unit_sizes: Optional["UnitCheck"] = None,
                 forward: Callable = _own_forward,
                 tracing: Callable[[torch.nn.Module], ContextManager] = _as_it_is
                 ) -> Tuple[AotGraph, List[str]]:
    """Export and package one block: (graph, notes); CompileFailed says why not.

    `check_unit_sizes(candidate, guards)` is asked whether the graph also
    serves sizes of 1 the range declares (see `unit_guards`); the candidate
    has those guards widened to 1. None means yes and the candidate is
    returned; a reason keeps the traced guards (size 1 then runs eager) and
    becomes a note. `forward(module, *args, **kwargs)` is what is traced
    (the family's `block_forward`), with `tracing(module)` entered around the trace.
    """
    refuse_where_the_loader_crashes(key.family.device)
    progress("tracing with torch.export", 0.05)
    spares.prestart(key.family.device)  # its build process starts Python and torch while this traces
    marks = [time.perf_counter()]
    traced = trace_block(module, call, bounds, key, forward, tracing)
    marks.append(time.perf_counter())
    progress("compiling with AOTInductor", 0.3)
    with third_party_quiet():
        built = build_package(traced.program, progress, BuildLabel(key.family.architecture, "block", key.family.id))
    marks.append(time.perf_counter())
    graph, notes = package_block(traced, built, progress, check_unit_sizes)
    marks.append(time.perf_counter())
    # the build's memory and phases for the compile event (as a whole model's graph carries them, aot._graph):
    # the trace here, the build process's wait and phases, and taking the package in (its load, sizes of 1 checked)
    export_s, build_wait_s, take_in_s = (round(b - a, 2) for a, b in zip(marks, marks[1:]))
    graph.build_usage = with_phases(built.usage, {"export_s": export_s, "build_wait_s": build_wait_s},
                                    {"take_in_s": take_in_s})
    return graph, notes


def block_for_build(module: torch.nn.Module, call: FlatCall, bounds: Bounds, key: GraphKey, forward: Callable,
                    tracing: Callable[[torch.nn.Module], ContextManager]) -> Tuple[Any, dict]:
    """`trace_block` as a background build's trace process runs it: (program, the JSON-able rest, the trace's
    seconds among it)."""
    started = time.perf_counter()
    block = trace_block(module, call, bounds, key, forward, tracing)
    return block.program, {"guards": block.guards, "out_spec": block.out_spec, "weight_inputs": block.weight_inputs,
                           "export_s": round(time.perf_counter() - started, 2)}


class BlockBuild:
    """A block traced (in a fork of this process, a spawned process, or here: backends/forked_trace.py,
    backends/spawned_trace.py) whose package builds in a child process (builds/package_builds.py). Traced
    here, the trace's CompileFailed is raised now."""

    def __init__(self, module: torch.nn.Module, call: FlatCall, bounds: Bounds, key: GraphKey, label: BuildLabel,
                 forward: Callable = _own_forward,
                 tracing: Callable[[torch.nn.Module], ContextManager] = _as_it_is, beside: int = 1):
        self.call, self.bounds, self.key = call, bounds, key
        self.beside = beside  # the block structures built at once with this one, it included
        refuse_where_the_loader_crashes(key.family.device)
        traced = functools.partial(block_for_build, module, call, bounds, key, forward, tracing)
        # The CPU level is picked in the build process (Inductor's probe compiles test programs: not here).
        self.build = package_builds.start_traced(traced, list(call.tensors), dict(PACKAGE_CONFIG), label, probe=True,
                                                 beside=beside, waited=self.together)

    @property
    def traced(self) -> TracedBlock:
        """What the trace found (once the build finished): its program stays with the build."""
        found = self.build.traced or {}
        return TracedBlock(None, list(found.get("guards", [])), found.get("out_spec", ""), self.call, self.bounds,
                           self.key, list(found.get("weight_inputs", [])))

    @property
    def together(self) -> bool:
        """Started beside the other block structures by a prepare that waits for them all (not in the background)."""
        return self.beside > 1

    @property
    def seconds(self) -> float:
        return self.build.seconds

    def done(self) -> bool:
        return self.build.done()

    def wait(self) -> None:
        self.build.wait()

    def package(self) -> Built:
        """The built package; CompileFailed with the build's reason."""
        return read_built(self.build)

    def cancel(self) -> None:
        self.build.cancel()

    def usage(self, take_in_s: float) -> dict:
        """The build's memory and phases for its compile event, as `export_block` gives a block built in the caller
        its own: the trace (in its process), the time from the build's start to its build process's start (the
        trace process starting, the trace, a wait for a free slot), the build process's phases, and `take_in_s`
        (the package loaded here and its sizes of 1 checked)."""
        build = self.build
        found = build.traced or {}
        phases = {"export_s": float(found.get("export_s", 0.0))}
        if build.launched is not None:
            phases["to_build_start_s"] = round(build.launched - build.started, 2)
        return with_phases(build.usage, phases, {"take_in_s": take_in_s})


# -- tensors the block's code creates ---------------------------------------------------

CODE_CONSTANT_LIMIT = 256  # elements; larger tensors made by code stay constants (and fail to bind, with the name)


def inline_code_constants(program: Any) -> int:
    """Tensors the traced code made (`torch.tensor([0, 4])` in ComfyUI-GGUF's dequantisation), rebuilt by ops.

    torch.export lifts such tensors as constants beside the weights; packages
    leave every constant out (weights are bound per call), so the graph would
    ask for them at bind time under a name no module has (measured: "the block
    has no tensor _tensor_constant0"). They are code, not a checkpoint's
    values, so each small one becomes `arange` (an arithmetic progression) or
    a `cat` of `full`s, reshaped. Returns how many were rebuilt.
    """
    from torch.export.graph_signature import InputKind

    graph = program.graph_module.graph
    specs = program.graph_signature.input_specs
    placeholders = {node.name: node for node in graph.nodes if node.op == "placeholder"}
    first_op = next((node for node in graph.nodes if node.op != "placeholder"), None)
    kept, rebuilt = [], 0
    for spec in specs:
        value = program.constants.get(spec.target) if spec.kind == InputKind.CONSTANT_TENSOR else None
        if (value is None or not isinstance(value, torch.Tensor) or value.numel() > CODE_CONSTANT_LIMIT
                or value.numel() == 0 or value.is_complex() or first_op is None):
            kept.append(spec)
            continue
        node = placeholders[spec.arg.name]
        with graph.inserting_before(first_op):
            made = _ops_making(graph, value, getattr(node.meta.get("val"), "fake_mode", None))
        made.meta.update(node.meta)
        node.replace_all_uses_with(made)
        graph.erase_node(node)
        del program.constants[spec.target]
        rebuilt += 1
    if rebuilt:
        specs[:] = kept
        graph.lint()
        program.graph_module.recompile()
    return rebuilt


def _ops_making(graph: Any, value: torch.Tensor, fake_mode: Any = None) -> Any:
    """FX nodes computing `value` from Python numbers only, each with the value it makes (`val`, a fake tensor
    of the program's fake mode: what saving the program to a build process checks)."""
    aten = torch.ops.aten
    flat = value.detach().cpu().reshape(-1)
    items = flat.tolist()
    options = {"dtype": value.dtype, "device": value.device}

    def op(target, args, kwargs=None):
        node = graph.call_function(target, args, kwargs or {})
        if fake_mode is not None:
            fake_args = torch.fx.node.map_aggregate(args, lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a)
            with fake_mode:
                node.meta["val"] = target(*fake_args, **(kwargs or {}))
        return node

    steps = {b - a for a, b in zip(items, items[1:])}
    if len(items) > 1 and len(steps) == 1 and not value.is_floating_point() and value.dtype != torch.bool \
            and next(iter(steps)) != 0:
        step = next(iter(steps))
        node = op(aten.arange.start_step, (items[0], items[0] + step * len(items), step), options)
    else:
        parts = [op(aten.full.default, ([1], item), options) for item in items]
        node = parts[0] if len(parts) == 1 else op(aten.cat.default, (parts,))
    if tuple(value.shape) != (len(items),):
        node = op(aten.view.default, (node, list(value.shape)))
    return node


# -- sizes of 1 -------------------------------------------------------------------

def unit_guards(graph: AotGraph, bounds: Bounds) -> Dict[str, Tuple[int, int]]:
    """Range guards `size >= 2` that export added where the declared range starts at 1.

    Traced with backed sizes, export assumes every dynamic size is >= 2 (0 and
    1 are specialised); the code it generates does not depend on that for the
    shapes a block sees, which `widen_to_one` checks by running before it trusts it.
    Returns guard text -> (input index, dim).
    """
    from ..keys.guards import size_ref

    out = {}
    for leaf, dims in enumerate(bounds):
        for dim, (low, _high) in dims.items():
            text = f"{size_ref(leaf, dim)} >= 2"
            if low <= 1 and text in graph.info.guards:
                out[text] = (leaf, dim)
    return out
