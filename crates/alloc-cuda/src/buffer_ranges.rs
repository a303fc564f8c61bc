//! The blocks owned by live [`crate::DeviceBuffer`]s of one allocator.
//!
//! A typed buffer hands its memory to cudarc's safe copies, so two live
//! buffers must never share a byte (a `DeviceBuffer<bool>` reading bytes a
//! `DeviceBuffer<u8>` wrote could produce an invalid `bool` on the host),
//! and no other path may free a buffer's block while the buffer lives. The
//! allocator therefore claims each buffer's block here, refuses a block
//! that overlaps a claimed one (a policy of one's own that hands out a
//! block twice is caught here, not in the program's data), and refuses
//! `free` of a claimed block, and a private pool's restore that would free
//! one: only dropping the buffer frees it.

use std::collections::BTreeMap;

use alloc_core::PoolId;

/// Claimed address ranges: start -> (end (exclusive), private pool).
#[derive(Debug, Default)]
pub(crate) struct BufferRanges {
    ranges: BTreeMap<u64, (u64, Option<PoolId>)>,
}

impl BufferRanges {
    /// Claims `[addr, addr + size)`, a block of `pool` (if any); `false`,
    /// claiming nothing, when that overlaps a claimed range (or is empty,
    /// or wraps around).
    pub(crate) fn claim(&mut self, addr: u64, size: u64, pool: Option<PoolId>) -> bool {
        let Some(end) = addr.checked_add(size).filter(|_| size > 0) else {
            return false;
        };
        let before = self.ranges.range(..=addr).next_back();
        let after = self.ranges.range(addr..).next();
        if before.is_some_and(|(_, &(e, _))| e > addr) || after.is_some_and(|(&s, _)| s < end) {
            return false;
        }
        self.ranges.insert(addr, (end, pool));
        true
    }

    /// Whether a claimed block belongs to the private pool `pool`.
    pub(crate) fn in_pool(&self, pool: PoolId) -> bool {
        self.ranges.values().any(|&(_, p)| p == Some(pool))
    }

    /// Gives up the range claimed at `addr`; `false` if none starts there.
    pub(crate) fn release(&mut self, addr: u64) -> bool {
        self.ranges.remove(&addr).is_some()
    }

    /// Whether a claimed range starts at `addr`.
    #[inline]
    pub(crate) fn owns(&self, addr: u64) -> bool {
        !self.ranges.is_empty() && self.ranges.contains_key(&addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_claims_are_refused() {
        let mut r = BufferRanges::default();
        assert!(r.claim(0x1000, 0x100, None));
        assert!(r.claim(0x1100, 0x100, None), "adjacent after");
        assert!(r.claim(0x0f00, 0x100, Some((1, 2))), "adjacent before");
        for (addr, size) in [
            (0x1000, 0x100),  // the same range
            (0x10ff, 1),      // its last byte
            (0x0fff, 2),      // across a boundary
            (0x0800, 0x1000), // covering several
            (0x1050, 0x10),   // inside
        ] {
            assert!(!r.claim(addr, size, None), "{addr:#x}+{size:#x} overlaps");
        }
        assert!(!r.claim(0x5000, 0, None), "empty");
        assert!(!r.claim(u64::MAX - 1, 4, None), "wraps around");
        assert!(r.in_pool((1, 2)) && !r.in_pool((1, 3)));
        assert!(r.owns(0x1000) && !r.owns(0x1001) && !r.owns(0x5000));
        assert!(r.release(0x1000));
        assert!(!r.release(0x1000), "released once");
        assert!(!r.owns(0x1000));
        assert!(r.claim(0x1000, 0x100, None), "claimable again");
        assert!(r.release(0x0f00));
        assert!(!r.in_pool((1, 2)), "the pool's only buffer released");
    }
}
