#!/usr/bin/env bash
# A crate outside the workspace that depends on alloc-cuda by path with
# `default-features = false`, choosing its own CUDA version and policies, and
# uses cudarc itself with features alloc-cuda does not use: it must build
# (and run: without a GPU it checks the policy features and skips the device
# part), and its dynamic-linking variant must type-check (linking needs
# libcuda, which a machine without a CUDA driver lacks).
set -euo pipefail
cd "$(dirname "$0")/../tests/downstream"

# Share the workspace's target directory (and its compiled dependencies).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/../../target}"

cargo build
"$CARGO_TARGET_DIR/debug/downstream"
cargo check --no-default-features --features dynamic-linking
