"""Which torch versions the pack serves: one place for the oldest it takes and the ones it was tested on.

The pack runs under the torch of the user's ComfyUI. It relies on torch.export's
size-oblivious tracing and derived dims, AOTInductor's package loader with a
device index and user-managed constants, and `torch.compiler.set_stance`; the
oldest torch it was run on with all of those is 2.11 (the CUDA 13 images). An
older torch is refused whole, before anything is traced, with the reason (every
call then runs the model as it is), instead of compiling with half the features
and failing later. A torch newer than the newest tested is used, with a note.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

import torch

OLDEST = (2, 11)
# Where each was run: the main suite on 2.13 (CI) and on 2.11 (.ci/torch211_leg.sh, a subset); ComfyUI's tests
# on 2.14.1 (ComfyUI's own virtualenv); the GPU device check on 2.11+cu130.
TESTED = ((2, 11), (2, 13), (2, 14))


def version_tuple(version: Optional[str] = None) -> Tuple[int, int]:
    """(major, minor) of a torch version string (this torch's by default); (0, 0) if it cannot be read."""
    parts = re.findall(r"\d+", version if version is not None else torch.__version__)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


def _name(version: Tuple[int, int]) -> str:
    return ".".join(map(str, version))


def refusal(version: Optional[str] = None) -> Optional[str]:
    """Why this torch is not used to compile (None: it is)."""
    found = version if version is not None else torch.__version__
    if version_tuple(found) < OLDEST:
        return (f"torch {found} is older than {_name(OLDEST)}, the oldest torch KeepFast compiles with "
                f"(tested: {', '.join(_name(v) for v in TESTED)}); models run uncompiled. Update the torch of "
                f"this ComfyUI to use the pack")
    return None


def untested_note(version: Optional[str] = None) -> Optional[str]:
    """A note when this torch is newer than the newest tested (None: it was tested, or is refused)."""
    found = version if version is not None else torch.__version__
    if refusal(found) is None and version_tuple(found) > max(TESTED):
        return (f"torch {found} is newer than the newest torch KeepFast was tested with ({_name(max(TESTED))}); "
                f"graphs are still checked against the model on first use")
    return None


__all__ = ["OLDEST", "TESTED", "refusal", "untested_note", "version_tuple"]
