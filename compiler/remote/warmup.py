"""Worker start: pull from the library that an environment variable names, and report the time.

A container's start command runs `python -m compiler graphs pull URL DIR`
(or this module's `warm_up_from_env`) before ComfyUI starts; inside ComfyUI
the pack calls `warm_up_from_env` with its graphs folder. Either way the
library is named by `KEEPFAST_REMOTE_LIBRARY` and the worker serves its
first image from the pulled graphs with no compile. A library that cannot be
read is logged and the worker starts as it would without one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping, Optional

import torch

from ..settings import REMOTE_LIBRARY, REMOTE_UNSIGNED, remote_library, remote_unsigned
from .pull import PullResult, pull_for

REMOTE_LIBRARY_ENV = REMOTE_LIBRARY.name
UNSIGNED_ENV = REMOTE_UNSIGNED.name  # "1": also pull unsigned graphs (left untrusted)

log = logging.getLogger("keepfast")


def remote_library_url(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The remote library the environment names, or None."""
    return remote_library(environ)


def warm_up_from_env(folder: Path | str, module: Optional[torch.nn.Module] = None, block_family=None,
                     environ: Mapping[str, str] = os.environ) -> Optional[PullResult]:
    """Pull the graphs that fit this machine (and `module`, if given) from $KEEPFAST_REMOTE_LIBRARY into
    `folder`; None when the variable is unset. The result carries the time taken; it never raises."""
    url = remote_library_url(environ)
    if url is None:
        return None
    result = pull_for(url, folder, module=module, block_family=block_family,
                      accept_unsigned=remote_unsigned(environ))
    log.info("[KeepFast] warm-up from %s: %d graphs pulled, %d already here in %.2f s", url,
             len(result.pulled), len([o for o in result.outcomes if o.status.value == "present"]), result.seconds)
    return result
