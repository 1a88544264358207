"""Channels-last convolutions in a GPU graph: a measured experiment, off unless asked for.

Inductor lays a graph's 2-D convolutions out channels-last (NHWC, what cuDNN's fp16 tensor-core kernels take) only
where it decides to (`GraphLowering.decide_layout_opt`), and it never does where a convolution's sizes are dynamic
("See perf regression with dynamic shape", pytorch/pytorch#102670, torch 2.11 to 2.13): every GPU graph of ours
that serves a range of sizes runs its convolutions NCHW, where torch.compile's static first graph (TorchCompileModel)
may run them NHWC. On a CPU Inductor lays mkldnn convolutions out channels-last whatever the sizes, so only GPU
programs are concerned.

`KEEPFAST_CONV_LAYOUT=channels_last` builds a GPU program that has 2-D convolutions with Inductor's
`force_layout_optimization`. The module's weights are left as they are (contiguous), so the graph copies each
convolution's weight to channels-last within each call (Inductor's `require_channels_last`): about 0.8 GB for the
SD1.5 UNet's convolutions in fp16, a fraction of a millisecond on an H100's memory, bought back only if NHWC
convolutions are faster. Whether they are is what the device check measures first on eager (its eager job times
the model both ways, `channels_last` in bench.json) and then with this setting on and off; until a GPU run says so
it stays off. The graph computes the same either way: the setting is not part of a graph's key.
"""

from __future__ import annotations

from typing import Any, Dict

from ..settings import CHANNELS_LAST, CONV_LAYOUT, conv_channels_last  # noqa: F401 - CHANNELS_LAST: the value asked

ENV = CONV_LAYOUT.name


def asked() -> bool:
    """Whether the user (or the device check) asked for channels-last convolutions in GPU graphs."""
    return conv_channels_last()


def has_2d_convolution(ep: Any) -> bool:
    """Whether an exported program convolves 4-D tensors (a UNet or VAE; a transformer block does not): an aten
    convolution (`conv2d` as export leaves it, `convolution` once decomposed) whose weight is 4-D."""
    for node in ep.graph.nodes:
        if node.op != "call_function" or not str(node.target).startswith(("aten.conv", "aten._convolution")):
            continue
        weight = node.args[1] if len(node.args) > 1 else None
        value = weight.meta.get("val") if hasattr(weight, "meta") else None
        if value is not None and value.dim() == 4:
            return True
    return False


def gpu_settings(ep: Any) -> Dict[str, Any]:
    """Inductor settings for a GPU program: channels-last convolutions where asked for and it has any."""
    if asked() and has_2d_convolution(ep):
        return {"force_layout_optimization": True}
    return {}
