//! An exact best-fit index of free blocks: per stream, a two-level bitmap of
//! size bins (16 sub-bins per power of two, as TLSF) whose bins are vectors
//! sorted by (size, address).
//!
//! It answers the same query as PyTorch's `std::set` ordered by (stream,
//! size, address) — the smallest block of the stream with size >= n, lowest
//! address first — but without per-operation node allocation: the bitmap
//! finds the first non-empty bin, and bins stay small.

use alloc_core::{BlockId, StreamId};

/// A free block as the index stores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Entry {
    /// Block size.
    pub size: u64,
    /// Block address.
    pub addr: u64,
    /// The block.
    pub id: BlockId,
}

const SUB_BITS: u32 = 4;
const SUBS: usize = 1 << SUB_BITS;
/// Sizes below this share the first level (bins of 512 bytes).
const LINEAR_LIMIT: u64 = 512 << SUB_BITS;
const LEVELS: usize = 64 - LINEAR_LIMIT.trailing_zeros() as usize + 1;

/// The bin of a size: (first level, sub-bin). Monotonic in size.
#[inline]
fn bin_of(size: u64) -> (usize, usize) {
    if size < LINEAR_LIMIT {
        (0, (size / 512) as usize)
    } else {
        let log = 63 - size.leading_zeros();
        let fl = (log - LINEAR_LIMIT.trailing_zeros() + 1) as usize;
        let sl = ((size >> (log - SUB_BITS)) as usize) - SUBS;
        (fl, sl)
    }
}

/// Size bins of one stream.
#[derive(Debug, Clone)]
struct Bins {
    first: u64,
    second: [u16; LEVELS],
    bins: Vec<Vec<Entry>>,
    len: usize,
}

impl Bins {
    fn new() -> Self {
        Bins {
            first: 0,
            second: [0; LEVELS],
            bins: vec![Vec::new(); LEVELS * SUBS],
            len: 0,
        }
    }

    /// First non-empty bin at or after (fl, sl).
    #[inline]
    fn next_nonempty(&self, fl: usize, sl: usize) -> Option<usize> {
        let here = self.second[fl] & (u16::MAX << sl);
        if here != 0 {
            return Some(fl * SUBS + here.trailing_zeros() as usize);
        }
        let above = self.first & (u64::MAX.checked_shl(fl as u32 + 1).unwrap_or(0));
        if above == 0 {
            return None;
        }
        let fl = above.trailing_zeros() as usize;
        Some(fl * SUBS + self.second[fl].trailing_zeros() as usize)
    }

    fn insert(&mut self, e: Entry) {
        let (fl, sl) = bin_of(e.size);
        let bin = &mut self.bins[fl * SUBS + sl];
        let at = bin.partition_point(|x| (x.size, x.addr) < (e.size, e.addr));
        bin.insert(at, e);
        self.second[fl] |= 1 << sl;
        self.first |= 1 << fl;
        self.len += 1;
    }

    fn remove(&mut self, size: u64, addr: u64) -> Option<Entry> {
        let (fl, sl) = bin_of(size);
        let bin = fl * SUBS + sl;
        let at = self.bins[bin].partition_point(|x| (x.size, x.addr) < (size, addr));
        if self.bins[bin]
            .get(at)
            .is_none_or(|x| (x.size, x.addr) != (size, addr))
        {
            return None;
        }
        Some(self.remove_at(bin, at))
    }

    /// Smallest (size, address) entry with size >= `size`.
    #[inline]
    fn lower_bound(&self, size: u64) -> Option<Entry> {
        let (bin, at) = self.lower_bound_position(size)?;
        Some(self.bins[bin][at])
    }

    /// Position (bin, index) of the smallest entry with size >= `size`.
    #[inline]
    fn lower_bound_position(&self, size: u64) -> Option<(usize, usize)> {
        let (fl, sl) = bin_of(size);
        let here = fl * SUBS + sl;
        let at = self.bins[here].partition_point(|x| x.size < size);
        if at < self.bins[here].len() {
            return Some((here, at));
        }
        let (fl, sl) = if sl + 1 < SUBS {
            (fl, sl + 1)
        } else {
            (fl + 1, 0)
        };
        if fl >= LEVELS {
            return None;
        }
        self.next_nonempty(fl, sl).map(|b| (b, 0))
    }

    /// Removes the entry at a position found by `lower_bound_position`.
    fn remove_at(&mut self, bin: usize, at: usize) -> Entry {
        let e = self.bins[bin].remove(at);
        if self.bins[bin].is_empty() {
            let (fl, sl) = (bin / SUBS, bin % SUBS);
            self.second[fl] &= !(1 << sl);
            if self.second[fl] == 0 {
                self.first &= !(1 << fl);
            }
        }
        self.len -= 1;
        e
    }

    fn iter(&self) -> impl DoubleEndedIterator<Item = &Entry> + '_ {
        self.bins.iter().flatten()
    }
}

/// Free blocks of one pool, per stream, in PyTorch's (stream, size, address)
/// order.
#[derive(Debug, Clone, Default)]
pub struct FreeIndex {
    /// Sorted by stream.
    streams: Vec<(StreamId, Bins)>,
}

impl FreeIndex {
    #[inline]
    fn bins(&self, stream: StreamId) -> Option<&Bins> {
        self.streams.iter().find(|s| s.0 == stream).map(|s| &s.1)
    }

    #[inline]
    fn bins_mut(&mut self, stream: StreamId) -> &mut Bins {
        let at = match self.streams.iter().position(|s| s.0 == stream) {
            Some(i) => i,
            None => {
                let at = self.streams.partition_point(|s| s.0 < stream);
                self.streams.insert(at, (stream, Bins::new()));
                at
            }
        };
        &mut self.streams[at].1
    }

    /// Adds a free block.
    pub fn insert(&mut self, stream: StreamId, size: u64, addr: u64, id: BlockId) {
        self.bins_mut(stream).insert(Entry { size, addr, id });
    }

    /// Removes the block with this (stream, size, address); returns it.
    pub fn remove(&mut self, stream: StreamId, size: u64, addr: u64) -> Option<Entry> {
        self.streams
            .iter_mut()
            .find(|s| s.0 == stream)
            .and_then(|s| s.1.remove(size, addr))
    }

    /// The smallest block of `stream` with size >= `size` (lowest address
    /// among equals).
    #[inline]
    pub fn lower_bound(&self, stream: StreamId, size: u64) -> Option<Entry> {
        self.bins(stream)?.lower_bound(size)
    }

    /// Removes and returns the smallest block of `stream` with size >=
    /// `size` if `accept` approves it (one search instead of two).
    #[inline]
    pub fn take_lower_bound(
        &mut self,
        stream: StreamId,
        size: u64,
        accept: impl FnOnce(&Entry) -> bool,
    ) -> Option<Entry> {
        let bins = &mut self.streams.iter_mut().find(|s| s.0 == stream)?.1;
        let (bin, at) = bins.lower_bound_position(size)?;
        if !accept(&bins.bins[bin][at]) {
            return None;
        }
        Some(bins.remove_at(bin, at))
    }

    /// Blocks of `stream` with size < `size`, largest first.
    pub fn below_descending(
        &self,
        stream: StreamId,
        size: u64,
    ) -> impl Iterator<Item = Entry> + '_ {
        self.bins(stream)
            .into_iter()
            .flat_map(|b| b.iter().rev())
            .filter(move |e| e.size < size)
            .copied()
    }

    /// Every block in (stream, size, address) order.
    pub fn iter(&self) -> impl Iterator<Item = (StreamId, Entry)> + '_ {
        self.streams
            .iter()
            .flat_map(|(stream, bins)| bins.iter().map(move |e| (*stream, *e)))
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.streams.iter().map(|s| s.1.len).sum()
    }

    /// True when no block is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn bins_are_monotonic_and_cover_all_sizes() {
        let mut last = (0, 0);
        for size in (512..(64 << 20)).step_by(512 * 7) {
            let b = bin_of(size);
            assert!(b >= last, "{size}");
            assert!(b.0 < LEVELS && b.1 < SUBS);
            last = b;
        }
        assert!(bin_of(1 << 50).0 < LEVELS);
        assert!(bin_of(u64::MAX).0 < LEVELS);
    }

    proptest! {
        /// The index answers exactly like an ordered set of (stream, size, addr).
        #[test]
        fn matches_an_ordered_set(ops in proptest::collection::vec((0u8..3, 0u64..3, 1u64..100_000, 0u64..64), 1..400)) {
            let mut index = FreeIndex::default();
            let mut model: BTreeSet<(u64, u64, u64)> = BTreeSet::new();
            for (op, stream, size_units, addr) in ops {
                let size = size_units * 512 * if size_units % 7 == 0 { 4096 } else { 1 };
                match op {
                    0 => {
                        if model.insert((stream, size, addr)) {
                            index.insert(stream, size, addr, BlockId::MIN);
                        }
                    }
                    1 if addr % 2 == 0 => {
                        let removed = index.remove(stream, size, addr).is_some();
                        prop_assert_eq!(removed, model.remove(&(stream, size, addr)));
                    }
                    1 => {
                        let want = model.range((stream, size, 0)..).next().filter(|k| k.0 == stream).copied();
                        let got = index.take_lower_bound(stream, size, |_| true).map(|e| (stream, e.size, e.addr));
                        prop_assert_eq!(got, want);
                        if let Some(k) = want {
                            model.remove(&k);
                        }
                    }
                    _ => {
                        let want = model.range((stream, size, 0)..).next().filter(|k| k.0 == stream).map(|k| (k.1, k.2));
                        let got = index.lower_bound(stream, size).map(|e| (e.size, e.addr));
                        prop_assert_eq!(got, want);
                        let below: Vec<_> = index.below_descending(stream, size).map(|e| (e.size, e.addr)).collect();
                        let want_below: Vec<_> = model.range((stream, 0, 0)..(stream, size, 0)).rev().map(|k| (k.1, k.2)).collect();
                        prop_assert_eq!(below, want_below);
                    }
                }
                prop_assert_eq!(index.len(), model.len());
            }
            let all: Vec<_> = index.iter().map(|(s, e)| (s, e.size, e.addr)).collect();
            prop_assert_eq!(all, model.into_iter().collect::<Vec<_>>());
        }
    }
}
