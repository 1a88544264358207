"""KeepFast's compiler core: compile once per model structure, serve every shape,
keep graphs on disk without weights. Never imports ComfyUI.

This is the package's public face: ComfyUI's nodes, the diffusers API and the command line use the names below.
They are imported when first used, so that importing one stage (the build process, the benchmark's configs)
does not import the others.

The core, by stage: `keys/` (when two calls share a graph), `tracing/` (a call to an exported program),
`backends/` (compiling and loading graphs), `builds/` (background builds) and `build_process/` (what runs in
a build process), `serving/` (the call path), `store/` (graphs on disk and in memory), `machine/` (what a graph
needs of the machine), `blocks/` (transformers block by block), `remote/` (graph libraries for fleets).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

# public name -> the module that defines it, relative to this package
_PUBLIC: Dict[str, str] = {
    "DEFAULT_BACKEND": ".backends", "backend_names": ".backends", "get_backend": ".backends",
    "register_backend": ".backends", "unavailable_reason": ".backends",
    "CallBinder": ".keys.binding",
    "CompiledForward": ".serving.compiled_forward", "CompileOptions": ".serving.compiled_forward",
    "Served": ".serving.compiled_forward",
    "compile_module": ".diffusers_api", "compile_pipe": ".diffusers_api", "load_pipe": ".diffusers_api",
    "save_pipe": ".diffusers_api", "uncompile_module": ".diffusers_api",
    "GraphLibrary": ".store.library",
    "GraphRegistry": ".store.registry", "default_registry": ".store.registry",
    "DEFAULT_RANGE": ".keys.shapes", "ShapeRange": ".keys.shapes",
    "GraphRefused": ".store.graph_store", "GraphStore": ".store.graph_store", "StoreError": ".store.graph_store",
    "TrustList": ".store.trust",
    "__version__": ".version",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
