#!/usr/bin/env bash
# The test command (README and CI): sets up what it needs, then runs every suite.
#  1. the main suite in .venv (Python 3.11, torch 2.13 CPU); the ComfyUI tests in it
#     run only when COMFYUI_PATH points at a ComfyUI checkout, and say so when skipped;
#  2. a part of the main suite again under torch 2.11 (what the CUDA 13 GPU images and the oldest torch the
#     pack takes have) in .venv-torch211: the real-depth compiles and the API orders (TORCH211_TESTS; PyPI has
#     only a CUDA build of 2.11, about 4 GB and 6 minutes the first time; KEEPFAST_SKIP_TORCH211=1 skips it);
#  3. the OneFlow backend tests in .venv-oneflow (Python 3.10, oneflow 0.9.0), built by
#     .ci/setup_oneflow.sh (about 6 minutes and 8.5 GB the first time, seconds after).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -r requirements.txt -r requirements-dev.txt
# Two workers, a test file each at a time (a file's compiled fixtures stay in one process): a test mostly
# keeps one core busy (tracing, code generation and g++ are single-threaded), so two workers use both.
.venv/bin/python -m pytest -n "${KEEPFAST_TEST_WORKERS:-2}" --dist loadfile "$@"
TORCH211_TESTS=(tests/test_real_depth.py tests/test_api_sequences.py tests/test_torch_support.py)
if [ "${KEEPFAST_SKIP_TORCH211:-0}" != "1" ]; then
  [ -x .venv-torch211/bin/python ] || python3 -m venv .venv-torch211
  .venv-torch211/bin/python -m pip install -q --disable-pip-version-check torch==2.11.0 -r requirements.txt \
    -r requirements-dev.txt
  .venv-torch211/bin/python -m pytest -n "${KEEPFAST_TEST_WORKERS:-2}" --dist loadfile "${TORCH211_TESTS[@]}"
fi
if [ "${KEEPFAST_SKIP_ONEFLOW:-0}" != "1" ]; then
  eval "$(.ci/setup_oneflow.sh)"
  KEEPFAST_REQUIRE_ONEFLOW=1 "$ONEFLOW_ENV/bin/python" -m pytest tests/oneflow -m oneflow
fi
