"""What a compiled graph needs of the machine that loads it, and whether this one has it.

A package is native code: a shared library built for one OS, one CPU
architecture, the CPU instructions its compiler was allowed to use and, for
GPU graphs, one GPU architecture. torch's own loader finds this out by
probing the CPU with a C++ compiler (11 test builds: 13 of the first load's
15 s on an empty Inductor cache) and then only warns. The pack records the
needs when it builds a package (the manifest's ``needs``) and checks them
here against facts this process reads without any compiler (/proc/cpuinfo,
torch.cuda), so a graph that cannot run here is refused, with the reason,
before its library is loaded.

Packages are built with a named x86-64 level (``-march=x86-64-v3`` on an
AVX2 CPU, ``x86-64-v4`` on an AVX-512 one) instead of Inductor's default
``-march=native``, so their needs are that level plus the vector ISA
Inductor chose, and a graph built on a large machine runs on every CPU of
that level. A GPU package's host code is built with no -march and no probe
(`gpu_host_build`); it needs the vector ISA named in the package. Feature
names are the Linux kernel's (/proc/cpuinfo flags).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

NEEDS_VERSION = 1

_V2 = ("cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2")
_V3 = _V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# The x86-64 psABI levels (gcc >= 11, clang >= 12), as /proc/cpuinfo names them (abm = lzcnt, pni = sse3).
X86_LEVELS: Dict[str, FrozenSet[str]] = {
    "x86-64-v2": frozenset(_V2), "x86-64-v3": frozenset(_V3), "x86-64-v4": frozenset(_V4),
}

# Instruction-set flags of x86 CPUs that -march=native may use (when a package was built
# that way, its needs are the building CPU's flags among these).
X86_ISA_FLAGS = frozenset(_V4 + (
    "sse", "sse2", "sse4a", "aes", "pclmulqdq", "sha_ni", "vaes", "vpclmulqdq", "gfni", "adx", "rdrand", "rdseed",
    "xsaveopt", "xsavec", "xsaves", "clflushopt", "clwb", "3dnowprefetch", "fsgsbase", "movdiri", "movdir64b",
    "serialize", "waitpkg", "rdpid", "pku", "ospke", "cldemote", "wbnoinvd", "xop", "fma4", "tbm", "clzero",
    "mwaitx", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq",
    "avx512_bf16", "avx512_fp16", "avx512_vp2intersect", "avx_vnni", "avx_vnni_int8", "avx_ifma",
    "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "amx_complex", "f16c", "lzcnt",
))

# gcc's -m flags (Inductor's vector ISA flags) by /proc/cpuinfo name.
_GCC_FLAG_FEATURES = {
    "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512dq": "avx512dq",
    "avx512vl": "avx512vl", "avx512bw": "avx512bw", "avx512cd": "avx512cd", "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "amx-tile": "amx_tile", "amx-bf16": "amx_bf16",
    "amx-int8": "amx_int8", "amx-fp16": "amx_fp16",
}
# Inductor's vector ISA names (the package's AOTI_CPU_ISA), for packages whose build flags were not recorded.
_ISA_FEATURES = {
    "AVX2": ("avx2", "fma", "f16c"),
    "AVX512": ("avx512f", "avx512dq", "avx512vl", "avx512bw", "fma"),
    "AVX512_VNNI": ("avx512_vnni",),
    "AMX_TILE": ("amx_tile", "amx_bf16", "amx_int8"),
    "SVE256": ("sve",),
    "SVE128": ("sve",),
}
_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


class CannotRunHere(Exception):
    """This machine lacks something a graph needs; the message names it."""


def machine() -> str:
    name = platform.machine().lower()
    return _MACHINE_ALIASES.get(name, name)


@functools.lru_cache(maxsize=None)
def host_cpu_features() -> Optional[FrozenSet[str]]:
    """This CPU's feature flags from /proc/cpuinfo (x86 'flags', Arm 'Features'); None where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return None


def _features_of_gcc_flags(flags: str) -> List[str]:
    out = []
    for flag in flags.split():
        if flag.startswith("-march=") and "+" in flag:  # Arm: -march=armv8-a+sve+bf16
            out.extend(part for part in flag.split("+")[1:] if part)
        elif flag.startswith("-m") and not flag.startswith(("-march", "-mtune", "-msve-vector-bits", "-mcpu")):
            name = flag[2:]
            out.append(_GCC_FLAG_FEATURES.get(name, name.replace("-", "_")))
    return out


def _features_of_isa(isa: str) -> List[str]:
    return [feature for token in isa.upper().split() for feature in _ISA_FEATURES.get(token, ())]


# -- when a package is built (a compiler is there) -------------------------------------------


def _inductor_march() -> Optional[str]:
    """The -march Inductor uses unless told otherwise (None: its default, native)."""
    try:
        from torch._inductor import config
    except ImportError:
        return None
    return getattr(getattr(config, "cpp", None), "march", None)


def _vec_isa():
    """Inductor's vector ISA for this machine (its probe; the compile that follows runs it anyway)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        return pick_vec_isa()
    except Exception:  # private API; its absence only makes the needs coarser
        return None


def _arch_flags(vec) -> Optional[str]:
    try:
        return str(vec.build_arch_flags())
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def _compiler_accepts(march: str) -> bool:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
        done = subprocess.run([compiler, f"-march={march}", "-x", "c++", "-E", "-", "-o", os.devnull],
                              input=b"", capture_output=True, timeout=60)
        return done.returncode == 0
    except Exception:
        return False


def build_march() -> Optional[str]:
    """The -march to build packages with, or None to leave Inductor's own choice.

    The highest x86-64 level that this CPU has and the vector ISA calls for;
    None off x86-64, with a torch whose Inductor has no such setting, when
    the user chose one (TORCHINDUCTOR_CPP_MARCH), or when the compiler does
    not know the level (gcc < 11).
    """
    from torch._inductor import config

    if machine() != "x86_64" or not hasattr(getattr(config, "cpp", None), "march") or config.cpp.march is not None:
        return None
    host = host_cpu_features()
    if host is None:
        return None
    isa = str(_vec_isa() or "").lower()
    wanted = "x86-64-v4" if "avx512" in isa else "x86-64-v3" if "avx2" in isa else "x86-64-v2"
    order = list(X86_LEVELS)
    for level in reversed(order[: order.index(wanted) + 1]):
        if X86_LEVELS[level] <= host:
            return level if _compiler_accepts(level) else None
    return None


NO_MARCH = ""  # built with no -march at all: the compiler's baseline, plus the flags of the vector ISA Inductor adds


def gpu_host_build() -> Tuple[Optional[str], Dict[str, str]]:
    """(the -march a GPU graph's host code is built with, the Inductor settings that say so); no probe runs.

    A CUDA package's host code only unpacks arguments and launches kernels, so its speed does not depend on a CPU
    level, and picking one (`build_march`) runs Inductor's ISA probe, which builds test programs with a C++
    compiler, for nothing. It is built with no -march (NO_MARCH): it then needs only the vector ISA Inductor
    names in the package (AOTI_CPU_ISA), which `needs_of_package` reads without a probe. A torch whose Inductor
    has no -march setting builds for this CPU (native); a level the user chose (TORCHINDUCTOR_CPP_MARCH) is kept.
    """
    try:
        from torch._inductor import config
    except ImportError:
        return None, {}
    if not hasattr(getattr(config, "cpp", None), "march"):
        return None, {}
    if config.cpp.march is not None:
        return config.cpp.march, {}
    if not _inductor_leaves_out_empty_march():
        return None, {}
    return NO_MARCH, {"cpp.march": NO_MARCH}


def _inductor_leaves_out_empty_march() -> bool:
    """Whether this torch's Inductor builds with no -march flag when cpp.march is "" (and not `-march=`, which
    the compiler refuses); asked of its own flag function, so an Inductor that cannot say keeps its own choice."""
    try:
        from torch._inductor import config
        from torch._inductor.cpp_builder import _get_cpu_arch_cflags

        with config.patch({"cpp.march": NO_MARCH}):
            return not any("march" in str(flag) for flag in _get_cpu_arch_cflags("g++"))
    except Exception:  # noqa: BLE001 - private API: without it, Inductor's default (-march=native)
        return False


def build_probe() -> Dict[str, Any]:
    """What a package build here is built for: {"march": build_march(), "vec_isa": Inductor's vector ISA,
    "vec_flags": its compiler flags}.

    Inductor's ISA probe compiles and runs a test program per ISA (seconds,
    tens of seconds on a busy CPU), so a background build runs this in its
    build process (this file is loaded there by path: it imports the standard
    library only at the top) and hands the result back: the caller that traced
    the graph never waits for the probe, and reads the package's needs with
    `needs_of_package(..., vec=(vec_isa, vec_flags))`.
    """
    march = build_march()
    vec = _vec_isa()
    return {"march": march, "vec_isa": str(vec) if vec is not None else None,
            "vec_flags": _arch_flags(vec) if vec is not None else None}


def needs_of_package(metadata: Dict[str, str], march: Optional[str] = None, built_here: bool = False,
                     vec: Optional[tuple] = None) -> Dict[str, Any]:
    """What a package needs, from its own metadata (AOTI_*) and how it was built.

    `built_here`: called in the process that built it, so the vector ISA's
    exact flags and, for a -march=native build, this CPU's flags are known.
    `march`: what it was built with (None: Inductor's own setting; NO_MARCH: no -march).
    `vec`: (ISA name, its compiler flags) as the build process found them
    (`build_probe`); without it Inductor's probe runs here, except for a GPU
    package, whose build ran no probe (`gpu_host_build`): the vector ISA named
    in the package stands for its flags.
    Without it (a package whose manifest has no needs) only the vector ISA
    named in the package is required.
    """
    isa = str(metadata.get("AOTI_CPU_ISA", ""))
    features = set(_features_of_isa(isa))
    gpu = str(metadata.get("AOTI_DEVICE_KEY", "") or "cpu") != "cpu"
    if built_here:
        if march is None:
            march = _inductor_march()
        march = "native" if march is None else march
        if vec is None and not gpu:
            probed = _vec_isa()
            vec = (str(probed), _arch_flags(probed)) if probed is not None else None
        if vec is not None and vec[0].upper() == isa.upper() and vec[1] is not None:
            features = set(_features_of_gcc_flags(vec[1]))
        if march in X86_LEVELS:
            features |= X86_LEVELS[march]
        elif march == "x86-64" or march.startswith("armv"):  # the baseline, or Arm's named extensions
            features |= set(_features_of_gcc_flags(f"-march={march}"))
        elif march != NO_MARCH:  # native (or a CPU's name): anything this CPU has may be in the code
            host = host_cpu_features() or frozenset()
            features |= (host & X86_ISA_FLAGS) if machine() == "x86_64" else host
    return {
        "version": NEEDS_VERSION,
        "platform": str(metadata.get("AOTI_PLATFORM") or sys.platform),
        "machine": _MACHINE_ALIASES.get(str(metadata.get("AOTI_MACHINE", "")).lower(),
                                        str(metadata.get("AOTI_MACHINE", "")).lower()) or machine(),
        "device": str(metadata.get("AOTI_DEVICE_KEY", "")),
        "cpu_isa": isa,
        "march": "none" if march == NO_MARCH else march or "unknown",
        "cpu_features": sorted(features),
        "compute_capability": str(metadata.get("AOTI_COMPUTE_CAPABILITY", "") or ""),
    }


# -- when a package is loaded (no compiler needed) -------------------------------------------


def _gpu_reason(device: str, capability: str) -> Optional[str]:
    import torch

    if device != "cuda":
        module = getattr(torch, device, None)
        available = getattr(module, "is_available", None)
        if callable(available) and not available():
            return f"it was built for {device} and torch here has no {device} device"
        return None
    if not torch.cuda.is_available():
        return "it was built for a CUDA GPU and torch here sees none"
    if getattr(torch.version, "hip", None) or not capability.isdigit():
        return None
    built = int(capability)
    major, minor = torch.cuda.get_device_capability()
    if major != built // 10 or minor < built % 10:
        return (f"its GPU code is for compute capability {built // 10}.{built % 10}; "
                f"this GPU is {major}.{minor}")
    return None


def why_not_here(needs: Dict[str, Any]) -> Optional[str]:
    """None if this machine can run a package with these needs, else the reason (nothing is loaded)."""
    platform_name = needs.get("platform") or sys.platform
    if platform_name != sys.platform:
        return f"it was built for {platform_name}; this is {sys.platform}"
    built_for = needs.get("machine") or machine()
    if built_for != machine():
        return f"it was built for {built_for} CPUs; this CPU is {machine()}"
    host = host_cpu_features()
    missing = sorted(set(needs.get("cpu_features") or ()) - host) if host is not None else []
    if missing:
        how = f" (vector ISA {needs.get('cpu_isa') or 'none'}, -march={needs.get('march', 'unknown')})"
        return f"it uses CPU instructions this CPU lacks: {', '.join(missing)}{how}"
    device = needs.get("device") or "cpu"
    if device != "cpu":
        return _gpu_reason(device, str(needs.get("compute_capability") or ""))
    return None


def check(needs: Dict[str, Any]) -> None:
    """Raise CannotRunHere with the reason if this machine cannot run the package."""
    reason = why_not_here(needs)
    if reason:
        raise CannotRunHere(reason)


__all__ = ["CannotRunHere", "NO_MARCH", "build_march", "check", "gpu_host_build", "host_cpu_features",
           "needs_of_package", "why_not_here"]
