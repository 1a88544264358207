"""What model code written for torch needs from OneFlow 0.9.0's `mock_torch` and does not find.

Installed once, the first time a OneFlow copy of a package is activated
(isolation.active). Each shim fills a gap (an attribute OneFlow 0.9.0 lacks)
and changes nothing OneFlow already has, so OneFlow's own behaviour is the
same with or without them. Nothing here imports oneflow at import time.
"""

from __future__ import annotations

import math
import sys
import types

_INSTALLED = False

# Constructors that take dtype=/device= in torch and not in OneFlow 0.9.0 (only Linear does there).
_FACTORY_KWARG_LAYERS = ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
                         "GroupNorm", "LayerNorm", "Embedding")
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


class MissingDtype:
    """Stands for a torch dtype OneFlow 0.9.0 does not have (float8): usable as a dict key or in a
    comparison, never as a tensor's dtype."""

    itemsize = 1
    is_floating_point = True

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"oneflow.{self.name} (not in OneFlow 0.9.0)"


def install() -> None:
    """Idempotent; call with oneflow importable."""
    global _INSTALLED
    if _INSTALLED:
        return
    import oneflow

    _missing_attributes_are_attribute_errors()
    _stub_modules(oneflow)
    _proxy_tensor_metadata()
    for name in _FLOAT8:
        if not hasattr(oneflow, name):
            setattr(oneflow, name, MissingDtype(name))
    for name in _FACTORY_KWARG_LAYERS:
        layer = getattr(oneflow.nn, name, None)
        if layer is not None:
            _drop_factory_kwargs(layer)
    tensor = oneflow.Tensor
    if not hasattr(tensor, "movedim"):
        tensor.movedim = lambda self, source, destination: oneflow.movedim(self, source, destination)
    if not hasattr(tensor, "unflatten"):
        tensor.unflatten = _unflatten
    if not hasattr(tensor, "baddbmm"):
        tensor.baddbmm = lambda self, b1, b2, beta=1.0, alpha=1.0: oneflow.baddbmm(self, b1, b2, beta=beta, alpha=alpha)
    _INSTALLED = True


def _missing_attributes_are_attribute_errors() -> None:
    """mock_torch raises NotImplementedError for a missing attribute, so code probing with
    hasattr(F, "scaled_dot_product_attention") raises instead of getting False."""
    import oneflow.mock_torch as mock

    class MockMissing(NotImplementedError, AttributeError):
        pass

    original = mock.ModuleWrapper.__getattr__
    if getattr(original, "_keepfast", False):
        return

    def __getattr__(self, name):
        try:
            return original(self, name)
        except NotImplementedError as error:
            raise MockMissing(str(error)) from None

    __getattr__._keepfast = True
    mock.ModuleWrapper.__getattr__ = __getattr__


def _stub_modules(oneflow) -> None:
    # torch._dynamo.allow_in_graph (diffusers >= 0.17).
    if "oneflow._dynamo" not in sys.modules:
        dynamo = types.ModuleType("oneflow._dynamo")
        dynamo.allow_in_graph = lambda fn: fn
        sys.modules["oneflow._dynamo"] = dynamo

    # torch.compiler: OneFlow code is never under torch.compile (ComfyUI's ops ask before each layer).
    if "oneflow.compiler" not in sys.modules:
        compiler = types.ModuleType("oneflow.compiler")
        compiler.is_compiling = lambda: False
        compiler.is_dynamo_compiling = lambda: False
        compiler.disable = lambda fn=None, recursive=True: fn if fn is not None else (lambda f: f)
        compiler.allow_in_graph = lambda fn: fn
        sys.modules["oneflow.compiler"] = compiler
        oneflow.compiler = compiler

    # torch.serialization: ComfyUI's comfy.utils asks it for add_safe_globals at import (checkpoint
    # loading, which the OneFlow copy never does); OneFlow 0.9.0 has no such module.
    if not hasattr(oneflow, "serialization"):
        serialization = types.ModuleType("oneflow.serialization")
        sys.modules.setdefault("oneflow.serialization", serialization)
        oneflow.serialization = serialization

    # torch.fft (diffusers >= 0.22 imports it for FreeU only).
    if "oneflow.fft" not in sys.modules:
        fft = types.ModuleType("oneflow.fft")

        def missing(name):
            def fn(*args, **kwargs):
                raise NotImplementedError(f"torch.fft.{name} is not available in OneFlow 0.9.0 (FreeU)")
            return fn

        for name in ("fft", "ifft", "fftn", "ifftn", "fftshift", "ifftshift", "rfft", "irfft"):
            setattr(fft, name, missing(name))
        sys.modules["oneflow.fft"] = fft

    # torch.utils._pytree (diffusers >= 0.22 registers BaseOutput as a node).
    if "oneflow.utils._pytree" not in sys.modules:
        import oneflow.utils

        pytree = types.ModuleType("oneflow.utils._pytree")
        pytree._register_pytree_node = pytree.register_pytree_node = lambda *args, **kwargs: None
        pytree._dict_flatten = lambda d: (list(d.values()), list(d.keys()))
        pytree._dict_unflatten = lambda values, context: dict(zip(context, values))
        sys.modules["oneflow.utils._pytree"] = pytree
        oneflow.utils._pytree = pytree


def _proxy_tensor_metadata() -> None:
    """Inside nn.Graph.build a module's parameters are ProxyTensors without .dtype/.device/.shape;
    diffusers' VAE decoder reads next(parameters()).dtype, ComfyUI's UNet self.dtype-casts."""
    from oneflow.nn.graph.proxy import ProxyTensor

    for attribute in ("dtype", "device", "shape", "ndim"):
        if not hasattr(ProxyTensor, attribute):
            setattr(ProxyTensor, attribute,
                    property(lambda self, a=attribute: getattr(self._oneflow_internal_origin__, a)))


def _drop_factory_kwargs(cls: type) -> None:
    """The layer is built on OneFlow's defaults and its tensors replaced by the torch ones afterwards,
    so dtype/device at construction do not matter."""
    init = cls.__init__
    if getattr(init, "_keepfast", False):
        return

    def __init__(self, *args, dtype=None, device=None, **kwargs):
        init(self, *args, **kwargs)

    __init__._keepfast = True
    cls.__init__ = __init__


def _unflatten(self, dim: int, sizes):
    dim = dim % self.ndim
    return self.reshape(tuple(self.shape[:dim]) + tuple(sizes) + tuple(self.shape[dim + 1:]))


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale=None, **unused):
    """torch's F.scaled_dot_product_attention for (batch, heads, length, dim) OneFlow tensors.

    OneFlow 0.9.0 has none: softmax(q k^T * scale) v, which OneFlow's graph
    compiler fuses as it can. (OneFlow's fused attention kernel is CUDA-only and
    was not tried: there was no GPU here.) Inference only: dropout is ignored.
    """
    import oneflow

    factor = (1.0 / math.sqrt(q.shape[-1])) if scale is None else scale
    weights = oneflow.matmul(q, k.transpose(-2, -1)) * factor
    if is_causal:
        rows, columns = q.shape[-2], k.shape[-2]
        upper = oneflow.ones(rows, columns, dtype=oneflow.bool, device=q.device).triu(1)
        weights = weights.masked_fill(upper, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == oneflow.bool:
            weights = weights.masked_fill(oneflow.logical_not(attn_mask), float("-inf"))
        else:
            weights = weights + attn_mask
    return oneflow.matmul(oneflow.softmax(weights, dim=-1), v)
