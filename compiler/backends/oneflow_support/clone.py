"""A built torch module tree -> the same tree of OneFlow modules, without constructor arguments.

For models whose constructor arguments are not kept anywhere (ComfyUI's
UNetModel, AutoencoderKL, TAESD, ControlNet: their config lives outside the
module), the tree is copied module by module:

- a `torch.nn` layer (Linear, Conv2d, GroupNorm, ...) becomes the OneFlow layer
  of the same name, built from the torch layer's attributes;
- any other class of the package being converted becomes the class of the same
  qualified name in the package's OneFlow copy (isolation), created without
  running its `__init__`, and gets the torch instance's plain attributes (ints,
  strings, flags, dtypes mapped to OneFlow's, functions of the package mapped to
  the copy's functions of the same name).

Weights are not copied: tensors are replaced by the torch tensors' memory
afterwards (weights.WeightBinding), and the names and shapes are checked then.
Anything the copy cannot stand for (a tensor outside parameters and buffers, a
torch callable, a class defined inside a function, a layer type not listed
here) is refused with its path in the tree. Call inside `isolation.active()`.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .isolation import find_in_copy, in_package


class CloneRefused(Exception):
    """The tree holds something the OneFlow copy cannot stand for; the message says what and where."""


# nn.Module bookkeeping that the OneFlow module sets up itself.
_MODULE_STATE = {
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks", "_backward_hooks",
    "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "training", "_compiled_call_impl",
}


def _conv(m) -> Tuple[tuple, dict]:
    return (m.in_channels, m.out_channels, m.kernel_size), dict(
        stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups, bias=m.bias is not None,
        padding_mode=m.padding_mode)


def _conv_transpose(m) -> Tuple[tuple, dict]:
    return (m.in_channels, m.out_channels, m.kernel_size), dict(
        stride=m.stride, padding=m.padding, output_padding=m.output_padding, dilation=m.dilation, groups=m.groups,
        bias=m.bias is not None)


def _no_arguments(m) -> Tuple[tuple, dict]:
    return (), {}


# torch.nn layer -> its constructor arguments, read back from the built layer.
LAYERS: Dict[type, Callable[[torch.nn.Module], Tuple[tuple, dict]]] = {
    torch.nn.Linear: lambda m: ((m.in_features, m.out_features), {"bias": m.bias is not None}),
    torch.nn.Conv1d: _conv, torch.nn.Conv2d: _conv, torch.nn.Conv3d: _conv,
    torch.nn.ConvTranspose1d: _conv_transpose, torch.nn.ConvTranspose2d: _conv_transpose,
    torch.nn.GroupNorm: lambda m: ((m.num_groups, m.num_channels), {"eps": m.eps, "affine": m.affine}),
    torch.nn.LayerNorm: lambda m: ((tuple(m.normalized_shape),), {"eps": m.eps,
                                                                  "elementwise_affine": m.elementwise_affine}),
    torch.nn.Embedding: lambda m: ((m.num_embeddings, m.embedding_dim), {}),
    torch.nn.Dropout: lambda m: ((m.p,), {}),
    torch.nn.GELU: lambda m: ((), {"approximate": m.approximate} if m.approximate != "none" else {}),
    torch.nn.Upsample: lambda m: ((), {"size": m.size, "scale_factor": m.scale_factor, "mode": m.mode}),
    torch.nn.SiLU: _no_arguments, torch.nn.ReLU: _no_arguments, torch.nn.Identity: _no_arguments,
    torch.nn.Sigmoid: _no_arguments, torch.nn.Tanh: _no_arguments, torch.nn.Mish: _no_arguments,
}


def _layer_type(cls: type) -> Optional[type]:
    """The torch.nn layer a class is (itself or a subclass of, e.g. comfy.ops' Conv2d)."""
    for base in cls.__mro__:
        if base in LAYERS:
            return base
    return None


def flow_dtype(dtype: torch.dtype):
    """OneFlow's dtype of the same name; CloneRefused where OneFlow 0.9.0 has none."""
    import oneflow

    name = str(dtype).split(".")[-1]
    if not hasattr(oneflow, name):
        raise CloneRefused(f"{dtype} is not in OneFlow 0.9.0")
    return getattr(oneflow, name)


def _counterpart(cls: type, root: str) -> type:
    module_name = cls.__module__ or ""
    if in_package(module_name, root):
        try:
            return find_in_copy(module_name, cls.__qualname__)
        except (LookupError, AttributeError, ImportError) as error:
            raise CloneRefused(f"the OneFlow copy has no {module_name}.{cls.__qualname__} ({error})") from None
    if module_name.startswith("torch.nn"):
        import oneflow

        found = getattr(oneflow.nn, cls.__name__, None)
        if found is None:
            raise CloneRefused(f"OneFlow has no nn.{cls.__name__}")
        return found
    raise CloneRefused(f"{module_name}.{cls.__qualname__} is neither a torch.nn layer nor part of {root}")


def _value(value: Any, root: str, where: str) -> Any:
    """A plain attribute of a torch module, as the OneFlow copy's module should hold it."""
    import oneflow

    if isinstance(value, torch.dtype):
        try:
            return flow_dtype(value)
        except CloneRefused as error:
            raise CloneRefused(f"{where}: {error}") from None
    if isinstance(value, torch.device):
        return oneflow.device(value.type, value.index or 0)
    if isinstance(value, torch.Tensor):
        raise CloneRefused(f"{where} holds a tensor that is neither a parameter nor a buffer")
    if isinstance(value, torch.nn.Module):
        raise CloneRefused(f"{where} holds a module outside the module tree")
    if isinstance(value, (list, tuple)):
        return type(value)(_value(item, root, where) for item in value)
    if isinstance(value, dict):
        return {key: _value(item, root, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, types.FunctionType):
        module_name = value.__module__ or ""
        if in_package(module_name, root):
            try:
                return find_in_copy(module_name, value.__qualname__)
            except (LookupError, AttributeError, ImportError) as error:
                raise CloneRefused(f"{where} is {module_name}.{value.__qualname__}, not in the OneFlow copy "
                                   f"({error})") from None
    if callable(value) and not isinstance(value, type):
        raise CloneRefused(f"{where} holds {value!r}, which cannot run on OneFlow tensors")
    return value


def clone_module(module: torch.nn.Module, root: str,
                 refuse: Callable[[torch.nn.Module], Optional[str]] = lambda m: None,
                 plain_layer: Callable[[type], bool] = lambda cls: False, path: str = "model"):
    """The OneFlow copy of `module`'s tree; its tensors are placeholders to be replaced.

    `root` names the package whose classes are looked up in the copy
    ("comfy"); `refuse(submodule)` may name a reason a submodule cannot be
    converted (ComfyUI casting a layer's weights on the fly); `plain_layer(cls)`
    says that a package's subclass of a torch layer computes what the layer
    does (ComfyUI's comfy.ops with casting off) and becomes OneFlow's layer.
    """
    reason = refuse(module)
    if reason:
        raise CloneRefused(f"{path}: {reason}")
    cls = type(module)
    layer = _layer_type(cls)
    if layer is not None and cls is not layer and plain_layer(cls):
        flow_cls = _counterpart(layer, root)
    else:
        flow_cls = _counterpart(cls, root)
    if layer is not None:
        args, kwargs = LAYERS[layer](module)
        flow_module = flow_cls(*args, **kwargs)
        extras = {key: value for key, value in vars(module).items()
                  if key not in _MODULE_STATE and key not in vars(flow_module)}
    else:
        if _subclasses_an_unlisted_layer(cls):
            raise CloneRefused(f"{path}: {cls.__qualname__} derives from a torch.nn layer this converter does "
                               "not know how to build")
        import oneflow

        flow_module = flow_cls.__new__(flow_cls)
        oneflow.nn.Module.__init__(flow_module)
        extras = {key: value for key, value in vars(module).items() if key not in _MODULE_STATE}
        _placeholder_tensors(module, flow_module)
    for key, value in extras.items():
        flow_module.__dict__[key] = _value(value, root, f"{path}.{key}")
    for name, child in module._modules.items():
        setattr(flow_module, name, None if child is None else clone_module(child, root, refuse, plain_layer,
                                                                               f"{path}.{name}"))
    flow_module.training = module.training
    return flow_module


def _placeholder_tensors(module: torch.nn.Module, flow_module) -> None:
    """The module's own parameters and buffers (not its children's), same names and shapes, not
    initialised: a constructor would have made them, and the torch tensors replace them."""
    import oneflow

    for name, tensor in module._parameters.items():
        flow_module._parameters[name] = None if tensor is None else oneflow.nn.Parameter(
            oneflow.empty(tuple(tensor.shape), dtype=flow_dtype(tensor.dtype)), requires_grad=False)
    for name, tensor in module._buffers.items():
        flow_module._buffers[name] = None if tensor is None else oneflow.empty(
            tuple(tensor.shape), dtype=flow_dtype(tensor.dtype))
        if name in module._non_persistent_buffers_set:
            flow_module._non_persistent_buffers_set.add(name)


_CONTAINERS = (torch.nn.Module, torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


def _subclasses_an_unlisted_layer(cls: type) -> bool:
    return any(base.__module__.startswith("torch.nn.modules") and base not in _CONTAINERS
               for base in cls.__mro__[1:])
