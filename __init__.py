"""KeepFast: a ComfyUI custom node pack (and a compiler core usable without ComfyUI).

ComfyUI imports this file as the pack's package. It imports nothing heavy and
changes nothing at import: the nodes, the `models/graphs` folder and the
/keepfast/stats route are set up when ComfyUI calls `comfy_entrypoint()`.
Importing it without ComfyUI (tests, tools) works and does nothing.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes import runtime
    from .nodes.comfy_nodes import KeepFastExtension

    runtime.setup()
    return KeepFastExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
