"""A package build child that fails as AOTInductor would (tests/builds/test_background_builds.py)."""

import os
import sys

with open(os.path.join(sys.argv[1], "error.txt"), "w") as handle:
    handle.write("InductorError: a test-only failure of the C++ compiler\n")
sys.exit(1)
