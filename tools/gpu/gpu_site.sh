# Sourced by the GPU machine's scripts (gpu_check.sh, gpu_probe.sh): installs the carried wheels (.whl/, made by
# tools/gpu/gpu_wheels.sh) into a folder of their own and puts it and the repository on PYTHONPATH.
: "${OUT:?OUT must name the folder whose files come back}"
ls .whl/*.whl > /dev/null || { echo "no .whl/*.whl: run tools/gpu/gpu_wheels.sh here and carry .whl" >&2; exit 2; }
SITE=$(mktemp -d "${TMPDIR:-/tmp}/keepfast-site-XXXXXX")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
export PYTHONPATH="$SITE:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
