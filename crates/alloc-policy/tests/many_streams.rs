//! Per-stream state costs nothing per stream on the hot path: with a stream
//! made per use (each allocating and freeing a buffer), the unmapping of free
//! pages visits the segments that hold free mapped pages, not one segment per
//! stream ever seen; the work is counted, not timed.
#![cfg(feature = "pytorch-bfc")]

mod common;

use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, GIB, MIB};
use alloc_policy::{AnyPolicy, BasePolicy};

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
    // progress: at the peak the host does not wait for them, and at a
    // budget it waits for the parked ones only when the others fall short.
    assert_eq!(e.parked_free_page_segments() > 0, !gpu_keeps_up, "{config}");
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

/// What a run of [`stream_per_use`] cost, counted.
#[derive(Debug, Clone, Copy)]
struct Work {
    /// Segments the walks that unmap free pages visited.
    visits: u64,
    /// Driver calls that map or unmap memory, or reserve a segment.
    driver_calls: u64,
    /// Host waits for streams or events.
    host_waits: u64,
    /// Growable segments held at the end, before `empty_cache`.
    held_segments: usize,
    /// Streams the engine may still use at the end.
    held_streams: usize,
    /// Cache keys with free lists in the policy at the end.
    policy_keys: usize,
    /// The same counts for `empty_cache` alone.
    empty_cache: (u64, u64, u64),
}

/// Segments (and streams) held are bounded by what the device holds
/// mapped (8 GiB in pages of 8 MiB or more: at most 1024), and by the
/// empty segments kept beside them; not by the streams seen.
const HELD_AT_MOST: usize = 1024 + 1024 + 64;

/// Stream 0 holds a block while each of `n` fresh streams allocates
/// `4 MiB` and frees it, on an 8 GiB device that the streams fill many
/// times over, the simulated GPU `lag` operations behind the host (none:
/// it runs only what the host waits for).
fn stream_per_use(config: &str, n: u64, lag: Option<u64>) -> Work {
    let streams = lag.map_or_else(SimStreams::new, SimStreams::with_gpu_lag);
    let cfg = AllocatorConfig::parse(config).unwrap();
    let mut e = AnyPolicy::engine(&cfg, SimMemory::new(8 * GIB), streams).unwrap();
    let held = e.malloc(8 * MIB, StreamId(0)).unwrap();
    let counts = |e: &alloc_core::Engine<AnyPolicy, SimMemory, SimStreams>| {
        let s = e.stats();
        (
            e.free_page_segments_visited(),
            s.num_device_alloc + s.num_device_free,
            e.streams().synchronizations,
        )
    };
    for s in 1..=n {
        let a = e.malloc(4 * MIB, StreamId(s)).unwrap();
        e.streams_mut().tick();
        e.free(a.addr).unwrap();
        e.streams_mut().tick();
    }
    e.assert_valid();
    let (visits, driver_calls, host_waits) = counts(&e);
    let held_segments = e.heap().segments().count();
    let held_streams = e.streams_in_use().len();
    // Irrefutable when pytorch-bfc is the one policy compiled in.
    #[allow(irrefutable_let_patterns)]
    let BasePolicy::PytorchBfc(p) = e.policy().base() else {
        panic!("{config}: PyTorch's policy")
    };
    let policy_keys = p.key_entries();
    e.empty_cache().unwrap();
    let after = counts(&e);
    e.free(held.addr).unwrap();
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0, "{config}: memory left on the device");
    e.assert_valid();
    Work {
        visits,
        driver_calls,
        host_waits,
        held_segments,
        held_streams,
        policy_keys,
        empty_cache: (
            after.0 - visits,
            after.1 - driver_calls,
            after.2 - host_waits,
        ),
    }
}

#[test]
fn a_stream_per_use_costs_a_bounded_work_per_stream_and_holds_nothing_per_stream_seen() {
    use alloc_core::config::named::{BOUND, BUDGET, UNMAP16};
    let (small, large) = (5_000, 20_000);
    for config in [BOUND.config, BUDGET.config, UNMAP16.config] {
        for lag in [None, Some(4)] {
            let (w5, w20) = (
                stream_per_use(config, small, lag),
                stream_per_use(config, large, lag),
            );
            let case = format!("{config}, GPU lag {lag:?}: {w5:?} at {small}, {w20:?} at {large}");
            // Four times the streams cost at most 4.4 times the work (a
            // walk of every segment seen would cost 16 times), and a few
            // visits, driver calls and waits per stream.
            let (n5, n20) = (small, large);
            for (name, a, b) in [
                ("visits", w5.visits, w20.visits),
                ("driver calls", w5.driver_calls, w20.driver_calls),
                ("host waits", w5.host_waits, w20.host_waits),
            ] {
                assert!(b * 10 <= (a + n5) * 44, "{name}: {case}");
            }
            assert!(w20.visits <= 20 * n20, "{case}");
            assert!(w20.driver_calls <= 4 * n20, "{case}");
            assert!(w20.host_waits <= 2 * n20, "{case}");
            // What stays is bounded by the device, not the streams seen.
            for w in [w5, w20] {
                assert!(w.held_segments <= HELD_AT_MOST, "segments: {case}");
                assert!(w.held_streams <= HELD_AT_MOST, "streams: {case}");
                assert!(w.policy_keys <= 2 * HELD_AT_MOST, "policy keys: {case}");
                // `empty_cache` costs what is held, not the streams seen.
                let (visits, calls, waits) = w.empty_cache;
                let held = w.held_segments as u64;
                assert!(
                    visits <= held && calls <= 4 * held && waits <= held + 1,
                    "empty_cache: {case}"
                );
            }
        }
    }
}
