#!/usr/bin/env bash
# The device check, on a lent GPU machine (docs/gpu.md): install the carried wheels (.whl/, made by
# tools/gpu/gpu_wheels.sh) into a folder of their own, then run
#   python -m compiler bench --device cuda --check --out "$OUT/check"
# which writes bench.json, bench.md, check.log and bench.png there as it goes (within about 7 minutes).
#
#   bash tools/gpu/gpu_check.sh [more bench options, e.g. --models sd15,flux]
set -euo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/gpu_site.sh
exec python3 -m compiler bench --device cuda --check --out "$OUT/check" "$@"
