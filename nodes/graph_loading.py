"""What the Load Graph node does, apart from its schema (comfy_nodes.py): the graphs a choice names (a graph, a
graph set, or every stored graph that fits), trusted first where asked, loaded now; a remote library pulled first.

Refusals are reported and recorded, never raised: the model and VAE then run as the speedup nodes left them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, List, Optional, Tuple

from ..compiler import (MANIFEST_SUFFIX, REFUSED, BlockEngine, GraphLibrary, GraphRefused, GraphStore, MultiRootStore,
                        verify_and_trust)
from . import runtime, unet, vae as vae_side
from .graph_sets import GraphSetError, graph_set_entries, read_json
from .operations import backend_of, prepare_blocks
from .reports import Report
from .unet import Settings

AUTO = "(every stored graph that fits)"


def graph_choices() -> List[str]:
    """AUTO, then graph sets and manifests in the graphs folders (names as folder_paths lists them)."""
    import folder_paths

    try:
        runtime.register_graphs_folder()
        names = folder_paths.get_filename_list(runtime.FOLDER)
    except Exception:
        names = []
    return [AUTO] + sorted(n for n in names if n.endswith(MANIFEST_SUFFIX))


def load(model, vae, choice: str, compile_on_miss: bool, trust: bool, report: Report, library: str = ""):
    """Serve the model and VAE from stored graphs, loaded now; refusals are reported, never raised.

    `library` (else $KEEPFAST_REMOTE_LIBRARY): a remote graph library (docs/fleet.md) whose graphs of these
    models that fit this machine are pulled into the first graphs folder first."""
    unavailable = runtime.compile_unavailable(backend_of(model, vae))
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
    from ..compiler import pull_remote_for, remote_library_url

    url = library.strip() or remote_library_url()
    if not url or not structures:
        return
    store = runtime.store()
    result = pull_remote_for(url, store.root, structures=structures, trust=store.trust)
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
                    verify_and_trust(where, stored, f"trusted in the Load Graph node ({stored.manifest_path})")
                except GraphRefused as error:
                    _refuse(f"{name}: {error}", report)
                    continue
                report.add(f"{stored.name} added to the trust list ({where.trust.path})")
    unet.load_to_device(model)
    prepare_blocks(runner, engine, report, force=True)


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
            verify_and_trust(where, stored, f"trusted in the Load Graph node ({stored.manifest_path})")
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
