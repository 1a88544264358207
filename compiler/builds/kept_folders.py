"""The folders build processes keep per machine and torch version, beside the trust list: Inductor's vector-ISA
probe, the pack's C++ compiler wrappers (cxx_linkage.py, interface_object.py) and Triton's compiled kernels.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..settings import ISA_CACHE, isa_cache as isa_cache_setting

ISA_CACHE_ENV = ISA_CACHE.name


def isa_cache() -> Path:
    """Where build processes keep Inductor's vector-ISA probe: KEEPFAST_ISA_CACHE, else beside the trust list, per
    torch version. The probe compiles and loads a test program per ISA (about 10 s a build on a busy 2-core CPU,
    repeated by every build in its own fresh Inductor cache); kept here, a machine runs it once."""
    from ..store.trust import default_trust_path

    configured = isa_cache_setting()
    base = Path(configured) if configured else default_trust_path().with_name("inductor-isa-probe")
    return base / torch.__version__.replace("+", "_")


def cxx_link_folder() -> Path:
    """Where the pack keeps its wrapper of a C++ compiler that links libstdc++ statically (cxx_linkage.py): beside
    the ISA probe's folder."""
    return isa_cache().parent.with_name("cxx-link")


def interface_object_folder() -> Path:
    """Where the pack keeps its compiler wrapper that compiles AOTInductor's runtime interface once, and those
    objects (interface_object.py): beside the ISA probe's folder."""
    return isa_cache().parent.with_name("cxx-interface")


def kernel_cache() -> Path:
    """Where build processes keep Triton's compiled GPU kernels (TRITON_CACHE_DIR, unless the user set it): beside
    the ISA probe's folder. Each build has a fresh Inductor cache (two builds of one graph at once must not read
    each other's files), and Triton's cache lives inside it by default, so every build compiled every kernel again,
    a kernel that an earlier build of the same model, another block structure or another shape range had compiled
    included. Triton keys a kernel by its source, options and target and writes each entry whole (a temporary
    file, then a rename), so builds share it safely."""
    probe = isa_cache()
    return probe.parent.with_name("triton-kernels") / probe.name
