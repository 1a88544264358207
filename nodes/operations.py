"""What the speedup, Warmup Graphs and Save Graph nodes do, apart from their schemas (comfy_nodes.py).

Load Graph's work is in graph_loading.py, what a node shows in reports.py."""

from __future__ import annotations

import time
from typing import List, Tuple

from ..compiler import (DEFAULT_BACKEND, BlockEngine, CompiledForward, GraphLibrary, MultiRootStore, StoreError,
                        get_backend)
from . import runtime, unet, vae as vae_side
from .graph_sets import set_file_name, write_graph_set
from .reports import Report
from .sizes import clamp
from .unet import Settings

DEFAULT_SIZE = 512


# -- speeding up -------------------------------------------------------------------

def _backend_unavailable(node: str, what: str, settings: Settings, report: Report) -> bool:
    """True (with the reason reported and noted) when the chosen backend cannot run here."""
    reason = runtime.compile_unavailable(settings.backend)
    if reason:
        report.add(f"the {settings.backend} backend is unavailable here ({reason}); the {what} passes through "
                   "unchanged")
        runtime.note(f"{node}: {reason}; the {what} runs uncompiled")
    return reason is not None


def model_speedup(model, settings: Settings, report: Report):
    if _backend_unavailable("Model Speedup", "model", settings, report):
        return model, None
    faster, runner = unet.speed_up(model, settings)
    module = faster.get_model_object("diffusion_model")
    engine = runner.block_engine(module)
    if settings.background and settings.compile_on_miss:
        report.add("graphs build in the background: the first images run uncompiled while they build, each "
                   "serves from the step after it is ready (docs/background.md)")
    if engine is not None:
        report.add(_blocks_summary(engine, settings))
        if settings.cuda_graphs:
            report.add("CUDA graph replays are for whole-model graphs: blocks run compiled without them")
        report.add(_stored_blocks(engine))
        if not settings.compile_on_miss:
            report.add("compiling is off: blocks no stored graph serves run uncompiled")
        return faster, runner
    forward = runner.forward_for(module)
    r = settings.unet_range()
    report.add(f"{forward.label}: served by {settings.backend} graphs for images "
               f"{settings.min_size}-{settings.max_size} px, batch up to {settings.max_batch} (cond+uncond up to {r.batch[1]}), prompts up to "
               f"{r.sequence[1]} tokens")
    report.add(_stored_summary(forward))
    if not settings.compile_on_miss:
        report.add("compiling is off: calls no stored graph serves run uncompiled")
    if forward.options.cuda_graphs:
        report.add("CUDA graph replays: each size is captured on its second step and replayed after it (on an "
                   "NVIDIA GPU; where a graph cannot replay, the log says why)")
    return faster, runner


def vae_speedup(vae, settings: Settings, report: Report):
    if _backend_unavailable("VAE Speedup", "VAE", settings, report):
        return vae, None
    try:
        faster, runner = vae_side.speed_up(vae, settings)
    except ValueError as error:
        report.add(f"{error}; the VAE passes through unchanged")
        return vae, None
    name = f"VAE {type(runner.module).__name__} ({runner.dtype})"
    sizes = f"images {settings.min_size}-{settings.max_size} px, batch up to {settings.max_batch}"
    if runner.unserved is not None:
        report.add(f"{name}: runs uncompiled: {runner.unserved}")
    elif runner.whole_video:
        report.add(f"{name}: decode and encode served by {settings.backend} graphs of whole videos, {sizes}, up to "
                   f"{settings.max_frames} frames ({runner.shape_range('decode').frames[1]} latent)")
    elif runner.chunks:
        report.add(f"{name}: decode and encode served chunk by chunk (a latent frame at a time) by "
                   f"{settings.backend} graphs, {sizes}")
    else:
        report.add(f"{name}: decode and encode served by {settings.backend} graphs for {sizes}")
    if settings.background and settings.compile_on_miss and runner.unserved is None:
        report.add("graphs build in the background: decodes run uncompiled until each is ready")
    report.add(_stored_summary(runner.forwards["decode"]))
    return faster, runner


def _blocks_summary(engine: BlockEngine, settings: Settings) -> str:
    if settings.backend != "aot":
        return (f"{engine.label}: a transformer served block by block, and block graphs are built with the aot "
                f"backend, not {settings.backend}: it runs uncompiled (choose aot)")
    r = engine.block_range
    frames = f", up to {settings.max_frames} video frames ({r.frames[1]} latent)" if engine.family.video else ""
    kinds = ", ".join(group.describe() for group in engine.groups)
    return (f"{engine.label}: served block by block ({kinds}): one {settings.backend} graph per block structure, "
            f"every instance binds its own weights; the glue (embedders, position tables, final layer) runs "
            f"uncompiled. Images {settings.min_size}-{settings.max_size} px, batch up to {settings.max_batch} "
            f"(cond+uncond up to {r.batch[1]}), prompts up to {r.sequence[1]} tokens{frames}")


def _stored_blocks(engine: BlockEngine) -> str:
    structures = {group.structure for group in engine.groups}
    try:
        entries = runtime.store().all_graphs()
    except OSError as error:
        return f"graphs folder unreadable: {error}"
    fitting = [s for _, _, s, _ in entries if s is not None and s.manifest.key.family.structure in structures]
    state = "prepared: " + "; ".join(engine.describe().split(": ", 1)[1:]) if engine.prepared else (
        "graphs are prepared on the first image (or now, with Warmup Graphs or Save Graph)")
    return f"{len(fitting)} stored block graphs for these block structures; {state}"


def _stored_summary(forward: CompiledForward) -> str:
    structure = forward.structure()
    try:
        entries = runtime.store().all_graphs()
    except OSError as error:
        return f"graphs folder unreadable: {error}"
    fitting = [s for _, _, s, _ in entries if s is not None and s.manifest.key.family.structure == structure]
    broken = [p for _, p, s, _ in entries if s is None]
    in_memory = forward.graphs()
    line = (f"{len(in_memory)} graphs in memory and {len(fitting)} stored graphs for this model structure "
            f"[{structure[:12]}] (stored ones load on first use)")
    if broken:
        line += f"; {len(broken)} unreadable files in the graphs folder are ignored"
    return line


def _ensure_model(model, sizes, batches):
    runner = unet.runner_of(model)
    base = runner.settings if runner is not None else Settings()
    wanted = base.widened(sizes, batches)
    if runner is not None and wanted == runner.settings:
        return model, runner
    return unet.speed_up(model, wanted)


def _ensure_vae(vae, sizes, batches):
    runner = vae_side.runner_of(vae)
    base = runner.settings if runner is not None else Settings()
    wanted = base.widened(sizes, batches)
    if runner is not None and wanted == runner.settings:
        return vae, runner
    return vae_side.speed_up(vae, wanted)


def backend_of(model, vae) -> str:
    """The backend a speedup node upstream chose (the default when there is none)."""
    runner = (unet.runner_of(model) if model is not None else None) or (
        vae_side.runner_of(vae) if vae is not None else None)
    return runner.settings.backend if runner is not None else DEFAULT_BACKEND


# -- ahead of time ------------------------------------------------------------------

def warm(model, vae, sizes: List[Tuple[int, int]], batches: List[int], report: Report,
         vae_ops: Tuple[str, ...] = ("decode",)):
    """Make sure graphs serve each size and batch; returns the (sped-up) model and VAE."""
    unavailable = runtime.compile_unavailable(backend_of(model, vae))
    if unavailable:
        report.add(f"compiling is unavailable here ({unavailable}); nothing was compiled")
        return model, vae
    model_out, vae_out = model, vae
    jobs: List[Tuple[str, CompiledForward, list]] = []
    if model is not None:
        model_out, runner = _ensure_model(model, sizes, batches)
        engine = runner.block_engine(model_out.get_model_object("diffusion_model"))
        calls, why = ([], None) if engine is not None else runner.example_calls(model_out, sizes, batches)
        if engine is not None:
            unet.load_to_device(model_out)
            prepare_blocks(runner, engine, report)
        if why:
            report.add(why)
        if calls:
            unet.load_to_device(model_out)
            forward = runner.forward_for(model_out.get_model_object("diffusion_model"))
            jobs.append(("model", forward, calls))
    if vae is not None:
        try:
            vae_out, vrunner = _ensure_vae(vae, sizes, batches)
        except ValueError as error:
            report.add(f"VAE: {error}")
        else:
            vae_side.load_to_device(vae_out)
            for op in vae_ops:
                calls = vrunner.example_calls(op, sizes, batches)
                if calls:
                    jobs.append((f"VAE {op}", vrunner.forwards[op], calls))
    bar = unet.progress_bar(sum(len(calls) for _, _, calls in jobs))
    shapes = [f"{w}x{h} batch {b}" for w, h in sizes for b in batches]
    for what, forward, calls in jobs:
        # one call per size and batch, or (a video VAE served chunk by chunk) one per chunk state and shape
        labels = shapes if len(calls) == len(shapes) else [_chunk_label(call) for call in calls]
        for shape, call in zip(labels, calls):
            started = time.perf_counter()
            result = forward.warmup([call])[0]
            line = result.describe() if result.eager else f"served by graph {result.graph_id} ({result.origin})"
            report.add(f"{what} {shape}: {line} ({time.perf_counter() - started:.1f} s)")
            if bar is not None:
                bar.update(1)
    return model_out, vae_out


def _chunk_label(call) -> str:
    (x, cached, state), _ = call
    return f"chunk {'x'.join(map(str, x.shape))} after {len(cached)} cached frames"


def save(model, vae, name: str, report: Report):
    """Compile (if needed) and write every graph of the model and VAE, plus the set `<name>.json`."""
    unavailable = runtime.compile_unavailable(backend_of(model, vae))
    if unavailable:
        report.add(f"compiling is unavailable here ({unavailable}); nothing was saved")
        return model, vae
    store = runtime.store()
    saved: List[str] = []
    model_out, vae_out = model, vae
    engine = None
    if model is not None:
        model_out, runner = _ensure_model(model, [], [])
        engine = runner.block_engine(model_out.get_model_object("diffusion_model"))
    if engine is not None:
        unet.load_to_device(model_out)
        prepare_blocks(runner, engine, report)
        saved += _save_blocks(engine, store, report)
    elif model is not None:
        s = runner.settings
        side = clamp(DEFAULT_SIZE, (s.min_size, s.max_size))
        calls, why = runner.example_calls(model_out, [(side, side)], [1])
        unet.load_to_device(model_out)
        forward = runner.forward_for(model_out.get_model_object("diffusion_model"))
        if why:
            report.add(why + "; saving the graphs already compiled for it")
        saved += _save_forward("model", forward, calls, store, report)
    if vae is not None:
        try:
            vae_out, vrunner = _ensure_vae(vae, [], [])
        except ValueError as error:
            report.add(f"VAE: {error}")
        else:
            vae_side.load_to_device(vae_out)
            s = vrunner.settings
            side = clamp(DEFAULT_SIZE, (s.min_size, s.max_size))
            for op in vae_side.OPS:
                calls = vrunner.example_calls(op, [(side, side)], [1])
                saved += _save_forward(f"VAE {op}", vrunner.forwards[op], calls, store, report, same_structure=False)
    if saved:
        try:
            path = write_graph_set(store.root, name, saved, note="written by KeepFast Save Graph")
            report.add(f"graph set {path.name} in {store.root} lists {len(saved)} graphs: load it with Load Graph")
        except OSError as error:
            report.add(f"could not write the graph set {set_file_name(name)}: {error}")
    else:
        report.add("no graph was saved")
    return model_out, vae_out


def prepare_blocks(runner: unet.UnetRunner, engine: BlockEngine, report: Report, force: bool = False) -> None:
    """Find, load or compile every block structure's graph now (no image needed)."""
    started = time.perf_counter()
    runner.prepare_blocks(engine, force=force, ahead_of_time=True)  # Save, Load, Warmup: graphs, not images
    for server in engine.servers:
        line = server.status() if not server.ready else f"{server.status()} {server.graph.key.id}"
        report.add(f"{server.group.describe()}: {line}")
    report.add(f"{engine.describe()} ({time.perf_counter() - started:.1f} s); every size in the range is served")


def _save_blocks(engine: BlockEngine, store: MultiRootStore, report: Report) -> List[str]:
    _, problems = engine.save(store)
    for problem in problems:
        report.add(problem)
    names = []
    for server in engine.servers:
        if server.saved_name:
            names.append(server.saved_name)
            report.add(f"{server.group.describe()}: saved {server.saved_name} (range "
                       f"{server.graph.key.shape_range.describe()})")
    return names


def _save_forward(what: str, forward: CompiledForward, calls, store: MultiRootStore, report: Report,
                  same_structure: bool = True) -> List[str]:
    families = {}
    library = GraphLibrary(store, runtime.registry())
    for args, kwargs in calls:
        result = forward.warmup([(args, kwargs)])[0]
        call = forward.flatten(args, kwargs)
        families[forward.family_for(call).id] = call.signature.to_json()
        if result.eager:
            report.add(f"{what}: {result.describe()}")
    names = []
    for graph in forward.graphs():
        family = graph.key.family
        if not same_structure and family.id not in families:
            continue  # VAE decode and encode share a structure: each saves its own families
        if not graph.persistent:
            why = get_backend(family.backend).persist_unavailable_reason() or "it keeps graphs in memory only"
            report.add(f"{what}: graphs of the {family.backend} backend cannot be saved ({why})")
            continue
        try:
            stored = library.save(graph, families.get(family.id, {}), what)
        except StoreError as error:
            report.add(f"{what}: {error}")
            continue
        names.append(stored.name)
        report.add(f"{what}: saved {stored.name} ({graph.nbytes / 1e6:.1f} MB, range "
                   f"{graph.key.shape_range.describe()})")
    return names
