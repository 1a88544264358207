"""The kinds of Triton kernel Inductor writes for an sm_90 GPU from a layer norm over a fixed size and a softmax over
a dynamic one (bounded at 512), with and without the pack's per-kernel decision (compiler/build_process/gpu_reductions.py).

Run in an interpreter with Triton (`python -m tests.support.reduction_kinds`): a fake driver stands for the GPU
and Inductor writes Triton kernels for the CPU's tensors, each kernel's source read instead of built
(tools/kernel_builds/kernel_sources.py `record_gpu_kernels`). Prints one JSON line:
{"default": {kind: count}, "fixed_only": {kind: count}}.
"""

from __future__ import annotations

import json

from tools.kernel_builds.kernel_sources import record_gpu_kernels, writes_kernels

KINDS = ("persistent_reduction", "reduction", "pointwise")


def main() -> int:
    kernels = record_gpu_kernels()
    import torch

    from compiler.build_process import gpu_reductions

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(64)

        def forward(self, x, s):
            return self.norm(x) * 2.0, torch.softmax(s * 3.0, dim=-1)

    def kinds(active: bool) -> dict:
        kernels.clear()
        torch._dynamo.reset()
        x, s = torch.randn(2, 40, 64), torch.randn(2, 8, 40)
        torch._dynamo.mark_dynamic(x, 1, min=2, max=512)
        torch._dynamo.mark_dynamic(s, 2, min=2, max=512)
        with gpu_reductions.fixed_size_persistent_reductions(active), torch.no_grad():
            torch.compile(Model(), backend=writes_kernels)(x, s)
        return {kind: sum(f"@triton_heuristics.{kind}(" in k["source"] for k in kernels) for kind in KINDS}

    print(json.dumps({"default": kinds(False), "fixed_only": kinds(True)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
