"""Support code for the `oneflow` backend (compiler/backends/oneflow_backend.py).

Nothing here imports oneflow at import time: the pack must import (and say
plainly why the backend is unavailable) where oneflow is not installed.

- availability: why the backend cannot run here, why graphs cannot be saved.
- isolation:    a OneFlow-backed copy of diffusers (0.31.0, imported under
                `oneflow.mock_torch`) living next to the real torch diffusers
                in one process, with the shims OneFlow 0.9.0 needs.
- convert:      a torch diffusers module -> the same OneFlow module.
- weights:      the OneFlow module's weights alias the torch module's tensors
                (DLPack, zero copy); rebinding rules when another module runs.
- graph:        the `oneflow.nn.Graph` that runs one static call shape.
"""

from .availability import (
    FLOW_DIFFUSERS_VERSION,
    flow_diffusers_path,
    oneflow_unavailable_reason,
    persist_unavailable_reason,
)

__all__ = [
    "FLOW_DIFFUSERS_VERSION", "flow_diffusers_path", "oneflow_unavailable_reason", "persist_unavailable_reason",
]
