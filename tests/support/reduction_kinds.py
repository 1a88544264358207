"""The kinds of Triton kernel Inductor writes for an sm_90 GPU from a layer norm over a fixed size and a softmax over
a dynamic one (bounded at 512), with and without the pack's per-kernel decision (compiler/backends/gpu_reductions.py).

Run in an interpreter with Triton (`python -m tests.support.reduction_kinds`): a fake driver stands for the GPU
(compiler/testing/bench/kernel_builds.py), Inductor writes Triton kernels for the CPU's tensors
(`cpu_backend="triton"`), and each kernel's source is read instead of built. Prints one JSON line:
{"default": {kind: count}, "fixed_only": {kind: count}}.
"""

from __future__ import annotations

import json

from compiler.testing.bench.kernel_builds import install_fake_driver

KINDS = ("persistent_reduction", "reduction", "pointwise")


def main() -> int:
    install_fake_driver()
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor import async_compile
    from torch._inductor.compile_fx import compile_fx

    from compiler.backends import gpu_reductions

    inductor_config.cpu_backend = "triton"
    inductor_config.compile_threads = 1
    inductor_config.fx_graph_cache = False  # each compile writes its kernels
    torch._functorch.config.enable_autograd_cache = False
    sources = []

    def record(self, kernel_name, source_code, device_str="cuda"):
        sources.append(source_code)
        return object()

    async_compile.AsyncCompile.triton = record

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(64)

        def forward(self, x, s):
            return self.norm(x) * 2.0, torch.softmax(s * 3.0, dim=-1)

    def backend(gm, example_inputs):
        compile_fx(gm, example_inputs)  # writes the kernels (recorded above); its result is not run
        return gm.forward

    def kinds(active: bool) -> dict:
        sources.clear()
        torch._dynamo.reset()
        x, s = torch.randn(2, 40, 64), torch.randn(2, 8, 40)
        torch._dynamo.mark_dynamic(x, 1, min=2, max=512)
        torch._dynamo.mark_dynamic(s, 2, min=2, max=512)
        with gpu_reductions.fixed_size_persistent_reductions(active), torch.no_grad():
            torch.compile(Model(), backend=backend)(x, s)
        return {kind: sum(f"@triton_heuristics.{kind}(" in source for source in sources) for kind in KINDS}

    print(json.dumps({"default": kinds(False), "fixed_only": kinds(True)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
