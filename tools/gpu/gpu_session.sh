#!/usr/bin/env bash
# The device check of SD1.5 and Flux within a fixed time, on a GPU machine without network (docs/gpu.md): the
# check in 2 lanes of half the cores each (the SD1.5 UNet then builds in 2 parts of 4 Triton compile workers),
# with a budget of what is left of SECONDS. Every step has its own limit, so the results are written even when one
# hangs. $OUT gets 3 files: the check's bench.json and bench.md, and logs.tgz (every log).
#
#   OUT=DIR bash tools/gpu/gpu_session.sh [SECONDS]   (default 560: the whole command's time)
#   MODELS=sdxl,vae bash tools/gpu/gpu_session.sh 490   the check of other models (default sd15,flux)
#   KEEPFAST_CONV_LAYOUT=channels_last bash tools/gpu/gpu_session.sh   builds the GPU graphs with channels-last
#   convolutions (docs/gpu.md, "Channels-last convolutions"); bench.json's meta says which ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
TOTAL=${1:-560}
START=$(date +%s)
. tools/gpu/gpu_site.sh
export PYTHONUNBUFFERED=1
RESULTS=$(mktemp -d "${TMPDIR:-/tmp}/keepfast-check-XXXXXX")
left() { echo $(( TOTAL - ($(date +%s) - START) )); }

BUDGET=$(( $(left) - 25 ))
if [ "$BUDGET" -ge 120 ]; then
    echo "device check: ${MODELS:-sd15,flux}, budget $BUDGET s"
    timeout -k 5 $(( BUDGET + 10 )) python3 -m compiler bench --device cuda --check --out "$RESULTS/check" \
        --models "${MODELS:-sd15,flux}" --lanes 2 --budget "$BUDGET" 2>&1 | tail -40
else
    echo "device check not run: $(left) s left"
fi

cp "$RESULTS/check/bench.json" "$RESULTS/check/bench.md" "$OUT/" 2>/dev/null
tar -C "$RESULTS" -czf "$OUT/logs.tgz" --exclude='*.png' --exclude='*.pt2' . 2>/dev/null
ls -la "$OUT"
exit 0
