//! Idle segments in the order collectors give them back: oldest first, the
//! larger first among equally old ones (one release frees more), the lower
//! address first among those (a deterministic order).

use std::cmp::Reverse;

use alloc_core::{Heap, Segment, SegmentId};

/// A wholly idle segment, as a collector weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleSegment {
    /// The segment.
    pub id: SegmentId,
    /// Its size in bytes.
    pub size: u64,
    /// Ticks of its pool's clock since its last busy block became free
    /// ([`Heap::clock`] minus [`Segment::idle_since`]).
    pub age: u64,
}

/// The wholly idle segments that `keep` selects (given each segment and its
/// age), in release order: see the module docs.
pub fn idle_oldest_first(heap: &Heap, keep: impl Fn(&Segment, u64) -> bool) -> Vec<IdleSegment> {
    let mut idle: Vec<(IdleSegment, u64)> = heap
        .segments()
        .filter(|(_, s)| s.is_idle())
        .map(|(id, s)| {
            let age = heap.clock(s.pool).saturating_sub(s.idle_since);
            (
                IdleSegment {
                    id,
                    size: s.size,
                    age,
                },
                s.addr,
            )
        })
        .filter(|(seg, _)| keep(heap.segment(seg.id), seg.age))
        .collect();
    idle.sort_unstable_by_key(|&(s, addr)| (Reverse(s.age), Reverse(s.size), addr));
    idle.into_iter().map(|(s, _)| s).collect()
}
