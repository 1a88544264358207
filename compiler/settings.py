"""Every KEEPFAST_* environment setting the pack reads: its name, its default, what it is for, and the function
that reads it. No other module reads a KEEPFAST_ variable (tests/test_settings.py checks it); docs/settings.md
lists the same table for users.

Each value is read when its function is called, never kept: a user (or a test, with monkeypatch.setenv) may change
it between calls. A setting the pack passes between its own processes (a build process's lifeline, its sweeper,
its compiler wrapper's log) is named here too, marked internal: nobody sets those by hand.

The standard library only, and nothing imported from the pack: files that run by their path with no package (the
compiler wrapper script build_process/interface_object.py, build_process/child_priority.py in a spawned trace
process) load this file by its path (`load_by_path` in those files).
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, NamedTuple, Optional, Union


class Setting(NamedTuple):
    name: str
    default: str  # as docs/settings.md shows it
    values: str  # what it takes
    purpose: str  # one line
    internal: bool = False  # passed between the pack's own processes, not set by users


SETTINGS: Dict[str, Setting] = {}


def _declare(name: str, default: str, values: str, purpose: str, internal: bool = False) -> Setting:
    setting = Setting(name, default, values, purpose, internal)
    SETTINGS[name] = setting
    return setting


Environ = Optional[Mapping[str, str]]


def get(setting: Union[Setting, str], environ: Environ = None) -> Optional[str]:
    """The setting's text as the environment (`environ`, else os.environ) has it now; None where unset. KeyError
    for a name not declared here."""
    name = setting.name if isinstance(setting, Setting) else SETTINGS[setting].name
    return (os.environ if environ is None else environ).get(name)


def _text(setting: Setting, environ: Environ = None) -> str:
    return get(setting, environ) or ""


# --- the trust list and the files kept beside it -------------------------------------------------------------
TRUST_FILE = _declare(
    "KEEPFAST_TRUST_FILE", "$XDG_CONFIG_HOME/keepfast/trusted.json (~/.config/keepfast/trusted.json)", "a path",
    "The trust list of graphs this machine loads; the files below default to its folder.")
BUILD_TIMES_FILE = _declare(
    "KEEPFAST_BUILD_TIMES_FILE", "build_times.json beside the trust list", "a path",
    "Where the times of past builds are kept (the 'about N s left' of a background build).")
ISA_CACHE = _declare(
    "KEEPFAST_ISA_CACHE", "inductor-isa-probe beside the trust list", "a folder",
    "Where build processes keep Inductor's vector-ISA probe (and, beside it, the pack's C++ compiler wrappers).")
LOADER_VERDICTS = _declare(
    "KEEPFAST_LOADER_VERDICTS", "package-loader.json beside the trust list", "a path",
    "Where this machine's verdicts on torch's package loader are kept (backends/loader_check.py).")


def trust_file() -> Optional[str]:
    """KEEPFAST_TRUST_FILE where set and not empty, else None (store/trust.py picks the default)."""
    return get(TRUST_FILE) or None


def build_times_file() -> Optional[str]:
    """KEEPFAST_BUILD_TIMES_FILE where set and not empty, else None (builds/times.py picks the default)."""
    return get(BUILD_TIMES_FILE) or None


def isa_cache() -> Optional[str]:
    """KEEPFAST_ISA_CACHE where set and not empty, else None (builds/package_builds.py picks the default)."""
    return get(ISA_CACHE) or None


def loader_verdicts() -> Optional[str]:
    """KEEPFAST_LOADER_VERDICTS where set and not empty, else None (backends/loader_check.py picks the default)."""
    return get(LOADER_VERDICTS) or None


# --- builds ---------------------------------------------------------------------------------------------------
BUILD_PROCESSES = _declare(
    "KEEPFAST_BUILD_PROCESSES", "one per two cores", "a whole number > 0",
    "How many graph builds run at once.")
GRAPH_PARTS = _declare(
    "KEEPFAST_GRAPH_PARTS", "as many as the builds at once take, at least 400 operations each",
    "a whole number > 0", "How many parts a program is cut into, built in parallel processes.")
SPARE_BUILDER = _declare(
    "KEEPFAST_SPARE_BUILDER", "1", "0 or 1",
    "0: start no build process ahead of its build (a spare imports torch while the graph is traced).")
BUILD_NICE = _declare(
    "KEEPFAST_BUILD_NICE", "10", "0 to 19",
    "How far below the caller's priority builds and traces run (0: the caller's priority).")
BUILD_MEMORY_MB = _declare(
    "KEEPFAST_BUILD_MEMORY_MB", "half of the machine's memory", "MB (0: no limit)",
    "The most a build may hold resident with its compilers before it is stopped.")
BUILD_MEMO = _declare(
    "KEEPFAST_BUILD_MEMO", "unset (off)", "a folder",
    "A folder of packages built before: a build of the same program copies its package instead of compiling.")
BUILD_STACKS = _declare(
    "KEEPFAST_BUILD_STACKS", "unset (off)", "a folder",
    "Build processes write their Python stacks there every 30 s (build-PID.txt): where a slow build is.")
CLAIM_WAIT_S = _declare(
    "KEEPFAST_CLAIM_WAIT_S", "1800", "seconds",
    "How long a blocking compile waits for another process's build of the same graph.")
INTERFACE_OBJECT = _declare(
    "KEEPFAST_INTERFACE_OBJECT", "1", "0 or 1",
    "0: compile AOTInductor's runtime interface in every package's wrapper, not once per compiler and torch.")
PERSISTENT_REDUCTIONS = _declare(
    "KEEPFAST_PERSISTENT_REDUCTIONS", "0", "0 or 1",
    "1: keep Inductor's persistent reductions over dynamic sizes in GPU programs (slow to build).")
CONV_LAYOUT = _declare(
    "KEEPFAST_CONV_LAYOUT", "unset (Inductor's choice)", "channels_last",
    "channels_last: GPU programs with 2-D convolutions run them channels-last (an experiment).")
DEFAULT_CLAIM_WAIT_S = 1800.0
DEFAULT_BUILD_NICE = 10
CHANNELS_LAST = "channels_last"


def build_processes() -> Optional[int]:
    """KEEPFAST_BUILD_PROCESSES where it is a whole number above 0, else None (one per two cores)."""
    configured = _text(BUILD_PROCESSES)
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return None


def graph_parts() -> Optional[int]:
    """KEEPFAST_GRAPH_PARTS where it is a whole number above 0, else None (tracing/program_split.py decides)."""
    configured = _text(GRAPH_PARTS)
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return None


def spare_builder() -> bool:
    """Whether build processes may start ahead of their builds (KEEPFAST_SPARE_BUILDER, anything but "0")."""
    return get(SPARE_BUILDER) != "0"


def build_nice() -> int:
    """KEEPFAST_BUILD_NICE where it is 0-19 (spaces around ignored), else 10."""
    configured = _text(BUILD_NICE).strip()
    if configured.isdigit() and int(configured) <= 19:
        return int(configured)
    return DEFAULT_BUILD_NICE


def build_memory_mb() -> Optional[float]:
    """KEEPFAST_BUILD_MEMORY_MB as a number where it is one (0: no limit), else None (half of the memory)."""
    value = _text(BUILD_MEMORY_MB)
    try:
        if value:
            return float(value)
    except ValueError:
        pass
    return None


def build_memo() -> str:
    """The folder KEEPFAST_BUILD_MEMO names ("" where unset)."""
    return _text(BUILD_MEMO).strip()


def build_stacks() -> Optional[str]:
    """The folder KEEPFAST_BUILD_STACKS names, or None where unset or empty."""
    return get(BUILD_STACKS) or None


def claim_wait_s() -> float:
    """KEEPFAST_CLAIM_WAIT_S in seconds (below 0: 0), else 1800 where unset or not a number."""
    value = get(CLAIM_WAIT_S)
    try:
        return max(0.0, float(DEFAULT_CLAIM_WAIT_S if value is None else value))
    except ValueError:
        return DEFAULT_CLAIM_WAIT_S


def interface_object() -> bool:
    """Whether torch's runtime interface is compiled once, not in every wrapper (KEEPFAST_INTERFACE_OBJECT not "0")."""
    return get(INTERFACE_OBJECT) != "0"


def persistent_reductions() -> bool:
    """Whether KEEPFAST_PERSISTENT_REDUCTIONS=1 keeps Inductor's persistent-reduction default."""
    return _text(PERSISTENT_REDUCTIONS).strip() == "1"


def conv_layout() -> str:
    """KEEPFAST_CONV_LAYOUT, stripped and lower case ("" where unset)."""
    return _text(CONV_LAYOUT).strip().lower()


def conv_channels_last() -> bool:
    """Whether KEEPFAST_CONV_LAYOUT asks for channels-last convolutions in GPU programs."""
    return conv_layout() == CHANNELS_LAST


# --- tracing --------------------------------------------------------------------------------------------------
TRACE_PROCESS = _declare(
    "KEEPFAST_TRACE_PROCESS", "1 (a forked process where it can, else a spawned one for CUDA)", "1, 0 or spawn",
    "Where a graph is traced: 0 in the caller; spawn in a spawned process even where a fork could.")
TRACE_TIMEOUT_S = _declare(
    "KEEPFAST_TRACE_TIMEOUT_S", "300", "seconds",
    "How long a trace process may run before it is killed (the caller traces then).")
ALIGN = _declare(
    "KEEPFAST_ALIGN", "1", "0 or 1",
    "0: whole-model graphs are traced on free sizes, not on multiples of the model's downsampling.")
TRACE_SPAWN = "spawn"
DEFAULT_TRACE_TIMEOUT_S = 300.0


def trace_process() -> str:
    """KEEPFAST_TRACE_PROCESS as set ("1" where unset): "0" traces in the caller, "spawn" in a spawned process."""
    value = get(TRACE_PROCESS)
    return "1" if value is None else value


def trace_timeout_s() -> float:
    """KEEPFAST_TRACE_TIMEOUT_S in seconds, else 300 where unset, empty or not a number."""
    value = _text(TRACE_TIMEOUT_S)
    try:
        return float(value) if value else DEFAULT_TRACE_TIMEOUT_S
    except ValueError:
        return DEFAULT_TRACE_TIMEOUT_S


def align() -> bool:
    """Whether graph size ranges are aligned to the model's strides (KEEPFAST_ALIGN not "0")."""
    return get(ALIGN) != "0"


# --- loading and serving --------------------------------------------------------------------------------------
LOADER_CHECK = _declare(
    "KEEPFAST_LOADER_CHECK", "unset (GPU packages)", "all or 0",
    "Which packages are loaded in another process before this one loads them: all (CPU too) or 0 (none).")
CUDA_GRAPHS = _declare(
    "KEEPFAST_CUDA_GRAPHS", "0", "0 or 1",
    "1: whole-model GPU graphs replay CUDA graphs of repeated shapes by default (CompileOptions.cuda_graphs).")


def loader_check() -> str:
    """KEEPFAST_LOADER_CHECK as set ("" where unset): "all" checks CPU packages too, "0" none."""
    return _text(LOADER_CHECK)


def cuda_graphs() -> bool:
    """Whether KEEPFAST_CUDA_GRAPHS=1 asks for CUDA graph replays by default."""
    return get(CUDA_GRAPHS) == "1"


# --- remote graph libraries (docs/fleet.md) -------------------------------------------------------------------
REMOTE_LIBRARY = _declare(
    "KEEPFAST_REMOTE_LIBRARY", "unset (none)", "a URL (s3://, gs://, hf://, a folder...)",
    "The remote graph library a worker pulls the graphs that fit its machine from at start.")
REMOTE_UNSIGNED = _declare(
    "KEEPFAST_REMOTE_UNSIGNED", "0", "0 or 1",
    "1: a pull takes unsigned graphs too (left untrusted).")
REMOTE_OPTIONS = _declare(
    "KEEPFAST_REMOTE_OPTIONS", "unset", "a JSON object",
    "fsspec storage options for the remote library (an endpoint_url, anon...).")
SIGNING_KEY = _declare(
    "KEEPFAST_SIGNING_KEY", "unset", "a key file",
    "The builder's private key that `graphs push` signs with where --key is not given.")


def remote_library(environ: Environ = None) -> Optional[str]:
    """The remote library KEEPFAST_REMOTE_LIBRARY names (spaces stripped), or None."""
    return _text(REMOTE_LIBRARY, environ).strip() or None


def remote_unsigned(environ: Environ = None) -> bool:
    """Whether KEEPFAST_REMOTE_UNSIGNED=1 accepts unsigned graphs in a pull."""
    return get(REMOTE_UNSIGNED, environ) == "1"


def remote_options(environ: Environ = None) -> str:
    """KEEPFAST_REMOTE_OPTIONS's JSON text, stripped ("" where unset); remote/location.py parses it."""
    return _text(REMOTE_OPTIONS, environ).strip()


def signing_key() -> Optional[str]:
    """The key file KEEPFAST_SIGNING_KEY names, as set (None where unset)."""
    return get(SIGNING_KEY)


# --- the benchmark --------------------------------------------------------------------------------------------
GGUF_PATH = _declare(
    "KEEPFAST_GGUF_PATH", "unset", "a folder",
    "The benchmark only: a ComfyUI-GGUF checkout, for the quantised (GGUF) jobs.")


def gguf_path(environ: Environ = None) -> str:
    """The ComfyUI-GGUF checkout KEEPFAST_GGUF_PATH names ("" where unset)."""
    return _text(GGUF_PATH, environ)


# --- internal: passed by the pack to its own processes --------------------------------------------------------
PARENT_LIFELINE_FD = _declare(
    "KEEPFAST_PARENT_LIFELINE_FD", "set by the parent", "a file descriptor",
    "A build process's read end of its parent's lifeline: end-of-file stops the build and cleans up.", True)
SWEEPER = _declare(
    "KEEPFAST_SWEEPER", "set by the parent", "a path",
    "store/extraction.py, which a build process loads by path to sweep what its dead parent left.", True)
INTERFACE_LOG = _declare(
    "KEEPFAST_INTERFACE_LOG", "set by the build process", "a path",
    "Where the compiler wrapper (build_process/interface_object.py) logs each wrapper compile.", True)


def parent_lifeline_fd() -> str:
    """KEEPFAST_PARENT_LIFELINE_FD as set ("" where unset)."""
    return _text(PARENT_LIFELINE_FD)


def sweeper() -> Optional[str]:
    """The path KEEPFAST_SWEEPER names, as set (None where unset)."""
    return get(SWEEPER)


def interface_log() -> Optional[str]:
    """The log file KEEPFAST_INTERFACE_LOG names, as set (None where unset)."""
    return get(INTERFACE_LOG)

