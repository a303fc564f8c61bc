//! The pointer table: the block handed out at each live address.
//!
//! Open addressing with linear probing, Fibonacci hashing (the high bits of
//! the address times 2^64 / phi, so addresses that differ only above their
//! alignment still spread) and deletion by shifting later entries back
//! (no tombstones, so runs stay short under the malloc/free churn of a
//! caching allocator). Beside the 16-byte slots, one byte a slot holds 1 +
//! the entry's distance from its home slot (0: empty): probes read these
//! bytes (2 KiB for 2048 slots, which stay in the L1 cache) and read a slot
//! only where an entry of the same home lies, inserts find the empty slot
//! without reading slots, and deletions shift entries back by their
//! distances (entries are not kept in Robin Hood order, so a deletion scans
//! to the next empty slot). Kept at most a quarter full: 68 to 136 bytes a
//! live allocation.
//!
//! The address inserted last waits in a slot of its own, `recent`, until
//! the next insert moves it into the table: a block freed right after it
//! was handed out (a temporary) then costs no probe and no shifting. Every
//! lookup looks at both, so answers are those of one map.

use crate::types::BlockId;

/// Slots of the first table.
const FIRST_CAPACITY: usize = 64;
/// The largest distance a probe byte holds; an insert that would go
/// further doubles the table instead.
const MAX_DISTANCE: usize = 250;

/// One slot: an address and its block.
#[derive(Clone, Copy, Debug)]
struct Slot {
    addr: u64,
    block: BlockId,
}

const VACANT: Slot = Slot {
    addr: 0,
    block: BlockId::MIN,
};

/// Live allocations by address.
#[derive(Debug, Default)]
pub(crate) struct LiveTable {
    /// A power of two of slots (or none before the first insert), at most
    /// a quarter full: at half full, the probe loop's length varies enough
    /// from op to op to be mispredicted (the ops bench's mixed small
    /// workload, 1000 live blocks, was 4 ns an op slower than a general
    /// map, and as fast at a quarter).
    slots: Vec<Slot>,
    /// Per slot: 0 when empty, else 1 + its entry's distance from home.
    probes: Vec<u8>,
    /// 64 - log2(number of slots): the hash is the top bits of a product.
    shift: u32,
    /// Entries in `slots` (`recent` not counted).
    len: usize,
    /// The address inserted last, not in `slots`.
    recent: Option<Slot>,
}

impl LiveTable {
    /// Number of live addresses.
    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.recent.is_some())
    }

    #[inline(always)]
    fn home(&self, addr: u64) -> usize {
        (addr.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    #[inline(always)]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The slots and their probes, sliced to one length (a power of two,
    /// or 0): an index masked by [`LiveTable::mask`] is then below both,
    /// and the compiler drops the bounds checks of the probe loops.
    #[inline(always)]
    fn parts(&self) -> (&[Slot], &[u8]) {
        let n = self.slots.len();
        (&self.slots[..], &self.probes[..n])
    }

    /// [`LiveTable::parts`], mutably.
    #[inline(always)]
    fn parts_mut(&mut self) -> (&mut [Slot], &mut [u8]) {
        let n = self.slots.len();
        (&mut self.slots[..], &mut self.probes[..n])
    }

    /// The slot holding `addr`, if any.
    #[inline]
    fn find(&self, addr: u64) -> Option<usize> {
        let (slots, probes) = self.parts();
        if slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let home = self.home(addr);
        let mut distance = 0;
        loop {
            let i = (home + distance) & mask;
            let probe = probes[i] as usize;
            if probe == 0 {
                return None;
            }
            if probe == distance + 1 && slots[i].addr == addr {
                return Some(i);
            }
            distance += 1;
        }
    }

    /// The block at `addr`, if live.
    #[inline]
    pub(crate) fn get(&self, addr: u64) -> Option<BlockId> {
        match self.recent {
            Some(r) if r.addr == addr => Some(r.block),
            _ => self.find(addr).map(|i| self.slots[i].block),
        }
    }

    /// Records `block` at `addr`, which must not be live.
    #[inline]
    pub(crate) fn insert(&mut self, addr: u64, block: BlockId) {
        debug_assert!(self.get(addr).is_none(), "{addr:#x} is live already");
        if let Some(r) = self.recent.replace(Slot { addr, block }) {
            self.insert_slot(r.addr, r.block);
        }
    }

    /// Records `block` at `addr` in the slots (replacing any block
    /// recorded there).
    #[inline]
    fn insert_slot(&mut self, addr: u64, block: BlockId) {
        if 4 * (self.len + 1) > self.slots.len() {
            self.grow();
        }
        loop {
            let mask = self.mask();
            let home = self.home(addr);
            let (slots, probes) = self.parts_mut();
            // A half-open range: an inclusive one keeps an extra flag in the
            // loop.
            for distance in 0..MAX_DISTANCE + 1 {
                let i = (home + distance) & mask;
                let probe = probes[i] as usize;
                if probe == 0 {
                    probes[i] = (distance + 1) as u8;
                    slots[i] = Slot { addr, block };
                    self.len += 1;
                    return;
                }
                if probe == distance + 1 && slots[i].addr == addr {
                    slots[i].block = block;
                    return;
                }
            }
            self.grow();
        }
    }

    /// Removes `addr`; returns its block if it was live.
    // Always inline, the slots' path out of line: the recent slot's hit
    // then costs a compare, not a call and its register saves.
    #[inline(always)]
    pub(crate) fn remove(&mut self, addr: u64) -> Option<BlockId> {
        if let Some(r) = self.recent.filter(|r| r.addr == addr) {
            self.recent = None;
            return Some(r.block);
        }
        self.remove_slot(addr)
    }

    /// Removes `addr` from the slots; returns its block if it was there.
    // The hole's index masked again (`find`'s answer and every hole are
    // already within the mask): the compiler then drops the bounds checks
    // of the hole's writes.
    #[inline(never)]
    fn remove_slot(&mut self, addr: u64) -> Option<BlockId> {
        let hole = self.find(addr)?;
        let mask = self.mask();
        let mut hole = hole & mask;
        self.len -= 1;
        let (slots, probes) = self.parts_mut();
        let block = slots[hole].block;
        // Up to the next empty slot, an entry that may sit in the hole (its
        // home is not past the hole) moves into it, leaving a hole there.
        let (mut next, mut gap) = (hole, 0);
        loop {
            next = (next + 1) & mask;
            gap += 1;
            let probe = probes[next];
            if probe == 0 {
                break;
            }
            if probe as usize > gap {
                slots[hole & mask] = slots[next];
                probes[hole & mask] = probe - gap as u8;
                (hole, gap) = (next, 0);
            }
        }
        probes[hole & mask] = 0;
        Some(block)
    }

    /// Every (address, block) pair, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        let recent = self.recent.map(|r| (r.addr, r.block));
        self.in_slots().chain(recent)
    }

    /// The (address, block) pairs of the slots.
    fn in_slots(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.slots
            .iter()
            .zip(&self.probes)
            .filter(|(_, &p)| p != 0)
            .map(|(s, _)| (s.addr, s.block))
    }

    /// Doubles the slots (kept out of the hot path).
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        let capacity = (self.slots.len() * 2).max(FIRST_CAPACITY);
        let old: Vec<Slot> = self
            .in_slots()
            .map(|(addr, block)| Slot { addr, block })
            .collect();
        self.slots = vec![VACANT; capacity];
        self.probes = vec![0; capacity];
        self.shift = 64 - capacity.trailing_zeros();
        self.len = 0;
        for slot in old {
            self.insert_slot(slot.addr, slot.block);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    fn id(n: u32) -> BlockId {
        BlockId::from_index(n as usize)
    }

    #[test]
    fn insert_get_remove() {
        let mut t = LiveTable::default();
        assert_eq!(t.get(0x1000), None);
        t.insert(0x1000, id(1));
        t.insert(0x1200, id(2));
        t.insert(0, id(3));
        t.insert(u64::MAX, id(4));
        assert_eq!(t.get(u64::MAX), Some(id(4)));
        assert_eq!(t.remove(u64::MAX), Some(id(4)));
        assert_eq!(
            (t.get(0x1000), t.get(0x1200), t.get(0)),
            (Some(id(1)), Some(id(2)), Some(id(3)))
        );
        assert_eq!(t.remove(0x1000), Some(id(1)));
        assert_eq!(t.remove(0x1000), None);
        assert_eq!(t.get(0x1200), Some(id(2)));
        assert_eq!(t.len(), 2);
    }

    proptest! {
        /// The table answers as a map under any mix of inserts of addresses
        /// not live and removes, of addresses that collide (all multiples
        /// of 512 in a small range, so runs wrap around and grow).
        #[test]
        fn behaves_as_a_map(ops in prop::collection::vec((any::<bool>(), 0u64..300), 1..2000)) {
            let mut t = LiveTable::default();
            let mut m = HashMap::new();
            for (n, (insert, k)) in ops.into_iter().enumerate() {
                let addr = k * 512;
                if insert && !m.contains_key(&addr) {
                    let b = id(n as u32 + 1);
                    t.insert(addr, b);
                    m.insert(addr, b);
                } else if !insert {
                    prop_assert_eq!(t.remove(addr), m.remove(&addr));
                }
                prop_assert_eq!(t.len(), m.len());
            }
            for (&addr, &b) in &m {
                prop_assert_eq!(t.get(addr), Some(b));
            }
            let mut all: Vec<_> = t.iter().collect();
            all.sort();
            let mut want: Vec<_> = m.into_iter().collect();
            want.sort();
            prop_assert_eq!(all, want);
        }
    }
}
