#!/usr/bin/env bash
# ComfyUI on a GPU machine without network (docs/gpu.md, "ComfyUI on CUDA"): installs the wheels in .whl/ and
# uses ComfyUI's source in .comfyui-src/ (both made by tools/gpu/gpu_wheels.sh --comfy and copied beside this
# tree), then runs benchmarks/comfy_gpu.py in the machine's Python: the real SD1.5 UNet and Flux (full width)
# sampled through comfy.sample with and without Model Speedup, whole and partly loaded. Writes
# $OUT/comfy/comfy_gpu.json.
#
#   OUT=DIR bash tools/gpu/gpu_comfy.sh [--models sd15,flux] [--steps N]
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f .comfyui-src/comfy/sample.py ] || { echo "no .comfyui-src: run tools/gpu/gpu_wheels.sh --comfy where pip reaches PyPI and copy it here" >&2; exit 2; }
. tools/gpu/gpu_site.sh
export COMFYUI_PATH="$PWD/.comfyui-src"
# First, where .kernels/ is present (written by tools/kernel_builds/kernel_sources.py): Triton's build seconds per
# configuration of the same SD1.5 kernels at 1, 4, 8 and 16 builds at once, and this machine's cores; at most 90 s,
# and the ComfyUI run goes on whatever it says.
if [ -f .kernels/sd15_kernels.json ]; then
  timeout -k 5 90 python3 -m tools.kernel_builds.kernel_builds --sources .kernels/sd15_kernels.json \
    --out "$OUT/kernel_builds" --budget-s 50 || echo "kernel_builds ended with $?" >&2
fi
exec python3 -m benchmarks.comfy_gpu --out "$OUT/comfy" "$@"
