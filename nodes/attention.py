"""The attention a graph computes for ComfyUI's models (whole UNets and transformer blocks alike).

ComfyUI's split and sub-quadratic attention pick their chunking from the
token count and the free memory: traced, split gives a graph per latent area
(h*w == 1024) and sub-quadratic one per 4096-token band and memory regime. A
graph computes the same attention with ComfyUI's own attention_pytorch, which
traces once for every shape, through ComfyUI's `optimized_attention_override`;
calls that run eager keep ComfyUI's choice.
"""

from __future__ import annotations

_CHUNKED_ATTENTION = frozenset({"attention_split", "attention_sub_quad"})


def graph_attention(func, *args, **kwargs):
    pytorch = func.__globals__.get("attention_pytorch") if func.__name__ in _CHUNKED_ATTENTION else None
    return (pytorch or func)(*args, **kwargs)


def graph_attention_options() -> dict:
    """The transformer_options a traced call gets (a fresh dict: ComfyUI's models write into theirs)."""
    return {"optimized_attention_override": graph_attention}
