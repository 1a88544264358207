"""Whether torch's AOTInductor loader survives a GPU package on this machine, asked once per machine.

On the GPU machines this project is lent (an H100 with torch 2.11+cu130, 2026-11-27), torch's package loader
killed the process with SIGSEGV for every CUDA package: the SDXL UNet's, Flux's and Wan's block graphs, a
50-line module's, and torch's own example (aoti_compile_and_package, then aoti_load_package; the bench's
load_probe.py ran them side by side, each in its own process). A crash in ComfyUI's process is a lost workflow,
so a GPU package is never loaded here before one loaded in another process of this machine:

- a build process loads each GPU package it built before handing it over (build_process/child.py); when that
  kills it, the build fails with the reason and this machine's verdict is "crashes";
- a package this process did not see built (a saved graph at a restart, another machine's graph) is loaded
  first by `python package_loader.py PACKAGE` in a process of its own, once per machine;
- the verdict is kept per machine (device kind, torch and CUDA versions, GPU, driver) in
  package-loader.json beside the trust list: once a loader crashed, no package of that kind is built (minutes
  for a package that cannot load) or loaded; a whole model's graphs are compiled by torch.compile in this process
  instead (backends.serving_backend: as fast, not saved), transformer blocks run eager, each with the reason.
  Once one loaded, later loads run here at once. Another torch or driver is another machine: asked again.

The cause on those machines was found on an H200 (2026-11-27): their g++ found only libstdc++.a and linked the
C++ runtime statically into every model library (cxx_linkage.py, which now links it as a shared library or builds
no package). This check stays for causes not yet seen; verdicts recorded before that fix do not stand
(LINKAGE_MARK in every machine key).

A CPU package is loaded here as before (it has loaded on every machine the pack ran on); KEEPFAST_LOADER_CHECK=all
checks those too (the tests use it: this machine has no GPU).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from ..settings import LOADER_CHECK, LOADER_VERDICTS, loader_check, loader_verdicts
from ..store import file_lock
from ..store.atomic import write_bytes

log = logging.getLogger("keepfast")

CHILD = Path(__file__).with_name("package_loader.py")  # what a check runs (tests put a script of their own here)
VERDICTS_ENV = LOADER_VERDICTS.name
CHECK_ENV = LOADER_CHECK.name  # "all": CPU packages too; "0": never (a machine the user vouches for)
TIMEOUT_S = 300.0  # a check loads one package (seconds); a slow disk or a busy GPU may take longer
# In every machine key: verdicts recorded before the pack linked libstdc++ as a shared library (cxx_linkage.py, the
# cause of the GPU machines' crashes) are not this pack's. A constant, not a compiler call: loading saved graphs
# calls no compiler.
LINKAGE_MARK = "libstdc++ shared"
LOADING_MARK = "loading"  # written by a build process before it loads its package (its content: the device kind)


class Verdict(NamedTuple):
    loads: bool
    reason: str  # what was seen, for the log and the fallback's reason


def kind_of(device: str) -> str:
    """The device kind of "cuda:0", a torch.device, or a graph family's "cuda-sm90"."""
    return str(device).split(":")[0].split("-")[0]


def applies(kind: str) -> bool:
    """Whether packages of device kind `kind` are loaded elsewhere before they are loaded here."""
    setting = loader_check()
    if setting == "0":
        return False
    return kind != "cpu" or setting == "all"


def verdicts_path() -> Path:
    configured = loader_verdicts()
    if configured:
        return Path(configured)
    from ..store.trust import default_trust_path

    return default_trust_path().with_name("package-loader.json")


def _driver() -> str:
    try:
        version = torch._C._cuda_getDriverVersion()  # e.g. 13000; not a public API: absent, the key says so
        return f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # noqa: BLE001
        return "unknown"


@functools.lru_cache(maxsize=8)
def machine_key(kind: str) -> str:
    """What the verdict depends on: the device kind, torch, its CUDA, the GPU and the driver (asked once per
    process: the GPU's name and the driver's version are driver calls)."""
    parts = [kind, f"torch {torch.__version__}"]
    if kind == "cuda":
        parts.append(f"cuda {torch.version.cuda}")
        try:
            parts.append(torch.cuda.get_device_name())
        except Exception:  # noqa: BLE001 - no GPU visible: the key still names torch and its CUDA
            parts.append("no device")
        parts.append(f"driver {_driver()}")
    parts.append(LINKAGE_MARK)
    return " | ".join(parts)


def _read() -> Dict[str, dict]:
    try:
        data = json.loads(verdicts_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


_seen: Dict[Tuple[str, str], Verdict] = {}  # (verdicts file, machine key): a verdict once read or recorded here


def known(kind: str) -> Optional[Verdict]:
    """This machine's verdict for `kind`, None while nobody has seen a package of it load or crash here. Once
    found it is kept in memory (asked on every model call): a verdict only changes by `record`."""
    seen = (str(verdicts_path()), machine_key(kind))
    if seen in _seen:
        return _seen[seen]
    entry = _read().get(seen[1])
    if not isinstance(entry, dict) or not isinstance(entry.get("loads"), bool):
        return None
    _seen[seen] = Verdict(entry["loads"], str(entry.get("reason", "")))
    return _seen[seen]


def record(kind: str, loads: bool, reason: str) -> None:
    """Keep this machine's verdict (atomically: two processes may record at once; a write that fails leaves the
    question open, asked again next time)."""
    path = verdicts_path()
    key = machine_key(kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock.held(path.with_name("." + path.name + ".lock")):
            data = _read()
            if isinstance(data.get(key), dict) and data[key].get("loads") is False and loads:
                return  # a crash seen once stands: one package loading does not make the loader safe
            data[key] = {"loads": loads, "reason": reason,
                         "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
            write_bytes(path, json.dumps(data, indent=1).encode())
            _seen[(str(path), key)] = Verdict(data[key]["loads"], data[key]["reason"])
    except OSError as error:
        log.warning("could not keep the package loader's verdict in %s: %s", path, error)


def crash_reason(kind: str, returncode: int, where: str) -> str:
    """The reason a crashed load gives (`where`: which process loaded what)."""
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return (f"torch's AOTInductor package loader crashed ({name}) {where} on this machine "
            f"({machine_key(kind)}); {kind} packages are not built or loaded here ({CHECK_ENV}=0 loads them "
            "anyway, once the loader is fixed)")


def refusal(kind: str) -> Optional[str]:
    """The reason packages of `kind` are not built or loaded here (a loader crash seen on this machine)."""
    if not applies(kind):
        return None
    verdict = known(kind)
    return verdict.reason if verdict is not None and not verdict.loads else None


def before_load(kind: str, package: Path) -> Optional[str]:
    """None when the package at `package` (a .pt2 file) may be loaded in this process, else the reason not to.
    Unknown on this machine: it is loaded first in a process of its own, and the verdict kept."""
    if not applies(kind):
        return None
    verdict = known(kind)
    if verdict is not None:
        return None if verdict.loads else verdict.reason
    log.info("loading a %s graph in a separate process first: this machine's package loader has not been seen "
             "to load one (%s)", kind, machine_key(kind))
    try:
        done = subprocess.run([sys.executable, str(CHILD), str(package)], capture_output=True, text=True,
                              timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"a separate process loading the {kind} graph did not finish in {TIMEOUT_S:.0f} s; not loaded here"
    except OSError as error:
        return f"a separate process to load the {kind} graph could not start ({error}); not loaded here"
    if done.returncode == 0:
        record(kind, True, "a package loaded in a separate process")
        return None
    if done.returncode < 0:
        reason = crash_reason(kind, done.returncode, f"loading a {kind} graph in a separate process")
        record(kind, False, reason)
        log.warning("%s", reason)
        return reason
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no message"]
    return f"the {kind} graph did not load in a separate process ({tail[0][:300]}); not loaded here"
