#!/usr/bin/env bash
# The device check, on a lent GPU machine (docs/gpu.md): install the carried wheels (.whl/, made by
# .ci/gpu_wheels.sh) into a folder of their own, then run
#   python -m compiler bench --device cuda --check --out "$OUT/check"
# which writes bench.json, bench.md, check.log and bench.png there as it goes (within about 7 minutes).
#
#   bash .ci/gpu_check.sh [more bench options, e.g. --models sd15,flux]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder whose files come back}"
ls .whl/*.whl > /dev/null || { echo "no .whl/*.whl: run .ci/gpu_wheels.sh here and carry .whl" >&2; exit 2; }
SITE=$(mktemp -d "${TMPDIR:-/tmp}/keepfast-site-XXXXXX")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
export PYTHONPATH="$SITE:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python3 -m compiler bench --device cuda --check --out "$OUT/check" "$@"
