#!/usr/bin/env bash
# The cargo feature matrix: each base policy alone, one with `gc-age`, and
# all four, through alloc-policy (checked with every target, and tested:
# each policy's tests run without the others), alloc-cuda and alloc-ffi
# (checked); alloc-cuda with other CUDA versions and the dynamic-linking mode;
# and the compile errors of a build without a base policy or without a way
# to reach libcuda.
set -euo pipefail
cd "$(dirname "$0")/.."

# The base policies: alloc-policy's cargo features other than its default
# set, the collector and the test switches. A test of alloc-policy
# (registry.rs) keeps them equal to the entries of its policy registry; the
# features of alloc-cuda and alloc-ffi must forward each one.
mapfile -t bases < <(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
packages = {p["name"]: p["features"] for p in json.load(sys.stdin)["packages"]}
bases = [f for f in packages["alloc-policy"] if f not in ("default", "gc-age", "testing", "arbitrary")]
for crate, dep in (("alloc-cuda", "alloc-policy"), ("alloc-ffi", "alloc-cuda")):
    features = packages[crate]
    for base in bases:
        if features.get(base) != [f"{dep}/{base}"] or base not in features["all-policies"]:
            sys.exit(f"{crate}: feature `{base}` must be [\"{dep}/{base}\"] and in `all-policies`")
print("\n".join(bases))
')
if [ "${#bases[@]}" -eq 0 ]; then
    echo "no base policy among alloc-policy's features" >&2
    exit 1
fi
all=$(IFS=,; echo "${bases[*]}")
# Each base alone, the last with the collector, and all of them with it.
sets=("${bases[@]}" "${bases[-1]},gc-age" "$all,gc-age")
only=(--no-default-features --features)

for set in "${sets[@]}"; do
    cargo check -p alloc-policy "${only[@]}" "$set" --all-targets
    cargo test -p alloc-policy "${only[@]}" "$set"
    cargo check -p alloc-cuda "${only[@]}" "dynamic-loading,cuda-13000,$set"
    cargo check -p alloc-ffi "${only[@]}" "cuda-13000,$set"
done

# `fails_with MESSAGE PACKAGE FEATURES`: checking PACKAGE with only FEATURES
# fails, with our MESSAGE and without a panic of a dependency's build script.
fails_with() {
    local message=$1 package=$2 set=$3 out
    if out=$(cargo check -p "$package" "${only[@]}" "$set" 2>&1); then
        echo "$package built with only the features \"$set\"" >&2
        exit 1
    fi
    if ! grep -qF "$message" <<<"$out" || grep -q 'panicked' <<<"$out"; then
        echo "$out" >&2
        echo "$package with only \"$set\": expected the error \"$message\"" >&2
        exit 1
    fi
}

# No base policy (`gc-age` wraps one): the build stops and says what to enable.
policy_missing='alloc-policy needs a base policy: enable one of its cargo features'
for set in "" gc-age; do
    fails_with "$policy_missing" alloc-policy "$set"
done
# alloc-cuda with its defaults off and only a CUDA version: our errors, not
# cudarc's build script's "None between `dynamic-loading`, ... this is a bug".
fails_with "$policy_missing" alloc-cuda cuda-12080
fails_with 'alloc-cuda needs to know how libcuda is reached: enable its cargo feature `dynamic-loading`' \
    alloc-cuda cuda-12080,pytorch-bfc

# The driver API bindings of the oldest, a CUDA 12 and the newest version
# cudarc has, with tests and examples: nothing may need a newer driver API.
for version in cuda-11040 cuda-12080 cuda-13040; do
    cargo check -p alloc-cuda "${only[@]}" "dynamic-loading,$version,pytorch-bfc" --all-targets
done
# Linked at build time (no libcuda here to link a binary: the library only).
cargo check -p alloc-cuda "${only[@]}" dynamic-linking,cuda-12080,pytorch-bfc
