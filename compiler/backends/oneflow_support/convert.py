"""A torch module -> the same module built from a OneFlow copy of its package.

Converters for other packages are registered by the part of the pack that
knows them (`register_converter`: the ComfyUI nodes register one for
ComfyUI's own model classes) and are asked first. The built-in one handles
diffusers: diffusers models (ModelMixin/ConfigMixin: UNet2DConditionModel, AutoencoderKL,
ControlNetModel, ...) are rebuilt from their config. The VAE's `Encoder` and
`Decoder` (what the pack compiles as `vae.encoder` / `vae.decoder`) carry no
config: their constructor arguments are read back from the built module.
Anything else is refused with the reason. The new module's weights are not
initialised (they are replaced by the torch tensors right after), and its
tensor names and shapes must equal the torch module's, so a config the older
diffusers copy does not understand is caught here, not at run time.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Callable, Dict, Iterator, List, Protocol, Tuple

import torch

from . import isolation


class ConversionError(Exception):
    """The module cannot be built in OneFlow; the message says why."""


class Converter(Protocol):
    """Builds OneFlow modules for the models of one package."""

    name: str  # what it converts, for messages ("ComfyUI models")

    def claims(self, module: torch.nn.Module) -> bool:
        """Whether `module` is one of this converter's models (cheap; imports nothing)."""

    def build(self, module: torch.nn.Module) -> Any:
        """The OneFlow module, tensors not yet set; raises ConversionError with the reason."""


_CONVERTERS: Dict[str, Converter] = {}


def register_converter(converter: Converter) -> None:
    """Ask `converter` before the built-in diffusers conversion (replaces one of the same name)."""
    _CONVERTERS[converter.name] = converter


_INIT_FUNCTIONS = ("uniform_", "normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                   "kaiming_normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "orthogonal_", "eye_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Skip OneFlow's weight initialisation: every tensor is replaced afterwards."""
    import oneflow.nn.init as init

    saved = {name: getattr(init, name) for name in _INIT_FUNCTIONS if hasattr(init, name)}
    try:
        for name in saved:
            setattr(init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


@contextlib.contextmanager
def _quiet(logger_name: str = "diffusers") -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


_ACTIVATIONS = {"SiLU": "silu", "Mish": "mish", "GELU": "gelu", "ReLU": "relu", "LeakyReLU": "leaky_relu"}


def _act_fn(module: torch.nn.Module) -> str:
    resnet = module.mid_block.resnets[0]
    name = type(resnet.nonlinearity).__name__
    if name not in _ACTIVATIONS:
        raise ConversionError(f"unknown activation {name} in {type(module).__name__}")
    return _ACTIVATIONS[name]


def _group_norm_groups(module: torch.nn.Module) -> int:
    for sub in module.modules():
        if isinstance(sub, torch.nn.GroupNorm):
            return int(sub.num_groups)
    raise ConversionError(f"{type(module).__name__} has no GroupNorm to read norm_num_groups from")


def _decoder_arguments(module: torch.nn.Module) -> Dict[str, Any]:
    """diffusers.models.autoencoders.vae.Decoder's constructor arguments, read back."""
    up_blocks = list(module.up_blocks)
    reversed_channels = [int(block.resnets[-1].out_channels) for block in up_blocks]
    spatial = type(module.conv_norm_out).__name__ == "SpatialNorm"
    return {
        "in_channels": int(module.conv_in.in_channels),
        "out_channels": int(module.conv_out.out_channels),
        "up_block_types": tuple(type(block).__name__ for block in up_blocks),
        "block_out_channels": tuple(reversed(reversed_channels)),
        "layers_per_block": int(module.layers_per_block),
        "norm_num_groups": _group_norm_groups(module),
        "act_fn": _act_fn(module),
        "norm_type": "spatial" if spatial else "group",
        "mid_block_add_attention": bool(getattr(module.mid_block, "add_attention", True)),
    }


def _encoder_arguments(module: torch.nn.Module) -> Dict[str, Any]:
    """diffusers.models.autoencoders.vae.Encoder's constructor arguments, read back.

    `double_z` only doubles conv_out's channels: (out, True) and (2 * out,
    False) build the same tensors and the same computation.
    """
    down_blocks = list(module.down_blocks)
    conv_out = int(module.conv_out.out_channels)
    return {
        "in_channels": int(module.conv_in.in_channels),
        "out_channels": conv_out // 2 if conv_out % 2 == 0 else conv_out,
        "double_z": conv_out % 2 == 0,
        "down_block_types": tuple(type(block).__name__ for block in down_blocks),
        "block_out_channels": tuple(int(block.resnets[-1].out_channels) for block in down_blocks),
        "layers_per_block": int(module.layers_per_block),
        "norm_num_groups": _group_norm_groups(module),
        "act_fn": _act_fn(module),
        "mid_block_add_attention": bool(getattr(module.mid_block, "add_attention", True)),
    }


CONSTRUCTORS: Dict[str, Callable[[torch.nn.Module], Dict[str, Any]]] = {
    "diffusers.models.autoencoders.vae.Decoder": _decoder_arguments,
    "diffusers.models.autoencoders.vae.Encoder": _encoder_arguments,
}


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_plain(v) for v in value)
    return value


def _config_arguments(module: torch.nn.Module, flow_cls: type) -> Dict[str, Any]:
    """The torch model's config, refusing options the OneFlow copy does not know."""
    config = {k: v for k, v in dict(module.config).items() if not k.startswith("_")}
    flow_parameters = inspect.signature(flow_cls.__init__).parameters
    torch_parameters = inspect.signature(type(module).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in flow_parameters.values()):
        return config
    unknown = []
    for key, value in config.items():
        if key in flow_parameters:
            continue
        default = torch_parameters[key].default if key in torch_parameters else inspect.Parameter.empty
        if default is inspect.Parameter.empty or _plain(default) != _plain(value):
            unknown.append(f"{key}={value!r}")
    if unknown:
        raise ConversionError(
            f"{type(module).__name__} uses config options that diffusers {isolation.load()} (the copy OneFlow "
            f"imports) does not have: {', '.join(unknown[:5])}"
        )
    return {k: v for k, v in config.items() if k in flow_parameters}


def named_tensors(module) -> List[Tuple[str, Any]]:
    """(name, tensor) for every parameter and buffer, persistent or not, in module order.

    Works on torch and OneFlow modules alike (walks `_modules`, `_parameters`,
    `_buffers`; OneFlow 0.9.0 has no get_submodule).
    """
    out: List[Tuple[str, Any]] = []

    def walk(prefix: str, sub) -> None:
        for name, tensor in sub._parameters.items():
            if tensor is not None:
                out.append((prefix + name, tensor))
        for name, tensor in sub._buffers.items():
            if tensor is not None:
                out.append((prefix + name, tensor))
        for name, child in sub._modules.items():
            if child is not None:
                walk(prefix + name + ".", child)

    walk("", module)
    return out


def build_flow_module(module: torch.nn.Module):
    """A OneFlow module of the same class and configuration, weights not yet set."""
    for converter in _CONVERTERS.values():
        if converter.claims(module):
            flow_module = converter.build(module)
            break
    else:
        flow_module = _build_diffusers_module(module)
    flow_module.eval()
    check_same_tensors(module, flow_module)
    return flow_module


def _build_diffusers_module(module: torch.nn.Module):
    torch_cls = type(module)
    flow_cls, why = isolation.flow_class(torch_cls)
    if flow_cls is None:
        known = ", ".join(["diffusers models"] + list(_CONVERTERS))
        raise ConversionError(f"{why}; the oneflow backend converts {known}")
    qualified = f"{torch_cls.__module__}.{torch_cls.__qualname__}"
    config = getattr(module, "config", None)
    with isolation.active(), _no_init(), _quiet():
        if config is not None and hasattr(config, "items") and hasattr(flow_cls, "from_config"):
            flow_module = flow_cls.from_config(_config_arguments(module, flow_cls))
        elif qualified in CONSTRUCTORS:
            flow_module = flow_cls(**CONSTRUCTORS[qualified](module))
        else:
            raise ConversionError(
                f"no OneFlow conversion for {torch_cls.__name__}: it has no diffusers config and is not one of "
                f"{', '.join(name.rsplit('.', 1)[1] for name in CONSTRUCTORS)}"
            )
    return flow_module


def check_same_tensors(module: torch.nn.Module, flow_module) -> None:
    """The OneFlow module must have exactly the torch module's tensor names and shapes."""
    have = {name: tuple(t.shape) for name, t in named_tensors(flow_module)}
    want = {name: tuple(t.shape) for name, t in named_tensors(module)}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    shapes = sorted(name for name in set(have) & set(want) if have[name] != want[name])
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} torch tensors have no OneFlow counterpart (e.g. {', '.join(missing[:3])})")
        if extra:
            parts.append(f"{len(extra)} OneFlow tensors are not in the torch module (e.g. {', '.join(extra[:3])})")
        if shapes:
            name = shapes[0]
            parts.append(f"{len(shapes)} shapes differ (e.g. {name}: torch {list(want[name])}, "
                         f"OneFlow {list(have[name])})")
        raise ConversionError(f"the OneFlow {type(module).__name__} does not match the torch one: " + "; ".join(parts))
