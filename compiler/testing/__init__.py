"""The pack's own test bench, shipped as torch.testing and diffusers' testing utilities are.

- `tiny_models`: diffusion models and pipelines built from configs with random
  weights (no weights can be downloaded): the demo, the tests and the bench use them;
- `demo`: the standalone demo (`python -m compiler demo`);
- `bench`: the benchmark (`python -m compiler bench`);
- `comfy_models`: a script that builds tiny checkpoints, LoRAs and ControlNets from
  ComfyUI's own classes, run inside ComfyUI's Python;
- `comfy_families`, `comfy_quantised`, `comfy_pack`: tiny models of ComfyUI's DiT
  families, the same as GGUF (through ComfyUI-GGUF) and fp8-scaled checkpoints
  with a LoRA for them, and the pack loaded as ComfyUI loads it: imported inside
  ComfyUI's Python by the ComfyUI tests and the bench's weights part.

Nothing shipped imports from tests/.
"""
