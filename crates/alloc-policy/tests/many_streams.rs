//! Per-stream state costs nothing per stream on the hot path: with a stream
//! made per use (each allocating and freeing a buffer), the unmapping of free
//! pages visits the segments that hold free mapped pages, not one segment per
//! stream ever seen; the work is counted, not timed.
#![cfg(feature = "pytorch-bfc")]

mod common;

use alloc_core::{StreamId, GIB, MIB};

/// `streams` fresh streams, each allocating and freeing `size` bytes while
/// stream 0 holds a block; the GPU keeps up when `gpu_keeps_up`. Returns the
/// segments visited.
fn fresh_streams(config: &str, streams: u64, size: u64, gpu_keeps_up: bool) -> u64 {
    let mut e = common::engine(config, 64 * GIB);
    let held = e.malloc(8 * MIB, StreamId(0)).unwrap();
    for s in 1..=streams {
        let a = e.malloc(size, StreamId(s)).unwrap();
        e.free(a.addr).unwrap();
        if gpu_keeps_up {
            e.streams_mut().complete_all();
        }
    }
    e.assert_valid();
    let visited = e.free_page_segments_visited();
    e.empty_cache().unwrap();
    // Streams that hold nothing are forgotten by empty_cache.
    assert_eq!(e.heap().segments().count(), 1, "{config}");
    common::drain(&mut e, [held.addr]);
    visited
}

const PEAK: &str = "expandable_segments:True,unmap_free_pages:True";
const BUDGET: &str = "expandable_segments:True,unmap_free_pages:True,memory_budget_mb:256";

#[test]
fn unmapping_visits_a_bounded_number_of_segments_per_allocation() {
    // At the peak, busy pages of other streams stay mapped rather than
    // wait, and a walk meets them again until the GPU passes them: a GPU
    // that never catches up is left to the budget, which waits for them.
    let cases = [
        (PEAK, 4 * MIB, true),
        (BUDGET, 4 * MIB, true),
        (BUDGET, 64 * MIB, false),
    ];
    for (config, size, keeps_up) in cases {
        let (n, small, large) = (
            400,
            fresh_streams(config, 400, size, keeps_up),
            fresh_streams(config, 1600, size, keeps_up),
        );
        // Four times the streams cost at most 4.8 times the visits (one
        // segment per stream seen would cost 16 times); with the GPU
        // keeping up, a few visits per allocation.
        assert!(
            large * 10 <= small * 48 && (!keeps_up || large <= 8 * 4 * n),
            "{config}, {} MiB, GPU keeps up {keeps_up}: {small} visits for {n} streams, \
                 {large} for {}",
            size >> 20,
            4 * n
        );
    }
}
