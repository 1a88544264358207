"""Tensor-subclass weights are lifted as their parts in the exported program (compiler/tracing/subclass_weights.py).

ComfyUI's fp8-scaled weights are such a subclass; under torch 2.14 export kept them whole and the package read
each as a dense constant (tests/comfyui/test_comfyui_quantised.py -k fp8_scaled, with ComfyUI's own class).
Here a small scaled-int8 subclass stands for it."""

import torch
from torch.utils._pytree import tree_map

from compiler.tracing.subclass_weights import is_subclass_weight, unwrap_subclass_weights


class ScaledInt8(torch.Tensor):
    """int8 data and a float32 scale; every op sees the dequantised float tensor (as comfy_kitchen falls back)."""

    @staticmethod
    def __new__(cls, data, scale):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    def __init__(self, data, scale):
        self.data_, self.scale_ = data, scale

    def __tensor_flatten__(self):
        return ["data_", "scale_"], None

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return ScaledInt8(inner["data_"], inner["scale_"])

    def dequantize(self):
        return self.data_.to(torch.float32) * self.scale_

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # nn.Parameter needs detach to keep the type
            return ScaledInt8(args[0].data_, args[0].scale_)
        plain = tree_map(lambda t: t.dequantize() if isinstance(t, ScaledInt8) else t, (args, kwargs or {}))
        return func(*plain[0], **plain[1])


def _linear():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    scale = torch.tensor(0.02)
    data = (layer.weight.detach() / scale).round().clamp(-127, 127).to(torch.int8)
    layer.weight = torch.nn.Parameter(ScaledInt8(data, scale), requires_grad=False)
    return layer.eval()


def test_a_subclass_weight_is_lifted_as_its_parts_and_dequantised_in_the_graph():
    layer, x = _linear(), torch.randn(3, 8)
    assert is_subclass_weight(layer.weight) and not is_subclass_weight(layer.bias)
    with torch.no_grad():
        program = unwrap_subclass_weights(torch.export.export(layer, (x,), strict=False))
        want = layer(x)
    lifted = {spec.target for spec in program.graph_signature.input_specs if spec.target}
    assert lifted == {"bias", "parametrizations.weight.original0", "parametrizations.weight.original1"}
    assert not any(is_subclass_weight(t) for t in program.state_dict.values())
    assert program.state_dict["parametrizations.weight.original0"].dtype == torch.int8
    with torch.no_grad():
        got = program.module()(x)
    assert torch.allclose(got, want, atol=1e-6)


def test_a_program_without_subclass_weights_is_kept_as_it_is():
    layer, x = torch.nn.Linear(8, 4).eval(), torch.randn(3, 8)
    with torch.no_grad():
        program = torch.export.export(layer, (x,), strict=False)
    assert unwrap_subclass_weights(program) is program
