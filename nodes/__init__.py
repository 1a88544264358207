"""KeepFast's ComfyUI nodes: thin V3 adapters over the compiler core.

Nothing here is imported until ComfyUI calls the pack's comfy_entrypoint;
ComfyUI modules are imported by the submodules that need them.
"""
