#!/usr/bin/env bash
# A crate outside the workspace that depends on alloc-cuda by path with
# `default-features = false`, choosing its own CUDA version and policies, and
# uses cudarc itself with features alloc-cuda does not use: it must build
# (and run: without a GPU it checks the policy features and skips the device
# part), and its dynamic-linking variant must type-check (linking needs
# libcuda, which a machine without a CUDA driver lacks). Without a loading
# mode, the build must stop at alloc-cuda's own error.
set -euo pipefail
cd "$(dirname "$0")/../tests/downstream"

# Share the workspace's target directory (and its compiled dependencies).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/../../target}"

cargo build
"$CARGO_TARGET_DIR/debug/downstream"
cargo check --no-default-features --features dynamic-linking
# No loading mode at all (alloc-cuda's defaults off, a version and policies
# only; cudarc without one either): alloc-cuda's own error names the feature,
# rather than cudarc's build script panicking.
if out=$(cargo check --no-default-features 2>&1); then
    echo "downstream built without a loading mode" >&2
    exit 1
fi
if ! grep -qF 'alloc-cuda needs to know how libcuda is reached' <<<"$out" ||
    grep -q panicked <<<"$out"; then
    echo "$out" >&2
    exit 1
fi
