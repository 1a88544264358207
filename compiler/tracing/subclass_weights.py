"""Tensor-subclass weights (ComfyUI's fp8-scaled `QuantizedTensor`) lifted as their parts in an exported program.

The pack binds such a weight by its parts (fp8 bytes, scale) under the names torch gives them
(`<module>.parametrizations.<name>.original<i>`, blocks/binding.py), and the graph dequantises them. Under
torch 2.14 (ComfyUI's venv) `torch.export.export` keeps the subclass parameter whole (`<module>.weight`,
`aten.linear` on it); only lowering to ATen IR unwraps it. AOTInductor then built a package that read the
weight as a dense float32 constant, bound to the subclass wrapper (no storage of its own): every fp8 block's
first run failed with "The tensor has a non-zero number of elements, but its data is not allocated yet"
(tests/comfyui/test_comfyui_quantised.py -k fp8_scaled). `run_decompositions({})` (an empty table: no op is
decomposed) does the unwrapping, and the dequantisation (`comfy_kitchen.dequantize_fp8`) is in the graph.
"""

from __future__ import annotations

from typing import Any

import torch


def is_subclass_weight(tensor: Any) -> bool:
    """A traceable tensor subclass (it flattens to plain tensors), not a plain tensor or Parameter."""
    return (isinstance(tensor, torch.Tensor) and type(tensor) not in (torch.Tensor, torch.nn.Parameter)
            and hasattr(type(tensor), "__tensor_flatten__"))


def unwrap_subclass_weights(program: "torch.export.ExportedProgram") -> "torch.export.ExportedProgram":
    """`program` with its subclass weights lifted as their parts; itself where it has none (older torch
    versions' export unwraps them already)."""
    tensors = list(program.state_dict.values()) + list(program.constants.values())
    if not any(is_subclass_weight(t) for t in tensors):
        return program
    return program.run_decompositions({})
