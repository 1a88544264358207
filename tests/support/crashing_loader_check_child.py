"""loader_check.py's check process, with a loader that crashes (crashing_loader.py).

    python crashing_loader_check_child.py PACKAGE.pt2
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(__file__))
import crashing_loader  # noqa: E402

crashing_loader.install()
REAL = os.path.join(os.path.dirname(__file__), "..", "..", "compiler", "backends", "package_loader.py")
sys.argv = [REAL] + sys.argv[1:]
runpy.run_path(REAL, run_name="__main__")
