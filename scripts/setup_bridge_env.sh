#!/usr/bin/env bash
# Creates the folder of headers that scripts/check_bridge.sh compiles the C++ bridge
# (python/gpu_alloc/*.cpp) against, on a machine with no GPU, no CUDA toolkit and no torch:
#
#   scripts/setup_bridge_env.sh [ENV_DIR]        (default: .bridge-env, git-ignored)
#
#   ENV_DIR/torch/include   torch's headers (c10, ATen, torch/csrc, pybind11), from the torch
#                           wheel on PyPI (about 530 MB to download; only torch/include is kept)
#   ENV_DIR/cuda/include    the CUDA 13.0 runtime and driver API headers (cuda_runtime_api.h,
#                           cuda.h) from nvidia-cuda-runtime, and crt/ from nvidia-cuda-crt:
#                           the versions torch 2.11.0+cu130 itself requires (cuda-toolkit 13.0.2)
#   ENV_DIR/python-include  a link to this interpreter's Python.h folder
#
# Versions: TORCH_VERSION (default 2.11.0), CUDA_RUNTIME_VERSION (13.0.96), CUDA_CRT_VERSION
# (13.0.88); PYTHON (default python3) runs pip. Running it again skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

ENV_DIR=${1:-.bridge-env}
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
CUDA_RUNTIME_VERSION=${CUDA_RUNTIME_VERSION:-13.0.96}
CUDA_CRT_VERSION=${CUDA_CRT_VERSION:-13.0.88}
PYTHON=${PYTHON:-python3}

mkdir -p "$ENV_DIR/downloads" "$ENV_DIR/cuda"
DL="$ENV_DIR/downloads"

download() { # name==version: the wheel for this interpreter and platform, no dependencies
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d "$DL" "$1"
}

if [ ! -f "$ENV_DIR/torch/include/torch/extension.h" ] ||
   [ "$(cat "$ENV_DIR/torch/VERSION" 2>/dev/null)" != "$TORCH_VERSION" ]; then
    echo "torch $TORCH_VERSION headers (downloading the wheel, about 530 MB)"
    download "torch==$TORCH_VERSION"
    rm -rf "$ENV_DIR/torch"
    whl=$(ls "$DL"/torch-"$TORCH_VERSION"-*.whl | head -n1)
    unzip -q -o "$whl" 'torch/include/*' -d "$ENV_DIR"
    echo "$TORCH_VERSION" > "$ENV_DIR/torch/VERSION"
    rm -f "$whl"
fi

if [ ! -f "$ENV_DIR/cuda/include/cuda_runtime_api.h" ] || [ ! -f "$ENV_DIR/cuda/include/cuda.h" ]; then
    echo "CUDA runtime headers (nvidia-cuda-runtime $CUDA_RUNTIME_VERSION)"
    download "nvidia-cuda-runtime==$CUDA_RUNTIME_VERSION"
    rm -rf "$DL/x" && mkdir -p "$DL/x"
    unzip -q -o "$DL"/nvidia_cuda_runtime-"$CUDA_RUNTIME_VERSION"-*.whl 'nvidia/*/include/*' -d "$DL/x"
    mkdir -p "$ENV_DIR/cuda/include"
    cp -r "$DL"/x/nvidia/*/include/. "$ENV_DIR/cuda/include/"
    rm -rf "$DL/x" "$DL"/nvidia_cuda_runtime-*.whl
fi

if [ ! -f "$ENV_DIR/cuda/include/crt/host_config.h" ]; then
    echo "CUDA crt headers (nvidia-cuda-crt $CUDA_CRT_VERSION)"
    download "nvidia-cuda-crt==$CUDA_CRT_VERSION"
    rm -rf "$DL/x" && mkdir -p "$DL/x"
    unzip -q -o "$DL"/nvidia_cuda_crt-"$CUDA_CRT_VERSION"-*.whl 'nvidia/*/include/*' -d "$DL/x"
    cp -r "$DL"/x/nvidia/*/include/. "$ENV_DIR/cuda/include/"
    rm -rf "$DL/x" "$DL"/nvidia_cuda_crt-*.whl
fi

py_include=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_path('include', scheme='posix_prefix'))")
if [ ! -f "$py_include/Python.h" ]; then
    echo "no Python.h in $py_include: install the Python development headers (python3-dev)" >&2
    exit 1
fi
ln -sfn "$py_include" "$ENV_DIR/python-include"
rmdir "$DL" 2>/dev/null || true

echo "ready: $ENV_DIR (torch $(cat "$ENV_DIR/torch/VERSION"), $(grep -m1 -o 'CUDART_VERSION *[0-9]*' "$ENV_DIR/cuda/include/cuda_runtime_api.h"), Python.h from $py_include)"
