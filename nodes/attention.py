"""The attention a graph computes for ComfyUI's models (whole UNets and transformer blocks alike).

ComfyUI's split and sub-quadratic attention pick their chunking from the
token count and the free memory: traced, split gives a graph per latent area
(h*w == 1024) and sub-quadratic one per 4096-token band and memory regime. A
graph computes the same attention with ComfyUI's own attention_pytorch, which
traces once for every shape, through ComfyUI's `optimized_attention_override`;
calls that run eager keep ComfyUI's choice.

ComfyUI's VAE has no override: each AttnBlock holds the function
`vae_attention()` picked at load (split `normal_attention` on a CPU without
--use-pytorch-cross-attention), which slices by free memory and traced gives
a graph per latent area. `graph_vae_attention` swaps in the same module's
`pytorch_attention` while a graph of the VAE is traced, and puts ComfyUI's
choice back afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_CHUNKED_ATTENTION = frozenset({"attention_split", "attention_sub_quad"})


def graph_attention(func, *args, **kwargs):
    pytorch = func.__globals__.get("attention_pytorch") if func.__name__ in _CHUNKED_ATTENTION else None
    return (pytorch or func)(*args, **kwargs)


def graph_attention_options() -> dict:
    """The transformer_options a traced call gets (a fresh dict: ComfyUI's models write into theirs)."""
    return {"optimized_attention_override": graph_attention}


_CHUNKED_VAE_ATTENTION = frozenset({"normal_attention"})


@contextlib.contextmanager
def graph_vae_attention(module: torch.nn.Module) -> Iterator[None]:
    """Within: the VAE's split-attention blocks compute ComfyUI's pytorch_attention (see the module docstring).

    Only outside torch.compile's own tracing (the aot backend exports without
    it): torch.compile keeps ComfyUI's choice, as an attribute change there
    would break its graph.
    """
    swapped = []
    if isinstance(module, torch.nn.Module) and not torch.compiler.is_dynamo_compiling():
        for block in module.modules():
            chosen = block.__dict__.get("optimized_attention")
            if getattr(chosen, "__name__", None) in _CHUNKED_VAE_ATTENTION:
                pytorch = chosen.__globals__.get("pytorch_attention")
                if pytorch is not None:
                    swapped.append((block, chosen))
                    block.optimized_attention = pytorch
    try:
        yield
    finally:
        for block, chosen in swapped:
            block.optimized_attention = chosen
