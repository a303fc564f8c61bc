#!/usr/bin/env bash
# Puts torch_memory_saver (the manylinux wheel for Python 3.12, with its CUDA 12 and 13
# builds) in benchmarks/sleep_wake/site, git-ignored, for pause_resume.py --impls tms on a GPU
# machine without internet: carry that folder there (the device's `carry`), no pip needed.
#   bash benchmarks/sleep_wake/fetch_tms.sh [VERSION]
set -euo pipefail
cd "$(dirname "$0")"
spec=torch_memory_saver${1:+==$1}
rm -rf wheels site
python3 -m pip download "$spec" --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 -d wheels
python3 -m pip install --no-deps --no-compile --target site wheels/*.whl
echo "ready: $(ls wheels) in benchmarks/sleep_wake/site"
