//! Frees that complete after other events (a block used on other streams,
//! `record_stream`): the replay keeps the block out of reuse until its
//! completion, as the recording allocator did, and a setting that reuses
//! with a stream wait may hand it over earlier.

use alloc_replay::{parse_text, replay, ReplayOptions, ReplayReport};

const MIB: u64 = 1 << 20;

/// Three 64 MiB blocks on the default stream, one after another; the
/// first one's free completes (`c 1`) only after the second is allocated
/// when `waits`.
fn trace(waits: bool) -> String {
    let b = 64 * MIB;
    let c = if waits { "c 1\n" } else { "" };
    format!("a 1 {b} 0\nf 1 0\na 2 {b} 0\n{c}f 2 0\na 3 {b} 0\nf 3 0\n")
}

fn run(text: &str, config: &str, capacity: u64) -> ReplayReport {
    let t = parse_text("cross_stream", text).unwrap();
    let mut opts = ReplayOptions::default();
    opts.timed_runs = 0;
    opts.capacity = capacity;
    replay(&t, config, &opts).unwrap().report
}

#[test]
fn a_block_whose_free_waits_is_not_reused_before_its_completion() {
    let roomy = 80 << 30;
    // Freed at once, the second block takes the first one's memory.
    let at_once = run(&trace(false), "policy:pytorch-bfc", roomy);
    assert_eq!(at_once.peak_reserved_bytes, 64 * MIB);
    // Still in use on another stream, it cannot: a second segment. The
    // third block, after the completion, reuses a cached one.
    let waiting = run(&trace(true), "policy:pytorch-bfc", roomy);
    assert_eq!(waiting.peak_reserved_bytes, 128 * MIB);
    assert_eq!(waiting.device_allocs, 2);
    assert_eq!(waiting.ooms, 0);
    // Statistics count the block freed at its free, as PyTorch's do.
    assert_eq!(waiting.peak_allocated_bytes, 64 * MIB);
}

#[test]
fn stream_wait_reuse_hands_a_waiting_block_over_where_the_heap_cannot_grow() {
    // A device of 100 MiB: two 64 MiB segments do not fit.
    let small = 100 * MIB;
    let pytorch = run(&trace(true), "policy:pytorch-bfc", small);
    assert_eq!(pytorch.peak_reserved_bytes, 64 * MIB);
    assert_eq!(
        pytorch.retries, 1,
        "PyTorch's rules wait for the block's streams only at out of memory"
    );
    let stream_wait = run(&trace(true), "stream_wait_reuse:True", small);
    assert_eq!(stream_wait.peak_reserved_bytes, 64 * MIB);
    assert_eq!(stream_wait.ooms, 0);
    assert_eq!(
        stream_wait.retries, 0,
        "handed over with a stream wait, no flush-everything retry"
    );
}
