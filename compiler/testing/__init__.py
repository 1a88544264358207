"""The pack's own test bench, shipped as torch.testing and diffusers' testing utilities are.

- `tiny_models`: diffusion models and pipelines built from configs with random
  weights (no weights can be downloaded): the demo, the tests and the bench use them;
- `demo`: the standalone demo (`python -m compiler demo`);
- `bench`: the benchmark (`python -m compiler bench`);
- `comfy_models`: a script that builds tiny checkpoints, LoRAs and ControlNets from
  ComfyUI's own classes, run inside ComfyUI's Python.

Nothing shipped imports from tests/.
"""
