#!/usr/bin/env bash
# The device check on a GPU machine without network (docs/gpu.md): installs the wheels in .whl/ (made elsewhere
# by tools/gpu/gpu_wheels.sh and copied beside this tree) into a folder of their own, then runs
#   python -m compiler bench --device cuda --check --out "$OUT/check"
# which writes bench.json, bench.md, check.log and bench.png there as it goes (within about 7 minutes).
# OUT names the folder for the results.
#
#   OUT=DIR bash tools/gpu/gpu_check.sh [more bench options, e.g. --models sd15,flux --budget 300]
set -euo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/gpu_site.sh
exec python3 -m compiler bench --device cuda --check --out "$OUT/check" "$@"
