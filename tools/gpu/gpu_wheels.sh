#!/usr/bin/env bash
# Download what the lent GPU machines lack (docs/gpu.md) into .whl/ (git-ignored), for Python 3.12 on Linux x86-64:
#   diffusers and importlib_metadata, the versions this project's .venv runs, and what importlib_metadata 10 imports
#   on Python < 3.15 that the machine's image lacks or may hold too old: lazy_importer (not there) and zipp (>= 3.20
#   for zipp.compat.overlay). No other dependencies: the machine has torch, transformers, huggingface_hub,
#   safetensors, numpy, Pillow, filelock, regex, requests, httpx.
#
#   tools/gpu/gpu_wheels.sh            then carry .whl to the machine and run tools/gpu/gpu_check.sh there
#   tools/gpu/gpu_wheels.sh --comfy    also what ComfyUI's in-process path needs there and the image lacks (av, torchsde,
#                                trampoline: the image has scipy, einops, aiohttp, torchvision and torchaudio), and
#                                ComfyUI's tracked files from $COMFYUI_PATH in .comfyui-src (ignored), for
#                                tools/gpu/gpu_comfy.sh (carry .whl and .comfyui-src)
#
# Uses pip's own client (the network goes through pip); prints each wheel's size and the total, and fails if the
# wheels would not leave room in the 64 MB a device call carries.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(diffusers==0.42.1 importlib_metadata==10.2.0 lazy_importer==0.1.0 zipp==4.1.2)
LIMIT_BYTES=$((16 * 1024 * 1024))  # of the 64 MB carried: the working tree needs the rest
if [ "${1:-}" = "--comfy" ]; then
  : "${COMFYUI_PATH:?COMFYUI_PATH must name the ComfyUI checkout whose source travels}"
  WHEELS+=(av==18.1.0 torchsde==0.2.6 trampoline==0.1.2)  # the versions ComfyUI's venv here runs
  LIMIT_BYTES=$((44 * 1024 * 1024))  # with ComfyUI's source (about 15 MB) and this tree (about 3 MB)
  rm -rf .comfyui-src && mkdir .comfyui-src
  # the checkout's tracked files as they are on disk (a snapshot's git objects may lack its largest files)
  git -C "$COMFYUI_PATH" ls-files -z | (cd "$COMFYUI_PATH" && tar --null --ignore-failed-read -T - -cf -) \
    | tar -x -C .comfyui-src
  du -sb .comfyui-src
fi
PYTHON=${PYTHON:-python3}
rm -rf .whl
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}" >&2
total=0
for wheel in .whl/*.whl; do
  size=$(stat -c %s "$wheel")
  total=$((total + size))
  printf '%10d  %s\n' "$size" "$wheel"
done
printf '%10d  total\n' "$total"
if [ "$total" -gt "$LIMIT_BYTES" ]; then
  echo "the wheels take $total bytes, more than $LIMIT_BYTES: too much to carry beside the working tree" >&2
  exit 1
fi
