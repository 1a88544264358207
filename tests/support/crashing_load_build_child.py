"""A package build process whose loader crashes on the package it built (crashing_loader.py); the build itself
is skipped (a minimal package is written at once): what is tested is what follows the crash.

    python crashing_load_build_child.py JOB_FOLDER
"""

import importlib.util
import os
import sys
import zipfile

sys.path.insert(0, os.path.dirname(__file__))
import crashing_loader  # noqa: E402
import torch  # noqa: E402


def _quick_package(program, package_path, inductor_configs=None):
    with zipfile.ZipFile(package_path, "w") as archive:
        archive.writestr("graph/data/aotinductor/model/wrapper_metadata.json", "{}")
        archive.writestr("graph/data/aotinductor/model/wrapper.so", b"")
    return package_path


torch._inductor.aoti_compile_and_package = _quick_package
crashing_loader.install()
RUN = os.path.join(os.path.dirname(__file__), "..", "..", "compiler", "build_process", "run.py")
spec = importlib.util.spec_from_file_location("build_process_run", RUN)
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)
child = run.child_module()
sys.exit(child.main(sys.argv[1]))
