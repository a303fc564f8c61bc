//! An exact best-fit index of free blocks: per cache key (a stream's blocks,
//! device-wide or in one private pool), a two-level bitmap of
//! size bins (64 sub-bins per power of two, exact 512-byte bins below
//! 32 KiB) whose bins are short unsorted vectors, searched by a scan.
//!
//! It answers the same query as PyTorch's `std::set` ordered by (stream,
//! size, address) — the smallest block of the stream with size >= n, lowest
//! address first — but without per-operation node allocation: the bitmap
//! finds the first non-empty bin, and bins stay small.

use alloc_core::{BlockId, CacheKey};

use crate::per_key::PerKey;

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

const SUB_BITS: u32 = 6;
/// A second-level bitmap: one bit per sub-bin.
type SubMask = u64;
const SUBS: usize = 1 << SUB_BITS;
/// Sizes below this share the first level (bins of 512 bytes).
const LINEAR_LIMIT: u64 = 512 << SUB_BITS;
const LINEAR_SHIFT: u32 = LINEAR_LIMIT.trailing_zeros();
const LEVELS: usize = 64 - LINEAR_SHIFT as usize + 1;
const BINS: usize = LEVELS * SUBS;

/// The bin of a size: first level x [`SUBS`] + sub-bin. Monotonic in size.
#[inline]
fn bin_of(size: u64) -> usize {
    if size < LINEAR_LIMIT {
        (size / 512) as usize
    } else {
        let log = 63 - size.leading_zeros();
        // (log - LINEAR_SHIFT + 1) * SUBS + (the top SUB_BITS + 1 bits - SUBS)
        (log - LINEAR_SHIFT) as usize * SUBS + (size >> (log - SUB_BITS)) as usize
    }
}

/// The order of the index within one cache key, as one comparable number:
/// size, then address.
#[inline(always)]
fn rank_key(e: &Entry) -> u128 {
    (u128::from(e.size) << 64) | u128::from(e.addr)
}

/// Position of the smallest entry (by size, then address) of `entries`
/// with size >= `size`. Bins are short, so a scan costs less than keeping
/// them sorted (a binary search and a `memmove` at every insert and
/// removal); the scan has no data-dependent branch but the running minimum.
#[inline]
fn min_position(entries: &[Entry], size: u64) -> Option<usize> {
    let mut best = u128::MAX;
    let mut at = usize::MAX;
    for (i, e) in entries.iter().enumerate() {
        let key = if e.size >= size {
            rank_key(e)
        } else {
            u128::MAX
        };
        if key < best {
            best = key;
            at = i;
        }
    }
    (at != usize::MAX).then_some(at)
}

/// Size bins of one cache key.
#[derive(Debug, Clone)]
struct Bins {
    /// Bit `fl` set: some bin of first level `fl` is non-empty.
    first: u64,
    /// Bit `sl` of `second[fl]` set: bin `fl * SUBS + sl` is non-empty.
    second: [SubMask; LEVELS],
    /// Entries of each bin, in no particular order.
    bins: Box<[Vec<Entry>]>,
    len: usize,
}

impl Bins {
    fn new() -> Self {
        Bins {
            first: 0,
            second: [0; LEVELS],
            bins: vec![Vec::new(); BINS].into_boxed_slice(),
            len: 0,
        }
    }

    /// First non-empty bin at or after `bin`.
    #[inline]
    fn next_nonempty(&self, bin: usize) -> Option<usize> {
        let (fl, sl) = (bin / SUBS, bin % SUBS);
        if fl >= LEVELS {
            return None;
        }
        let here = self.second[fl] & (SubMask::MAX << sl);
        if here != 0 {
            return Some(fl * SUBS + here.trailing_zeros() as usize);
        }
        // fl + 1 <= LEVELS < 64: the shift cannot overflow.
        let above = self.first & (u64::MAX << (fl + 1));
        if above == 0 {
            return None;
        }
        let fl = above.trailing_zeros() as usize;
        Some(fl * SUBS + self.second[fl].trailing_zeros() as usize)
    }

    #[inline]
    fn insert(&mut self, e: Entry) {
        let bin = bin_of(e.size);
        let entries = &mut self.bins[bin];
        if entries.is_empty() {
            let (fl, sl) = (bin / SUBS, bin % SUBS);
            self.second[fl] |= 1 << sl;
            self.first |= 1 << fl;
        }
        entries.push(e);
        self.len += 1;
    }

    #[inline]
    fn remove(&mut self, size: u64, addr: u64) -> Option<Entry> {
        let bin = bin_of(size);
        // From the end: a block merged away was often indexed lately.
        let at = self.bins[bin]
            .iter()
            .rposition(|x| x.addr == addr && x.size == size)?;
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
        let bin = bin_of(size);
        if let Some(at) = min_position(&self.bins[bin], size) {
            return Some((bin, at));
        }
        let bin = self.next_nonempty(bin + 1)?;
        // Every entry of a later bin is large enough.
        min_position(&self.bins[bin], 0).map(|at| (bin, at))
    }

    /// Removes the entry at a position found by `lower_bound_position`.
    #[inline]
    fn remove_at(&mut self, bin: usize, at: usize) -> Entry {
        let entries = &mut self.bins[bin];
        let e = entries.swap_remove(at);
        if entries.is_empty() {
            let (fl, sl) = (bin / SUBS, bin % SUBS);
            self.second[fl] &= !(1 << sl);
            if self.second[fl] == 0 {
                self.first &= !(1 << fl);
            }
        }
        self.len -= 1;
        e
    }

    /// Every entry in (size, address) order.
    fn sorted(&self) -> Vec<Entry> {
        let mut all = Vec::with_capacity(self.len);
        for entries in self.bins.iter().filter(|b| !b.is_empty()) {
            let from = all.len();
            all.extend_from_slice(entries);
            all[from..].sort_unstable_by_key(rank_key);
        }
        all
    }
}

/// Free blocks of one pool, per cache key, in PyTorch's (stream, size, address)
/// order.
///
/// The block inserted last waits in a one-entry cache, `recent`, until the
/// next insertion moves it into the bins: the two index updates of the
/// commonest patterns (a block freed and taken again by the next request of
/// its size; a split remainder merged back when its neighbour is freed) then
/// never touch the bins. Every query looks at both, so answers are exactly
/// those of one ordered set.
#[derive(Debug, Clone, Default)]
pub struct FreeIndex {
    /// Bins per cache key.
    keys: PerKey<Bins>,
    /// The most recently inserted block, not in `keys`.
    recent: Recent,
}

/// The one-entry cache of [`FreeIndex`], read and written field by field:
/// emptying it writes the id alone, and a copy of the whole slot read right
/// after such a narrow write waits for the store to drain (a
/// store-forwarding stall on every alloc+free pair).
#[derive(Debug, Clone, Copy, Default)]
struct Recent {
    /// The block, `None` when the slot is empty.
    id: Option<BlockId>,
    key: CacheKey,
    size: u64,
    addr: u64,
}

impl Recent {
    #[inline(always)]
    fn get(&self) -> Option<(CacheKey, Entry)> {
        let id = self.id?;
        Some((
            self.key,
            Entry {
                size: self.size,
                addr: self.addr,
                id,
            },
        ))
    }

    #[inline(always)]
    fn set(&mut self, key: CacheKey, size: u64, addr: u64, id: BlockId) {
        self.id = Some(id);
        self.key = key;
        self.size = size;
        self.addr = addr;
    }

    #[inline(always)]
    fn clear(&mut self) {
        self.id = None;
    }

    #[inline(always)]
    fn is_some(&self) -> bool {
        self.id.is_some()
    }
}

/// The order of the index within one cache key.
#[inline(always)]
fn rank(e: &Entry) -> (u64, u64) {
    (e.size, e.addr)
}

impl FreeIndex {
    /// The cached recent block if it belongs to `key` and has at least
    /// `size` bytes.
    #[inline(always)]
    fn recent_fit(&self, key: CacheKey, size: u64) -> Option<Entry> {
        match self.recent.get() {
            Some((s, e)) if s == key && e.size >= size => Some(e),
            _ => None,
        }
    }

    /// Adds a free block.
    #[inline]
    pub fn insert(&mut self, key: CacheKey, size: u64, addr: u64, id: BlockId) {
        if self.recent.is_some() {
            self.keys
                .get_or_insert_with(key, Bins::new)
                .insert(Entry { size, addr, id });
        } else {
            self.recent.set(key, size, addr, id);
        }
    }

    /// Removes the block with this (key, size, address); returns it.
    #[inline]
    pub fn remove(&mut self, key: CacheKey, size: u64, addr: u64) -> Option<Entry> {
        if let Some((s, e)) = self.recent.get() {
            if s == key && rank(&e) == (size, addr) {
                self.recent.clear();
                return Some(e);
            }
        }
        self.keys
            .get_mut(key)
            .and_then(|bins| bins.remove(size, addr))
    }

    /// The smallest block of `key` with size >= `size` (lowest address
    /// among equals).
    #[inline]
    pub fn lower_bound(&self, key: CacheKey, size: u64) -> Option<Entry> {
        let binned = self.keys.get(key).and_then(|b| b.lower_bound(size));
        match (binned, self.recent_fit(key, size)) {
            (Some(b), Some(r)) => Some(if rank(&r) < rank(&b) { r } else { b }),
            (b, r) => b.or(r),
        }
    }

    /// Removes and returns the smallest block of `key` with size >=
    /// `size` if `accept` approves it (one search instead of two).
    #[inline]
    pub fn take_lower_bound(
        &mut self,
        key: CacheKey,
        size: u64,
        accept: impl FnOnce(&Entry) -> bool,
    ) -> Option<Entry> {
        let recent = self.recent_fit(key, size);
        let found = match self.keys.get_mut(key) {
            Some(bins) => bins
                .lower_bound_position(size)
                .map(|(bin, at)| (bins, bin, at)),
            None => None,
        };
        match (found, recent) {
            (Some((bins, bin, at)), r)
                if r.is_none_or(|r| rank(&bins.bins[bin][at]) < rank(&r)) =>
            {
                if !accept(&bins.bins[bin][at]) {
                    return None;
                }
                Some(bins.remove_at(bin, at))
            }
            (_, Some(r)) => {
                if !accept(&r) {
                    return None;
                }
                self.recent.clear();
                Some(r)
            }
            (_, None) => None,
        }
    }

    /// Blocks of `key` with size < `size`, largest first.
    pub fn below_descending(&self, key: CacheKey, size: u64) -> impl Iterator<Item = Entry> + '_ {
        let mut below: Vec<Entry> = self
            .keys
            .get(key)
            .into_iter()
            .flat_map(|b| b.sorted().into_iter().rev())
            .filter(|e| e.size < size)
            .collect();
        if let Some((s, e)) = self.recent.get() {
            if s == key && e.size < size {
                let at = below.partition_point(|x| rank(x) > rank(&e));
                below.insert(at, e);
            }
        }
        below.into_iter()
    }

    /// Every block in (key, size, address) order.
    pub fn iter(&self) -> impl Iterator<Item = (CacheKey, Entry)> + '_ {
        let mut all: Vec<(CacheKey, Entry)> = self
            .keys
            .iter()
            .flat_map(|(key, bins)| bins.sorted().into_iter().map(move |e| (key, e)))
            .collect();
        if let Some((s, e)) = self.recent.get() {
            let at = all.partition_point(|(t, x)| (*t, x.size, x.addr) < (s, e.size, e.addr));
            all.insert(at, (s, e));
        }
        all.into_iter()
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.keys.iter().map(|(_, b)| b.len).sum::<usize>() + usize::from(self.recent.is_some())
    }

    /// True when no block is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc_core::StreamId;

    /// The device-wide cache of stream `s`.
    fn k(s: u64) -> CacheKey {
        CacheKey::shared(StreamId(s))
    }
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn bins_are_monotonic_and_cover_all_sizes() {
        let mut last = 0;
        for size in (512..(64 << 20)).step_by(512 * 7) {
            let b = bin_of(size);
            assert!(b >= last, "{size}");
            assert!(b < BINS);
            last = b;
        }
        assert!(bin_of(1 << 50) < BINS);
        assert!(bin_of(u64::MAX) < BINS);
    }

    #[test]
    fn recent_entry_competes_with_the_bins() {
        let mut index = FreeIndex::default();
        index.insert(k(0), 4096, 0x1000, BlockId::MIN);
        index.insert(k(0), 1024, 0x9000, BlockId::MIN); // recent; 4096 moves to the bins
        index.insert(k(1), 512, 0x5000, BlockId::MIN); // recent, other stream
                                                       // The best fit is in the bins (1024 at 0x9000), not the recent one.
        assert_eq!(index.lower_bound(k(0), 600).map(|e| e.addr), Some(0x9000));
        assert_eq!(index.lower_bound(k(1), 600), None);
        let taken = index.take_lower_bound(k(0), 600, |_| true).map(|e| e.addr);
        assert_eq!(taken, Some(0x9000));
        index.insert(k(0), 4096, 0x0, BlockId::MIN); // recent, same size, lower address
        assert_eq!(index.lower_bound(k(0), 4000).map(|e| e.addr), Some(0x0));
        assert!(index.take_lower_bound(k(0), 4000, |_| false).is_none());
        let all: Vec<_> = index
            .iter()
            .map(|(s, e)| (s.stream.0, e.size, e.addr))
            .collect();
        assert_eq!(
            all,
            vec![(0, 4096, 0x0), (0, 4096, 0x1000), (1, 512, 0x5000)]
        );
        assert_eq!(index.len(), 3);
        assert!(index.remove(k(0), 4096, 0x0).is_some());
        assert!(index.remove(k(0), 4096, 0x0).is_none());
        assert_eq!(
            index.take_lower_bound(k(0), 1, |_| true).map(|e| e.addr),
            Some(0x1000)
        );
        assert_eq!(index.len(), 1);
    }

    /// Runs `ops` (operation, stream, size, address) on the index and on an
    /// ordered set of (stream, size, address), and checks that every answer
    /// is the same.
    fn check_against_ordered_set(
        ops: Vec<(u8, u64, u64, u64)>,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let mut index = FreeIndex::default();
        let mut model: BTreeSet<(u64, u64, u64)> = BTreeSet::new();
        for (op, stream, size, addr) in ops {
            match op {
                0 => {
                    if model.insert((stream, size, addr)) {
                        index.insert(k(stream), size, addr, BlockId::MIN);
                    }
                }
                1 if addr % 2 == 0 => {
                    let removed = index.remove(k(stream), size, addr).is_some();
                    prop_assert_eq!(removed, model.remove(&(stream, size, addr)));
                }
                1 => {
                    let want = model
                        .range((stream, size, 0)..)
                        .next()
                        .filter(|k| k.0 == stream)
                        .copied();
                    let got = index
                        .take_lower_bound(k(stream), size, |_| true)
                        .map(|e| (stream, e.size, e.addr));
                    prop_assert_eq!(got, want);
                    if let Some(k) = want {
                        model.remove(&k);
                    }
                }
                _ => {
                    let want = model
                        .range((stream, size, 0)..)
                        .next()
                        .filter(|k| k.0 == stream)
                        .map(|k| (k.1, k.2));
                    let got = index.lower_bound(k(stream), size).map(|e| (e.size, e.addr));
                    prop_assert_eq!(got, want);
                    let below: Vec<_> = index
                        .below_descending(k(stream), size)
                        .map(|e| (e.size, e.addr))
                        .collect();
                    let want_below: Vec<_> = model
                        .range((stream, 0, 0)..(stream, size, 0))
                        .rev()
                        .map(|k| (k.1, k.2))
                        .collect();
                    prop_assert_eq!(below, want_below);
                }
            }
            prop_assert_eq!(index.len(), model.len());
        }
        let all: Vec<_> = index
            .iter()
            .map(|(s, e)| (s.stream.0, e.size, e.addr))
            .collect();
        prop_assert_eq!(all, model.into_iter().collect::<Vec<_>>());
        Ok(())
    }

    proptest! {
        /// The index answers exactly like an ordered set of (stream, size, addr).
        #[test]
        fn matches_an_ordered_set(ops in proptest::collection::vec((0u8..3, 0u64..3, 1u64..100_000, 0u64..64), 1..400)) {
            let ops = ops
                .into_iter()
                .map(|(op, stream, units, addr)| {
                    (op, stream, units * 512 * if units % 7 == 0 { 4096 } else { 1 }, addr)
                })
                .collect();
            check_against_ordered_set(ops)?;
        }

        /// Many blocks of one bin (sizes 1 MiB .. 1 MiB + 7.5 KiB, all in the
        /// 16 KiB sub-bin of 1 MiB, many of them equal): the best fit within a
        /// bin is the smallest size, then the lowest address, whatever the
        /// insertion order.
        #[test]
        fn matches_an_ordered_set_within_one_bin(ops in proptest::collection::vec((0u8..3, 0u64..2, 0u64..16, 0u64..48), 1..600)) {
            let ops = ops
                .into_iter()
                .map(|(op, stream, units, addr)| (op, stream, (1 << 20) + units * 512, addr))
                .collect();
            check_against_ordered_set(ops)?;
        }
    }
}
