"""torch's AOTInductor package loader made to crash as it did on an H100 (torch 2.11+cu130):
the process that constructs one dies with SIGSEGV. Used by the child scripts beside this file
(tests/backends/test_loader_check.py); this machine has no GPU whose loader crashes."""

import os
import signal

import torch


def _crash(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGSEGV)


def install() -> None:
    torch._C._aoti.AOTIModelPackageLoader = _crash
