#!/usr/bin/env bash
# Create (or reuse) the Python 3.10 environment for the OneFlow backend tests.
#
#   .ci/setup_oneflow.sh [ENV_DIR]        ENV_DIR defaults to <repo>/.venv-oneflow
#
# Installs, into ENV_DIR only (a venv, plus one --target folder inside it):
#   oneflow==0.9.0 (CUDA 11 build, cp310 only; runs on the CPU), nvidia-cudnn-cu11==8.5.0.96,
#   nvidia-cublas-cu11==11.10.3.66, numpy<2 (1.26.4), torch==2.13.0 (for cp310 PyPI has only the
#   CUDA 13 build, ~4 GB with its nvidia-* wheels; it runs on the CPU), diffusers==0.41.0
#   (0.42.x requires Python >= 3.11), safetensors==0.8.0, pytest==9.2.0; all other versions are
#   pinned by the constraints below (the set that was installed and tested together).
#   And diffusers==0.31.0 with --no-deps into ENV_DIR/flow-diffusers-0.31.0: the copy that is
#   imported under oneflow.mock_torch to build OneFlow modules (diffusers >= 0.32 does not import
#   under oneflow 0.9.0's mock_torch).
# torchvision is kept out on purpose (a CUDA torchvision next to this torch breaks imports).
#
# Output: progress goes to stderr; stdout carries only `export ...` lines, so CI can do
#   eval "$(.ci/setup_oneflow.sh)"  &&  python -m pytest ...
# The same lines are written to ENV_DIR/oneflow-env.sh (`. ENV_DIR/oneflow-env.sh`).
# LD_LIBRARY_PATH must be set before python starts (oneflow's extension links libcudnn*.so.8,
# libcublas.so.11 and libcublasLt.so.11 from the nvidia-* wheels).
#
# Re-running is quick: a marker (ENV_DIR/.setup_oneflow.ok) holding a hash of this spec skips
# all installs. Set SETUP_ONEFLOW_FORCE=1 to reinstall/verify anyway.
# PYTHON310 overrides the interpreter (default /root/.pyenv/versions/3.10.13/bin/python).
set -euo pipefail

log() { printf '[setup_oneflow] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_DIR="${1:-$REPO_ROOT/.venv-oneflow}"
PY310="${PYTHON310:-/root/.pyenv/versions/3.10.13/bin/python}"
FLOW_DIFFUSERS_VERSION="0.31.0"

read -r -d '' CONSTRAINTS <<'EOF' || true
anyio==4.16.0
certifi==2026.10.18
charset-normalizer==3.5.2
click==8.5.1
cuda-bindings==13.4.4
cuda-pathfinder==1.8.3
cuda-toolkit==13.0.3.0
diffusers==0.41.0
exceptiongroup==1.3.1
filelock==4.1.0
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpx==0.28.1
huggingface_hub==1.33.0
idna==3.20
importlib_metadata==9.0.1
iniconfig==2.3.1
Jinja2==3.1.6
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
mpmath==1.3.0
networkx==3.4.2
numpy==1.26.4
nvidia-cublas==13.1.1.3
nvidia-cublas-cu11==11.10.3.66
nvidia-cuda-cupti==13.0.85
nvidia-cuda-nvrtc==13.0.88
nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu11==8.5.0.96
nvidia-cudnn-cu13==9.20.0.48
nvidia-cufft==12.0.0.61
nvidia-cufile==1.15.1.6
nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66
nvidia-cusparse==12.6.3.3
nvidia-cusparselt-cu13==0.8.1
nvidia-nccl-cu13==2.29.7
nvidia-nvjitlink==13.5.37
nvidia-nvshmem-cu13==3.4.5
nvidia-nvtx==13.0.85
oneflow==0.9.0
packaging==26.3
pillow==12.3.0
pluggy==1.7.0
protobuf==3.20.3
Pygments==2.21.0
pytest==9.2.0
PyYAML==6.0.3
regex==2026.9.29
requests==2.34.2
rich==15.0.0
safetensors==0.8.0
sympy==1.14.0
tomli==2.5.0
torch==2.13.0
tqdm==4.70.1
triton==3.7.1
typing_extensions==4.16.0
urllib3==2.8.0
zipp==4.1.2
EOF

# The install steps, in the order that was tested.
STEP1=(oneflow==0.9.0 nvidia-cudnn-cu11==8.5.0.96 nvidia-cublas-cu11==11.10.3.66 "numpy<2")
STEP2=(torch==2.13.0)
STEP3=(diffusers==0.41.0 safetensors==0.8.0 pytest==9.2.0)

SPEC_HASH="$(printf '%s\n' "$CONSTRAINTS" "${STEP1[@]}" "${STEP2[@]}" "${STEP3[@]}" \
  "flow-diffusers=$FLOW_DIFFUSERS_VERSION" "spec-v1" | sha256sum | cut -c1-16)"

mkdir -p "$ENV_DIR"
ENV_DIR="$(cd "$ENV_DIR" && pwd)"
MARKER="$ENV_DIR/.setup_oneflow.ok"
ENV_FILE="$ENV_DIR/oneflow-env.sh"
SP="$ENV_DIR/lib/python3.10/site-packages"
FLOW_DIFFUSERS_PATH="$ENV_DIR/flow-diffusers-$FLOW_DIFFUSERS_VERSION"
LDP="$SP/nvidia/cudnn/lib:$SP/nvidia/cublas/lib"

emit_exports() {
  cat <<EOF
export LD_LIBRARY_PATH="$LDP\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export ONEFLOW_ENV="$ENV_DIR"
export FLOW_DIFFUSERS_PATH="$FLOW_DIFFUSERS_PATH"
export PATH="$ENV_DIR/bin:\$PATH"
EOF
}

# One setup at a time per env.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$ENV_DIR/.setup_oneflow.lock"
  flock 9
fi

if [[ "${SETUP_ONEFLOW_FORCE:-0}" != "1" && -f "$MARKER" && "$(cat "$MARKER")" == "$SPEC_HASH" \
      && -x "$ENV_DIR/bin/python" && -f "$ENV_FILE" && -d "$FLOW_DIFFUSERS_PATH/diffusers" ]]; then
  log "env up to date ($ENV_DIR, spec $SPEC_HASH); nothing to do"
  emit_exports
  exit 0
fi
rm -f "$MARKER"

# Keep pip's installs inside the env whatever the caller's pip settings say.
unset PIP_TARGET PIP_PREFIX PIP_ROOT PIP_USER PIP_REQUIRE_VIRTUALENV PYTHONPATH PYTHONHOME || true
export PIP_USER=0 PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ -x "$ENV_DIR/bin/python" ]]; then
  have="$("$ENV_DIR/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  [[ "$have" == "3.10" ]] || die "$ENV_DIR has Python $have; oneflow 0.9.0 needs 3.10 (remove the folder)"
  log "reusing venv $ENV_DIR"
else
  [[ -x "$PY310" ]] || die "no Python 3.10 at $PY310 (set PYTHON310)"
  "$PY310" -c 'import sys; assert sys.version_info[:2] == (3, 10), sys.version' \
    || die "$PY310 is not Python 3.10"
  log "creating venv $ENV_DIR with $PY310"
  "$PY310" -m venv "$ENV_DIR"
fi
PY="$ENV_DIR/bin/python"

CONSTRAINTS_FILE="$ENV_DIR/constraints-oneflow.txt"
printf '%s\n' "$CONSTRAINTS" > "$CONSTRAINTS_FILE"

pipi() {
  local t0=$SECONDS
  log "pip install $*"
  "$PY" -m pip install --progress-bar off --no-compile -c "$CONSTRAINTS_FILE" "$@" 2>&1 \
    | { grep -v "^WARNING: Location '" || true; } >&2
  log "  done in $((SECONDS - t0)) s"
}
pipi "${STEP1[@]}"
pipi "${STEP2[@]}"
pipi "${STEP3[@]}"
if [[ ! -d "$FLOW_DIFFUSERS_PATH/diffusers" ]]; then
  t0=$SECONDS
  log "pip install --no-deps --target $FLOW_DIFFUSERS_PATH diffusers==$FLOW_DIFFUSERS_VERSION"
  rm -rf "$FLOW_DIFFUSERS_PATH.tmp"
  "$PY" -m pip install --progress-bar off --no-deps --target "$FLOW_DIFFUSERS_PATH.tmp" \
    "diffusers==$FLOW_DIFFUSERS_VERSION" 2>&1 | { grep -v "^WARNING: Location '" || true; } >&2
  mv "$FLOW_DIFFUSERS_PATH.tmp" "$FLOW_DIFFUSERS_PATH"
  log "  done in $((SECONDS - t0)) s"
fi

if "$PY" -m pip show torchvision >/dev/null 2>&1; then
  die "torchvision is installed in $ENV_DIR; it breaks diffusers/transformers imports with this torch"
fi

emit_exports > "$ENV_FILE"

log "verifying imports"
VERIFY_PY='
import os, sys
import numpy, torch, oneflow as flow, diffusers, safetensors, pytest
from oneflow.utils.tensor import from_torch, to_torch
assert numpy.__version__.startswith("1."), numpy.__version__
assert flow.__version__ == "0.9.0", flow.__version__
t = torch.arange(6, dtype=torch.float32)
f = from_torch(t)
t.add_(1)  # from_torch aliases the torch storage
assert (to_torch(f) == t).all()
fd = os.environ["FLOW_DIFFUSERS_PATH"]
assert os.path.isfile(os.path.join(fd, "diffusers", "__init__.py")), fd
print("ok: python %s, torch %s, oneflow %s, numpy %s, diffusers %s, safetensors %s"
      % (sys.version.split()[0], torch.__version__, flow.__version__, numpy.__version__,
         diffusers.__version__, safetensors.__version__))
'
# shellcheck disable=SC1090
if ! VERIFY_OUT="$( . "$ENV_FILE" && "$PY" -c "$VERIFY_PY" 2>&1 )"; then
  printf '%s\n' "$VERIFY_OUT" >&2
  die "import check failed"
fi
printf '%s\n' "$VERIFY_OUT" | { grep -vE "libibverbs not available|CUDA driver version is insufficient" || true; } >&2

echo "$SPEC_HASH" > "$MARKER"
log "env ready: $ENV_DIR ($(du -sh "$ENV_DIR" 2>/dev/null | cut -f1)); env file: $ENV_FILE"
emit_exports
