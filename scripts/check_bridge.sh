#!/usr/bin/env bash
# Compile check of the C++ bridge without a GPU: g++ -fsyntax-only on python/gpu_alloc/*.cpp
# with the flags torch.utils.cpp_extension.load uses, against the headers that
# scripts/setup_bridge_env.sh put in ENV_DIR (default .bridge-env). Prints OK, or the
# compiler's errors and exits 1.
#
#   scripts/check_bridge.sh [ENV_DIR]        CXX overrides the compiler (default g++)
set -euo pipefail
cd "$(dirname "$0")/.."

ENV_DIR=${1:-.bridge-env}
CXX=${CXX:-g++}

for f in "$ENV_DIR/torch/include/torch/extension.h" "$ENV_DIR/cuda/include/cuda_runtime_api.h" \
         "$ENV_DIR/cuda/include/crt/host_config.h" "$ENV_DIR/python-include/Python.h"; do
    if [ ! -f "$f" ]; then
        echo "missing $f: run scripts/setup_bridge_env.sh $ENV_DIR first" >&2
        exit 2
    fi
done

flags=(
    -std=c++17 -fsyntax-only -fPIC
    -DTORCH_EXTENSION_NAME=gpu_alloc_bridge -DTORCH_API_INCLUDE_EXTENSION_H
    -D_GLIBCXX_USE_CXX11_ABI=1
    -I python/gpu_alloc
    -isystem "$ENV_DIR/torch/include"
    -isystem "$ENV_DIR/torch/include/torch/csrc/api/include"
    -isystem "$ENV_DIR/cuda/include"
    -isystem "$ENV_DIR/python-include"
)

status=0
for src in python/gpu_alloc/*.cpp; do
    if out=$("$CXX" "${flags[@]}" "$src" 2>&1); then
        if [ -n "$out" ]; then
            echo "$out"
        fi
        echo "OK $src ($(cat "$ENV_DIR/torch/VERSION" 2>/dev/null || echo '?') headers, $("$CXX" -dumpfullversion 2>/dev/null || "$CXX" -dumpversion))"
    else
        echo "$out"
        echo "FAILED $src"
        status=1
    fi
done
exit $status
