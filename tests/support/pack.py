"""The pack imported as a package, the way ComfyUI imports it, so nodes/ can `from ..compiler import ...`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def pack_module(package: str, name: str) -> ModuleType:
    """`package.name`, with the repository imported as `package` on first use.

    Each test module picks its own package name: the modules it gets are
    separate from the top-level `compiler` other tests import (own registries,
    own backend instances).
    """
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(package, REPO / "__init__.py",
                                                      submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.{name}")
