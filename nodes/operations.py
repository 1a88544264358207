"""What the nodes do, apart from their schemas: speed up, save, load, warm up, report."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Iterable, List, Optional, Tuple

from ..compiler import DEFAULT_BACKEND, CompiledForward, GraphRefused, StoreError, get_backend
from ..compiler.blocks import BlockEngine
from ..compiler.store.library import GraphLibrary, trust as trust_graph
from ..compiler.store.manifest import MANIFEST_SUFFIX
from ..compiler.store.registry import REFUSED
from ..compiler.store.graph_store import GraphStore, MultiRootStore
from . import runtime, unet, vae as vae_side
from .graph_sets import GraphSetError, graph_set_entries, read_json, set_file_name, write_graph_set
from .sizes import clamp
from .unet import Settings

AUTO = "(every stored graph that fits)"
DEFAULT_SIZE = 512


class Report:
    """The lines a node shows, plus the registry's messages (compiles, loads, fallbacks) since it started."""

    def __init__(self, title: str):
        self.title = title
        self.lines: List[str] = []
        self.started = time.time()

    def add(self, line: str) -> None:
        self.lines.append(line)

    def text(self) -> str:
        events = runtime.describe(runtime.messages_since(self.started))
        body = self.lines + ([""] + ["during this node:"] + events if events else [])
        return "\n".join([self.title] + ["- " + line if line else "" for line in body])


def graph_choices() -> List[str]:
    """AUTO, then graph sets and manifests in the graphs folders (names as folder_paths lists them)."""
    import folder_paths

    try:
        runtime.register_graphs_folder()
        names = folder_paths.get_filename_list(runtime.FOLDER)
    except Exception:
        names = []
    return [AUTO] + sorted(n for n in names if n.endswith(MANIFEST_SUFFIX))


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


def _backend_of(model, vae) -> str:
    """The backend a speedup node upstream chose (the default when there is none)."""
    runner = (unet.runner_of(model) if model is not None else None) or (
        vae_side.runner_of(vae) if vae is not None else None)
    return runner.settings.backend if runner is not None else DEFAULT_BACKEND


# -- ahead of time ------------------------------------------------------------------

def warm(model, vae, sizes: List[Tuple[int, int]], batches: List[int], report: Report,
         vae_ops: Tuple[str, ...] = ("decode",)):
    """Make sure graphs serve each size and batch; returns the (sped-up) model and VAE."""
    unavailable = runtime.compile_unavailable(_backend_of(model, vae))
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
            _prepare_blocks(runner, engine, report)
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
    unavailable = runtime.compile_unavailable(_backend_of(model, vae))
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
        _prepare_blocks(runner, engine, report)
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


def _prepare_blocks(runner: unet.UnetRunner, engine: BlockEngine, report: Report, force: bool = False) -> None:
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


# -- loading --------------------------------------------------------------------------

def load(model, vae, choice: str, compile_on_miss: bool, trust: bool, report: Report, library: str = ""):
    """Serve the model and VAE from stored graphs, loaded now; refusals are reported, never raised.

    `library` (else $KEEPFAST_REMOTE_LIBRARY): a remote graph library (docs/fleet.md) whose graphs of these
    models that fit this machine are pulled into the first graphs folder first."""
    unavailable = runtime.compile_unavailable(_backend_of(model, vae))
    if unavailable:
        report.add(f"graphs cannot run here ({unavailable}); the model and VAE pass through unchanged")
        return model, vae
    settings = Settings(compile_on_miss=compile_on_miss)
    targets = []
    engine = None
    model_out, vae_out = model, vae
    if model is not None:
        runner = unet.runner_of(model)
        model_out, runner = unet.speed_up(
            model, dataclasses.replace(runner.settings, compile_on_miss=compile_on_miss) if runner else settings)
        module = model_out.get_model_object("diffusion_model")
        engine = runner.block_engine(module)
        if engine is None:
            forward = runner.forward_for(module)
            targets.append(("model", type(module).__name__, forward.structure(),
                            lambda signature, m=model_out: unet.family_here(m, signature)))
    if vae is not None:
        vrunner = vae_side.runner_of(vae)
        vae_settings = (dataclasses.replace(vrunner.settings, compile_on_miss=compile_on_miss) if vrunner
                        else settings)
        try:
            vae_out, vrunner = vae_side.speed_up(vae, vae_settings)
        except ValueError as error:
            report.add(f"VAE: {error}")
        else:
            structures = set()
            for op in vae_side.OPS:  # one structure for both (the autoencoder), or one per chunk module
                structure = vrunner.forwards[op].structure()
                if structure not in structures:
                    structures.add(structure)
                    targets.append(("VAE", type(vrunner.forwards[op].module).__name__, structure,
                                    lambda signature, op=op, r=vrunner: r.family_here(signature, op)))
    block_structures = {group.structure for group in engine.groups} if engine is not None else set()
    _pull(library, block_structures | {structure for _, _, structure, _ in targets}, report)
    if engine is not None:
        _load_blocks(runner, model_out, engine, choice, trust, report)
    if not targets:
        if engine is None:
            report.add("connect a MODEL and/or a VAE to load graphs for")
        return model_out, vae_out
    store = runtime.store()
    served_by_blocks = {group.structure for group in engine.groups} if engine is not None else set()
    for where, name, problem in _chosen(store, choice, targets, report):
        if problem:
            _refuse(f"{name}: {problem}", report)
            continue
        _load_one(where, name, targets, trust, report, skip=served_by_blocks)
    return model_out, vae_out


def _pull(library: str, structures: set, report: Report) -> None:
    """Pull these structures' graphs that fit here from the remote library, if one is named (never raises:
    a library that cannot be read is reported and the node goes on with what the graphs folder has)."""
    from ..compiler import remote

    url = library.strip() or remote.remote_library_url()
    if not url or not structures:
        return
    store = runtime.store()
    result = remote.pull_for(url, store.root, structures=structures, trust=store.trust)
    report.add(result.summary())
    for outcome in result.refused:
        report.add(f"{outcome.name} refused: {outcome.reason}")


def _load_blocks(runner: unet.UnetRunner, model, engine: BlockEngine, choice: str, trust: bool,
                 report: Report) -> None:
    """Block graphs: each block structure finds its graph in the graphs folders (trusted first, if asked)."""
    store = runtime.store()
    if trust:
        structures = {group.structure for group in engine.groups}
        targets = [("model", group.class_name, group.structure, None) for group in engine.groups]
        for where, name, problem in _chosen(store, choice, targets, report):
            if problem:
                _refuse(f"{name}: {problem}", report)
                continue
            try:
                stored = where.get(name)
            except (GraphRefused, ValueError, OSError) as error:
                _refuse(f"{name}: {error}", report)
                continue
            if stored.manifest.key.family.structure not in structures:
                continue
            if not where.trust.is_trusted(stored.manifest.package_sha256):
                try:
                    trust_graph(where, stored, f"trusted in the Load Graph node ({stored.manifest_path})")
                except GraphRefused as error:
                    _refuse(f"{name}: {error}", report)
                    continue
                report.add(f"{stored.name} added to the trust list ({where.trust.path})")
    unet.load_to_device(model)
    _prepare_blocks(runner, engine, report, force=True)


def _chosen(store: MultiRootStore, choice: str, targets, report: Report) -> Iterable[Tuple[GraphStore, str, Optional[str]]]:
    """(store, graph name, problem) for each graph the choice names."""
    if choice == AUTO or not choice:
        structures = {structure for _, _, structure, _ in targets}
        matched = 0
        for where, path, stored, problem in store.all_graphs():
            name = f"{path.parent.name}/{path.stem}"
            if stored is None:
                report.add(f"ignored {name}: {problem}")
                continue
            if stored.manifest.key.family.structure in structures:
                matched += 1
                yield where, name, None
        if not matched:
            report.add("no stored graph fits this model or VAE")
        return
    import folder_paths

    full = folder_paths.get_full_path(runtime.FOLDER, choice)
    if full is None:
        yield store, choice, f"not found in the graphs folders ({', '.join(map(str, store.roots))})"
        return
    try:
        where, relative = store.store_for(Path(full))
    except ValueError as error:
        yield store, choice, str(error)
        return
    if "/" not in relative:  # a file at the top of a graphs folder: a graph set
        try:
            entries = graph_set_entries(read_json(full), choice)
        except GraphSetError as error:
            yield where, choice, f"{error} (graph sets are written by Save Graph; graphs are FOLDER/GRAPH.json)"
            return
        report.add(f"graph set {choice}: {len(entries)} graphs")
        for entry in entries:
            yield where, entry, None
        return
    yield where, relative, None


def _refuse(text: str, report: Report, family: Any = "-") -> None:
    runtime.registry().record(REFUSED, family, f"Load Graph: {text}")
    report.add(f"refused {text}")


def _load_one(where: GraphStore, name: str, targets, trust: bool, report: Report, skip=frozenset()) -> None:
    try:
        stored = where.get(name)
    except (GraphRefused, ValueError, OSError) as error:
        _refuse(f"{name}: {error}", report)
        return
    family = stored.manifest.key.family
    if family.structure in skip:
        return  # a block graph of the model: its block engine loaded it
    target = next((t for t in targets if t[2] == family.structure),
                  next((t for t in targets if t[1] == family.architecture), targets[0]))
    what, _, structure, family_here = target
    library = GraphLibrary(where, runtime.registry())
    wanted = family_here(family.signature)
    if not family.differences(wanted) and library.in_memory(stored.manifest.graph_id) is not None:
        report.add(f"{what}: {stored.name} is already in memory")
        return
    if trust and not where.trust.is_trusted(stored.manifest.package_sha256):
        try:
            trust_graph(where, stored, f"trusted in the Load Graph node ({stored.manifest_path})")
        except GraphRefused:
            pass  # loading refuses it below, with the reason
        else:
            report.add(f"{stored.name} added to the trust list ({where.trust.path})")
    try:
        graph = library.load(stored, wanted, f"Load Graph: {what}")
    except GraphRefused as error:
        report.add(f"refused {what}: {error}")
        return
    report.add(f"{what}: loaded {stored.name} (range {graph.key.shape_range.describe()})")


# -- reporting ---------------------------------------------------------------------------

def stats_text() -> str:
    import json

    data = runtime.stats()
    recent = [m for m in data["messages"] if m.get("kind") != "progress"][-20:]
    lines = [f"{k}: {v}" for k, v in data["counts"].items()]
    if data["time_served"]:
        lines.append(data["time_served"])
    lines.append(f"graphs folders: {', '.join(data['graphs_folders'])}")
    if data["compile_unavailable"]:
        lines.append(f"compiling unavailable: {data['compile_unavailable']}")
    if data["background"]:
        lines.append("building in the background:")
        lines += [f"  {entry['text']}" for entry in data["background"]]
    lines.append("graphs in memory:")
    lines += [f"  {g['graph_id']} {g['family']} ({g['origin']}, {g['bytes'] / 1e6:.1f} MB)" for g in data["graphs"]]
    lines.append("recent events:")
    lines += [f"  {m['kind']}: {m['reason']}" for m in recent]
    return "\n".join(lines) + "\n\n" + json.dumps(data["counts"])
