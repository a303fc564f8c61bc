#!/usr/bin/env bash
# The cargo feature matrix: each base policy alone, one with `gc-age`, and
# all four, through alloc-policy (checked with every target, and tested:
# each policy's tests run without the others), alloc-cuda and alloc-ffi
# (checked); alloc-cuda with other CUDA versions and the dynamic-linking mode;
# and the compile error of a build without a base policy.
set -euo pipefail
cd "$(dirname "$0")/.."

sets=(pytorch-bfc buddy size-class size-class,gc-age pytorch-bfc,buddy,size-class,gc-age)
only=(--no-default-features --features)

for set in "${sets[@]}"; do
    cargo check -p alloc-policy "${only[@]}" "$set" --all-targets
    cargo test -p alloc-policy "${only[@]}" "$set"
    cargo check -p alloc-cuda "${only[@]}" "dynamic-loading,cuda-13000,$set"
    cargo check -p alloc-ffi "${only[@]}" "cuda-13000,$set"
done

# No base policy (`gc-age` wraps one): the build stops and says what to enable.
for set in "" gc-age; do
    if out=$(cargo check -p alloc-policy "${only[@]}" "$set" 2>&1); then
        echo "alloc-policy built with features \"$set\" and no base policy" >&2
        exit 1
    fi
    grep -q 'enable cargo feature `pytorch-bfc`, `buddy` or `size-class`' <<<"$out" || {
        echo "$out" >&2
        exit 1
    }
done

# The driver API bindings of the oldest, a CUDA 12 and the newest version
# cudarc has, with tests and examples: nothing may need a newer driver API.
for version in cuda-11040 cuda-12080 cuda-13040; do
    cargo check -p alloc-cuda "${only[@]}" "dynamic-loading,$version,pytorch-bfc" --all-targets
done
# Linked at build time (no libcuda here to link a binary: the library only).
cargo check -p alloc-cuda "${only[@]}" dynamic-linking,cuda-12080,pytorch-bfc
