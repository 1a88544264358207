"""The pack's one exception boundary: an unexpected exception while serving a call becomes a reason.

Whole-model dispatch (`CompiledForward.serve`, `warmup`) and block serving
(`BlockServer.call`) both name the stage they are in with `stage(...)` and
turn whatever escapes it into a `Failure` with `contain(...)`: the caller then
runs the eager forward and records the failure's text as the reason. A bug in
the pack can cost speed, never an image. Exceptions the dispatchers expect
(a call that does not bind, a graph that does not fit, no room for a compile
yet) pass through `stage` unchanged, for their own handling.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

from ..backends.base import CannotServe, CompileDeferred, CompileFailed, GraphMismatch, GuardsUnknown
from ..keys.binding import CallDoesNotBind
from ..keys.signature import UnsupportedCall

log = logging.getLogger("keepfast")


class Failure(Exception):
    """An unexpected exception inside the pack, with the stage it happened in."""

    def __init__(self, stage: str, error: BaseException):
        super().__init__(f"{stage} failed unexpectedly: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error


EXPECTED = (Failure, CompileDeferred, GraphMismatch, GuardsUnknown, UnsupportedCall, CallDoesNotBind, CannotServe)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Name the stage an unexpected exception came from (`contain` reports it)."""
    try:
        yield
    except EXPECTED:
        raise
    except Exception as error:
        raise Failure(name, error) from error


def expected_failure(error: Exception) -> Exception:
    """A failed build's CompileFailed as it was raised, where `stage` wrapped it: its reason, not a pack bug's."""
    if isinstance(error, Failure) and isinstance(error.error, CompileFailed):
        return error.error
    return error


def contain(label: str, error: Exception, default_stage: str) -> Failure:
    """The failure to report for `error` (stage named, or `default_stage`), logged with its traceback at debug."""
    failure = error if isinstance(error, Failure) else Failure(default_stage, error)
    log.warning("%s: %s", label, failure)
    log.debug("%s: traceback of the failure", label, exc_info=failure.error)
    return failure
