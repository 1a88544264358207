"""`oneflow`: the torch module rebuilt in OneFlow, one static `oneflow.nn.Graph` per call shape.

- The module is rebuilt from a OneFlow copy of its package (imported under
  `oneflow.mock_torch`, kept out of `sys.modules`; see oneflow_support.isolation):
  diffusers built in, other packages through registered converters (the
  ComfyUI nodes register one for ComfyUI's classes). The graph calls the
  module itself, or the caller's forward function where it is portable
  (backends.base.portable_forward). Its parameters and buffers are the torch
  tensors' memory (DLPack, zero copy; oneflow_support.weights). All graphs of one model -- every shape,
  every input structure -- are built on that one OneFlow module and so read
  the same weights; an in-place change to the torch weights reaches them all.
- OneFlow 0.9.0 graphs have static shapes: a graph serves exactly the shapes,
  dtypes and devices it was built for and `why_not` refuses any other call
  with the reason, so the dispatcher builds another graph for it (bounded per
  family, see `max_graphs_per_family`). Warming up the declared resolutions
  and batch sizes (`CompiledForward.warmup`, `declared_calls`) makes later
  calls hits.
- Each build is checked once against torch eager on the building call; a
  graph whose output differs beyond `TOLERANCE` is not used.
- OneFlow runs asynchronously: `run` syncs before returning, so the output is
  final and torch may write the shared weights as soon as it returns.
- Persisting needs `nn.Graph.runtime_state_dict` (OneFlow newer than 0.9.0);
  without it `persistent` is False and `persist_unavailable_reason()` says so.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from ..tracing.flat_module import CallTemplate, dump_out_spec, load_out_spec
from ..keys.guards import GuardSet, readable, size_ref
from ..keys.graph_keys import GraphKey
from ..keys.probes import reshape_call
from ..keys.signature import FlatCall
from .base import (
    Backend, BackendUnavailable, CompileDeferred, CompiledGraph, CompileFailed, PackageInfo, Progress,
    is_portable_forward, no_progress,
)
from .oneflow_support import oneflow_unavailable_reason, persist_unavailable_reason
from .oneflow_support.availability import runtime_state_supported

log = logging.getLogger("keepfast")

# Largest |graph - torch eager| accepted when a graph is built, relative to max(1, max |eager|).
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _first_line(error: BaseException) -> str:
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip().splitlines()
    text = [line.strip() for line in text if line.strip()]
    return (text[0] if text else type(error).__name__)[:300]


# OneFlow 0.9.0 leaves its plan compiler in a broken state when building a plan fails (e.g. no kernel
# for a dtype): the next graph compile in the process aborts it ("Check failed: Get() == nullptr" in
# oneflow::Compiler::Compile). Tracing failures are harmless. After a plan failure no more graphs are
# compiled in this process; graphs already built keep running.
_PLAN_FAILURE: Optional[str] = None


def _compile_nn_graph(nn_graph, inputs: list) -> None:
    """Trace (with OneFlow's diffusers in sys.modules), then compile the plan, guarding the process."""
    global _PLAN_FAILURE
    from .oneflow_support import isolation

    if _PLAN_FAILURE:
        raise BackendUnavailable(_PLAN_FAILURE)
    with isolation.active():  # tracing runs the OneFlow copy's Python code
        nn_graph.build_graph(*inputs)
    try:
        nn_graph.finish_complie_and_init_runtime()
    except Exception as error:
        _PLAN_FAILURE = (
            f"an earlier OneFlow graph failed in OneFlow's plan compiler ({_first_line(error)}); OneFlow 0.9.0 "
            "aborts the process on the next graph compile after that, so no more OneFlow graphs are compiled "
            "in this process (restart it to compile again; graphs already built keep running)"
        )
        log.error("oneflow backend: %s", _PLAN_FAILURE)
        raise


def _flow_forward(module: torch.nn.Module, forward_fn) -> Optional[Any]:
    """What the graph calls on the OneFlow module: None for its own forward (`module(...)`), else
    `forward_fn` itself, which must be portable (reach the model through its methods only)."""
    if forward_fn is getattr(type(module), "forward", None):
        return None
    if is_portable_forward(forward_fn):
        return forward_fn
    raise CompileFailed(
        f"the oneflow backend runs {type(module).__name__}'s OneFlow copy; the forward function "
        f"{getattr(forward_fn, '__qualname__', forward_fn)!r} is not marked portable (compiler.backends.base."
        "portable_forward), so it may call torch directly and cannot run there"
    )


class _Output:
    """How to rebuild the torch output structure around the graph's tensors."""

    def __init__(self, spec, leaves: Sequence[Any]):
        self.spec = spec
        self.positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.constants)
        for position, tensor in zip(self.positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.spec)


class OneflowGraph(CompiledGraph):
    """One nn.Graph: one call structure at one static set of shapes, dtypes and devices."""

    def __init__(self, key: GraphKey, binding, call: FlatCall, origin: str = "compiled"):
        self.key = key
        self.origin = origin
        self.binding = binding
        self.paths = list(call.tensor_paths)
        self.metas = [(tuple(t.shape), t.dtype, t.device) for t in call.tensors]
        self.bool_inputs = [i for i, t in enumerate(call.tensors) if t.dtype == torch.bool]
        self.template = CallTemplate(call)
        self.output: Optional[_Output] = None
        self.nn_graph = None
        self.ready = False
        self.runs = 0
        self.build_seconds = 0.0
        self.eager_seconds = 0.0
        self.max_abs_diff: Optional[float] = None
        self.measured_bytes = 0  # memory the build took (process RSS on the CPU, device memory on CUDA)
        self.last_note = ""

    @property
    def nbytes(self) -> int:
        return self.measured_bytes

    # -- serving ----------------------------------------------------------------
    def why_not(self, call: FlatCall) -> Optional[str]:
        tensors = call.tensors
        if len(tensors) != len(self.metas):
            return f"the call has {len(tensors)} tensor inputs, this OneFlow graph takes {len(self.metas)}"
        for path, tensor, (shape, dtype, device) in zip(call.tensor_paths, tensors, self.metas):
            if tuple(tensor.shape) != shape:
                return (f"{path} has shape {list(tensor.shape)}, this OneFlow graph was built for {list(shape)} "
                        "(OneFlow graphs have static shapes: each shape gets its own graph)")
            if tensor.dtype != dtype:
                return f"{path} is {tensor.dtype}, this OneFlow graph was built for {dtype}"
            if tensor.device != device:
                return f"{path} is on {tensor.device}, this OneFlow graph was built for {device}"
        return None

    def _inputs(self, call: FlatCall) -> list:
        from .oneflow_support.weights import to_flow

        flat = []
        for tensor in call.tensors:
            if tensor.dtype == torch.bool:
                tensor = tensor.to(torch.uint8)
            flat.append(to_flow(tensor.detach().contiguous()))
        return flat

    def _execute(self, module: torch.nn.Module, call: FlatCall) -> List[torch.Tensor]:
        """Bind `module`'s weights, run the graph (compiling it on the first call), wait for it;
        the outputs as torch tensors."""
        from .oneflow_support.weights import sync, to_torch

        binding = self.binding
        with binding.lock:
            copies = binding.copies
            binding.bind(module)
            if binding.copies != copies:
                self.last_note = binding.notes[-1]
            inputs = self._inputs(call)
            cuda = [t.device for t in call.tensors if t.is_cuda]
            if cuda:
                torch.cuda.synchronize(cuda[0])  # torch's kernels producing the inputs run on torch's stream
            if not self.nn_graph._is_compiled:
                _compile_nn_graph(self.nn_graph, inputs)
            outputs = self.nn_graph(*inputs)
            sync()
            return [to_torch(o) for o in outputs]

    def run(self, module: torch.nn.Module, call: FlatCall, replay: bool = False) -> Any:
        if self.nn_graph is None or self.output is None:
            raise RuntimeError("this OneFlow graph was not built")
        outputs = self._execute(module, call)
        self.runs += 1
        return self.output.rebuild(outputs)

    # -- persisting (OneFlow with runtime_state_dict only; not testable with 0.9.0) ----------------
    @property
    def persistent(self) -> bool:
        """Savable only where OneFlow serialises graphs and the output is tensors only."""
        return (runtime_state_supported() and self.output is not None
                and len(self.output.positions) == len(self.output.constants)
                and dump_out_spec(self.output.spec) is not None)

    def package_info(self) -> PackageInfo:
        guards = [f"{size_ref(leaf, dim)} == {size}" for leaf, (shape, _, _) in enumerate(self.metas)
                  for dim, size in enumerate(shape)]
        return PackageInfo(guards=guards, out_spec=dump_out_spec(self.output.spec) if self.output else None,
                           constant_names=list(self.binding.names), input_paths=list(self.paths))

    def write_package(self, path: Path) -> PackageInfo:
        reason = persist_unavailable_reason()
        if reason:
            raise NotImplementedError(reason)
        import oneflow

        state = self.nn_graph.runtime_state_dict()
        with tempfile.TemporaryDirectory(prefix="keepfast-oneflow-") as folder:
            oneflow.save(state, os.path.join(folder, "graph"))
            with tarfile.open(path, "w") as archive:
                archive.add(os.path.join(folder, "graph"), arcname="graph")
        return self.package_info()


class LoadedOneflowGraph(OneflowGraph):
    """A graph from a package (OneFlow with load_runtime_state_dict only; untested with 0.9.0).

    The OneFlow module is built and the compiled state loaded on the first
    run, when the torch module whose weights it shares is known.
    """

    def __init__(self, backend: "OneflowBackend", key: GraphKey, package: bytes, info: PackageInfo):
        self.key = key
        self.origin = "loaded"
        self.binding = None
        self.paths = list(info.input_paths)
        self.metas = []
        self.bool_inputs = []
        self.template = None
        self.output = None
        self.nn_graph = None
        self.ready = False
        self.runs = 0
        self.build_seconds = 0.0
        self.eager_seconds = 0.0
        self.max_abs_diff = None
        self.last_note = ""
        self._backend = backend
        self._package = package
        self._info = info
        self._guards = GuardSet(info.guards)
        spec = load_out_spec(info.out_spec)
        if spec is None:
            raise CompileFailed("the graph's output structure is unknown (it could not be serialised)")
        self._spec = spec
        self._lock = threading.Lock()

    def why_not(self, call: FlatCall) -> Optional[str]:
        if self.metas:
            return super().why_not(call)
        failed = self._guards.first_failure(call.shapes)
        return None if failed is None else "shape guard " + readable(failed, call.tensor_paths) + " does not hold"

    def run(self, module: torch.nn.Module, call: FlatCall, replay: bool = False) -> Any:
        with self._lock:
            if self.nn_graph is None:
                self._restore(module, call)
        return super().run(module, call)

    def _restore(self, module: torch.nn.Module, call: FlatCall) -> None:
        import oneflow
        from .oneflow_support.graph import CallGraph

        self.binding = self._backend.binding_for(module, self.key)
        self.metas = [(tuple(t.shape), t.dtype, t.device) for t in call.tensors]
        self.bool_inputs = [i for i, t in enumerate(call.tensors) if t.dtype == torch.bool]
        self.template = CallTemplate(call)
        graph = CallGraph(self.binding.flow_module, self.template, self.bool_inputs)
        with tempfile.TemporaryDirectory(prefix="keepfast-oneflow-") as folder:
            with tarfile.open(fileobj=io.BytesIO(self._package)) as archive:
                archive.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
            state = oneflow.load(os.path.join(folder, "graph"))
        graph.load_runtime_state_dict(state)
        self.output = _Output(self._spec, [torch.empty(0)] * self._spec.num_leaves)
        self.nn_graph = graph
        self.ready = True

    def write_package(self, path: Path) -> PackageInfo:
        Path(path).write_bytes(self._package)
        return self._info


class OneflowBackend(Backend):
    name = "oneflow"
    persistent = False  # set per instance: True only where nn.Graph.runtime_state_dict exists
    package_suffix = ".oneflow"
    # Static shapes: one graph per (batch, resolution, sequence length) of a family. The dispatcher's
    # default bound (4) is too low for a resolution x batch sweep; it should read this attribute.
    max_graphs_per_family = 8
    # A graph serves only the shapes it was built for: covering a declared range by compiling its
    # corners builds graphs for those corners alone (at 256x256 latents, large ones). The dispatcher
    # should skip range covering for this backend; warm up the declared shapes instead.
    static_shapes = True
    verify_against_eager = True

    def __init__(self):
        self._bindings: List["weakref.ref"] = []
        self._lock = threading.Lock()
        self._footprints: dict = {}  # (family id, device) -> [(largest input's elements, bytes)]
        reason = oneflow_unavailable_reason()
        self.persistent = reason is None and runtime_state_supported()

    def unavailable_reason(self) -> Optional[str]:
        return oneflow_unavailable_reason() or _PLAN_FAILURE

    def persist_unavailable_reason(self) -> Optional[str]:
        return persist_unavailable_reason()

    # -- models -------------------------------------------------------------------
    def binding_for(self, module: torch.nn.Module, key: GraphKey):
        """The OneFlow module all graphs of this model share; built on first use."""
        from .oneflow_support.convert import ConversionError, build_flow_module
        from .oneflow_support.weights import WeightBinding, WeightsUnavailable

        family = key.family
        device = next((str(t.device) for t in module.parameters()), "cpu")
        group = (family.architecture, family.structure, family.dtype, device)
        with self._lock:
            alive = [b for b in (ref() for ref in self._bindings) if b is not None]
            self._bindings = [weakref.ref(b) for b in alive]
            candidates = [b for b in alive if b.group == group]
        for binding in candidates:  # one that reads this module's memory, else one whose memory is free
            if binding.shares_with(module):
                return binding
        for binding in candidates:
            if binding.available_to(module):
                with binding.lock:
                    binding.bind(module)
                return binding
        try:
            flow_module = build_flow_module(module)
            binding = WeightBinding(flow_module, module, group)
        except (ConversionError, WeightsUnavailable) as error:
            raise CompileFailed(str(error)) from None
        except Exception as error:
            raise CompileFailed(f"building the OneFlow module failed: {type(error).__name__}: {_first_line(error)}") from error
        with self._lock:
            self._bindings.append(weakref.ref(binding))
        return binding

    # -- compiling ----------------------------------------------------------------
    def check_supported(self, module: torch.nn.Module, call: FlatCall) -> None:
        """Refuse, before OneFlow sees it, what OneFlow 0.9.0 is known not to run.

        float16 on the CPU fails in OneFlow's plan compiler, which then aborts
        the process on the next compile (see _PLAN_FAILURE).
        """
        first = list(module.parameters())[:1]
        half = {t.dtype for t in list(call.tensors) + first if t.dtype in (torch.float16, torch.bfloat16)}
        on_cpu = any(t.device.type == "cpu" for t in list(call.tensors) + first)
        if half and on_cpu:
            raise CompileFailed(
                f"OneFlow 0.9.0 has no CPU kernels for {', '.join(sorted(str(d) for d in half))} (conv2d, "
                "group_norm); on the CPU the oneflow backend runs float32 models only"
            )

    def compile(self, module, forward_fn, call: FlatCall, key: GraphKey,
                progress: Progress = no_progress) -> OneflowGraph:
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailable(reason)
        self.check_supported(module, call)
        flow_forward = _flow_forward(module, forward_fn)
        from .oneflow_support import memory
        from .oneflow_support.graph import CallGraph

        device = call.tensors[0].device if call.tensors else torch.device("cpu")
        footprint_key = (key.family.id, str(device))  # one model, one input structure (VAE decode != encode)
        elements = max((t.numel() for t in call.tensors), default=0)
        short = memory.shortfall(self._footprints.get(footprint_key, []), elements, device)
        if short:
            raise CompileDeferred(short)

        started = time.perf_counter()
        progress("building the OneFlow module (shared weights)", 0.05)
        binding = self.binding_for(module, key)
        variant = {"shapes": [list(s) for s in call.shapes], "dtypes": [str(t.dtype) for t in call.tensors],
                   "devices": [str(t.device) for t in call.tensors]}
        graph = OneflowGraph(key.with_variant(variant), binding, call)
        graph.nn_graph = CallGraph(binding.flow_module, graph.template, graph.bool_inputs, flow_forward)
        convert_seconds = time.perf_counter() - started

        progress("compiling the OneFlow graph", 0.2)
        started = time.perf_counter()
        used_before = memory.used_bytes(device)
        try:
            outputs = graph._execute(module, call)
        except CompileFailed:
            raise
        except Exception as error:
            raise CompileFailed(f"OneFlow graph compile failed: {type(error).__name__}: {_first_line(error)}") from error
        graph.build_seconds = time.perf_counter() - started
        used_after = memory.used_bytes(device)
        if used_before is not None and used_after is not None:
            graph.measured_bytes = max(0, used_after - used_before)
            self._footprints.setdefault(footprint_key, []).append((elements, graph.measured_bytes))

        progress("checking the graph against torch eager", 0.9)
        started = time.perf_counter()
        args, kwargs = call.rebuild(call.tensors)
        with torch.no_grad():
            reference = forward_fn(module, *args, **kwargs)
        graph.eager_seconds = time.perf_counter() - started
        leaves, spec = pytree.tree_flatten(reference)
        expected = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if len(expected) != len(outputs):
            raise CompileFailed(f"the OneFlow model returned {len(outputs)} tensors, torch returned {len(expected)}")
        diff = 0.0
        for index, (got, want) in enumerate(zip(outputs, expected)):
            if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
                raise CompileFailed(
                    f"output {index}: OneFlow gives {got.dtype} {list(got.shape)}, torch {want.dtype} {list(want.shape)}"
                )
            if got.is_floating_point() and self.verify_against_eager:
                scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
                error = float((got.float() - want.float()).abs().max()) / scale if want.numel() else 0.0
                diff = max(diff, error)
                tolerance = TOLERANCE.get(want.dtype, 5e-2)
                if not error <= tolerance:
                    raise CompileFailed(
                        f"the OneFlow graph's output {index} differs from torch eager by {error:.3g} "
                        f"(relative to max(1, max|eager|); tolerance {tolerance:g}); not used"
                    )
        graph.max_abs_diff = diff
        graph.output = _Output(spec, leaves)
        graph.ready = True
        log.info("oneflow graph %s: module %.2fs, compile+first run %.2fs, eager check %.2fs, diff %.2g",
                 graph.key.id, convert_seconds, graph.build_seconds, graph.eager_seconds, diff)
        return graph

    def load_bytes(self, package_bytes: bytes, key: GraphKey, info: PackageInfo) -> OneflowGraph:
        reason = persist_unavailable_reason()
        if reason:
            raise BackendUnavailable(reason)
        return LoadedOneflowGraph(self, key, package_bytes, info)


def declared_calls(args: tuple, kwargs: dict, batch_sizes: Iterable[int],
                   latent_sizes: Iterable[Tuple[int, int]], seed: int = 0) -> List[Tuple[tuple, dict]]:
    """Example calls at every declared batch size and latent (height, width), for warmup.

    `CompiledForward.warmup(declared_calls(...))` builds a graph for each, so
    later calls at those sizes are hits. Tensors whose shape does not change
    (a scalar timestep) are kept; reshaped floating tensors are random (each
    build is checked against eager on them), others zeros.
    """
    call = FlatCall(args, kwargs)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for batch in batch_sizes:
        for height, width in latent_sizes:
            probe = reshape_call(call, batch, height, width)
            if probe is None:
                raise ValueError(f"cannot reshape the example call to batch {batch}, latent {height}x{width}")
            tensors = []
            for original, shaped in zip(call.tensors, probe.tensors):
                if shaped.shape == original.shape:
                    tensors.append(original)
                elif shaped.is_floating_point():
                    tensors.append(torch.randn(shaped.shape, generator=generator, dtype=shaped.dtype)
                                   .to(shaped.device))
                else:
                    tensors.append(shaped)
            out.append(probe.rebuild(tensors))
    return out
