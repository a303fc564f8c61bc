#!/usr/bin/env bash
# The publishable crates package and build from their .crate files alone
# (`cargo package` verifies each against the others through a local registry),
# and every .crate carries both license texts and its README. Run from a
# clean clone: packaging refuses uncommitted changes.
set -euo pipefail
cd "$(dirname "$0")/.."

crates=(alloc-core alloc-policy alloc-replay alloc-cuda alloc-ffi)

# Each crate ships copies of the root license texts: they must not drift.
for c in "${crates[@]}"; do
    for f in LICENSE-MIT LICENSE-APACHE; do
        cmp "$f" "crates/$c/$f"
    done
done

# cargo verifies each .crate against the others through a temporary local
# registry. It treats what comes from a registry as immutable, so a crate of
# the same version packaged by an earlier run would be used stale, both as
# unpacked sources ($CARGO_HOME/registry/src/-<hash>/, the directories of
# local registries start with `-`) and as build artifacts: remove the former
# and build in a target directory of its own, emptied first (its
# dependencies build in about 20 s on two cores).
version=$(grep -m1 '^version = ' Cargo.toml | cut -d'"' -f2)
for c in "${crates[@]}"; do
    rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/"$c-$version"
done
target=$(cargo metadata --no-deps --format-version 1 |
    grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)/package-check
rm -rf "$target"

CARGO_TARGET_DIR=$target cargo package --workspace --exclude xtask

for c in "${crates[@]}"; do
    listing=$(tar -tzf "$target/package/$c-$version.crate")
    for f in LICENSE-MIT LICENSE-APACHE README.md; do
        grep -qx "$c-$version/$f" <<<"$listing" || {
            echo "$c-$version.crate lacks $f" >&2
            exit 1
        }
    done
done
echo "packaged: ${crates[*]}"
