"""Process-wide state of the ComfyUI nodes: graphs folder, store, registry, the page's messages.

ComfyUI clones node classes per run, so everything that must outlive one run
lives here. Nothing happens at import: `setup()` runs from the pack's
`comfy_entrypoint` (and again, harmlessly, from any node that needs it).
ComfyUI modules are imported inside functions only. What happened (compiles,
loads, fallbacks, refusals, calls served) is the registry's event log: this
module subscribes to it to tell the page and ComfyUI's log, and reads it for
the stats; it keeps no copy.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, List, Optional

from ..compiler import (COMPILE, DEFAULT_BACKEND, EVICT, FALLBACK, LOAD, MANIFEST_SUFFIX, MISMATCH, NOTE, PROGRESS,
                        REFUSED, Event, GraphRegistry, MultiRootStore, TimeShare, TrustList, add_build_listener,
                        backend_names, build_progress, default_registry, unavailable_reason)

log = logging.getLogger("keepfast")

FOLDER = "graphs"
EVENT_NAME = "keepfast.event"
STATS_ROUTE = "/keepfast/stats"

_lock = threading.RLock()
_state: Dict[str, Any] = {"setup": False, "route": False, "listener": False}
_bars: Dict[str, Any] = {}


def registry() -> GraphRegistry:
    return default_registry()


# -- setup ---------------------------------------------------------------------

def setup() -> None:
    """Register the graphs folder, the event listener, the stats route and the oneflow backend's
    converter for ComfyUI's model classes (idempotent)."""
    from . import oneflow_comfy, trace_process

    with _lock:
        first = not _state["setup"]
        if first:
            _sweep_leftovers()
            _say_torch_support()
        register_graphs_folder()
        oneflow_comfy.register()
        trace_process.register()
        if not _state["listener"]:
            registry().add_listener(_on_event)
            add_build_listener(_builds_changed)
            _state["listener"] = True
        if not _state["route"]:
            _state["route"] = _register_route()
        _state["setup"] = True
    if first:
        _warm_up_from_remote_library()


def _say_torch_support() -> None:
    """At ComfyUI's start: a torch the pack does not compile with is named now, not at the first image."""
    from ..compiler import torch_refusal, torch_untested_note

    refused, untested = torch_refusal(), torch_untested_note()
    if refused:
        log.warning("[KeepFast] %s", refused)
    elif untested:
        log.info("[KeepFast] %s", untested)


def _sweep_leftovers() -> None:
    """Remove what stopped ComfyUI processes left in TMPDIR (SIGTERM, SIGKILL), at start, not at first load."""
    from ..compiler import sweep_leftover_graphs

    try:
        swept = sweep_leftover_graphs()
    except OSError as error:  # a tidy TMPDIR is a nicety; starting must not fail on it
        log.warning("[KeepFast] could not sweep earlier processes' graph folders: %s", error)
        return
    if swept:
        log.info("[KeepFast] removed %d graph folders left by stopped processes", len(swept))


def _warm_up_from_remote_library() -> None:
    """$KEEPFAST_REMOTE_LIBRARY (docs/fleet.md): pull every graph that fits this machine into the first graphs
    folder, in a thread (ComfyUI starts meanwhile; Load Graph and the Speedup nodes find what has landed).
    Logged with its time; a library that cannot be read is logged and nothing else happens."""
    from ..compiler import remote_library_url, warm_up_from_remote

    if not remote_library_url():
        return
    folder = graphs_folders()[0]
    threading.Thread(target=warm_up_from_remote, args=(folder,), name="keepfast-remote-warm-up",
                     daemon=True).start()


def register_graphs_folder() -> List[str]:
    """`models/graphs` in folder_paths, listing manifest files only; keeps user-given paths."""
    import folder_paths

    default = os.path.join(folder_paths.models_dir, FOLDER)
    if FOLDER not in folder_paths.folder_names_and_paths:
        folder_paths.add_model_folder_path(FOLDER, default, is_default=True)
    else:
        folder_paths.add_model_folder_path(FOLDER, default)  # appended after paths a user gave
    paths, _extensions = folder_paths.folder_names_and_paths[FOLDER]
    folder_paths.folder_names_and_paths[FOLDER] = (paths, {MANIFEST_SUFFIX})
    return list(paths)


def graphs_folders() -> List[str]:
    import folder_paths

    if FOLDER not in folder_paths.folder_names_and_paths:
        register_graphs_folder()
    return folder_paths.get_folder_paths(FOLDER)


def store() -> MultiRootStore:
    return MultiRootStore(graphs_folders(), TrustList())


def compile_unavailable(backend: str = DEFAULT_BACKEND) -> Optional[str]:
    """None when `backend` can compile in this process, else why not (a node then passes models through)."""
    return unavailable_reason(backend)


def backend_reasons() -> Dict[str, Optional[str]]:
    """Every registered backend -> None when it runs here, else why not.

    Asking imports a backend's library once (oneflow only where it is installed:
    a spec lookup decides that without importing it).
    """
    return {name: unavailable_reason(name) for name in backend_names()}


def backend_choices() -> List[str]:
    """What the speedup nodes offer: the backends that run here, the default first."""
    usable = [name for name, reason in backend_reasons().items() if reason is None]
    return sorted(usable, key=lambda name: name != DEFAULT_BACKEND) or [DEFAULT_BACKEND]


def backend_tooltip() -> str:
    lines = ["How graphs are made. aot: torch.export + AOTInductor packages, saved in models/graphs and loaded "
             "after a restart; inductor: torch.compile with dynamic shapes, kept in memory only; oneflow: one "
             "OneFlow graph per shape and batch size, built from a OneFlow copy of the model (warm "
             "up the sizes you use; OneFlow 0.9.0 cannot save graphs; made for CUDA, slower than torch on a CPU)."]
    missing = {name: reason for name, reason in backend_reasons().items() if reason}
    if missing:
        lines.append("Not offered here: " + "; ".join(f"{name}: {reason}" for name, reason in missing.items()))
    return "\n".join(lines)


# -- messages ------------------------------------------------------------------

def _server():
    try:
        from server import PromptServer
    except Exception:
        return None
    return getattr(PromptServer, "instance", None)


def _executing() -> dict:
    """The node ComfyUI is running now (and its prompt), so the page can badge the KeepFast node behind it."""
    try:
        from comfy_execution.utils import get_executing_context

        context = get_executing_context()
    except Exception:
        context = None
    if context is not None:
        return {"node": str(context.node_id), "prompt_id": context.prompt_id}
    node = getattr(_server(), "last_node_id", None)
    return {"node": str(node)} if node is not None else {}


def send(event: str, data: dict) -> None:
    server = _server()
    if server is None:
        return
    try:
        server.send_sync(event, {**_executing(), **data}, getattr(server, "client_id", None))
    except Exception:  # the page is a nicety; a run must never fail on it
        pass


def inform(text: str) -> None:
    """Something a user should know that changes no call's outcome (each call still served as before): a note."""
    registry().record(NOTE, "-", text)


def note(text: str) -> None:
    """Something the nodes found that a user must know (a model served uncompiled and why): a fallback event."""
    registry().record(FALLBACK, "-", text)


def _on_event(event: Event) -> None:
    """The event log's listener: ComfyUI's log, the page's badges and the sampler's progress bar."""
    if event.kind == PROGRESS:
        _progress(event)
        return
    if event.kind == COMPILE:
        log.info("[KeepFast] compiled in %.1f s: %s", event.seconds, event.reason)
    elif event.kind == LOAD:
        log.info("[KeepFast] %s (%.2f s)", event.reason, event.seconds)
    elif event.kind in (REFUSED, EVICT):
        log.warning("[KeepFast] %s: %s", event.kind, event.reason)
    elif event.kind in (FALLBACK, NOTE):
        log.info("[KeepFast] %s", event.reason)
    send(EVENT_NAME, event.to_json())


def _progress(event: Event) -> None:
    fraction = float(event.detail.get("fraction", 0.0) or 0.0)
    background = bool(event.detail.get("background"))
    send(EVENT_NAME, {"kind": PROGRESS, "reason": event.reason, "fraction": fraction, "family": event.family,
                      "background": background})
    if background:
        return  # ComfyUI's progress bar stays the sampler's: the build runs beside it (the badge shows it)
    try:
        import comfy.utils

        bar = _bars.get(event.family)
        if bar is None:
            bar = _bars[event.family] = comfy.utils.ProgressBar(100)
        bar.update_absolute(int(round(100 * min(max(fraction, 0.0), 1.0))))
        if fraction >= 1.0:
            _bars.pop(event.family, None)
    except Exception:
        pass


# -- background builds ---------------------------------------------------------

BUILDING_EVENT = "building"
TICK_S = 2.0  # how often the page hears a build's time left while builds run


def _builds_changed() -> None:
    """A build started, ended, was taken in or cancelled (any thread): tell the page now, and keep telling it
    every TICK_S while builds run."""
    _send_build_progress()
    with _lock:
        if _state.get("ticker") is None or not _state["ticker"].is_alive():
            _state["ticker"] = threading.Thread(target=_tick, name="keepfast-build-progress", daemon=True)
            _state["ticker"].start()


def _tick() -> None:
    import time

    while _send_build_progress():
        time.sleep(TICK_S)
    with _lock:
        _state["ticker"] = None


def _send_build_progress() -> bool:
    """One "building" event per model with builds; True while any build is waiting or running."""
    running = False
    for entry in build_progress():
        running |= not entry.finished
        # No "node": a build's progress belongs to the node that made the model (found by family), not to
        # whatever node runs now.
        send(EVENT_NAME, {**entry.to_json(), "kind": BUILDING_EVENT, "reason": entry.text(), "node": None})
    return running


def messages_since(mark: float) -> List[dict]:
    return [event.to_json() for event in registry().log.since(mark)]


def describe(messages: List[dict]) -> List[str]:
    return [f"{m['kind']}: {m['reason']}" + (f" ({m['seconds']:.1f} s)" if m.get("seconds") else "")
            for m in messages if m.get("kind") != PROGRESS]


def stats() -> dict:
    reg = registry()
    summary = reg.stats()
    counts = summary["counts"]
    share = TimeShare.from_seconds(reg.log.seconds)
    return {
        "counts": {
            "compiles": counts.get(COMPILE, 0),
            "loads": counts.get(LOAD, 0),
            "fallbacks": counts.get(FALLBACK, 0),
            "mismatches": counts.get(MISMATCH, 0),
            "refused": counts.get(REFUSED, 0),
            "evicted": counts.get(EVICT, 0),
            "hits": summary["hits"],
            "graphs": len(summary["graphs"]),
            "unet_graph_calls": counts.get("unet.graph", 0),
            "unet_eager_calls": counts.get("unet.eager", 0),
            "vae_graph_calls": counts.get("vae.graph", 0),
            "vae_eager_calls": counts.get("vae.eager", 0),
            "block_graph_calls": counts.get("blocks.graph", 0),
            "block_eager_calls": counts.get("blocks.eager", 0),
        },
        "time": share.to_json(),
        "time_served": share.describe(),
        "graphs": summary["graphs"],
        "background": [entry.to_json() for entry in build_progress()],
        "messages": [event.to_json() for event in reg.log.events[-100:]],
        "graphs_folders": graphs_folders() if _state["setup"] else [],
        "compile_unavailable": compile_unavailable(),
        "backends": backend_reasons(),
    }


def _register_route() -> bool:
    """The stats and graph library routes (nodes/routes.py) on ComfyUI's server."""
    server = _server()
    if server is None or not hasattr(server, "routes"):
        return False
    try:
        from . import routes

        routes.add_routes(server.routes, store, stats)
    except Exception as error:  # a route is a nicety; loading the nodes must not fail on it
        log.warning("[KeepFast] routes not registered: %s", error)
        return False
    return True
