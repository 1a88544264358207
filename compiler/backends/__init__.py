"""Backends by name, imported only when first asked for.

Like torch's own backend registry: a name maps to "module:Class", so that
importing the pack never imports oneflow (or any other heavy or optional
dependency) and a missing one is reported with its reason, not a crash.
"""

from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Tuple

from .base import Backend, BackendUnavailable, CompiledGraph, CompileFailed, PackageInfo

_REGISTERED: Dict[str, str] = {
    "aot": "compiler.backends.aot:AotBackend",
    "inductor": "compiler.backends.inductor:InductorBackend",
    "oneflow": "compiler.backends.oneflow_backend:OneflowBackend",
}
_INSTANCES: Dict[str, Backend] = {}

DEFAULT_BACKEND = "aot"


def register_backend(name: str, target: str) -> None:
    """Register `target` ("package.module:Class") under `name`."""
    _REGISTERED[name] = target
    _INSTANCES.pop(name, None)


def backend_names() -> List[str]:
    return list(_REGISTERED)


def _import(target: str) -> Backend:
    module_name, _, class_name = target.partition(":")
    if module_name.startswith("compiler."):
        # Resolve relative to this package, whatever name it was imported under
        # (ComfyUI imports the pack under its folder name).
        module = importlib.import_module("." + module_name.split(".", 2)[2], __name__)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, class_name)()


def get_backend(name: str) -> Backend:
    """The backend instance; raises BackendUnavailable with the reason."""
    if name not in _REGISTERED:
        raise BackendUnavailable(f"unknown backend {name!r}; known: {', '.join(_REGISTERED)}")
    if name not in _INSTANCES:
        try:
            backend = _import(_REGISTERED[name])
        except ImportError as error:
            raise BackendUnavailable(f"backend {name!r} cannot be imported: {error}") from error
        reason = backend.unavailable_reason()
        if reason:
            raise BackendUnavailable(reason)
        _INSTANCES[name] = backend
    return _INSTANCES[name]


def serving_backend(name: str, device: str) -> Tuple[str, Optional[str]]:
    """(the backend that compiles `name`'s graphs on `device` ("cuda:0", or a family's "cuda-sm90"), why not
    `name` itself, or None).

    Where torch's AOTInductor package loader crashed on this machine for the device's kind
    (loader_check.py), the aot backend's packages cannot be loaded: its graphs are compiled by torch.compile in
    this process instead (the inductor backend: as fast, not saved)."""
    if name != "aot":
        return name, None
    from . import loader_check

    refused = loader_check.refusal(loader_check.kind_of(device))
    if refused is None:
        return name, None
    return "inductor", f"{refused}; compiled by torch.compile in this process instead (not saved)"


def unavailable_reason(name: str) -> Optional[str]:
    try:
        get_backend(name)
    except BackendUnavailable as error:
        return str(error)
    return None


__all__ = [
    "Backend", "BackendUnavailable", "CompiledGraph", "CompileFailed", "PackageInfo",
    "DEFAULT_BACKEND", "backend_names", "get_backend", "register_backend", "serving_backend", "unavailable_reason",
]
