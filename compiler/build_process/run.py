"""The build process's one entry point, run by path: `python compiler/build_process/run.py JOB_FOLDER`.

ComfyUI imports the pack under its folder's name, which a child process cannot import. This script enters
the `compiler` folder as the package `keepfast_compiler` without running its `__init__` (nothing but what the
build imports is loaded), then hands over to `build_process.child`. Tests that stand in for the child call
`child_module()` the same way.
"""

import importlib
import sys
import types
from pathlib import Path

PACKAGE = "keepfast_compiler"


def child_module():
    """build_process/child.py, imported as `keepfast_compiler.build_process.child`."""
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(Path(__file__).resolve().parent.parent)]
        sys.modules[PACKAGE] = package
    return importlib.import_module(f"{PACKAGE}.build_process.child")


if __name__ == "__main__":
    sys.exit(child_module().run(sys.argv[1:]))
