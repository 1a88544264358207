"""A package build child slowed on purpose (tests/test_background_builds.py): waits, then builds as the real one.

    python slow_build_child.py JOB_FOLDER   (KEEPFAST_TEST_BUILD_DELAY_S: the wait, default 20)
"""

import os
import runpy
import sys
import time

time.sleep(float(os.environ.get("KEEPFAST_TEST_BUILD_DELAY_S", "20")))
REAL = os.path.join(os.path.dirname(__file__), "..", "..", "compiler", "backends", "package_build_child.py")
sys.argv = [REAL] + sys.argv[1:]
runpy.run_path(REAL, run_name="__main__")
