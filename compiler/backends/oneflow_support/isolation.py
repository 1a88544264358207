"""OneFlow-backed copies of model packages next to the real ones, in one process.

OneFlow modules are built from a second copy of the package that defines the
torch model -- diffusers (a 0.31.0 copy, the newest that imports under OneFlow
0.9.0's `mock_torch`), or a package another part of the pack registers
(`register_package`: the ComfyUI nodes register `comfy`) -- imported while
`import torch` yields oneflow. The copies' modules are kept here, out of
`sys.modules`, and put back only while OneFlow code needs them (building a
module, tracing a graph), so the real `torch`, `diffusers` and `comfy` are what
every other import in the process sees.

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
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from . import shims
from .availability import FLOW_DIFFUSERS_VERSION, flow_diffusers_missing_reason, flow_diffusers_path

_LOCK = threading.RLock()
_FLOW_MODULES: Dict[str, types.ModuleType] = {}
_QUARANTINE: Dict[str, types.ModuleType] = {}
_LOADED: Dict[str, str] = {}  # "path", "version" of the diffusers copy
IMPORT_ERRORS: Dict[str, str] = {}  # root -> why its OneFlow copy did not import at the last activation

# `oneflow.mock_torch.enable()` edits its caller's globals (drops `torch`,
# adds `torch.*` keys): call it from a namespace of its own.
_MOCK_NS: dict = {}
exec(
    "def enter():\n"
    "    import oneflow.mock_torch as m\n"
    "    return m.enable()\n",
    _MOCK_NS,
)


@dataclass(frozen=True)
class FlowPackage:
    """A package that is imported a second time, under `mock_torch`, to build OneFlow modules.

    root:      the top-level package name ("diffusers", "comfy").
    path:      the folder of another version of the package, put first on
               sys.path while active; "" for the real package's own files;
               None when the copy is not available here.
    shared:    submodules both copies use, not imported twice (pure-Python
               state such as ComfyUI's parsed command line).
    stand_ins: given the real package's modules, modules the copy imports in
               place of its own (e.g. one that would query the GPU at import).
    blocked:   other top-level modules the copy must see as not installed
               (a torch-bound extension it would otherwise pick up).
    preload:   real modules imported before the copy, so it finds them instead
               of importing them bound to oneflow.
    """

    root: str
    path: Callable[[], Optional[str]] = lambda: ""
    shared: Tuple[str, ...] = ()
    stand_ins: Callable[[Dict[str, types.ModuleType]], Dict[str, types.ModuleType]] = lambda real: {}
    blocked: Tuple[str, ...] = ()
    preload: Tuple[str, ...] = ()

    def owns(self, name: str) -> bool:
        return in_package(name, self.root)


def in_package(name: str, root: str) -> bool:
    """`name` is the module `root` or one of its submodules."""
    return name == root or name.startswith(root + ".")


_PACKAGES: Dict[str, FlowPackage] = {
    "diffusers": FlowPackage(
        root="diffusers", path=flow_diffusers_path,
        # Where transformers is installed (always, next to ComfyUI) the copy would import its model code
        # under the mock, which fails; UNet and VAE do not need it.
        blocked=("transformers",),
        preload=("huggingface_hub", "safetensors", "safetensors.torch", "PIL.Image", "regex", "requests", "filelock"),
    ),
}
_PRELOADED: set = set()


def register_package(package: FlowPackage) -> None:
    """Make `active()` swap in a OneFlow copy of `package.root` too (replaces an earlier one)."""
    with _LOCK:
        if _PACKAGES.get(package.root) != package:
            for name in [n for n in _FLOW_MODULES if package.owns(n)]:
                del _FLOW_MODULES[name]  # a copy imported under the old description
        _PACKAGES[package.root] = package


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


def _preload(packages: List[FlowPackage]) -> None:
    for package in packages:
        for name in package.preload:
            if name in _PRELOADED:
                continue
            _PRELOADED.add(name)
            try:
                importlib.import_module(name)
            except Exception:  # optional: the copy imports what it needs itself
                pass


@contextlib.contextmanager
def active() -> Iterator[Dict[str, types.ModuleType]]:
    """Inside: `torch` is OneFlow and sys.modules holds the OneFlow copy of every registered
    package that can be imported here. Yields {root name: the copy's root module}; a package
    whose copy does not import is left out (IMPORT_ERRORS says why)."""
    _MISSING = object()
    with _LOCK:
        shims.install()
        packages = [(p, where) for p, where in ((p, p.path()) for p in _PACKAGES.values()) if where is not None]
        _preload([p for p, _ in packages])
        before = set(sys.modules)
        saved = {name: sys.modules.pop(name) for name in list(sys.modules)
                 if any(p.owns(name) for p, _ in packages)}
        blocked = {name: sys.modules.get(name, _MISSING) for p, _ in packages for name in p.blocked}
        for name in blocked:
            sys.modules[name] = None  # import raises ImportError: the copy takes its fallback path
        sys.modules.update(_FLOW_MODULES)
        shared_names = {name for p, _ in packages for name in p.shared}
        for package, _ in packages:
            for name in package.shared:
                if name in saved:
                    sys.modules[name] = saved[name]
            real = {name: module for name, module in saved.items() if package.owns(name)}
            for name, module in package.stand_ins(real).items():
                sys.modules.setdefault(name, module)
        paths = [where for _, where in packages if where]
        for where in paths:
            sys.path.insert(0, where)
        mock = _MOCK_NS["enter"]()
        try:
            roots = {}
            for package, where in packages:
                try:
                    root = importlib.import_module(package.root)
                except ImportError as error:  # this one cannot be built here; the others still can
                    IMPORT_ERRORS[package.root] = f"{type(error).__name__}: {error}"
                    continue
                IMPORT_ERRORS.pop(package.root, None)
                if where and not str(getattr(root, "__file__", "")).startswith(where):
                    raise ImportError(f"expected the {package.root} copy in {where}, got {getattr(root, '__file__', '?')}")
                for name in list(package.shared) + [n for n in sys.modules if package.owns(n) and "." in n]:
                    parent, _, child = name.rpartition(".")
                    if parent == package.root and sys.modules.get(name) is not None:
                        setattr(root, child, sys.modules[name])  # `import comfy.x; comfy.x` must find it
                roots[package.root] = root
            yield roots
        finally:
            mock.__exit__(None, None, None)
            for name in list(sys.modules):
                if any(p.owns(name) for p, _ in packages):
                    module = sys.modules.pop(name)
                    if name not in shared_names:
                        _FLOW_MODULES[name] = module
            sys.modules.update(saved)
            for name, module in blocked.items():
                if module is _MISSING:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
            for where in paths:
                try:
                    sys.path.remove(where)
                except ValueError:
                    pass
            for name in set(sys.modules) - before:
                module = sys.modules.get(name)
                if module is None or name.split(".")[0] == "oneflow":
                    continue
                if _bound_to_oneflow(module):  # e.g. safetensors.torch imported under the mock
                    _QUARANTINE[name] = sys.modules.pop(name)


def flow_copy_missing(root: str) -> str:
    """Why the OneFlow copy of the package `root` was left out of the last `active()`."""
    return IMPORT_ERRORS.get(root, "it is not importable here")


def load() -> str:
    """Import the OneFlow diffusers copy once; returns its version."""
    with _LOCK:
        if "version" in _LOADED:
            return _LOADED["version"]
        path = flow_diffusers_path()
        if path is None:
            raise ImportError(flow_diffusers_missing_reason())
        with active() as roots:
            if "diffusers" not in roots:
                raise ImportError(f"the diffusers copy in {path} does not import under OneFlow: "
                                  f"{IMPORT_ERRORS.get('diffusers', '?')}")
            version = str(roots["diffusers"].__version__)
        _LOADED.update(path=path, version=version)
        return version


def find_in_copy(module_name: str, qualname: str):
    """The object named `qualname` in the OneFlow copy's `module_name`; call inside active()."""
    if "<locals>" in qualname:
        raise LookupError(f"{module_name}.{qualname} is defined inside a function: the copy has no such name")
    found = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def flow_class(torch_cls: type) -> Tuple[Optional[type], str]:
    """(the OneFlow copy's class for a torch diffusers class, "") or (None, why not)."""
    module_name = getattr(torch_cls, "__module__", "") or ""
    if not _PACKAGES["diffusers"].owns(module_name):
        return None, f"{torch_cls.__name__} (from {module_name or '?'}) is not a diffusers model"
    try:
        version = load()
    except ImportError as error:
        return None, str(error)
    with active() as roots:
        try:
            return find_in_copy(module_name, torch_cls.__qualname__), ""
        except Exception:  # moved or renamed between diffusers versions: try the top level
            pass
        try:
            return getattr(roots["diffusers"], torch_cls.__name__), ""
        except Exception as error:
            text = str(error).strip()
            return None, (f"diffusers {version} (the copy OneFlow imports) has no {torch_cls.__name__}: "
                          f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}")


__all__ = ["FlowPackage", "FLOW_DIFFUSERS_VERSION", "active", "find_in_copy", "flow_class", "load",
           "register_package"]
