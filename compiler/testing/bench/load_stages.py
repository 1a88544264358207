"""The load of one CUDA AOTInductor package, one step per process, and what the machine has that the load uses.

The H100 run of 2026-11-27 (torch 2.11+cu130) saw torch's own `aoti_load_package` die with SIGSEGV inside the
`AOTIModelPackageLoader` constructor. That constructor extracts the archive, reads its metadata, dlopens the
model's .so (its library initialisers run), starts a proxy executor where the package has a fallback-ops .json,
and creates the model container (cudaMalloc, the weights copied in); the kernels' cubins load at the first run
only. So the package is loaded here in steps, each in its own process, to name the step that crashes:

- `stage_dlopen`: torch imported and CUDA initialised, then only `dlopen` of the model's .so (RTLD_NOW);
- `stage_runner`: torch's container runner on the .so alone (AOTIModelContainerRunnerCuda: dlopen + container),
  then one run;
- `stage_package`: torch's package loader on the .pt2 (AOTIModelPackageLoader), then one run.

`machine_facts` records what the load depends on (driver, the libcuda the linker finds, the .so's dynamic
section and unresolved symbols, /tmp's mount options). `c_stack_preload` builds, with the machine's gcc, a
library that prints the C stack (glibc's backtrace) of a process that dies with SIGSEGV, SIGBUS or SIGABRT:
LD_PRELOADed into each step, it names the library and function of a crash without a debugger.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Dict, List, Optional

STAGES = ("stage_dlopen", "stage_runner", "stage_package")

# Python's faulthandler, enabled after this library's constructor ran, restores the handler it replaced (this one)
# and raises the signal again once it has printed Python's stack: both stacks reach the log.
C_STACK_SOURCE = r"""
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void keepfast_print_c_stack(int signum) {
    void *frames[96];
    int count = backtrace(frames, 96);
    const char *head = "\n--- C stack (keepfast c_stack_preload) ---\n";
    write(2, head, strlen(head));
    backtrace_symbols_fd(frames, count, 2);
    write(2, "--- end of C stack ---\n", 23);
    signal(signum, SIG_DFL);
    raise(signum);
}

__attribute__((constructor)) static void keepfast_install(void) {
    signal(SIGSEGV, keepfast_print_c_stack);
    signal(SIGBUS, keepfast_print_c_stack);
    signal(SIGABRT, keepfast_print_c_stack);
}
"""


def _run(command: List[str], timeout: float = 20.0, env: Optional[dict] = None) -> str:
    """A command's output (stdout and stderr), or why it gave none; never raises."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.SubprocessError) as error:
        return f"not run: {type(error).__name__}: {error}"
    text = (done.stdout + done.stderr).strip()
    return (text[-4000:] if text else "(no output)") + ("" if done.returncode == 0 else f" [rc {done.returncode}]")


def c_stack_preload(work: Path) -> Optional[Path]:
    """The C-stack printer built for this machine (None where gcc is missing or the build failed)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    source, library = work / "c_stack.c", work / "c_stack.so"
    source.write_text(C_STACK_SOURCE)
    built = subprocess.run([compiler, "-shared", "-fPIC", "-O0", "-o", str(library), str(source)],
                           capture_output=True, text=True)
    return library if built.returncode == 0 and library.is_file() else None


def model_library(package: Path, into: Path) -> Path:
    """The package extracted into `into`; the model's .so (the one beside the package's metadata)."""
    with zipfile.ZipFile(package) as archive:
        archive.extractall(into)
    libraries = sorted(into.rglob("*.so"))
    if not libraries:
        raise FileNotFoundError(f"no .so in {package}")
    return libraries[0]


def machine_facts(library: Optional[Path] = None) -> Dict[str, str]:
    """What a CUDA package's load uses on this machine, as the commands that tell it print it."""
    import torch

    facts: Dict[str, str] = {
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda}, git {getattr(torch.version, 'git_version', '?')})",
        "env": "; ".join(f"{k}={os.environ.get(k, '')}" for k in ("CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH",
                                                                   "LIBRARY_PATH", "TMPDIR", "LD_PRELOAD")),
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total",
                            "--format=csv,noheader"]),
        "gcc": _run(["gcc", "--version"]).splitlines()[0],
        "libcuda_for_the_linker": _run(["gcc", "-print-file-name=libcuda.so"]),
        "libcuda_in_ldconfig": _run(["sh", "-c", "ldconfig -p | grep -E 'libcuda\\.so|libcudart\\.so' | head -8"]),
        "tmp_mount": _run(["sh", "-c", "findmnt -no FSTYPE,OPTIONS --target /tmp || mount | grep ' /tmp '"]),
    }
    try:
        facts["torch_cuda_driver"] = str(torch._C._cuda_getDriverVersion()) if torch.cuda.is_available() else "-"
    except Exception as error:  # noqa: BLE001 - a fact, not a requirement
        facts["torch_cuda_driver"] = f"{type(error).__name__}: {error}"
    if library is not None:
        facts["so_dynamic"] = _run(["readelf", "-d", str(library)])
        facts["so_ldd"] = _run(["ldd", "-r", str(library)])
    return facts


def run_stage(name: str, package: Path, work: Path, device: str, inputs: list) -> List[str]:
    """One step of the load, in a process of its own: each step is printed ("STEP ...") as it is reached, so the
    log of a process that crashed says how far it got."""
    import ctypes

    import torch

    class Steps(list):
        def append(self, step: str) -> None:
            print(f"STEP {step}", flush=True)
            super().append(step)

    steps: List[str] = Steps()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.init()
        steps.append("cuda initialised")
    library = model_library(package, work / f"{name}-extracted")
    steps.append(f"extracted: {library.name}")
    if name == "stage_dlopen":
        ctypes.CDLL(str(library), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        steps.append("dlopen returned")
        return steps
    if name == "stage_runner":
        runner = (torch._C._aoti.AOTIModelContainerRunnerCuda(str(library), 1, device, str(library.parent)) if cuda
                  else torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1))
    elif name == "stage_package":
        runner = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
    else:
        raise ValueError(f"no stage {name!r}: {', '.join(STAGES)}")
    steps.append("constructed")
    with torch.no_grad():
        runner.run(inputs)
    if cuda:
        torch.cuda.synchronize()
    steps.append("ran")
    return steps
