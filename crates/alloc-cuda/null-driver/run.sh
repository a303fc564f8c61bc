#!/usr/bin/env bash
# The CUDA layer on a machine without a GPU, over the null driver
# (null_cuda.c: a libcuda.so whose calls do no device work).
#
#   bash crates/alloc-cuda/null-driver/run.sh [--callgrind]
#     Host cost of the allocator's Rust path and C library path over one
#     engine: builds gpu_bench and liballoc_ffi.so and runs `gpu_bench
#     --paths`. With --callgrind, also counts the instructions per alloc+free
#     pair and per mixed operation of each path under valgrind
#     (deterministic, unlike the clock on a shared machine), and of the C
#     library under engine_per_stream once a second stream has allocated.
#   bash crates/alloc-cuda/null-driver/run.sh --tests
#     The GPU-suite tests of stream registration that need no device work,
#     the allocator parts' tests (null_driver_tests in alloc-cuda's modules),
#     and the C library's tests that fail each driver call in turn
#     (null_driver_faults.rs), the C library's call times
#     (null_driver_call_times.rs) and its engines per stream
#     (null_driver_per_stream.rs) and per stream and thread
#     (null_driver_per_thread.rs), and frees that name another device
#     (null_driver_devices.rs) (.ci/run runs them).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
drv="$target/null-driver"
mkdir -p "$drv"
cc -O2 -Wall -shared -fPIC -o "$drv/libcuda.so.1" "$here/null_cuda.c"
ln -sf libcuda.so.1 "$drv/libcuda.so"
export LD_LIBRARY_PATH="$drv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if [ "${1:-}" = "--tests" ]; then
  # Built as `cargo test --workspace` builds them (no rebuild after it).
  cd "$root"
  cargo test --workspace --test gpu_streams --test gpu_devices -- --ignored --exact \
    streams_created_and_dropped_by_the_hundred_are_let_go \
    a_stream_in_the_place_of_one_let_go_is_checked_again \
    expandable_segments_fall_back_to_ordinary_segments_without_virtual_memory
  # The allocator's parts (Pools, SleepWake, Ipc, Diagnostics) over a driver.
  cargo test --workspace --lib -- --ignored null_driver_tests
  # Tests that arm driver failures, alone in their process.
  cargo test --workspace --lib -- --ignored null_driver_fault_tests
  GPUALLOC_NULL_DRIVER=1 cargo test --workspace --test null_driver_faults -- --ignored
  GPUALLOC_NULL_DRIVER=1 cargo test --workspace --test null_driver_call_times -- --ignored
  GPUALLOC_NULL_DRIVER=1 cargo test --workspace --test null_driver_per_stream -- --ignored
  GPUALLOC_NULL_DRIVER=1 cargo test --workspace --test null_driver_per_thread -- --ignored
  GPUALLOC_NULL_DRIVER=1 cargo test --workspace --test null_driver_devices -- --ignored
  exit 0
fi

# Both with every policy, as the GPU bundle and the C library are built.
(cd "$root" && cargo build --release -p alloc-cuda --features all-policies --bin gpu_bench \
  && cargo build --release -p alloc-ffi)
bench="$target/release/gpu_bench"
"$bench" --paths
if [ "${1:-}" = "--callgrind" ]; then
  # --quick: 3 rounds x 5 pair sizes x (20000 pairs + 1 warm pair), and
  # 3 rounds x 2 mixed workloads x 2 passes x 20000 ops (plus, counted in
  # the total, the frees of the blocks live at the end of each pass).
  pairs=300015
  ops=240000
  echo
  echo "| path | instructions per alloc+free pair | per mixed op |"
  echo "|---|---:|---:|"
  # count NAME ARGS...: instructions per pair and per mixed op of gpu_bench ARGS.
  count() {
    local name="$1" out="$drv/callgrind.${1// /_}"
    shift
    valgrind --tool=callgrind --callgrind-out-file="$out" \
      --toggle-collect=gpu_bench::pair_ns --toggle-collect=gpu_bench::mixed_ns \
      "$bench" --paths --quick "$@" 2>"$out.log" >/dev/null
    inclusive() {
      callgrind_annotate --inclusive=yes --show-percs=no "$out" \
        | awk -v f="gpu_bench::$1 " '$0 ~ f { gsub(",", "", $1); print $1; exit }'
    }
    echo "| $name | $(( $(inclusive pair_ns) / pairs )) | $(( $(inclusive mixed_ns) / ops )) |"
  }
  for only in cudarc raw c; do
    count "$only" --only "$only"
  done
  # The C library with an engine per stream, once a second stream has
  # allocated (every operation then publishes the device's statistics).
  count "c, engine_per_stream" --c-config engine_per_stream:True
  # The C library under the setting recommended for memory and the one for
  # multi-stream training (expandable segments beneath both), with the
  # same second stream.
  count "c, budget" --c-config budget
  count "c, multi-stream" --c-config multi-stream
fi
