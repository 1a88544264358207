"""KeepFast's ComfyUI nodes: thin V3 adapters over the compiler core, which they reach through its public face
only (`from ..compiler import X`: compiler/__init__.py).

Nothing here is imported until ComfyUI calls the pack's comfy_entrypoint;
ComfyUI modules are imported by the submodules that need them.

- comfy_nodes.py: the V3 node definitions (schemas, `execute`) and the extension ComfyUI lists them from;
- operations.py: what the speedup, Warmup Graphs and Save Graph nodes do; graph_loading.py: what Load Graph
  does; reports.py: what a node shows, and the Stats node's text;
- unet.py: the MODEL's hooks (ComfyUI's APPLY_MODEL and DIFFUSION_MODEL wrappers); vae.py: the VAE's decode and
  encode; patches.py, attention.py, other_compilers.py: what ComfyUI passes the model that a graph must heed;
- blocks.py: transformers block by block (which family, which block call runs eager, one engine a model);
  comfy_family.py, image_families.py, video_families.py: the families; gguf.py, lowvram.py: weights bound per
  call;
- runtime.py: process-wide state (graphs folders, registry, the page's messages); routes.py: the HTTP routes;
  graph_sets.py, sizes.py, trace_process.py, oneflow_comfy.py.
"""
