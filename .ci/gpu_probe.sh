#!/usr/bin/env bash
# Where a CUDA AOTInductor package's load crashes (docs/gpu.md, "First run on an H100"), on a lent GPU machine:
# torch's default package built once and loaded one step per process with a C-stack printer preloaded, a CPU
# package's build and load as the control, the machine's facts; then the pack's whole path on the same module.
# Writes $OUT/probe (load_probe.json and a log per process; 8 files). About 2 minutes on an H100.
#
#   bash .ci/gpu_probe.sh [--timeout S]
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/gpu_site.sh
python3 -m compiler.testing.bench.load_probe --device cuda --out "$OUT/probe" --stages "$@"
exec python3 -m compiler.testing.bench.load_probe --device cuda --out "$OUT/probe-pack" --only pack_whole "$@"
