"""A package build child slowed on purpose (tests/builds/test_background_builds.py): waits, then builds as the real one.

    python slow_build_child.py JOB_FOLDER   (KEEPFAST_TEST_BUILD_DELAY_S: the wait, default 20)

It watches the parent's lifeline from the start, as the real child does, so a parent killed during the wait
is seen as during a build.
"""

import importlib.util
import os
import sys
import time

RUN = os.path.join(os.path.dirname(__file__), "..", "..", "compiler", "build_process", "run.py")
spec = importlib.util.spec_from_file_location("build_process_run", RUN)
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)
child = run.child_module()
folder = sys.argv[1]
child._stop_when_the_parent_is_gone(folder)
time.sleep(float(os.environ.get("KEEPFAST_TEST_BUILD_DELAY_S", "20")))
os.environ.pop("KEEPFAST_PARENT_LIFELINE_FD", None)  # watched already
sys.exit(child.main(folder))
