"""KeepFast's compiler core: compile once per model structure, serve every shape,
keep graphs on disk without weights. Never imports ComfyUI."""

from .backends import DEFAULT_BACKEND, backend_names, get_backend, register_backend, unavailable_reason
from .binding import CallBinder
from .compiled_forward import CompiledForward, CompileOptions, Served
from .diffusers_api import compile_module, compile_pipe, load_pipe, save_pipe, uncompile_module
from .library import GraphLibrary
from .registry import GraphRegistry, default_registry
from .shapes import DEFAULT_RANGE, ShapeRange
from .store import GraphRefused, GraphStore, StoreError
from .trust import TrustList
from .version import __version__

__all__ = [
    "DEFAULT_BACKEND", "DEFAULT_RANGE", "CallBinder", "CompiledForward", "CompileOptions", "GraphLibrary",
    "GraphRefused", "GraphRegistry", "Served",
    "GraphStore", "ShapeRange", "StoreError", "TrustList", "__version__", "backend_names", "compile_module",
    "compile_pipe", "default_registry", "get_backend", "load_pipe", "register_backend", "save_pipe",
    "uncompile_module", "unavailable_reason",
]
