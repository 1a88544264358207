"""What every backend provides, so callers never care which one runs.

A backend turns (module, one example call, declared range) into a
`CompiledGraph`. A graph holds no weights of its own: `run` takes the module
whose weights it should use, which is how one graph serves every checkpoint of
an architecture and sees LoRA patches applied in place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..tracing.flat_module import ForwardFn
from ..keys.graph_keys import GraphKey
from ..keys.shapes import LeafBounds
from ..keys.signature import FlatCall

Progress = Callable[[str, float], None]  # (stage, fraction done)


def no_progress(stage: str, fraction: float) -> None:
    return None


def portable_forward(fn: ForwardFn) -> ForwardFn:
    """Mark `fn(module, ...)` as reaching the model only through the module's own
    attributes and methods.

    A backend that rebuilds the module in another framework (oneflow) can then
    run the same function on its rebuilt module; a function that calls torch
    itself, or a class's function by name, cannot be moved there and keeps such
    a backend from compiling it.
    """
    fn.keepfast_portable = True
    return fn


def is_portable_forward(fn: ForwardFn) -> bool:
    return bool(getattr(fn, "keepfast_portable", False))


class CompileFailed(Exception):
    """The backend could not build a graph; the message says why."""


class BuildInProcess(CompileFailed):
    """This graph cannot be built off the caller's process (the message says why): build it in the caller's."""


class CompileDeferred(CompileFailed):
    """The backend cannot build this graph now (not enough free memory); a later call may try again."""


class GraphMismatch(Exception):
    """Running showed this graph cannot serve the call (e.g. a torch.compile guard
    failed); the graph remembers it, and the dispatcher looks for another."""


class CannotServe(Exception):
    """A graph cannot serve this call, for a reason its backend expected and states (e.g. OneFlow
    graphs whose weight memory another live module holds): the call runs eagerly with that reason."""


class WeightsElsewhere(CannotServe, RuntimeError):
    """A tensor a graph would read by pointer is not on the device the call runs on (the message names it)."""


def call_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The device a call runs on: that of its first tensor not on the CPU (the runner `aot_loading.device_index` picks),
    else the CPU."""
    for tensor in tensors:
        if tensor.device.type != "cpu":
            return tensor.device
    return torch.device("cpu")


def weights_elsewhere(tensors: Dict[str, torch.Tensor], device: torch.device) -> Optional[str]:
    """Why these graph tensors (by graph name) cannot be bound for a call on `device`, or None: the first that is
    elsewhere. A graph reads its weights by pointer where it runs: a weight left in CPU memory (a model ComfyUI
    loaded partly, low-VRAM mode; a pipeline offloaded layer by layer) handed to a CUDA graph is read as device
    memory, which crashes or corrupts the process rather than raising."""
    from ..tracing.flat_module import MODULE_PREFIX

    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            shown = name[len(MODULE_PREFIX):] if name.startswith(MODULE_PREFIX) else name
            return (f"its tensor {shown} is on {tensor.device}, the call runs on {device} (a model loaded partly "
                    "keeps some weights in CPU memory)")
    return None


class GuardsUnknown(Exception):
    """A graph's guards cannot be checked without running it here (the message says why)."""


class BackendUnavailable(Exception):
    """The backend cannot run in this environment; the message says why."""


@dataclass
class PackageInfo:
    """What a persistent backend writes next to its package in the manifest."""

    guards: List[str] = field(default_factory=list)
    out_spec: Optional[str] = None
    constant_names: List[str] = field(default_factory=list)
    input_paths: List[str] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)
    # What the package needs of the machine that loads it (compiler/machine/machine_fit.py); empty if unknown.
    needs: Dict[str, Any] = field(default_factory=dict)
    # A graph built in parts: which values each part takes and makes (program_split.Wiring.to_json); None: whole.
    wiring: Optional[Dict[str, Any]] = None
    # A block graph that takes its weights as inputs after the call's tensors, by these names in this order
    # (backends/weight_inputs.py); empty: its weights are constants, bound before a call (`constant_names`).
    weight_inputs: List[str] = field(default_factory=list)


class CompiledGraph(ABC):
    key: GraphKey
    origin: str  # "compiled" or "loaded"

    @abstractmethod
    def why_not(self, call: FlatCall) -> Optional[str]:
        """None if this graph serves the call, else the reason it cannot."""

    @abstractmethod
    def run(self, module: torch.nn.Module, call: FlatCall, replay: bool = False) -> Any:
        """Run with `module`'s current weights; returns the output structure. `replay`: the call may be served from
        a CUDA graph of an earlier call of its shapes (backends/cuda_graphs.py; backends without them ignore it)."""

    def guard_failure(self, module: torch.nn.Module, call: FlatCall) -> Optional[str]:
        """Like why_not, for graphs whose guards need the module too; never runs the graph.

        Covering a declared range asks this at the range's corners: running a
        UNet at its largest corner (2048 px, batch 8) to learn a guard would cost
        minutes on a CPU, or all of a GPU's memory. Raises GuardsUnknown when the
        answer needs a run.
        """
        return self.why_not(call)

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def persistent(self) -> bool:
        return False

    def write_package(self, path: Path) -> PackageInfo:
        raise NotImplementedError(f"{type(self).__name__} cannot be saved")


class Backend(ABC):
    name: str = ""
    persistent: bool = False
    package_suffix: str = ""
    # A graph serves only the exact shapes it was built for (oneflow): warm up
    # declared shapes, never compile range corners, and allow more per family.
    static_shapes: bool = False
    max_graphs_per_family: int = 4

    def unavailable_reason(self) -> Optional[str]:
        return None

    def persist_unavailable_reason(self) -> Optional[str]:
        """None if this backend's graphs can be saved here, else why not."""
        return None if self.persistent else f"the {self.name} backend's graphs cannot be saved"

    @abstractmethod
    def compile(
        self,
        module: torch.nn.Module,
        forward_fn: ForwardFn,
        call: FlatCall,
        key: GraphKey,
        progress: Progress = no_progress,
    ) -> CompiledGraph:
        ...

    def load_bytes(self, package_bytes: bytes, key: GraphKey, info: PackageInfo) -> CompiledGraph:
        """Build a graph from package bytes the store has already verified."""
        raise BackendUnavailable(f"backend {self.name!r} cannot load graphs from disk")

    def start_compile(self, module: torch.nn.Module, forward_fn: ForwardFn, call: FlatCall,
                      key: GraphKey, label: "BuildLabel" = None) -> "PendingGraph":
        """Start building a graph off the caller's process (what must read the module runs now).

        BackendUnavailable where this backend builds in the caller's process only (the caller then compiles
        as `compile` does)."""
        raise BackendUnavailable(f"the {self.name} backend builds graphs in the caller's process only")


@dataclass(frozen=True)
class BuildLabel:
    """What a build is for, so the page and Graph Stats can say "block 1 of 2 (DoubleStreamBlock), 30 s left".

    `owner`: the model the graph serves, as the user knows it; `owner_id` tells two models of one name apart;
    `what`: the graph, also the kind its build time is remembered under (build_times.py); `family`: the id
    of the graph's family, which the page's badge events carry."""

    owner: str
    what: str
    family: str = ""
    owner_id: str = ""

    def _replace_what(self, what: str) -> "BuildLabel":
        return BuildLabel(self.owner, what, self.family, self.owner_id)

    @property
    def group(self) -> str:
        return self.owner_id or self.owner

    @property
    def times_key(self) -> str:
        """The kind its build time is remembered under: the graph's family (the same graph in a later process)."""
        return self.family or self.what


UNLABELLED = BuildLabel(owner="graph", what="graph")


class PendingGraph(ABC):
    """A graph being built in the background: poll `done()`, then `finish()` it, or `cancel()` it."""

    @property
    @abstractmethod
    def seconds(self) -> float:
        """Seconds since the build started (until it finished)."""

    @abstractmethod
    def done(self) -> bool:
        ...

    @abstractmethod
    def finish(self, module: torch.nn.Module) -> CompiledGraph:
        """The graph (may run it on `module` to check it); CompileFailed with the reason if the build failed."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop the build; nothing it wrote is left behind."""

    @property
    def usage(self) -> Dict[str, float]:
        """The build's peak memory in MB (`peak_rss_mb`, `compiler_peak_rss_mb`) once finished; {} if unknown."""
        return {}

    @property
    @abstractmethod
    def stopper(self) -> Callable[[], None]:
        """`cancel` without a reference to the module: what a finalizer of the model's owner may hold (holding
        the module would keep the owner alive)."""


def range_failure(shapes: Sequence[Sequence[int]], bounds: LeafBounds, paths: Sequence[str]) -> Optional[str]:
    """Check each dynamic dimension against the bounds a graph was built for."""
    for shape, leaf_bounds, path in zip(shapes, bounds, paths):
        for dim, (low, high) in leaf_bounds.items():
            size = shape[dim]
            if not low <= size <= high:
                return f"{path}.shape[{dim}] = {size} is outside the graph's range {low}-{high}"
    return None
