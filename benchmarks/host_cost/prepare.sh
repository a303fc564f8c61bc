#!/usr/bin/env bash
# Builds what host_threads.py runs beside PyTorch, where a Rust toolchain is
# (the GPU machine may have none): gpu_bench (its --threads mode) and the C
# library, both with every policy as the GPU bundle builds them, stripped of
# debug info into gpu-bundle/host_cost/ (git-ignored; it travels to the GPU
# machine with the working tree when named in the call's carry).
#   bash benchmarks/host_cost/prepare.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
dest="$root/gpu-bundle/host_cost"
cd "$root"
cargo build --release -p alloc-cuda --features all-policies --bin gpu_bench
cargo build --release -p alloc-ffi
mkdir -p "$dest"
for f in gpu_bench liballoc_ffi.so; do
  cp "$target/release/$f" "$dest/$f"
  strip --strip-debug "$dest/$f"
done
git rev-parse --short HEAD > "$dest/REVISION"
ls -l "$dest"
