"""Support code for the `oneflow` backend (compiler/backends/oneflow_backend.py).

Nothing here imports oneflow at import time: the pack must import (and say
plainly why the backend is unavailable) where oneflow is not installed.

- availability: why the backend cannot run here, why graphs cannot be saved.
- isolation:    OneFlow-backed copies of model packages (diffusers 0.31.0, and
                what the pack registers: ComfyUI's comfy), imported under
                `oneflow.mock_torch`, living next to the real torch ones in one
                process.
- shims:        what torch model code needs that OneFlow 0.9.0 lacks.
- convert:      a torch module -> the same OneFlow module (diffusers built in,
                other packages by registered converters).
- clone:        a module tree copied class by class into a package's OneFlow
                copy (for models that keep no config).
- weights:      the OneFlow module's weights alias the torch module's tensors
                (DLPack, zero copy); rebinding rules when another module runs.
- graph:        the `oneflow.nn.Graph` that runs one static call shape.
"""

from .availability import (
    FLOW_DIFFUSERS_VERSION, flow_diffusers_missing_reason, flow_diffusers_path, oneflow_unavailable_reason,
    persist_unavailable_reason,
)

__all__ = [
    "FLOW_DIFFUSERS_VERSION", "flow_diffusers_missing_reason", "flow_diffusers_path", "oneflow_unavailable_reason", "persist_unavailable_reason",
]
