//! Invariant checks over the whole allocator state, used by tests after every
//! step: blocks tile segments, coalescing holds, every free block is indexed
//! exactly once, live blocks never overlap, statistics equal a recount.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::engine::live_table::LiveTable;
use crate::heap::{BlockState, Heap};
use crate::policy::Policy;
use crate::stats::{Stat, StatArray, Stats};
use crate::types::{BlockId, Pool};

/// Checks all invariants; `pending` lists the block of every outstanding event.
pub(crate) fn check<P: Policy>(
    heap: &Heap,
    policy: &P,
    coalesces: bool,
    live: &LiveTable,
    awaiting: &FxHashMap<BlockId, u32>,
    pending: impl Iterator<Item = BlockId>,
) -> Result<(), String> {
    check_tiling(heap, coalesces)?;
    check_index(heap, policy)?;
    check_live(heap, live)?;
    check_events(heap, awaiting, pending)?;
    check_stats(heap)?;
    policy.check(heap)
}

fn check_tiling(heap: &Heap, coalesces: bool) -> Result<(), String> {
    let mut seen_blocks = 0;
    let mut prev_end = 0u64;
    for (seg_id, seg) in heap.segments() {
        if seg.addr < prev_end {
            return Err(format!("segment {:#x} overlaps its predecessor", seg.addr));
        }
        prev_end = seg.addr + seg.size;
        let (mut addr, mut count, mut busy) = (seg.addr, 0u32, 0u32);
        let mut prev: Option<BlockId> = None;
        for id in heap.segment_blocks(seg_id) {
            let b = heap.block(id);
            if b.segment != seg_id || b.prev != prev {
                return Err(format!("block {:#x}: broken segment links", b.addr));
            }
            if b.addr != addr || b.size == 0 {
                return Err(format!(
                    "segment {:#x}: gap or overlap at {:#x}",
                    seg.addr, b.addr
                ));
            }
            if b.key() != seg.key() || b.pool != seg.pool {
                return Err(format!(
                    "block {:#x}: stream or pool differs from segment",
                    b.addr
                ));
            }
            if coalesces && b.state == BlockState::Free {
                if let Some(p) = prev.filter(|&p| heap.block(p).state == BlockState::Free) {
                    return Err(format!(
                        "adjacent free blocks {:#x} and {:#x} not merged",
                        heap.block(p).addr,
                        b.addr
                    ));
                }
            }
            busy += u32::from(b.state != BlockState::Free);
            addr += b.size;
            count += 1;
            prev = Some(id);
        }
        if prev != Some(seg.last) {
            return Err(format!("segment {:#x}: last block link wrong", seg.addr));
        }
        if addr != seg.addr + seg.size {
            return Err(format!("segment {:#x}: blocks do not cover it", seg.addr));
        }
        if count != seg.blocks || busy != seg.busy {
            return Err(format!(
                "segment {:#x}: block or busy count wrong",
                seg.addr
            ));
        }
        seen_blocks += count as usize;
    }
    if seen_blocks != heap.block_count() {
        return Err(format!(
            "{} blocks in the arena, {} reachable from segments",
            heap.block_count(),
            seen_blocks
        ));
    }
    Ok(())
}

fn check_index<P: Policy>(heap: &Heap, policy: &P) -> Result<(), String> {
    let indexed = policy.indexed_blocks();
    let mut set = FxHashSet::default();
    for &id in &indexed {
        if !set.insert(id) {
            return Err(format!("block {id:?} indexed twice"));
        }
        if heap.blocks().all(|(b, _)| b != id) {
            return Err(format!("index holds retired block {id:?}"));
        }
        if heap.block(id).state != BlockState::Free {
            return Err(format!(
                "index holds non-free block {:#x}",
                heap.block(id).addr
            ));
        }
    }
    let free = heap
        .blocks()
        .filter(|(_, b)| b.state == BlockState::Free)
        .count();
    if free != set.len() {
        return Err(format!("{free} free blocks but {} indexed", set.len()));
    }
    Ok(())
}

fn check_live(heap: &Heap, live: &LiveTable) -> Result<(), String> {
    for (addr, id) in live.iter() {
        let b = heap.block(id);
        if b.addr != addr || b.state != BlockState::Allocated {
            return Err(format!("pointer table entry {addr:#x} is stale"));
        }
    }
    let allocated = heap
        .blocks()
        .filter(|(_, b)| b.state == BlockState::Allocated)
        .count();
    if allocated != live.len() {
        return Err(format!(
            "{allocated} allocated blocks, {} in the pointer table",
            live.len()
        ));
    }
    Ok(())
}

fn check_events(
    heap: &Heap,
    awaiting: &FxHashMap<BlockId, u32>,
    pending: impl Iterator<Item = BlockId>,
) -> Result<(), String> {
    let mut counts: FxHashMap<BlockId, u32> = FxHashMap::default();
    for b in pending {
        *counts.entry(b).or_default() += 1;
    }
    for (id, b) in heap.blocks() {
        let waiting = b.state == BlockState::AwaitingEvents;
        let expected = awaiting.get(&id).copied();
        if waiting != expected.is_some() {
            return Err(format!(
                "block {:#x}: awaiting state and table disagree",
                b.addr
            ));
        }
        if let Some(n) = expected {
            if counts.get(&id).copied().unwrap_or(0) != n {
                return Err(format!(
                    "block {:#x}: event count {n} but queued differ",
                    b.addr
                ));
            }
        }
    }
    Ok(())
}

/// Current values recomputed from the blocks, compared with the tracked ones.
fn check_stats(heap: &Heap) -> Result<(), String> {
    let mut r = Stats::default();
    let add = |a: &mut StatArray, pool: Pool, n: u64| a.increase(pool, n);
    let mut oversize_allocs = Stat::default();
    let mut oversize_segs = Stat::default();
    for (seg_id, seg) in heap.segments() {
        add(&mut r.segment, seg.pool, 1);
        add(&mut r.reserved_bytes, seg.pool, seg.size - seg.unmapped);
        if seg.size >= heap.ledger.oversize_threshold() {
            oversize_segs.increase(1);
        }
        for id in heap.segment_blocks(seg_id) {
            let b = heap.block(id);
            match b.state {
                BlockState::Free if seg.blocks > 1 => {
                    add(&mut r.inactive_split, b.pool, 1);
                    add(&mut r.inactive_split_bytes, b.pool, b.size);
                }
                BlockState::Free => {}
                state => {
                    add(&mut r.active, b.pool, 1);
                    add(&mut r.active_bytes, b.pool, b.size);
                    add(&mut r.requested_bytes, b.pool, b.requested);
                    if state == BlockState::Allocated {
                        add(&mut r.allocation, b.pool, 1);
                        add(&mut r.allocated_bytes, b.pool, b.size);
                        if b.size >= heap.ledger.oversize_threshold() {
                            oversize_allocs.increase(1);
                        }
                    }
                }
            }
        }
    }
    let s = &heap.ledger.snapshot();
    let pairs: [(&str, &StatArray, &StatArray); 9] = [
        ("allocation", &s.allocation, &r.allocation),
        ("segment", &s.segment, &r.segment),
        ("active", &s.active, &r.active),
        ("inactive_split", &s.inactive_split, &r.inactive_split),
        ("allocated_bytes", &s.allocated_bytes, &r.allocated_bytes),
        ("reserved_bytes", &s.reserved_bytes, &r.reserved_bytes),
        ("active_bytes", &s.active_bytes, &r.active_bytes),
        (
            "inactive_split_bytes",
            &s.inactive_split_bytes,
            &r.inactive_split_bytes,
        ),
        ("requested_bytes", &s.requested_bytes, &r.requested_bytes),
    ];
    for (name, tracked, recount) in pairs {
        for (pool, t, c) in [
            ("all", &tracked.all, &recount.all),
            ("small_pool", &tracked.small_pool, &recount.small_pool),
            ("large_pool", &tracked.large_pool, &recount.large_pool),
        ] {
            if t.current != c.current {
                return Err(format!(
                    "stat {name}.{pool}: tracked {} but recount {}",
                    t.current, c.current
                ));
            }
            if t.peak < t.current {
                return Err(format!("stat {name}.{pool}: peak below current"));
            }
        }
    }
    if s.oversize_allocations.current != oversize_allocs.current
        || s.oversize_segments.current != oversize_segs.current
    {
        return Err("oversize stats differ from recount".into());
    }
    Ok(())
}
