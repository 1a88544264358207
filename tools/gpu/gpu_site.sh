# Sourced by the GPU machine's scripts (gpu_check.sh, gpu_comfy.sh, gpu_session.sh): installs the wheels in .whl/
# (made by tools/gpu/gpu_wheels.sh) into a folder of their own and puts it and the repository on PYTHONPATH.
: "${OUT:?OUT must name the folder for the results}"
ls .whl/*.whl > /dev/null || { echo "no .whl/*.whl: run tools/gpu/gpu_wheels.sh where pip reaches PyPI and copy .whl here" >&2; exit 2; }
SITE=$(mktemp -d "${TMPDIR:-/tmp}/keepfast-site-XXXXXX")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
export PYTHONPATH="$SITE:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
