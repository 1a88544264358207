"""The pack's version, written into every manifest."""

__version__ = "0.2.0"

# Whole-model graphs written before this version may have been traced at a
# size of 1, which AOTInductor can compile into code that is wrong for every
# larger size (compiler/keys/probes.py, `trace_example`). They are not loaded.
FIRST_SIZE_SAFE_VERSION = (0, 2, 0)
