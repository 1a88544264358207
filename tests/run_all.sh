#!/usr/bin/env bash
# The test command (README and CI): sets up what it needs, then runs every suite.
#  1. the main suite in .venv (Python 3.11, torch 2.13 CPU); the ComfyUI tests in it
#     run only when COMFYUI_PATH points at a ComfyUI checkout, and say so when skipped;
#  2. a part of the main suite under torch 2.11 (what the CUDA 13 GPU images and the oldest torch the
#     pack takes have) in .venv-torch211: the SD and upcast-VAE API orders, the torch check, the real-depth SDXL UNet,
#     Triton's kernel builds for a GPU target and the kernels Inductor writes for one (triton is in that torch's
#     wheels, not in the CPU 2.13's), a block program with its weights lifted to inputs (torch's IR internals)
#     (TORCH211_TESTS; the real-depth SD1.5 UNet and VAE run under 2.13 in the main suite). PyPI has only a
#     CUDA build of 2.11 (about 4.6 GB, a minute to install here); KEEPFAST_SKIP_TORCH211=1 skips it;
#  3. the OneFlow backend tests in .venv-oneflow (Python 3.10, oneflow 0.9.0), built by
#     .ci/setup_oneflow.sh (several minutes and 8.5 GB the first time, seconds after), beside 2.
# The environments of 2 and 3 are installed while the main suite runs, at the lowest CPU and disk priority (the
# test workers come first) and without pip's bytecode compile (torch 2.11's install took 148 s of a core with it,
# 99 s without; Python compiles what a test imports). The main suite took 2771 s so, 2783 s before: it keeps both
# cores busy (98% on this machine) with its compiles, which is where its time goes. Their logs are shown when an
# install fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes the bytecode of what it imports (__pycache__, ignored by git), whatever the machine's environment
# says: with PYTHONDONTWRITEBYTECODE=1 (set on this machine) and no bytecode in the venvs, every process compiled
# torch's sources again as it imported them, and the suite starts hundreds (build processes, fresh-process tests):
# `import torch, torch._inductor.compile_fx, diffusers.models` took 14.4 s a process so, 5.9 s once written. The
# main suite took 2666 s in a fresh clone so (the other legs' installs beside it), 1804 s in a venv with bytecode
# and nothing beside it (2026-11-27, this 2-core machine).
unset PYTHONDONTWRITEBYTECODE
python3 -m venv .venv
# No bytecode compile at install (63 s here with it, 33 s without): Python compiles what the tests import, once.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 -r requirements.txt \
  -r requirements-dev.txt

SETUP_LOGS=$(mktemp -d)
BACKGROUND=()
trap 'for pid in "${BACKGROUND[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$SETUP_LOGS"' EXIT

setup_torch211() {
  [ -x .venv-torch211/bin/python ] || python3 -m venv .venv-torch211
  .venv-torch211/bin/python -m pip install -q --disable-pip-version-check --no-compile torch==2.11.0 \
    -r requirements.txt -r requirements-dev.txt
}
setup_oneflow() {
  .ci/setup_oneflow.sh >/dev/null  # writes .venv-oneflow/oneflow-env.sh
}
# Runs "$@" in the background at the lowest CPU and disk priority.
in_background() {
  (
    renice -n 19 -p "$BASHPID" >/dev/null 2>&1 || true
    ionice -c 2 -n 7 -p "$BASHPID" >/dev/null 2>&1 || true
    "$@"
  ) &
}
# Waits for a background setup; on failure prints its log and fails the run.
joined() {
  if ! wait "$1"; then
    echo "setting up $2 failed:" >&2
    cat "$SETUP_LOGS/$2.log" >&2
    exit 1
  fi
}
if [ "${KEEPFAST_SKIP_TORCH211:-0}" != "1" ]; then
  in_background setup_torch211 >"$SETUP_LOGS/torch211.log" 2>&1
  TORCH211_SETUP=$!
  BACKGROUND+=("$TORCH211_SETUP")
fi
if [ "${KEEPFAST_SKIP_ONEFLOW:-0}" != "1" ]; then
  in_background setup_oneflow >"$SETUP_LOGS/oneflow.log" 2>&1
  ONEFLOW_SETUP=$!
  BACKGROUND+=("$ONEFLOW_SETUP")
fi

# Two workers, a test file each at a time (a file's compiled fixtures stay in one process): a test mostly
# keeps one core busy (tracing, code generation and g++ are single-threaded), so two workers use both. Files
# go out slowest first (tests/support/file_order.py), not by their number of tests (xdist's default).
REAL_DEPTH_SDXL="tests/serving/test_real_depth.py::test_a_unet_at_its_real_depth_compiles_once_and_serves_every_call_equal_to_eager[sdxl]"
.venv/bin/python -m pytest -n "${KEEPFAST_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  --deselect "$REAL_DEPTH_SDXL" "$@"

# The SD pipeline compiled, then loaded in a fresh process, the float16 one whose VAE runs upcast (SDXL: its
# real-depth UNet here). The other API orders of the SD pipeline run in the main suite: what they vary is the order
# of the pack's own calls, not torch; under 2.11 they only lengthened the leg's slower worker (390 s against the
# real-depth SDXL's 344 s on the other). A GPU program's build without Inductor's ISA probe: it is torch 2.11's
# probe (a Python importing torch per ISA checked) that the GPU machines run (about 17 s here).
TORCH211_TESTS=(tests/machine/test_torch_support.py "$REAL_DEPTH_SDXL"
  "tests/api/test_api_sequences.py::test_sd_pipe_any_api_order_compiles_nothing[compile_then_load]"
  tests/api/test_api_sequences.py::test_float16_pipe_whose_vae_runs_upcast_compiles_nothing
  tests/api/test_api_sequences.py::test_positional_and_keyword_calls_are_one_graph
  tests/build_process/test_gpu_host_isa.py::test_a_build_without_a_host_isa_probes_none_and_its_package_still_computes
  tests/tools/test_kernel_builds.py tests/build_process/test_gpu_reductions.py
  tests/tracing/test_block_weight_inputs.py::test_a_lifted_program_takes_every_weight_after_the_call_and_its_package_computes_as_eager)
# The OneFlow tests (one process, about a minute) run beside the torch 2.11 leg, whose two workers rarely end
# together: they take the core the first one to finish leaves. Their output follows the leg's. They start once
# their environment is set up, which the torch 2.11 leg does not wait for (its setup is the smaller one).
ONEFLOW_TESTS=""
if [ "${KEEPFAST_SKIP_ONEFLOW:-0}" != "1" ]; then
  (
    wait_for_setup() { while kill -0 "$1" 2>/dev/null; do sleep 1; done; }
    wait_for_setup "$ONEFLOW_SETUP"
    . .venv-oneflow/oneflow-env.sh
    KEEPFAST_REQUIRE_ONEFLOW=1 "$ONEFLOW_ENV/bin/python" -m pytest tests/oneflow -m oneflow
  ) >"$SETUP_LOGS/oneflow-tests.log" 2>&1 &
  ONEFLOW_TESTS=$!
  BACKGROUND+=("$ONEFLOW_TESTS")
fi
if [ "${KEEPFAST_SKIP_TORCH211:-0}" != "1" ]; then
  joined "$TORCH211_SETUP" torch211
  .venv-torch211/bin/python -m pytest -n "${KEEPFAST_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
    "${TORCH211_TESTS[@]}"
fi
if [ -n "$ONEFLOW_TESTS" ]; then
  joined "$ONEFLOW_SETUP" oneflow
  ONEFLOW_STATUS=0
  wait "$ONEFLOW_TESTS" || ONEFLOW_STATUS=$?
  cat "$SETUP_LOGS/oneflow-tests.log"
  [ "$ONEFLOW_STATUS" = 0 ] || { echo "the OneFlow tests failed (exit $ONEFLOW_STATUS)" >&2; exit "$ONEFLOW_STATUS"; }
fi
