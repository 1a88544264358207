#!/usr/bin/env bash
# One lent GPU session's runs in one command (docs/gpu.md, "What the next GPU session runs"), for a 15-minute
# device budget: the device check of SD1.5 and Flux with the time allowed, in 2 lanes of half the cores each (the
# SD1.5 UNet then builds in 2 parts of 4 Triton compile workers: docs/gpu.md, "Parts of a GPU program"). PROBE=1
# runs the load probe first (torch's own package, the pack's whole path with CUDA graph replays). Every step has
# its own limit so that the files come back even when one hangs. $OUT gets at most 8 files: the probe's
# probe.json (with PROBE=1), the check's bench.json and bench.md, and logs.tgz (every log).
#
#   bash tools/gpu/gpu_session.sh [SECONDS]   (default 560: the whole command's time, under the call's timeout_s)
#   MODELS=sdxl,vae bash tools/gpu/gpu_session.sh 490   the check of other models (default sd15,flux; the CPU rehearsal
#   of sdxl,vae in 2 lanes: 428 s here, 2026-11-28)
#   KEEPFAST_CONV_LAYOUT=channels_last bash tools/gpu/gpu_session.sh   builds our GPU graphs with channels-last
#   convolutions (docs/gpu.md, "Channels-last convolutions"); bench.json's meta says which ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
TOTAL=${1:-560}
START=$(date +%s)
. tools/gpu/gpu_site.sh
export PYTHONUNBUFFERED=1
RESULTS=$(mktemp -d "${TMPDIR:-/tmp}/keepfast-session-XXXXXX")
left() { echo $(( TOTAL - ($(date +%s) - START) )); }

# torch's own package after the pack's libstdc++ check, and the pack's whole path with CUDA graph replays (both
# loaded since the fix; docs/gpu.md, "The loader crash: cause and fix"). `--stages` is the crash's probe.
if [ "${PROBE:-0}" = "1" ]; then
    timeout -k 5 160 python3 -m benchmarks.load_probe --device cuda --out "$RESULTS/probe" \
        --only torch_linked,pack_whole --timeout 150 2>&1 | tee "$RESULTS/probe.out"
fi

BUDGET=$(( $(left) - 25 ))
if [ "$BUDGET" -ge 120 ]; then
    echo "device check: ${MODELS:-sd15,flux}, budget $BUDGET s"
    timeout -k 5 $(( BUDGET + 10 )) python3 -m compiler bench --device cuda --check --out "$RESULTS/check" \
        --models "${MODELS:-sd15,flux}" --lanes 2 --budget "$BUDGET" 2>&1 | tail -40
else
    echo "device check not run: $(left) s left"
fi

cp "$RESULTS/probe/load_probe.json" "$OUT/probe.json" 2>/dev/null
cp "$RESULTS/check/bench.json" "$RESULTS/check/bench.md" "$OUT/" 2>/dev/null
tar -C "$RESULTS" -czf "$OUT/logs.tgz" --exclude='*.png' --exclude='*.pt2' . 2>/dev/null
ls -la "$OUT"
exit 0
