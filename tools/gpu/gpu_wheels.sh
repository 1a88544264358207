#!/usr/bin/env bash
# Download, where pip reaches PyPI, what a GPU machine without network needs beside torch (docs/gpu.md) into .whl/
# (git-ignored), for Python 3.12 on Linux x86-64:
#   diffusers and importlib_metadata, the versions this project's .venv runs, and what importlib_metadata 10 imports
#   on Python < 3.15: lazy_importer and zipp (>= 3.20 for zipp.compat.overlay). No other dependencies: the machine
#   is expected to have torch, triton, transformers, huggingface_hub, safetensors, numpy, Pillow, filelock, regex,
#   requests and httpx.
#
#   tools/gpu/gpu_wheels.sh            then copy .whl to the machine's checkout and run tools/gpu/gpu_check.sh there
#   tools/gpu/gpu_wheels.sh --comfy    also what ComfyUI's in-process path needs beyond scipy, einops, aiohttp,
#                                torchvision and torchaudio (av, torchsde, trampoline), and
#                                ComfyUI's tracked files from $COMFYUI_PATH in .comfyui-src (ignored), for
#                                tools/gpu/gpu_comfy.sh (copy .whl and .comfyui-src to the machine)
#
# Uses pip's own client (the network goes through pip); prints each wheel's size and the total, and fails above
# LIMIT_BYTES, so that the tree with its wheels stays under 64 MB to copy.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(diffusers==0.42.1 importlib_metadata==10.2.0 lazy_importer==0.1.0 zipp==4.1.2)
LIMIT_BYTES=$((16 * 1024 * 1024))  # of 64 MB in all: the working tree needs the rest
if [ "${1:-}" = "--comfy" ]; then
  : "${COMFYUI_PATH:?COMFYUI_PATH must name the ComfyUI checkout whose source travels}"
  WHEELS+=(av==18.1.0 torchsde==0.2.6 trampoline==0.1.2)  # the versions ComfyUI 0.8's venv runs
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
  echo "the wheels take $total bytes, more than $LIMIT_BYTES: too much to copy beside the working tree" >&2
  exit 1
fi
