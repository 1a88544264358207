"""The block engine: a transformer served block by block from graphs compiled once per block structure.

How an adapter (diffusers here, ComfyUI's nodes later) uses it:

    engine = BlockEngine(model, family, BlockOptions(shape_range=..., store=...), registry)
    engine.install_blocks()      # every block's forward now goes through the engine
    engine.prepare(progress)     # probes, then find / load / compile one graph per block structure
    model(...)                   # blocks run compiled, glue eager; anything a graph cannot serve runs eager
    engine.report()              # blocks compiled, per structure: graph or eager with the reason
    engine.save(store)           # graphs into a graphs folder (works before any image)

`install()` also routes the model's own forward through the engine, so the
first call prepares (what diffusers' compile_pipe uses). An adapter whose
model is shared with callers that did not ask for graphs (ComfyUI: one
module behind every clone of a MODEL) makes the engine `scoped`: its blocks
then serve from graphs only inside `serving()`, which the adapter's own hook
opens, and run their own forward everywhere else. `eager_scope()`
runs the blocks uncompiled (the reference path; an adapter's own eager
path), and `block_filter` lets an adapter send single blocks to eager with a
reason (a patch on block 6 makes block 6 eager, not the model).

Preparing runs the model twice, eagerly, at two small sizes inside the
declared range (`tokens.probe_dims`), recording the inputs of the first
instance of each block structure; comparing the two names each input
dimension (batch, image tokens, text tokens, both joined), which gives the
dynamic dimensions and their bounds for export and the block graph's key.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..backends import DEFAULT_BACKEND
from ..store.registry import FALLBACK, PROGRESS, GraphRegistry, default_registry
from ..keys.shapes import DEFAULT_RANGE, ShapeRange
from ..store.graph_store import GraphStore
from ..keys.structure import architecture_name, structure_hash
from . import tokens as T
from .export import export_block
from .family import BlockFamily
from .finder import find_blocks
from .server import BlockInstance, BlockServer

log = logging.getLogger("keepfast")

Progress = Callable[[str, float], None]
BlockFilter = Callable[[BlockInstance, tuple, dict], Optional[str]]


@dataclass
class BlockOptions:
    backend: str = DEFAULT_BACKEND
    shape_range: ShapeRange = DEFAULT_RANGE  # latent pixels, text tokens, batch, latent frames
    store: Optional[GraphStore] = None
    autosave: bool = False
    compile_on_miss: bool = True
    label: str = ""
    # The first-use check: a graph's first call with new input shapes is compared with eager (compiler/serving/verify.py).
    verify: bool = True
    # Block graphs build in child processes while the blocks run eager (docs/background.md); save, load
    # and warmup still wait for them.
    background: bool = False
    # What widens the range, per role ("tokens", "batch", ...), said where a call falls outside it; the
    # ComfyUI node names its own inputs (max_resolution, ...).
    range_advice: Optional[Dict[str, str]] = None

    def with_(self, **changes) -> "BlockOptions":
        return replace(self, **changes)


class _Capture:
    """The first call of each block structure during one probe call of the model."""

    def __init__(self, structures: int):
        self.calls: Dict[int, Tuple[tuple, dict]] = {}
        self.structures = structures

    @property
    def complete(self) -> bool:
        return len(self.calls) >= self.structures


class _CaptureComplete(Exception):
    """Ends a probe call once every block structure has its inputs.

    Only the first call of each structure is needed; the rest of the model
    would run eager for nothing (on Wan 1.3B on a CPU, the two probes took
    26 s of a 65 s first call).
    """


def _cancel_all(stoppers: List[Callable[[], None]]) -> None:
    for stop in stoppers:
        stop()
    stoppers.clear()


class BlockEngine:
    is_keepfast_dispatcher = True

    def __init__(self, model: torch.nn.Module, family: BlockFamily, options: Optional[BlockOptions] = None,
                 registry: Optional[GraphRegistry] = None, forward_fn: Optional[Callable] = None,
                 scoped: bool = False):
        self.module = model
        self.scoped = scoped
        self.family = family
        self._options = options or BlockOptions()
        self.registry = registry or default_registry()
        self.original_forward = model.__dict__.get("forward")
        self.forward_fn = forward_fn or self._model_forward
        self.label = self.options.label or architecture_name(model)
        self.architecture = architecture_name(model)
        self.groups = find_blocks(model, family.block_classes, family.ignored_settings, family.split_stacks,
                                  storage_key=family.storage_key)
        self.servers: List[BlockServer] = []
        index = 0
        for group in self.groups:
            self.servers.append(BlockServer(self, group, index))
            index += len(group.instances)
        self.exporter = export_block  # replaceable (tests: a block whose export raises)
        self.block_filter: Optional[BlockFilter] = None
        self.compile_failures: Dict[str, str] = {}
        self.ahead_of_time = False  # inside prepare(ahead_of_time=True): no background builds
        # Inside a prepare that waits for its graphs: the block structures' builds start one after another and
        # run side by side, then prepare waits for them all (`_build_together`).
        self.together = False
        # Background builds started for this model's blocks: a model dropped (ComfyUI unloading it) stops
        # them, as nothing would take them in. The finalizer holds their stoppers only, not the engine.
        self.builds: List[Callable[[], None]] = []
        weakref.finalize(self, _cancel_all, self.builds)
        self.capturing: Optional[_Capture] = None
        self.prepared = False
        self.problem: Optional[str] = None
        self.probes: Tuple[T.Dims, ...] = ()
        self.probe_counts: Tuple[Dict[str, int], ...] = ()
        self.last_status = "not run yet"
        self._local = threading.local()
        self._lock = threading.RLock()
        self._structure: Optional[str] = None

    @property
    def options(self) -> BlockOptions:
        return self._options

    @options.setter
    def options(self, options: BlockOptions) -> None:
        """New options; another range, backend or compile setting prepares the graphs again."""
        old = self._options
        self._options = options
        if (old.shape_range, old.backend, old.compile_on_miss) != (options.shape_range, options.backend,
                                                                     options.compile_on_miss):
            self.prepared = False

    def _model_forward(self, model: torch.nn.Module, *args, **kwargs) -> Any:
        """The model's own forward (not the engine, once installed in its place)."""
        if self.original_forward is not None:
            return self.original_forward(*args, **kwargs)
        return type(model).forward(model, *args, **kwargs)

    # -- installing -----------------------------------------------------------
    def install_blocks(self) -> None:
        for server in self.servers:
            for instance in server.instances:
                instance.install()

    def install(self) -> None:
        """Blocks, and the model's own forward (its first call prepares)."""
        self.install_blocks()
        self.module.forward = self

    def uninstall(self) -> None:
        for server in self.servers:
            for instance in server.instances:
                instance.uninstall()
        if self.module.__dict__.get("forward") is self:
            if self.original_forward is not None:
                self.module.forward = self.original_forward
            else:
                del self.module.forward

    # -- describing -------------------------------------------------------------
    @property
    def instances(self) -> List[BlockInstance]:
        return [instance for server in self.servers for instance in server.instances]

    @property
    def block_range(self) -> ShapeRange:
        return self.family.geometry.block_range(self.options.shape_range)

    def structure(self) -> str:
        if self._structure is None:
            self._structure = structure_hash(self.module)
        return self._structure

    @property
    def graph_calls(self) -> int:
        return sum(i.graph_calls for i in self.instances)

    @property
    def eager_calls(self) -> int:
        return sum(i.eager_calls for i in self.instances)

    def report(self) -> Dict[str, Any]:
        """What runs compiled and what eager, and why: the node's and compile_pipe's report."""
        total = len(self.instances)
        compiled = sum(len(s.instances) for s in self.servers if s.ready)
        return {
            "model": self.architecture,
            "family": self.family.describe(),
            "graphs": "blocks",
            "blocks": total,
            "blocks_compiled": compiled,
            "share_compiled": (compiled / total) if total else 0.0,
            "structures": [
                {"class": s.group.class_name, "instances": len(s.instances), "paths": s.group.paths,
                 "status": s.status(), "graph_id": s.graph.key.id if s.graph is not None else None,
                 "compile_s": round(s.compile_s, 3), "notes": list(s.notes), "roles": s.roles}
                for s in self.servers
            ],
            "glue": "eager (patch embedding, position tables, embedders, final layer)",
            "probes": [d.describe() for d in self.probes],
            "problem": self.problem,
        }

    def describe(self) -> str:
        r = self.report()
        kinds = ", ".join(f"{s['class']} x{s['instances']}: {s['status']}" for s in r["structures"])
        return (f"{r['model']}: {r['blocks_compiled']} of {r['blocks']} blocks compiled ({kinds}); "
                f"glue eager" + (f"; {r['problem']}" if r["problem"] else ""))

    # -- calling ----------------------------------------------------------------
    @contextlib.contextmanager
    def _flag(self, name: str):
        """A per-thread flag set inside (sampling threads of one model never see each other's)."""
        previous = getattr(self._local, name, False)
        setattr(self._local, name, True)
        try:
            yield
        finally:
            setattr(self._local, name, previous)

    def eager_now(self) -> bool:
        return bool(getattr(self._local, "eager", False))

    def eager_scope(self):
        """Every block runs its own forward inside (the reference path)."""
        return self._flag("eager")

    def serving_now(self) -> bool:
        return bool(getattr(self._local, "serving", False))

    def serving(self):
        """Blocks of a `scoped` engine serve from graphs inside (the adapter's hook around a model call)."""
        return self._flag("serving")

    def eager(self, *args, **kwargs) -> Any:
        with self.eager_scope():
            return self.forward_fn(self.module, *args, **kwargs)

    def __call__(self, *args, **kwargs) -> Any:
        if self.eager_now():
            return self.forward_fn(self.module, *args, **kwargs)
        if not self.prepared:
            self.prepare()
        started = time.perf_counter()
        try:
            return self.forward_fn(self.module, *args, **kwargs)
        finally:  # the whole model's call: what its blocks did not take is glue
            self.registry.log.add_time("blocks.model", time.perf_counter() - started)

    def capture(self, server: BlockServer, instance: BlockInstance, args: tuple, kwargs: dict) -> Any:
        capture = self.capturing
        if capture is not None and id(server) not in capture.calls:
            capture.calls[id(server)] = (args, kwargs)
            if capture.complete:
                raise _CaptureComplete()
        return instance.eager(args, kwargs)

    # -- preparing ----------------------------------------------------------------
    def prepare(self, progress: Optional[Progress] = None, force: bool = False,
                ahead_of_time: bool = False) -> List[str]:
        """Make every block structure ready (registry, store or compile); returns each one's status.

        `ahead_of_time` (Save, Load, Warmup: asked for graphs, not images): compile now even with background
        builds on. Never raises for a model problem: whatever fails leaves those blocks
        eager with the reason in `report()` and the registry's fallbacks.
        """
        with self._lock:
            if self.prepared and not force:
                return [s.status() for s in self.servers]
            self.ahead_of_time = ahead_of_time
            try:
                self._prepare(progress)
            except Exception as error:  # never let preparing break the model's call
                log.exception("%s: preparing block graphs failed", self.label)
                self.problem = f"preparing block graphs failed: {type(error).__name__}: {error}"
                for server in self.servers:
                    if server.reason:
                        server.reason = self.problem
            finally:
                self.ahead_of_time = False
            self.prepared = True
            self.last_status = self.describe()
            return [s.status() for s in self.servers]

    def _prepare(self, progress: Optional[Progress]) -> None:
        if not self.servers:
            self.problem = "no repeated blocks found"
            self.registry.record(FALLBACK, "-", f"{self.label}: no repeated blocks found; running eager")
            return
        geometry = self.family.geometry
        first, second = T.probe_dims(geometry, self.options.shape_range, self.family.spatial_multiple)
        self.probes = (first, second)
        counts = (T.counts_of(geometry, first), T.counts_of(geometry, second))
        self.probe_counts = counts
        captures = []
        for dims in (first, second):
            calls, problem = self._capture(dims)
            if problem:
                self.problem = problem
                for server in self.servers:
                    server.reason = problem
                    server.record_fallback(problem)
                return
            captures.append(calls)
        total = len(self.servers)
        self.together = self._build_together()
        try:
            for k, server in enumerate(self.servers):
                stage = f"block {k + 1} of {total}: {server.group.describe()}"
                server.prepare(captures[0].get(id(server)), captures[1].get(id(server)), counts,
                               self._progress(progress, stage, k, total))
        finally:
            together, self.together = self.together, False
        if together:
            self.wait_for_builds()
        self.registry.record(PROGRESS, "-", f"{self.label}: {self.describe()}", detail={"fraction": 1.0})
        if progress:
            progress(self.describe(), 1.0)

    def _build_together(self) -> bool:
        """Whether this prepare builds its block structures side by side and waits for them all: it waits for its
        graphs (no background builds, or Save, Load and Warmup), there is more than one structure, and blocks are
        exported the engine's own way (tests replace `exporter`). Each structure's trace and build then run in
        processes of their own at once (the background builds' machinery, package_builds.start_traced), instead of
        one structure's whole compile after another: Flux's two structures took 97.5 s and 26.7 s one after
        the other on the H200 (docs/gpu.md)."""
        return (len(self.servers) > 1 and self.options.compile_on_miss and self.exporter is export_block
                and (not self.options.background or self.ahead_of_time))

    def _capture(self, dims: T.Dims) -> Tuple[Dict[int, Tuple[tuple, dict]], Optional[str]]:
        try:
            args, kwargs = self.family.example_call(self.module, dims)
        except Exception as error:
            return {}, f"the {self.family.name} example call cannot be built: {type(error).__name__}: {error}"
        capture = _Capture(len(self.servers))
        self.capturing = capture
        try:
            with torch.no_grad():
                self.forward_fn(self.module, *args, **kwargs)
        except Exception as error:  # _CaptureComplete, or one a model's own code made of it
            if not capture.complete:
                return {}, (f"the model failed on an example call ({dims.describe()}): "
                            f"{type(error).__name__}: {error}")
        finally:
            self.capturing = None
        return capture.calls, None

    def _progress(self, progress: Optional[Progress], stage: str, k: int, total: int) -> Progress:
        """Progress of one block structure, with the time left from compiles measured on this machine."""
        registry, label = self.registry, self.label
        done = [e.seconds for e in registry.compiles if (e.detail or {}).get("block")]
        left = total - k
        eta = (f", about {sum(done) / len(done) * left:.0f} s left" if done
               else ", time left known after the first block compile")

        def report(step: str, fraction: float) -> None:
            overall = (k + fraction) / total
            text = f"{label}: {stage}: {step}{eta}"
            registry.record(PROGRESS, "-", text, detail={"fraction": overall, "block": k + 1, "blocks": total})
            if progress:
                progress(text, overall)

        return report

    # -- ahead of time --------------------------------------------------------------
    def wait_for_builds(self) -> int:
        """Wait for every background build and take it in; returns how many block structures now serve."""
        return sum(1 for server in self.servers
                   if (server.source.pending is not None or server.source.elsewhere is not None)
                   and server.source.wait())

    def cancel_builds(self) -> int:
        """Stop every background build (the blocks stay eager with that reason); returns how many."""
        return sum(1 for server in self.servers if server.source.cancel())

    @property
    def builds_pending(self) -> int:
        return sum(1 for server in self.servers if server.source.pending is not None)

    def save(self, store: GraphStore) -> Tuple[List[str], List[str]]:
        """Prepare if needed, then write every block graph into `store`: (saved, problems)."""
        if not self.prepared:
            self.prepare(ahead_of_time=True)
        self.wait_for_builds()
        saved, problems = [], []
        for server in self.servers:
            if not server.ready:
                problems.append(f"{server.label}: eager ({server.reason})")
                continue
            problem = server.save(store)
            if problem:
                problems.append(problem)
            else:
                saved.append(f"{server.group.describe()} -> {server.saved}")
        return saved, problems

    def load(self, progress: Optional[Progress] = None) -> Tuple[List[str], List[str]]:
        """Prepare now from the graph store (compiling what it lacks, if allowed): (loaded or ready, problems)."""
        self.prepare(progress, force=True, ahead_of_time=True)
        self.wait_for_builds()
        ready, problems = [], []
        for server in self.servers:
            if server.ready:
                ready.append(f"{server.group.describe()}: {server.status()} {server.graph.key.id}")
            else:
                problems.append(f"{server.group.describe()}: eager ({server.reason})")
        return ready, problems

    def warmup(self, calls=(), progress: Optional[Progress] = None) -> List[str]:
        """Block graphs serve every size in the range once prepared; `calls` are not needed."""
        self.prepare(progress, ahead_of_time=True)
        self.wait_for_builds()
        return [s.status() for s in self.servers]
