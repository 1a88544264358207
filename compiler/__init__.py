"""KeepFast's compiler core: compile once per model structure, serve every shape,
keep graphs on disk without weights. Never imports ComfyUI.

This is the package's public face: ComfyUI's nodes (which import nothing else of it), the diffusers API and the
command line use the names below, grouped by what they are for (`_GROUPS`). They are imported when first used, so
that importing one stage (the build process, the benchmark's configs) does not import the others.

The core, by stage: `keys/` (when two calls share a graph), `tracing/` (a call to an exported program),
`backends/` (compiling and loading graphs), `builds/` (background builds) and `build_process/` (what runs in
a build process), `serving/` (the call path), `store/` (graphs on disk and in memory), `machine/` (what a graph
needs of the machine), `blocks/` (transformers block by block), `remote/` (graph libraries for fleets).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple

# (what the group is for, {public name: the module that defines it, relative to this package; "module:name" where
# the module calls it by another name})
_GROUPS: Tuple[Tuple[str, Dict[str, str]], ...] = (
    ("Backends: which compilers make graphs, whether one runs here, and how a forward is marked portable to all.", {
        "DEFAULT_BACKEND": ".backends", "backend_names": ".backends", "get_backend": ".backends",
        "register_backend": ".backends", "unavailable_reason": ".backends",
        "portable_forward": ".backends.base", "cuda_graphs_asked_for": ".backends.cuda_graphs:asked_for",
    }),
    ("Serving a module from graphs: its options, the forward that serves each call, and how a call binds.", {
        "CompiledForward": ".serving.compiled_forward", "CompileOptions": ".serving.compiled_forward",
        "Served": ".serving.compiled_forward", "CallBinder": ".keys.binding", "TimeShare": ".serving.time_share",
    }),
    ("Chunk steps with a feature cache (video VAEs decoding a latent frame at a time), one graph per cache state.", {
        "ChunkServer": ".serving.cached_steps", "chunk_server": ".serving.cached_steps",
        "chunk_step": ".serving.cached_steps:chunk", "example_frames": ".serving.cached_steps",
        "takes_feature_cache": ".serving.cached_steps",
    }),
    ("Shapes and keys: the range a graph serves, the role of each axis, and what names a model's graphs.", {
        "DEFAULT_RANGE": ".keys.shapes", "ShapeRange": ".keys.shapes", "BATCH": ".keys.shapes",
        "FRAMES": ".keys.shapes", "SPATIAL": ".keys.shapes", "default_roles": ".keys.shapes",
        "FamilyKey": ".keys.graph_keys", "architecture_name": ".keys.structure",
    }),
    ("Transformers block by block: the engine, what an adapter's block family says, and a block's weights as bound.", {
        "BlockEngine": ".blocks.engine", "BlockOptions": ".blocks.engine", "BlockFamily": ".blocks.family",
        "BlockInstance": ".blocks.instance", "Dims": ".blocks.tokens", "Geometry": ".blocks.tokens",
        "generator_for": ".blocks.family", "model_dtype_device": ".blocks.family",
        "CallTensors": ".blocks.quantised", "StoredWeights": ".blocks.quantised", "PLAIN": ".blocks.quantised",
        "subclass_parts": ".blocks.quantised", "MODULE_PREFIX": ".tracing.flat_module",
    }),
    ("Graphs on disk: graphs folders, manifests, the trust list, and files written whole or not at all.", {
        "GraphStore": ".store.graph_store", "MultiRootStore": ".store.graph_store",
        "StoredGraph": ".store.graph_store", "GraphRefused": ".store.graph_store", "StoreError": ".store.graph_store",
        "safe_path_part": ".store.graph_store:safe_part", "MANIFEST_SUFFIX": ".store.manifest",
        "TrustList": ".store.trust", "GraphLibrary": ".store.library", "verify_and_trust": ".store.library:trust",
        "write_file_atomically": ".store.atomic:write_bytes",
        "sweep_leftover_graphs": ".store.extraction:sweep",
    }),
    ("Graphs in memory and what happened to them: the registry and its event log's kinds.", {
        "GraphRegistry": ".store.registry", "default_registry": ".store.registry", "Event": ".store.registry",
        "COMPILE": ".store.registry", "LOAD": ".store.registry", "FALLBACK": ".store.registry",
        "EVICT": ".store.registry", "REFUSED": ".store.registry", "PROGRESS": ".store.registry",
        "NOTE": ".store.registry", "MISMATCH": ".store.registry",
    }),
    ("Background builds: their progress, a listener for their changes, and what a spawned trace process runs first.", {
        "build_progress": ".builds.status:progress", "add_build_listener": ".builds.package_builds:add_listener",
        "prepare_trace_children": ".tracing.spawned_trace:prepare_children",
    }),
    ("The machine: torch's version, whether this torch is supported, dtype names.", {
        "torch_version": ".machine.environment", "dtype_name": ".machine.environment",
        "torch_refusal": ".machine.torch_support:refusal", "torch_untested_note": ".machine.torch_support:untested_note",
    }),
    ("Remote graph libraries for fleets (docs/fleet.md): where one is, pulling from it, warming up from it.", {
        "remote_library_url": ".remote.warmup", "warm_up_from_remote": ".remote.warmup:warm_up_from_env",
        "pull_remote": ".remote.pull:pull", "pull_remote_for": ".remote.pull:pull_for",
    }),
    ("The oneflow backend taught another package's models (a OneFlow copy of the package, a converter into it).", {
        "FlowPackage": ".backends.oneflow_support.isolation",
        "register_flow_package": ".backends.oneflow_support.isolation:register_package",
        "flow_copies": ".backends.oneflow_support.isolation:active",
        "flow_copy_missing": ".backends.oneflow_support.isolation",
        "clone_module": ".backends.oneflow_support.clone", "CloneRefused": ".backends.oneflow_support.clone",
        "flow_dtype": ".backends.oneflow_support.clone",
        "flow_attention": ".backends.oneflow_support.shims:scaled_dot_product_attention",
        "ConversionError": ".backends.oneflow_support.convert",
        "register_converter": ".backends.oneflow_support.convert",
    }),
    ("diffusers: compile, save and load a pipeline or one of its modules.", {
        "compile_module": ".diffusers_api", "compile_pipe": ".diffusers_api", "load_pipe": ".diffusers_api",
        "save_pipe": ".diffusers_api", "uncompile_module": ".diffusers_api",
    }),
    ("The pack's version.", {"__version__": ".version"}),
)
_PUBLIC: Dict[str, str] = {name: where for _, names in _GROUPS for name, where in names.items()}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, own_name = where.partition(":")
    value = getattr(importlib.import_module(module, __name__), own_name or name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
