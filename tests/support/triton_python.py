"""The interpreter that can run Triton and Inductor's GPU code generation for a test: this one, or the one
KEEPFAST_TRITON_PYTHON names (the test command sets the torch 2.11 leg's, whose CUDA wheel brings Triton; the CPU
torch of the main suite has none)."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional


def triton_python() -> Optional[str]:
    """This interpreter where Triton imports, else KEEPFAST_TRITON_PYTHON, else None."""
    if importlib.util.find_spec("triton") is not None:
        try:
            import triton  # noqa: F401
            return sys.executable
        except Exception:
            pass
    return os.environ.get("KEEPFAST_TRITON_PYTHON")
