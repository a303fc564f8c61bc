//! Engine behaviour with PyTorch's policy on the simulated device: the
//! allocation paths, record_stream deferral, stream-wait reuse, the
//! out-of-memory path, statistics, garbage collection and snapshots.
#![cfg(feature = "pytorch-bfc")]

mod common;

use alloc_core::{AllocError, SnapshotState, StreamId, MIB};
use alloc_policy::policy_names;
use common::engine;

const GIB: u64 = 1 << 30;

#[test]
fn small_requests_share_a_2mib_segment_and_are_reused() {
    let mut e = engine("", 8 * GIB);
    let a = e.malloc(100, StreamId(0)).unwrap();
    assert_eq!(a.size, 512);
    let b = e.malloc(1000, StreamId(0)).unwrap();
    assert_eq!(
        b.addr,
        a.addr + 512,
        "best fit carves from the same segment"
    );
    assert_eq!(e.stats().reserved_bytes.small_pool.current, 2 * MIB as i64);
    e.free(a.addr).unwrap();
    let c = e.malloc(512, StreamId(0)).unwrap();
    assert_eq!(c.addr, a.addr, "freed block reused");
    assert_eq!(e.stats().num_device_alloc, 1);
    e.assert_valid();
}

#[test]
fn streams_never_share_blocks() {
    let mut e = engine("", 8 * GIB);
    let a = e.malloc(4096, StreamId(1)).unwrap();
    e.free(a.addr).unwrap();
    let b = e.malloc(4096, StreamId(2)).unwrap();
    assert_ne!(
        e.heap().segment_containing(a.addr),
        e.heap().segment_containing(b.addr)
    );
    assert_eq!(e.stats().num_device_alloc, 2);
    e.assert_valid();
}

#[test]
fn stats_follow_pytorch_model() {
    let mut e = engine("", 8 * GIB);
    let a = e.malloc(3 * MIB, StreamId(0)).unwrap(); // large pool, 20 MiB segment, split
    let s = e.stats();
    assert_eq!(s.allocated_bytes.large_pool.current, 3 * MIB as i64);
    assert_eq!(s.requested_bytes.all.current, 3 * MIB as i64);
    assert_eq!(s.reserved_bytes.all.current, 20 * MIB as i64);
    assert_eq!(s.inactive_split.all.current, 1);
    assert_eq!(s.inactive_split_bytes.all.current, 17 * MIB as i64);
    e.free(a.addr).unwrap();
    let s = e.stats();
    assert_eq!(
        (s.allocated_bytes.all.current, s.allocated_bytes.all.peak),
        (0, 3 * MIB as i64)
    );
    assert_eq!(
        s.inactive_split.all.current, 0,
        "merged back into one block"
    );
    assert_eq!(s.allocation.all.allocated, 1);
    assert_eq!(s.allocation.all.freed, 1);
    e.reset_peak_stats();
    assert_eq!(e.stats().allocated_bytes.all.peak, 0);
    e.empty_cache().unwrap();
    assert_eq!(e.stats().reserved_bytes.all.current, 0);
    assert_eq!(e.stats().num_device_free, 1);
    let flat = e.stats().to_flat_map();
    assert_eq!(flat["reserved_bytes.all.peak"], 20 * MIB as i64);
}

/// The start of a free block that was never handed out (what carving left
/// after a block) is an unknown pointer, for `free` and `record_stream`
/// alike; a block freed twice is a double free. Every policy.
#[test]
fn a_free_remainder_is_unknown_and_a_second_free_double() {
    for name in policy_names() {
        let mut e = engine(&format!("policy:{name}"), 8 * GIB);
        let a = e.malloc(4096, StreamId(0)).unwrap();
        let heap = e.heap();
        let next = heap.block(heap.block_at(a.addr).unwrap()).next.unwrap();
        let rest = heap.block(next);
        assert_eq!(rest.state, alloc_core::BlockState::Free, "{name}");
        let rest = rest.addr;
        let unknown = Err(AllocError::UnknownPointer { addr: rest });
        assert_eq!(e.free(rest), unknown, "{name}");
        assert_eq!(e.record_stream(rest, StreamId(1)), unknown, "{name}");
        e.free(a.addr).unwrap();
        let double = Err(AllocError::DoubleFree { addr: a.addr });
        assert_eq!(e.free(a.addr), double, "{name}");
        assert_eq!(e.record_stream(a.addr, StreamId(1)), double, "{name}");
        e.assert_valid();
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let mut e = engine("", 8 * GIB);
    assert!(matches!(
        e.malloc(0, StreamId(0)),
        Err(AllocError::InvalidSize { .. })
    ));
    assert!(matches!(
        e.malloc(u64::MAX, StreamId(0)),
        Err(AllocError::InvalidSize { .. })
    ));
    assert!(matches!(
        e.free(0x1234),
        Err(AllocError::UnknownPointer { .. })
    ));
    let a = e.malloc(4096, StreamId(0)).unwrap();
    let b = e.malloc(4096, StreamId(0)).unwrap();
    assert!(matches!(
        e.free(a.addr + 512),
        Err(AllocError::UnknownPointer { .. })
    ));
    e.free(b.addr).unwrap();
    assert_eq!(e.free(b.addr), Err(AllocError::DoubleFree { addr: b.addr }));
    assert!(matches!(
        e.record_stream(b.addr, StreamId(3)),
        Err(AllocError::DoubleFree { .. })
    ));
    assert!(e.set_memory_fraction(-0.1).is_err());
    assert!(e.set_memory_fraction(1.5).is_err());
    e.set_memory_fraction(0.0).unwrap(); // as PyTorch: nothing more may be reserved
    assert_eq!(e.memory_limit(), Some(0));
    assert!(matches!(
        e.malloc(GIB, StreamId(0)),
        Err(AllocError::OutOfMemory(_))
    ));
    assert!(e.set_memory_fraction(f64::NAN).is_err());
    e.assert_valid();
}

#[test]
fn record_stream_defers_reuse_until_the_event_completes() {
    let mut e = engine("", 8 * GIB);
    let a = e.malloc(8192, StreamId(0)).unwrap();
    e.record_stream(a.addr, StreamId(7)).unwrap();
    e.record_stream(a.addr, StreamId(7)).unwrap(); // recorded once
    e.record_stream(a.addr, StreamId(0)).unwrap(); // own stream: no event
    e.free(a.addr).unwrap();
    assert_eq!(e.awaiting_events(), 1);
    assert_eq!(e.streams().pending(), 1);
    let stats = e.stats();
    assert_eq!(
        stats.allocated_bytes.all.current, 0,
        "allocated drops at free"
    );
    assert_eq!(
        stats.active_bytes.all.current, 8192,
        "still active until the event"
    );
    let b = e.malloc(8192, StreamId(0)).unwrap();
    assert_ne!(
        b.addr, a.addr,
        "not reused while stream 7 may still read it"
    );
    e.assert_valid();
    e.streams_mut().complete_stream(StreamId(7));
    let c = e.malloc(8192, StreamId(0)).unwrap();
    assert_eq!(c.addr, a.addr, "reused once the event completed");
    assert_eq!(e.awaiting_events(), 0);
    assert_eq!(e.streams().outstanding, 0, "events returned");
    e.assert_valid();
}

/// Stream-wait reuse waits only under pressure: with room to grow it maps a
/// new block as PyTorch does (no stream waits on work PyTorch never waits
/// for); out of room it makes the stream wait on the block's own event
/// instead of synchronising the host with every stream.
#[test]
fn stream_wait_mode_reuses_by_waiting_only_under_pressure() {
    for (config, device, expect_wait) in [
        ("", 8 * GIB, false),
        ("stream_wait_reuse:true", 8 * GIB, false),
        ("", 40 * MIB, false),
        ("stream_wait_reuse:true", 40 * MIB, true),
    ] {
        let what = format!("{config:?} on a {} MiB device", device / MIB);
        let mut e = engine(config, device);
        let a = e.malloc(30 * MIB, StreamId(0)).unwrap();
        e.record_stream(a.addr, StreamId(9)).unwrap();
        e.free(a.addr).unwrap();
        let b = e.malloc(30 * MIB, StreamId(0)).unwrap();
        let out_of_room = device < 60 * MIB;
        // Out of room without stream waits, the host waits, the segment
        // goes back to the device and a new one is made.
        assert_eq!(b.addr == a.addr, expect_wait, "{what}");
        if expect_wait {
            assert_eq!(e.streams().waits.len(), 1, "{what}: stream 0 waits on 9");
            assert_eq!(e.streams().waits[0].0, StreamId(0));
            assert_eq!(e.stats().num_sync_all_streams, 0, "{what}: no host sync");
        } else {
            assert!(e.streams().waits.is_empty(), "{what}: no stream wait");
            let synced = u64::from(out_of_room);
            assert_eq!(e.stats().num_sync_all_streams, synced, "{what}");
        }
        let reserved = if out_of_room { 30 } else { 60 };
        assert_eq!(
            e.stats().reserved_bytes.all.current,
            reserved * MIB as i64,
            "{what}"
        );
        e.assert_valid();
    }
}

#[test]
fn oom_frees_cache_retries_then_reports() {
    let mut e = engine("", 100 * MIB);
    let a = e.malloc(60 * MIB, StreamId(0)).unwrap();
    e.free(a.addr).unwrap();
    // 60 MiB cached; 70 MiB cannot fit beside it: the cache is flushed.
    let b = e.malloc(70 * MIB, StreamId(0)).unwrap();
    assert_eq!(e.stats().num_alloc_retries, 1);
    assert_eq!(e.stats().num_device_free, 1);
    let err = e.malloc(40 * MIB, StreamId(0)).unwrap_err();
    let AllocError::OutOfMemory(report) = &err else {
        panic!("{err}")
    };
    assert_eq!(report.requested, 40 * MIB);
    assert_eq!(report.capacity, 100 * MIB);
    assert_eq!(report.allocated, 70 * MIB);
    assert_eq!(report.device_free, 30 * MIB);
    let msg = err.to_string();
    for part in [
        "40.00 MiB",
        "100.00 MiB",
        "30.00 MiB",
        "70.00 MiB",
        "0 B is reserved but unallocated",
    ] {
        assert!(msg.contains(part), "{msg} lacks {part}");
    }
    assert_eq!(e.stats().num_ooms, 1);
    e.free(b.addr).unwrap();
    e.malloc(40 * MIB, StreamId(0)).unwrap();
    e.assert_valid();
}

#[test]
fn oom_releases_oversize_blocks_first() {
    let mut e = engine("max_split_size_mb:40", 150 * MIB);
    let small = e.malloc(10 * MIB, StreamId(0)).unwrap(); // 10 MiB segment, kept
    e.free(small.addr).unwrap();
    let big = e.malloc(100 * MIB, StreamId(0)).unwrap(); // oversize
    e.free(big.addr).unwrap();
    // 70 MiB: the cached 100 MiB oversize block is too large to reuse
    // (>= 70 + 20) and 110 + 70 MiB exceed the device, so the oversize block
    // alone is released; the 10 MiB block stays cached.
    e.malloc(70 * MIB, StreamId(0)).unwrap();
    let s = e.stats();
    assert_eq!(s.num_device_free, 1);
    assert_eq!(s.num_alloc_retries, 0, "first release step was enough");
    assert_eq!(s.oversize_segments.current, 1);
    e.assert_valid();
}

#[test]
fn memory_fraction_caps_reserved_bytes() {
    let mut e = engine("", GIB);
    e.set_memory_fraction(0.25).unwrap();
    assert_eq!(e.memory_limit(), Some(GIB / 4));
    let a = e.malloc(200 * MIB, StreamId(0)).unwrap();
    let err = e.malloc(100 * MIB, StreamId(0)).unwrap_err();
    assert!(
        err.to_string()
            .contains("memory fraction limits reserved memory to 256.00 MiB"),
        "{err}"
    );
    e.free(a.addr).unwrap();
    e.malloc(100 * MIB, StreamId(0)).unwrap();
    assert!(e.stats().reserved_bytes.all.peak as u64 <= GIB / 4);
}

#[test]
fn garbage_collection_releases_old_idle_segments() {
    let mut e = engine("garbage_collection_threshold:0.5", GIB);
    e.set_memory_fraction(1.0).unwrap();
    let old = e.malloc(600 * MIB, StreamId(0)).unwrap();
    e.free(old.addr).unwrap();
    for _ in 0..10 {
        let t = e.malloc(MIB / 2, StreamId(0)).unwrap(); // ticks the clock
        e.free(t.addr).unwrap();
    }
    // 600 MiB cached + 2 MiB small is past 50% of 1 GiB: before the 400 MiB
    // segment is made, the idle 600 MiB segment (the oldest) goes back.
    e.malloc(400 * MIB, StreamId(0)).unwrap();
    assert_eq!(e.stats().num_device_free, 1);
    assert_eq!(e.stats().num_alloc_retries, 0);
    assert!(e.heap().segment_containing(old.addr).is_none());
    e.assert_valid();
}

/// A segment whose blocks were freed at different times is as old as its
/// last free: merging keeps the later of the two free times, so PyTorch's
/// collector (oldest first) releases the segment idle longer, not the one
/// whose first half went idle early.
#[test]
fn garbage_collection_ages_a_merged_block_from_its_last_free() {
    let mut e = engine("garbage_collection_threshold:0.5", GIB);
    // A 20 MiB segment cut in two, and a 24 MiB one.
    let head = e.malloc(4 * MIB, StreamId(0)).unwrap();
    let tail = e.malloc(16 * MIB, StreamId(0)).unwrap();
    assert_eq!(
        tail.addr,
        head.addr + 4 * MIB,
        "carved from the same segment"
    );
    let whole = e.malloc(24 * MIB, StreamId(0)).unwrap();
    let mut fillers = Vec::new();
    // Each filler is one lookup in the large pool (a tick of its clock) and
    // stays allocated, so it is never a candidate.
    let mut pass_time = |e: &mut common::SimEngine| {
        for _ in 0..4 {
            fillers.push(e.malloc(32 * MIB, StreamId(0)).unwrap().addr);
        }
    };
    e.free(head.addr).unwrap();
    pass_time(&mut e);
    e.free(whole.addr).unwrap();
    pass_time(&mut e);
    // Merges with `head`: the 20 MiB segment went idle just now.
    e.free(tail.addr).unwrap();
    // 44 MiB cached + 256 MiB fillers = 300 MiB reserved, 12 MiB past half
    // of the 576 MiB limit: one idle segment (at least as old as the
    // average) must go before the next one is made.
    e.set_memory_fraction(576.0 / 1024.0).unwrap();
    fillers.push(e.malloc(32 * MIB, StreamId(0)).unwrap().addr);
    assert_eq!(e.stats().num_device_free, 1);
    assert!(
        e.heap().segment_containing(whole.addr).is_none(),
        "the segment idle longest goes back"
    );
    assert!(
        e.heap().segment_containing(head.addr).is_some(),
        "the segment freed last stays"
    );
    e.assert_valid();
    common::drain(&mut e, fillers);
}

#[test]
fn snapshot_lists_segments_and_block_states() {
    let mut e = engine("", 8 * GIB);
    let a = e.malloc(1000, StreamId(0)).unwrap();
    let b = e.malloc(3000, StreamId(0)).unwrap();
    e.record_stream(b.addr, StreamId(5)).unwrap();
    e.free(b.addr).unwrap();
    let snap = e.snapshot();
    assert_eq!(snap.segments.len(), 1);
    let seg = &snap.segments[0];
    assert_eq!(seg.total_size, 2 * MIB);
    let states: Vec<_> = seg.blocks.iter().map(|b| b.state).collect();
    assert_eq!(
        states,
        [
            SnapshotState::ActiveAllocated,
            SnapshotState::ActivePendingFree,
            SnapshotState::Inactive
        ]
    );
    assert_eq!(seg.blocks[0].requested_size, 1000);
    assert_eq!(seg.allocated_size, 1024);
    assert_eq!(
        seg.blocks.iter().map(|b| b.size).sum::<u64>(),
        seg.total_size
    );
    let json = snap.to_json();
    assert!(json.contains("\"active_pending_free\"") && json.contains(&a.addr.to_string()));
}

#[test]
fn empty_cache_waits_for_events_and_returns_everything() {
    let mut e = engine("", 8 * GIB);
    let a = e.malloc(5 * MIB, StreamId(0)).unwrap();
    e.record_stream(a.addr, StreamId(3)).unwrap();
    e.free(a.addr).unwrap();
    e.empty_cache().unwrap();
    assert_eq!(e.streams().synchronizations, 1);
    assert_eq!(e.memory().used(), 0);
    assert_eq!(e.stats().segment.all.current, 0);
    e.assert_valid();
}

/// The error building the policy of `config` gives, as text.
fn policy_error(config: &str) -> String {
    let cfg = alloc_core::AllocatorConfig::parse(config).unwrap();
    alloc_policy::AnyPolicy::from_config(&cfg)
        .unwrap_err()
        .to_string()
}

#[test]
fn unknown_policy_is_a_clear_error() {
    let err = policy_error("policy:nope");
    assert!(err.contains("nope") && err.contains("pytorch-bfc"), "{err}");
}

#[test]
fn idle_slab_limit_is_for_size_class_only() {
    let err = policy_error("idle_slab_limit_mb:64");
    assert!(
        err.contains("idle_slab_limit_mb") && err.contains("size-class"),
        "{err}"
    );
}

#[test]
fn expandable_segments_grow_one_segment_and_trim_on_empty_cache() {
    let mut e = engine("expandable_segments:True", 8 * GIB);
    assert!(e.expandable());
    let a = e.malloc(30 * MIB, StreamId(0)).unwrap();
    let b = e.malloc(30 * MIB, StreamId(0)).unwrap();
    let c = e.malloc(5 * MIB, StreamId(0)).unwrap();
    assert_eq!(b.addr, a.addr + 30 * MIB, "one growing segment");
    assert_eq!(c.addr, b.addr + 30 * MIB);
    let s = e.stats();
    assert_eq!(s.segment.large_pool.current, 1);
    // Grown in 20 MiB steps: 40, then +20 (60, 0 left), then +20 for 5 MiB.
    assert_eq!(s.reserved_bytes.all.current, 80 * MIB as i64);
    assert_eq!(s.num_device_alloc, 3);
    e.assert_valid();
    e.free(c.addr).unwrap();
    e.free(b.addr).unwrap();
    e.empty_cache().unwrap();
    // The free tail beyond `a` is unmapped in whole 2 MiB chunks.
    assert_eq!(e.stats().reserved_bytes.all.current, 30 * MIB as i64);
    assert_eq!(e.memory().used(), 30 * MIB);
    e.assert_valid();
    e.free(a.addr).unwrap();
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0);
    assert_eq!(e.stats().segment.all.current, 0);
    e.assert_valid();
}

#[test]
fn expandable_segments_respect_the_memory_fraction() {
    let mut e = engine("expandable_segments:true", GIB);
    e.set_memory_fraction(0.1).unwrap();
    let a = e.malloc(60 * MIB, StreamId(0)).unwrap();
    assert!(matches!(
        e.malloc(60 * MIB, StreamId(0)),
        Err(AllocError::OutOfMemory(_))
    ));
    e.free(a.addr).unwrap();
    e.malloc(90 * MIB, StreamId(0)).unwrap();
    assert!(e.stats().reserved_bytes.all.peak as u64 <= GIB / 10);
    e.assert_valid();
}

#[test]
fn expandable_request_larger_than_the_device_is_out_of_memory() {
    let mut e = engine("expandable_segments:true", 300 * MIB);
    let err = e.malloc(1700 * MIB, StreamId(0)).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err}");
    e.assert_valid();
}

/// With expandable segments PyTorch's best fit counts the free tail of the
/// growable segment as its size plus the unmapped rest, so a larger interior
/// free block is preferred to it and the tail stays for growth.
#[test]
fn expandable_best_fit_spares_the_growable_tail() {
    let mut e = common::engine("policy:pytorch-bfc,expandable_segments:true", 1 << 30);
    let a = e.malloc(4 * MIB, StreamId(0)).unwrap(); // maps 20 MiB: [a 4][free 16]
    let b = e.malloc(9 * MIB, StreamId(0)).unwrap(); // [a 4][b 9][free 7]
    let c = e.malloc(2 * MIB, StreamId(0)).unwrap(); // [a 4][b 9][c 2][tail 5]
    assert_eq!(e.stats().reserved_bytes.all.current as u64, 20 * MIB);
    e.free(b.addr).unwrap(); // interior 9 MiB free, tail 5 MiB free
    let d = e.malloc(4 * MIB, StreamId(0)).unwrap();
    assert_eq!(
        d.addr, b.addr,
        "took the tail instead of the interior block"
    );
    // The interior remainder (5 MiB) and the tail (5 MiB) tie: the interior
    // one is taken; then only the tail fits, and it is used without growth.
    let f = e.malloc(5 * MIB, StreamId(0)).unwrap();
    assert_eq!(f.addr, b.addr + 4 * MIB);
    let g = e.malloc(5 * MIB, StreamId(0)).unwrap();
    assert_eq!(g.addr, c.addr + 2 * MIB);
    assert_eq!(e.stats().reserved_bytes.all.current as u64, 20 * MIB);
    for x in [a, c, d, f, g] {
        e.free(x.addr).unwrap();
    }
    e.assert_valid();
}

/// `unmap_free_pages` with pages of the driver's 2 MiB granularity, so that
/// the tests' page counts are small multiples of MiB.
const UNMAP_2MIB_PAGES: &str =
    "policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true,unmap_page_mb:2";

/// `unmap_free_pages`: a mapping that would raise reserved memory above its
/// peak first unmaps whole free pages, which are mapped back when a block
/// over them is handed out.
#[test]
fn unmap_free_pages_reuses_physical_memory_before_growing() {
    let mut e = common::engine(UNMAP_2MIB_PAGES, 1 << 30);
    let reserved = |e: &common::SimEngine| e.stats().reserved_bytes.all.current as u64;
    let a = e.malloc(20 * MIB, StreamId(0)).unwrap();
    let b = e.malloc(20 * MIB, StreamId(0)).unwrap();
    assert_eq!(reserved(&e), 40 * MIB);
    e.free(a.addr).unwrap(); // 20 MiB free in the middle, still mapped
    let frees = e.stats().num_device_free;
    let c = e.malloc(30 * MIB, StreamId(0)).unwrap(); // needs 40 MiB more address space
    assert_eq!(
        reserved(&e),
        60 * MIB,
        "unmapped a's 20 MiB before mapping 40"
    );
    assert_eq!(e.memory().used(), 60 * MIB);
    assert!(e.stats().num_device_free > frees);
    e.assert_valid();
    // a's range is handed out again: its pages are mapped back.
    let d = e.malloc(20 * MIB, StreamId(0)).unwrap();
    assert_eq!(d.addr, a.addr);
    assert_eq!(
        e.memory().used() as i64,
        e.stats().reserved_bytes.all.current
    );
    e.assert_valid();
    common::drain(&mut e, [b, c, d].map(|x| x.addr));
}

/// `unmap_page_mb`: the large pool moves whole pages of the configured size
/// (the simulated device refuses any map or unmap that is not whole pages of
/// its range), so the same free hole costs a quarter of the page moves with
/// 8 MiB pages as with 2 MiB ones; `page_moves` counts them.
#[test]
fn unmap_page_mb_moves_whole_large_pages() {
    for (page_mb, pages_of_a) in [(2, 12), (8, 3)] {
        let config = format!(
            "policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true,\
             unmap_page_mb:{page_mb}"
        );
        let mut e = common::engine(&config, 1 << 30);
        let reserved = |e: &common::SimEngine| e.stats().reserved_bytes.all.current as u64;
        let a = e.malloc(24 * MIB, StreamId(0)).unwrap();
        let b = e.malloc(24 * MIB, StreamId(0)).unwrap();
        assert_eq!(reserved(&e) % (page_mb * MIB), 0);
        let before = reserved(&e);
        e.free(a.addr).unwrap();
        let c = e.malloc(40 * MIB, StreamId(0)).unwrap();
        let moves = e.stats().page_moves;
        assert_eq!(moves.rounds, 1, "{page_mb} MiB pages");
        assert_eq!(moves.pages_unmapped, pages_of_a, "{page_mb} MiB pages");
        assert!(
            reserved(&e) < before + 40 * MIB,
            "a's pages served the growth"
        );
        assert_eq!(e.memory().used() as u64, reserved(&e));
        let d = e.malloc(24 * MIB, StreamId(0)).unwrap();
        assert_eq!(d.addr, a.addr);
        assert_eq!(e.stats().page_moves.pages_mapped, pages_of_a);
        e.assert_valid();
        for x in [b, c, d] {
            e.free(x.addr).unwrap();
        }
        e.empty_cache().unwrap();
        assert_eq!(e.memory().used(), 0);
    }
}

/// `unmap_page_mb:auto`'s pages grow with the offset in the segment (here
/// at a small scale: 2 MiB pages below 16 MiB, 4 MiB to 32 MiB, 8 MiB
/// above): a random mix of sizes over pages of three sizes keeps the
/// invariants (the simulated device refuses any map or unmap that is not
/// whole pages of the range, and the growable segment's check counts every
/// unmapped page by its size), moves pages of every size, and gives every
/// byte back.
#[test]
fn pages_that_grow_with_the_heap_move_whole_and_add_up() {
    use alloc_core::{AllocatorConfig, PageLayout, SimDataMemory, SimStreams};
    let mut cfg =
        AllocatorConfig::parse("policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true")
            .unwrap();
    cfg.unmap_pages = PageLayout::scaled(2 * MIB, 8 * MIB, 4).unwrap();
    let mut e =
        alloc_policy::AnyPolicy::engine(&cfg, SimDataMemory::new(1 << 30), SimStreams::new())
            .unwrap();
    let mut next = alloc_policy::testing::xorshift(0x2545_f491_4f6c_dd1d);
    let mut live: Vec<u64> = Vec::new();
    let mut unmapped_above_32 = false;
    for i in 0..3000 {
        if i % 2 == 0 {
            e.streams_mut().complete_all(); // half the time the GPU keeps up
        }
        if live.len() < 12 && !next().is_multiple_of(3) {
            let size = (1 + next() % 12) * MIB + next() % MIB;
            live.push(e.malloc(size, StreamId(0)).unwrap().addr);
        } else if !live.is_empty() {
            let at = (next() % live.len() as u64) as usize;
            e.free(live.swap_remove(at)).unwrap();
        }
        e.assert_valid();
        assert_eq!(
            e.memory().used() as i64,
            e.stats().reserved_bytes.all.current
        );
        let seg = e
            .snapshot()
            .segments
            .into_iter()
            .map(|s| s.total_size)
            .max();
        unmapped_above_32 |= seg.unwrap_or(0) > 40 * MIB && e.stats().page_moves.pages_unmapped > 0;
    }
    assert!(
        unmapped_above_32,
        "the segment grew into 8 MiB pages and moved pages"
    );
    common::drain(&mut e, live);
}

/// The GPU test `unmap_free_pages_remaps_holes_with_data_intact`'s pattern
/// on the simulated device: interleaved holes are unmapped when larger
/// requests grow the segment, and mapped back when refilled.
#[test]
fn unmap_free_pages_on_interleaved_holes() {
    let mut e = common::engine(UNMAP_2MIB_PAGES, 8 << 30);
    let mut bufs: Vec<Option<u64>> = (0..20)
        .map(|_| Some(e.malloc(6 * MIB, StreamId(0)).unwrap().addr))
        .collect();
    for slot in bufs.iter_mut().step_by(2) {
        e.free(slot.take().unwrap()).unwrap();
    }
    let peak = e.stats().reserved_bytes.all.peak as u64;
    let frees0 = e.stats().num_device_free;
    let big: Vec<u64> = (0..3)
        .map(|_| e.malloc(14 * MIB, StreamId(0)).unwrap().addr)
        .collect();
    assert!(e.stats().num_device_free > frees0, "holes were unmapped");
    assert!((e.stats().reserved_bytes.all.peak as u64) < peak + 3 * 14 * MIB);
    let refill: Vec<u64> = (0..10)
        .map(|_| e.malloc(5 * MIB, StreamId(0)).unwrap().addr)
        .collect();
    e.assert_valid();
    assert_eq!(
        e.memory().used() as i64,
        e.stats().reserved_bytes.all.current
    );
    for a in bufs.into_iter().flatten().chain(big).chain(refill) {
        e.free(a).unwrap();
    }
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0);
}

/// `unmap_free_pages` waits for the stream only when the pages it needs may
/// still be in use: when the GPU has passed the marks recorded after their
/// frees (here: every event completes before each call), the same rounds
/// unmap without a host synchronization; when it never does, rounds move
/// busy pages without waiting, and mapping an address whose pages moved
/// while busy waits (for the mark of that move).
#[test]
fn unmap_free_pages_waits_only_for_pages_the_gpu_may_still_use() {
    let run = |gpu_keeps_up: bool| {
        let mut e = common::engine(UNMAP_2MIB_PAGES, 8 << 30);
        let mut live: Vec<u64> = Vec::new();
        // A training-like loop: every step frees the previous step's
        // interleaved buffers and asks for larger ones, so each step needs
        // pages that were freed earlier.
        for step in 0..12u64 {
            for i in 0..10u64 {
                if gpu_keeps_up {
                    e.streams_mut().complete_all();
                }
                let size = (4 + (step + i) % 5 * 3) * MIB;
                live.push(e.malloc(size, StreamId(0)).unwrap().addr);
                if live.len() > 6 {
                    let victim = live.remove((i as usize * 7) % live.len());
                    e.free(victim).unwrap();
                }
            }
            e.assert_valid();
            assert_eq!(
                e.memory().used() as i64,
                e.stats().reserved_bytes.all.current
            );
        }
        let unmaps = e.stats().num_device_free;
        for a in live {
            e.free(a).unwrap();
        }
        e.empty_cache().unwrap();
        assert_eq!(e.memory().used(), 0);
        (e.streams().synchronizations, unmaps)
    };
    let (waits_idle_gpu, unmaps_idle_gpu) = run(true);
    let (waits_busy_gpu, unmaps_busy_gpu) = run(false);
    assert!(
        unmaps_busy_gpu > 4,
        "the loop unmaps pages ({unmaps_busy_gpu})"
    );
    assert!(
        unmaps_idle_gpu > 4,
        "the loop unmaps pages ({unmaps_idle_gpu})"
    );
    assert!(
        waits_busy_gpu > 4,
        "a GPU that never finishes forces waits ({waits_busy_gpu})"
    );
    assert!(
        waits_idle_gpu * 2 < waits_busy_gpu,
        "a GPU that keeps up spares most waits: {waits_idle_gpu} vs {waits_busy_gpu}"
    );
}

/// `unmap_free_pages` with the GPU still busy on a freed block (no event
/// ever completes by itself here): a mapping on the same stream takes its
/// pages at once, with no host wait (the new use is queued after the old
/// one); mapping the old address again waits only for the mark recorded
/// when its pages moved, not for the work queued since.
#[test]
fn busy_pages_move_to_their_own_stream_without_a_wait() {
    let mut e = common::engine(UNMAP_2MIB_PAGES, 1 << 30);
    let a = e.malloc(20 * MIB, StreamId(0)).unwrap();
    let b = e.malloc(20 * MIB, StreamId(0)).unwrap();
    e.free(a.addr).unwrap();
    let c = e.malloc(30 * MIB, StreamId(0)).unwrap();
    let moves = e.stats().page_moves;
    assert_eq!(e.streams().synchronizations, 0, "no host wait");
    assert_eq!(moves.stream_waits, 0);
    assert_eq!(
        moves.busy_pages_reused, 10,
        "a's ten pages moved while busy"
    );
    assert_eq!(e.stats().reserved_bytes.all.current as u64, 60 * MIB);
    assert_eq!(e.memory().used(), 60 * MIB, "no new memory for them");
    e.assert_valid();
    // More work is queued after the move (an event the GPU has not reached).
    let later = e.malloc(MIB, StreamId(0)).unwrap();
    e.free(later.addr).unwrap();
    let pending = e.streams().pending();
    // a's address again: its old mapping goes first, after one wait for
    // the mark of the move.
    let d = e.malloc(20 * MIB, StreamId(0)).unwrap();
    assert_eq!(d.addr, a.addr);
    assert_eq!(e.streams().synchronizations, 1);
    assert_eq!(e.stats().page_moves.stream_waits, 1);
    assert!(
        e.streams().pending() > 0 && pending > 1,
        "later work is not waited for"
    );
    e.assert_valid();
    common::drain(&mut e, [b, c, d].map(|x| x.addr));
}

/// Busy pages of another stream cannot move without a wait (the new work
/// is not queued after theirs): a mapping for stream 1 leaves them mapped
/// and raises the peak instead of waiting on the host; emptying the cache
/// waits and unmaps them.
#[test]
fn busy_pages_of_another_stream_stay_and_the_host_does_not_wait() {
    let mut e = common::engine(UNMAP_2MIB_PAGES, 1 << 30);
    let a = e.malloc(20 * MIB, StreamId(0)).unwrap();
    e.free(a.addr).unwrap();
    let c = e.malloc(20 * MIB, StreamId(1)).unwrap();
    let moves = e.stats().page_moves;
    assert_eq!(e.streams().synchronizations, 0);
    assert_eq!((moves.pages_unmapped, moves.busy_pages_reused), (0, 0));
    assert_eq!(e.stats().reserved_bytes.all.current as u64, 40 * MIB);
    // Once stream 0's GPU work is done, its pages are idle and move freely.
    e.streams_mut().complete_stream(StreamId(0));
    let d = e.malloc(40 * MIB, StreamId(1)).unwrap();
    let moves = e.stats().page_moves;
    assert_eq!(e.streams().synchronizations, 0);
    assert_eq!((moves.pages_unmapped, moves.busy_pages_reused), (10, 0));
    assert_eq!(e.stats().reserved_bytes.all.peak as u64, 60 * MIB);
    e.assert_valid();
    common::drain(&mut e, [c, d].map(|x| x.addr));
}

/// Growable segments change size: the oversize segment count follows them
/// across `max_split_size` and comes back to zero (it drifted to -1 after
/// `empty_cache` when grow and shrink left it alone).
#[test]
fn oversize_segments_follow_growth_and_shrink() {
    let mut e = engine("expandable_segments:True,max_split_size_mb:40", 8 * GIB);
    let mut live = Vec::new();
    for _ in 0..6 {
        // 6 MiB at a time: the one growable segment crosses 40 MiB.
        live.push(e.malloc(6 * MIB, StreamId(0)).unwrap().addr);
        e.assert_valid();
    }
    assert_eq!(e.stats().oversize_segments.current, 1);
    for a in live {
        e.free(a).unwrap();
    }
    e.empty_cache().unwrap();
    assert_eq!(e.stats().oversize_segments.current, 0);
    e.assert_valid();
}

/// A block freed during a capture (its events deferred to the capture's end)
/// is no longer the caller's: record_stream on it is an error, as after any
/// free.
#[test]
fn record_stream_after_a_free_deferred_by_a_capture_is_refused() {
    let mut e = engine("", 8 * GIB);
    let pool = (1, 0);
    e.begin_allocate_to_pool(pool);
    let a = e.malloc_in(MIB, StreamId(1), Some(pool)).unwrap().addr;
    e.record_stream(a, StreamId(2)).unwrap();
    e.free(a).unwrap(); // deferred: another stream used it
    assert_eq!(
        e.record_stream(a, StreamId(3)),
        Err(AllocError::DoubleFree { addr: a })
    );
    assert_eq!(e.free(a), Err(AllocError::DoubleFree { addr: a }));
    e.end_allocate_to_pool(pool).unwrap();
    e.assert_valid();
}

/// Private pools are keyed apart from streams: every stream value, the top
/// bit included, is an ordinary stream, never served from a pool, and a
/// pool's blocks report their real stream.
#[test]
fn any_stream_value_is_a_stream_and_never_a_pool() {
    let mut e = engine("stream_wait_reuse:True", 8 * GIB);
    let pool = (1, 0);
    let in_pool = common::malloc_in_pool(&mut e, pool, StreamId(0), MIB);
    let cached = common::malloc_in_pool(&mut e, pool, StreamId(0), MIB);
    e.free(cached).unwrap();
    // Before pools were keyed apart, (pool, stream 0) was the stream value
    // with only the top bit set.
    let top = StreamId(1 << 63);
    let a = e.malloc(MIB, top).unwrap();
    let b = e.malloc(MIB, top).unwrap();
    assert!(
        a.addr != cached && b.addr != cached,
        "a stream is never served from a pool"
    );
    assert_eq!(e.allocation(a.addr).map(|x| x.stream), Some(top));
    assert_eq!(e.allocation(in_pool).map(|x| x.stream), Some(StreamId(0)));
    let other = StreamId(u64::MAX);
    e.record_stream(a.addr, other).unwrap();
    e.free(a.addr).unwrap();
    // Out of room (the limit at what is reserved), stream-wait reuse makes
    // `top` wait on the event recorded on `other`.
    let reserved = e.stats().reserved_bytes.all.current as f64;
    e.set_memory_fraction(reserved / (8 * GIB) as f64).unwrap();
    let c = e.malloc(MIB, top).unwrap();
    assert_eq!(c.addr, a.addr);
    let wait = e.streams().waits.last().map(|w| (w.0, w.2));
    assert_eq!(wait, Some((top, other)));
    let snap = e.snapshot();
    let segment_of = |addr: u64| {
        snap.segments
            .iter()
            .find(|s| s.address <= addr && addr < s.address + s.total_size)
            .expect("a segment holds it")
    };
    let pooled = segment_of(in_pool);
    assert_eq!(
        (pooled.stream, pooled.private_pool),
        (StreamId(0), Some(pool))
    );
    assert!(pooled.blocks.iter().all(|b| b.stream == StreamId(0)));
    let shared = segment_of(c.addr);
    assert_eq!((shared.stream, shared.private_pool), (top, None));
    for addr in [b.addr, c.addr, in_pool] {
        e.free(addr).unwrap();
    }
    common::release_all(&mut e, pool);
    e.assert_valid();
}

/// A policy that keeps `[lo, hi)` of its growable segment mapped
/// ([`Reclaim::kept_mapped`](alloc_core::Reclaim::kept_mapped)) once `keep` holds that range, and otherwise
/// is pytorch-bfc.
struct Keeping {
    inner: alloc_policy::AnyPolicy,
    keep: std::rc::Rc<std::cell::Cell<Option<(u64, u64)>>>,
}

impl alloc_core::Policy for Keeping {
    alloc_core::forward_policy!(field inner; all);
}

impl alloc_core::Reclaim for Keeping {
    fn kept_mapped(&self, _key: alloc_core::CacheKey) -> Option<(u64, u64)> {
        self.keep.get()
    }
    alloc_core::forward_policy!(field inner; release_for_oom, collect_garbage);
}

impl alloc_core::Audit for Keeping {
    alloc_core::forward_policy!(field inner; all_audit);
}

/// A boxed policy forwards every method of the trait, the kept range
/// included (`Box<dyn Policy>` stands wherever a policy does).
#[test]
fn a_boxed_policy_forwards_its_kept_range() {
    use alloc_core::{AllocatorConfig, CacheKey, Policy, Reclaim};
    let cfg = AllocatorConfig::parse(UNMAP_2MIB_PAGES).unwrap();
    let range = Some((4 * MIB, 12 * MIB));
    let boxed: Box<dyn Policy> = Box::new(Keeping {
        inner: alloc_policy::AnyPolicy::from_config(&cfg).unwrap(),
        keep: std::rc::Rc::new(std::cell::Cell::new(range)),
    });
    assert_eq!(boxed.kept_mapped(CacheKey::default()), range);
}

/// A range the policy keeps mapped may raise the reserved peak, instead of
/// giving up its free pages to a mapping, by 1/100 of the peak over the
/// allocator's life; past that, its free pages move as any others do.
#[test]
fn a_kept_range_raises_the_peak_by_its_allowance_only() {
    use alloc_core::{AllocatorConfig, Engine, EngineOptions, SimMemory, SimStreams};
    type Kept = Engine<Keeping, SimMemory, SimStreams>;
    let peak = |e: &Kept| e.stats().reserved_bytes.all.peak as u64;
    let unmapped = |e: &Kept| e.stats().page_moves.pages_unmapped;
    // (peak before the requests, (peak rise, pages unmapped) after each).
    let run = |kept: bool| {
        let cfg = AllocatorConfig::parse(UNMAP_2MIB_PAGES).unwrap();
        let keep = std::rc::Rc::new(std::cell::Cell::new(None));
        let policy = Keeping {
            inner: alloc_policy::AnyPolicy::from_config(&cfg).unwrap(),
            keep: keep.clone(),
        };
        let options = EngineOptions::from(&cfg);
        let mut e = Engine::new(policy, SimMemory::new(8 << 30), SimStreams::new(), options);
        // A 4 GiB block (the allowance is then about 41 MiB), eight 5 MiB
        // blocks and the segment's free tail; every other 5 MiB block
        // freed leaves holes of two whole pages that no 8 MiB request
        // fits in: 16 MiB of free pages, all in the kept range.
        let mut live = vec![e.malloc(4 << 30, StreamId(0)).unwrap().addr];
        let small: Vec<u64> = (0..8)
            .map(|_| e.malloc(5 * MIB, StreamId(0)).unwrap().addr)
            .collect();
        let tail = e.stats().reserved_bytes.all.current as u64 - (4 << 30) - 40 * MIB;
        if tail > 0 {
            live.push(e.malloc(tail, StreamId(0)).unwrap().addr);
        }
        for (i, &s) in small.iter().enumerate() {
            if i % 2 == 0 {
                e.free(s).unwrap();
            } else {
                live.push(s);
            }
        }
        if kept {
            keep.set(Some((small[0], small[7] + 5 * MIB)));
        }
        let start = peak(&e);
        let mut after = Vec::new();
        for _ in 0..12 {
            live.push(e.malloc(8 * MIB, StreamId(0)).unwrap().addr);
            after.push((peak(&e) - start, unmapped(&e)));
        }
        e.validate().unwrap();
        (start, after)
    };
    let (start, plain) = run(false);
    let (_, kept) = run(true);
    let allowance = start / 100;
    // Without a kept range the holes' pages serve the growth first.
    assert!(plain[0].1 > 0, "{plain:?}");
    // Kept: the first growth leaves the kept holes alone and raises the
    // peak instead; in all, the peak rises by no more than the allowance
    // (and a page) over what it did without, and the kept pages move once
    // it is spent.
    assert_eq!(kept[0].1, 0, "{kept:?}");
    assert!(kept[0].0 > plain[0].0, "{kept:?} {plain:?}");
    let (plain_rise, kept_rise) = (plain[11].0, kept[11].0);
    assert!(
        kept_rise <= plain_rise + allowance + 2 * MIB,
        "{kept:?} {plain:?}, allowance {allowance}"
    );
    assert!(kept[11].1 > 0, "{kept:?}");
}

/// A pool must be created (held) before allocations name it: an unknown
/// pool, or one its last holder released, is a typed error and changes
/// nothing.
#[test]
fn allocations_into_an_unknown_pool_are_refused() {
    for conf in ["", "expandable_segments:True"] {
        let mut e = engine(conf, 8 * GIB);
        let pool = (9, 1);
        let before = e.stats();
        let refused = e.malloc_in(MIB, StreamId(0), Some(pool));
        assert_eq!(refused, Err(AllocError::UnknownPool { pool }), "[{conf}]");
        assert_eq!(e.stats().reserved_bytes, before.reserved_bytes);
        assert_eq!(e.pool_table_len(), 0, "[{conf}] nothing remembered");
        e.retain_pool(pool);
        let a = e.malloc_in(MIB, StreamId(0), Some(pool)).unwrap().addr;
        e.release_pool(pool).unwrap();
        assert_eq!(
            e.malloc_in(MIB, StreamId(0), Some(pool)),
            Err(AllocError::UnknownPool { pool }),
            "[{conf}] released"
        );
        assert_eq!(e.release_pool(pool), Err(AllocError::UnknownPool { pool }));
        e.free(a).unwrap();
        e.assert_valid();
    }
}

/// 200,000 pools, each created, used and released, leave the pool tables
/// as small as one pool does: a pool is forgotten with its last segment.
#[test]
fn pools_created_used_and_released_are_forgotten() {
    for conf in ["", "expandable_segments:True"] {
        let mut e = engine(conf, 8 * GIB);
        let mut most = 0;
        for i in 0..200_000u64 {
            let pool = (i + 1, 7);
            if i % 2 == 0 {
                e.retain_pool(pool); // a MemPool
            } else {
                e.begin_allocate_to_pool(pool); // a capture
            }
            let a = e.malloc_in(MIB, StreamId(i % 3), Some(pool)).unwrap().addr;
            if i % 2 == 1 {
                e.end_allocate_to_pool(pool).unwrap();
            }
            e.free(a).unwrap();
            e.release_pool(pool).unwrap();
            most = most.max(e.pool_table_len());
        }
        assert!(most <= 3, "[{conf}] pool tables reached {most} entries");
        e.empty_cache().unwrap();
        assert_eq!(e.stats().reserved_bytes.all.current, 0, "[{conf}]");
        e.assert_valid();
    }
}

/// A released pool whose block is still live keeps its number until the
/// block's segment goes back, and only then forgets it.
#[test]
fn a_released_pool_is_forgotten_once_its_last_segment_goes() {
    let mut e = engine("", 8 * GIB);
    let pool = (5, 5);
    e.retain_pool(pool);
    let a = e.malloc_in(MIB, StreamId(0), Some(pool)).unwrap().addr;
    e.release_pool(pool).unwrap();
    assert_eq!(e.pool_table_len(), 2, "its live block's segment keeps it");
    let snap = e.snapshot();
    assert!(snap.segments.iter().any(|s| s.private_pool == Some(pool)));
    e.free(a).unwrap();
    e.empty_cache().unwrap();
    assert_eq!(e.pool_table_len(), 1, "only the spare number is left");
    e.retain_pool((6, 6));
    e.malloc_in(MIB, StreamId(0), Some((6, 6))).unwrap();
    assert_eq!(
        e.pool_table_len(),
        3,
        "the spare number serves the new pool"
    );
    e.assert_valid();
}

/// A device that reports `u64::MAX` bytes: a growable segment's range is
/// sized by the largest request, not by a product that overflows (debug
/// builds panicked, release builds wrapped and refused a 1-byte request).
#[test]
fn a_device_of_u64_max_bytes_serves_requests() {
    for config in [
        "expandable_segments:True",
        "expandable_segments:True,unmap_free_pages:True",
        "",
    ] {
        let mut e = common::engine(config, u64::MAX);
        let a = e.malloc(1, StreamId(0)).unwrap();
        let b = e.malloc(64 * MIB, StreamId(0)).unwrap();
        assert!(matches!(
            e.malloc(u64::MAX, StreamId(0)),
            Err(AllocError::InvalidSize { .. })
        ));
        e.set_memory_fraction(1.0).unwrap();
        common::drain(&mut e, [a.addr, b.addr]);
    }
}
