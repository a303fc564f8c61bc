//! Per-stream state costs nothing per stream on the hot path: with a stream
//! made per use (each allocating and freeing a buffer), the unmapping of free
//! pages visits the segments that hold free mapped pages, not one segment per
//! stream ever seen; the work is counted, not timed.
#![cfg(feature = "pytorch-bfc")]

mod common;

use alloc_core::{StreamId, GIB, MIB};
use alloc_policy::BasePolicy;

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
    // Segments with busy pages only are parked when the GPU makes no
    // progress and the host does not wait for it (at the peak).
    let parks = !gpu_keeps_up && !config.contains("budget");
    assert_eq!(e.parked_free_page_segments() > 0, parks, "{config}");
    e.empty_cache().unwrap();
    assert_eq!(e.parked_free_page_segments(), 0, "emptying wakes them");
    // Streams that hold nothing are forgotten by empty_cache: their
    // segments and the policy's bins for them.
    assert_eq!(e.heap().segments().count(), 1, "{config}");
    // Irrefutable when pytorch-bfc is the one policy compiled in.
    #[allow(irrefutable_let_patterns)]
    let BasePolicy::PytorchBfc(p) = e.policy().base() else {
        panic!("{config}: PyTorch's policy")
    };
    assert!(p.key_entries() <= 2, "{config}: {} keys", p.key_entries());
    common::drain(&mut e, [held.addr]);
    visited
}

const PEAK: &str = "expandable_segments:True,unmap_free_pages:True";
const BUDGET: &str = "expandable_segments:True,unmap_free_pages:True,memory_budget_mb:256";

#[test]
fn unmapping_visits_a_bounded_number_of_segments_per_allocation() {
    // At the peak, busy pages of other streams stay mapped rather than
    // wait; once their streams have as many marks outstanding as they may,
    // their segments are parked until a mark completes, so that a GPU that
    // never catches up costs a walk no more than one that does. At a
    // budget the host waits for them.
    let cases = [
        (PEAK, 4 * MIB, true),
        (PEAK, 4 * MIB, false),
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
        // segment per stream seen would cost 16 times), a few visits per
        // allocation: with a GPU that makes no progress, a segment is
        // visited once per mark its stream may have outstanding (16), then
        // parked.
        assert!(
            large * 10 <= small * 48 && large <= 24 * 4 * n,
            "{config}, {} MiB, GPU keeps up {keeps_up}: {small} visits for {n} streams, \
                 {large} for {}",
            size >> 20,
            4 * n
        );
    }
}

/// Parked segments wake when their marks complete: once the GPU has run
/// everything, the next growth takes their pages rather than raising the
/// peak.
#[test]
fn parked_segments_give_their_pages_once_the_gpu_is_done() {
    let mut e = common::engine(PEAK, 64 * GIB);
    for s in 1..=40 {
        let a = e.malloc(64 * MIB, StreamId(s)).unwrap();
        e.free(a.addr).unwrap();
    }
    let parked = e.parked_free_page_segments();
    assert!(
        parked > 0,
        "busy segments with all their marks out are parked"
    );
    let peak = e.stats().reserved_bytes.all.peak as u64;
    // The GPU makes no progress: the next stream's memory raises the peak.
    let a = e.malloc(64 * MIB, StreamId(41)).unwrap();
    e.free(a.addr).unwrap();
    let peak_now = e.stats().reserved_bytes.all.peak as u64;
    assert!(peak_now > peak);
    e.streams_mut().complete_all();
    // As much as 40 streams hold: more than the segments not parked have.
    let b = e.malloc(40 * 64 * MIB, StreamId(42)).unwrap();
    assert_eq!(
        e.stats().reserved_bytes.all.peak as u64,
        peak_now,
        "pages of the parked segments serve it"
    );
    assert!(e.parked_free_page_segments() < parked);
    e.assert_valid();
    common::drain(&mut e, [b.addr]);
}
