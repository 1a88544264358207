"""Whether the oneflow backend can run here, and why not.

Cheap where oneflow is absent (a spec lookup, no import), which is what the
main environment sees: oneflow 0.9.0 is published for CPython 3.10 only.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from typing import Optional

FLOW_DIFFUSERS_VERSION = "0.31.0"
SETUP_HINT = ".ci/setup_oneflow.sh builds a Python 3.10 environment with it"

_IMPORT_ERROR: Optional[str] = None
_IMPORT_TRIED = False


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:300]


def oneflow_import_error() -> Optional[str]:
    """None if `import oneflow` works, else why not (imports oneflow once)."""
    global _IMPORT_ERROR, _IMPORT_TRIED
    if _IMPORT_TRIED:
        return _IMPORT_ERROR
    python = "%d.%d" % sys.version_info[:2]
    if importlib.util.find_spec("oneflow") is None:
        _IMPORT_ERROR = (
            f"oneflow is not installed (pip install oneflow==0.9.0 needs Python 3.10, this is Python {python}; "
            f"{SETUP_HINT})"
        )
    else:
        try:
            import oneflow  # noqa: F401
        except Exception as error:  # ImportError, OSError from missing CUDA libraries, ...
            hint = ""
            if "lib" in str(error) and ".so" in str(error):
                hint = ("; its CUDA libraries (nvidia-cudnn-cu11, nvidia-cublas-cu11) must be on LD_LIBRARY_PATH "
                        "before Python starts")
            _IMPORT_ERROR = f"oneflow is installed but does not import: {type(error).__name__}: {_first_line(error)}{hint}"
        else:
            _IMPORT_ERROR = None
    _IMPORT_TRIED = True
    return _IMPORT_ERROR


def flow_diffusers_path() -> Optional[str]:
    """The folder holding the diffusers copy that is imported under oneflow.mock_torch.

    FLOW_DIFFUSERS_PATH if set, else <sys.prefix>/flow-diffusers-<version>
    (where .ci/setup_oneflow.sh installs it).
    """
    candidates = []
    if os.environ.get("FLOW_DIFFUSERS_PATH"):
        candidates.append(os.environ["FLOW_DIFFUSERS_PATH"])
    candidates.append(os.path.join(sys.prefix, f"flow-diffusers-{FLOW_DIFFUSERS_VERSION}"))
    candidates += sorted(glob.glob(os.path.join(sys.prefix, "flow-diffusers-*")))
    for path in candidates:
        if os.path.isfile(os.path.join(path, "diffusers", "__init__.py")):
            return os.path.abspath(path)
    return None


def oneflow_unavailable_reason() -> Optional[str]:
    """None if OneFlow imports here. (Converting a diffusers model also needs the diffusers copy:
    flow_diffusers_missing_reason; ComfyUI's models do not.)"""
    return oneflow_import_error()


def flow_diffusers_missing_reason() -> Optional[str]:
    if flow_diffusers_path() is not None:
        return None
    where = os.environ.get("FLOW_DIFFUSERS_PATH") or os.path.join(sys.prefix, f"flow-diffusers-{FLOW_DIFFUSERS_VERSION}")
    return (
        f"the oneflow backend builds diffusers models from a copy of diffusers {FLOW_DIFFUSERS_VERSION} "
        f"(newer diffusers do not import under oneflow.mock_torch); none at {where}: "
        f"pip install --no-deps --target {where} diffusers=={FLOW_DIFFUSERS_VERSION} (or set FLOW_DIFFUSERS_PATH)"
    )


def runtime_state_supported() -> bool:
    """Whether this OneFlow can serialise a compiled nn.Graph (newer than 0.9.0)."""
    if oneflow_import_error():
        return False
    import oneflow

    graph = oneflow.nn.Graph
    return hasattr(graph, "runtime_state_dict") and hasattr(graph, "load_runtime_state_dict")


def persist_unavailable_reason() -> Optional[str]:
    """None if compiled graphs can be saved, else why not."""
    reason = oneflow_import_error()
    if reason:
        return reason
    if runtime_state_supported():
        return None
    import oneflow

    return (
        f"OneFlow {oneflow.__version__} cannot serialise compiled graphs (nn.Graph has no runtime_state_dict); "
        "graphs are rebuilt on load"
    )
