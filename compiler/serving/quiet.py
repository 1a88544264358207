"""Third-party notices the pack's own calls trigger, silenced around those calls only.

`third_party_quiet()` is a context manager for the demo and the command line:
inside it, the notices below are dropped; outside it nothing changes (no
filter is installed at import, and every other warning and log line still
shows). Each entry matches one message, never a whole category or logger:

- torch 2.13's FutureWarning "`isinstance(treespec, LeafSpec)` is deprecated",
  printed as `return cls.__new__(cls, *args)` from copyreg: Inductor deep-copies
  every graph it compiles, and the copy rebuilds a deprecated LeafSpec;
- transformers' "`CLIPImageProcessor` requires torchvision (not installed);
  falling back to ..." (diffusers' pipelines import the image processors);
- diffusers' "There are modules in UNet2DConditionModel that should be kept in
  float32: []" from `.to(dtype)`: with an empty list there is nothing to keep;
- torch's "No CUDA runtime is found, using CUDA_HOME=..." (a CUDA build of
  torch on a machine without a GPU, logged when Inductor first builds C++).

`warnings.catch_warnings` swaps the process's warning filters, and leaving it
makes Python forget which warnings it already showed once: scope it around a
whole command or a compile (the nodes get it there: `GraphSupply.compile`
and the block export), never around each call of a model.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from typing import Dict, Iterator, Tuple, Type

# (category, start of the message) of warnings.warn calls
WARNINGS: Tuple[Tuple[Type[Warning], str], ...] = (
    (FutureWarning, re.escape("`isinstance(treespec, LeafSpec)` is deprecated")),
)

# logger name -> pattern of the one message dropped from it
LOG_LINES: Dict[str, str] = {
    "transformers.utils.import_utils": r"`\w+` requires torchvision \(not installed\); falling back to",
    "diffusers.models.modeling_utils": r"There are modules in \w+ that should be kept in float32: \[\]\.",
    "torch.utils.cpp_extension": r"No CUDA runtime is found",
}


class _DropMessage(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the library's to report, not ours to hide
            return True
        return not self.pattern.search(message)


@contextlib.contextmanager
def third_party_quiet() -> Iterator[None]:
    filters = [(logging.getLogger(name), _DropMessage(pattern)) for name, pattern in LOG_LINES.items()]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            for category, message in WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)
