"""A OneFlow-backed diffusers next to the real one, in one process.

The OneFlow modules are built from a second copy of diffusers (0.31.0, the
newest that imports under OneFlow 0.9.0's `mock_torch`), imported while
`import torch` yields oneflow. Its modules are kept here, out of
`sys.modules`, and put back only while OneFlow code needs them (building a
module, tracing a graph), so the real `torch` and `diffusers` are what every
other import in the process sees.

`active()` is the only place that swaps `sys.modules`; it holds a process-wide
lock and restores everything on the way out, exceptions included. While it is
held, another thread that imports a torch submodule for the first time would
get OneFlow's: keep what runs inside it short (it is used for module
construction and for graph tracing only; compiled graphs run outside it).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import types
from typing import Dict, Iterator, Optional, Tuple

from .availability import flow_diffusers_path

_LOCK = threading.RLock()
_FLOW_MODULES: Dict[str, types.ModuleType] = {}
_QUARANTINE: Dict[str, types.ModuleType] = {}
_LOADED: Dict[str, str] = {}  # "path", "version"
_SHIMS_INSTALLED = False

# `oneflow.mock_torch.enable()` edits its caller's globals (drops `torch`,
# adds `torch.*` keys): call it from a namespace of its own.
_MOCK_NS: dict = {}
exec(
    "def enter():\n"
    "    import oneflow.mock_torch as m\n"
    "    return m.enable()\n",
    _MOCK_NS,
)

# Imported (the real, torch-backed ones) before the OneFlow copy is, so that
# the copy finds them instead of importing them bound to oneflow.
_PRELOAD = ("huggingface_hub", "safetensors", "safetensors.torch", "PIL.Image", "regex", "requests", "filelock")


def _is_diffusers(name: str) -> bool:
    return name == "diffusers" or name.startswith("diffusers.")


def install_shims() -> None:
    """What diffusers needs from torch that OneFlow 0.9.0's mock_torch lacks. Idempotent."""
    global _SHIMS_INSTALLED
    if _SHIMS_INSTALLED:
        return
    import oneflow
    import oneflow.mock_torch as mock
    import oneflow.utils

    # (a) A missing attribute raises NotImplementedError, so diffusers'
    #     hasattr(F, "scaled_dot_product_attention") raises instead of being False.
    class MockMissing(NotImplementedError, AttributeError):
        pass

    original = mock.ModuleWrapper.__getattr__
    if not getattr(original, "_keepfast", False):
        def __getattr__(self, name):
            try:
                return original(self, name)
            except NotImplementedError as error:
                raise MockMissing(str(error)) from None

        __getattr__._keepfast = True
        mock.ModuleWrapper.__getattr__ = __getattr__

    # (b) torch._dynamo.allow_in_graph (diffusers >= 0.17).
    if "oneflow._dynamo" not in sys.modules:
        dynamo = types.ModuleType("oneflow._dynamo")
        dynamo.allow_in_graph = lambda fn: fn
        sys.modules["oneflow._dynamo"] = dynamo

    # (c) torch.fft (diffusers >= 0.22 imports it for FreeU only).
    if "oneflow.fft" not in sys.modules:
        fft = types.ModuleType("oneflow.fft")

        def missing(name):
            def fn(*args, **kwargs):
                raise NotImplementedError(f"torch.fft.{name} is not available in OneFlow 0.9.0 (FreeU)")
            return fn

        for name in ("fft", "ifft", "fftn", "ifftn", "fftshift", "ifftshift", "rfft", "irfft"):
            setattr(fft, name, missing(name))
        sys.modules["oneflow.fft"] = fft

    # (d) torch.utils._pytree (diffusers >= 0.22 registers BaseOutput as a node).
    if "oneflow.utils._pytree" not in sys.modules:
        pytree = types.ModuleType("oneflow.utils._pytree")
        pytree._register_pytree_node = pytree.register_pytree_node = lambda *args, **kwargs: None
        pytree._dict_flatten = lambda d: (list(d.values()), list(d.keys()))
        pytree._dict_unflatten = lambda values, context: dict(zip(context, values))
        sys.modules["oneflow.utils._pytree"] = pytree
        oneflow.utils._pytree = pytree

    # (e) Inside nn.Graph.build a module's parameters are ProxyTensors without
    #     .dtype/.device/.shape; the VAE decoder reads next(parameters()).dtype.
    from oneflow.nn.graph.proxy import ProxyTensor

    for attribute in ("dtype", "device", "shape", "ndim"):
        if not hasattr(ProxyTensor, attribute):
            setattr(ProxyTensor, attribute,
                    property(lambda self, a=attribute: getattr(self._oneflow_internal_origin__, a)))
    _SHIMS_INSTALLED = True


def _bound_to_oneflow(module: types.ModuleType) -> bool:
    """A module imported while mock_torch was on, holding OneFlow as `torch`."""
    import oneflow.mock_torch as mock

    try:
        values = list(vars(module).values())
    except TypeError:
        return False
    for value in values:
        if isinstance(value, mock.ModuleWrapper):
            return True
        if isinstance(value, types.ModuleType) and value.__name__.split(".")[0] == "oneflow":
            return True
    return False


@contextlib.contextmanager
def active() -> Iterator[types.ModuleType]:
    """sys.modules holds the OneFlow diffusers copy and `torch` is OneFlow, inside only."""
    with _LOCK:
        path = _LOADED.get("path") or flow_diffusers_path()
        if path is None:
            raise ImportError("no diffusers copy for OneFlow was found (FLOW_DIFFUSERS_PATH)")
        install_shims()
        before = set(sys.modules)
        saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _is_diffusers(name)}
        sys.modules.update(_FLOW_MODULES)
        sys.path.insert(0, path)
        mock = _MOCK_NS["enter"]()
        try:
            root = importlib.import_module("diffusers")
            if not str(getattr(root, "__file__", "")).startswith(path):
                raise ImportError(f"expected the diffusers copy in {path}, got {getattr(root, '__file__', '?')}")
            yield root
        finally:
            mock.__exit__(None, None, None)
            for name in list(sys.modules):
                if _is_diffusers(name):
                    _FLOW_MODULES[name] = sys.modules.pop(name)
            sys.modules.update(saved)
            try:
                sys.path.remove(path)
            except ValueError:
                pass
            for name in set(sys.modules) - before:
                module = sys.modules.get(name)
                if module is None or name.split(".")[0] == "oneflow":
                    continue
                if _bound_to_oneflow(module):  # e.g. safetensors.torch imported under the mock
                    _QUARANTINE[name] = sys.modules.pop(name)


def load() -> str:
    """Import the OneFlow diffusers copy once; returns its version."""
    with _LOCK:
        if "version" in _LOADED:
            return _LOADED["version"]
        for name in _PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # optional: the copy imports what it needs itself
                pass
        path = flow_diffusers_path()
        with active() as root:
            version = str(root.__version__)
        _LOADED.update(path=path or "", version=version)
        return version


def flow_class(torch_cls: type) -> Tuple[Optional[type], str]:
    """(the OneFlow copy's class for a torch diffusers class, None) or (None, why not)."""
    module_name = getattr(torch_cls, "__module__", "") or ""
    if not _is_diffusers(module_name):
        return None, (f"{torch_cls.__name__} (from {module_name or '?'}) is not a diffusers model; "
                      "the oneflow backend converts diffusers models only")
    version = load()
    with active() as root:
        try:
            found = importlib.import_module(module_name)
            for part in torch_cls.__qualname__.split("."):
                found = getattr(found, part)
            return found, ""
        except Exception:  # moved or renamed between diffusers versions: try the top level
            pass
        try:
            found = getattr(root, torch_cls.__name__)
            return found, ""
        except Exception as error:
            return None, (f"diffusers {version} (the copy OneFlow imports) has no {torch_cls.__name__}: "
                          f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}")
