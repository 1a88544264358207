"""How much memory a OneFlow graph takes, and whether the next one fits.

OneFlow 0.9.0 gives every nn.Graph its own activation memory, planned for its
one static shape and kept for the graph's life; graphs of one model share
only the weights. Measured on this CPU with ComfyUI's 13.6M-parameter test
UNet: 1.2 GB for batch 2 at 32x32 latents, 5.7 GB at 64x64; TAESD decoding
512x512: 6.3 GB. A few warmed sizes can exhaust RAM (or VRAM), and then the
operating system kills the whole ComfyUI process. So each graph's footprint
is measured when it is built, and a build that would not fit in what is
available is not started.
"""

from __future__ import annotations

from typing import Optional

import torch

# Headroom over the estimate, for what else the process allocates meanwhile (activations of eager
# calls, the estimate being linear in the input size while attention is not).
SAFETY = 1.25


def _proc_kib(path: str, field: str) -> Optional[int]:
    """A "Field: N kB" line of a /proc file, in bytes; None where there is none (not Linux)."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes(device: torch.device) -> Optional[int]:
    """Free memory where the graph's buffers go; None where it cannot be read."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return _proc_kib("/proc/meminfo", "MemAvailable")


def used_bytes(device: torch.device) -> Optional[int]:
    """What this process (CPU) or everyone (CUDA: the device's used memory) holds now."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)
    return _proc_kib("/proc/self/status", "VmRSS")


def estimate(measured: list, elements: int) -> Optional[int]:
    """Bytes a graph for an input of `elements` should take, from (elements, bytes) of graphs
    built for the same model: linear in the input size from each, the largest."""
    guesses = [size * elements / max(1, done) for done, size in measured if size > 0]
    return int(max(guesses)) if guesses else None


def shortfall(measured: list, elements: int, device: torch.device) -> Optional[str]:
    """Why the next graph should not be built now, or None."""
    need = estimate(measured, elements)
    free = available_bytes(device)
    if need is None or free is None or free >= need * SAFETY:
        return None
    return (f"not enough memory for another OneFlow graph: about {need / 2**30:.1f} GiB needed (from the graphs "
            f"of this model built so far), {free / 2**30:.1f} GiB available on {device}; each OneFlow graph keeps "
            "its own activation memory. Runs eager; warm up fewer or smaller sizes, or use the aot backend")
