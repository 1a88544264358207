"""The pack loaded in-process the way ComfyUI's loader loads it, in ComfyUI's Python (tests and the bench).

Scripts that drive the nodes without a server (tests/comfyui/kf_*.py, the
bench's weights worker) need the nodes exactly as ComfyUI would have them: a
package named by the pack's path, imported from its __init__.py, then
`comfy_entrypoint()`. Importing this module imports nothing of ComfyUI; the
functions do, so `compiler/` still never imports ComfyUI at module level.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from typing import Dict, Tuple


def load_pack(pack: str) -> Tuple[str, Dict[str, type]]:
    """(package name, node classes by name): the pack imported as ComfyUI's loader does it."""
    name = pack.replace(".", "_x_")
    spec = importlib.util.spec_from_file_location(name, os.path.join(pack, "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    extension = asyncio.run(module.comfy_entrypoint())
    return name, {node.__name__: node for node in asyncio.run(extension.get_node_list())}


def comfy_with_pack(pack: str, base: str, gpu: bool = False) -> Tuple[str, Dict[str, type]]:
    """ComfyUI on the CPU (on its GPU where `gpu`) with `base` as its --base-directory, the pack loaded as ComfyUI
    loads it, and the pack's folder on sys.path (for compiler and benchmarks): (package name, node classes by name)."""
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import comfy.cli_args

    comfy.cli_args.args.cpu = not gpu
    comfy.cli_args.args.base_directory = base  # read by folder_paths at import, like --base-directory
    name, nodes = load_pack(pack)
    sys.path.insert(0, pack)
    return name, nodes
