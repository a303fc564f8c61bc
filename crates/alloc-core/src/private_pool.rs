//! Private memory pools, as PyTorch keeps them for CUDA graphs and
//! `torch.cuda.MemPool`: while allocations are routed to a pool, its blocks
//! come only from its own segments, and those segments stay reserved while
//! the pool is in use (a captured graph replays into them).
//!
//! Blocks and segments carry their pool beside their stream
//! ([`CacheKey::private_pool`]), as a small [`PrivatePool`] number the
//! engine gives each [`PoolId`] it meets, so every policy keeps a pool's
//! blocks apart (it indexes free blocks by [`CacheKey`]) without knowing
//! about pools, and no stream value can stand for a pool.
//!
//! A pool exists from its first holder (`Engine::retain_pool`,
//! `Engine::begin_allocate_to_pool`, a sleep tag) until its last one lets
//! go, and allocations may name it only while it exists (an unknown pool
//! is [`crate::AllocError::UnknownPool`]). Its number lives on while segments
//! carry it, and is forgotten, and handed to the next new pool, once the
//! last of them goes back: the bookkeeping is bounded by the pools in use,
//! not by every id ever seen.

use std::fmt;

use rustc_hash::FxHashMap;

use crate::backend::SegmentSource;
use crate::error::AllocError;
use crate::heap::Heap;
use crate::types::{CacheKey, PrivatePool, SegmentId};

/// Identifies a private pool: PyTorch's `MempoolId_t` pair.
pub use crate::types::PoolId;

#[derive(Debug, Default)]
struct PoolState {
    /// Holders of the pool (graphs, `MemPool` objects); released at zero.
    use_count: u32,
    /// Open `begin_allocate_to_pool` calls.
    routing: u32,
    /// Blocks are handed out whole, never split (`MemPool(no_split=True)`).
    no_split: bool,
    /// Holds taken for a sleep tag (its own, and those its pool had when
    /// the tag was bound to it); 0 for an untagged pool. While nobody else
    /// holds the pool (no graph captured into it), its memory follows the
    /// rules of ordinary cache.
    tag_holds: u32,
    /// The pool's tag is paused: its physical memory is given back, so
    /// nothing of it may be mapped, released or handed out.
    paused: bool,
}

/// A number in use: its pool and the segments that carry the number.
#[derive(Debug, Clone, Copy)]
struct Numbered {
    pool: PoolId,
    segments: u32,
}

/// The segment sources of pools that take their segments from an
/// allocator of their own (`MemPool(allocator)`).
#[derive(Default)]
struct Sources(FxHashMap<PoolId, Box<dyn SegmentSource>>);

impl fmt::Debug for Sources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

/// How an allocation that names a pool is served: what a malloc asks the
/// private pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Route {
    /// The number its blocks and segments carry.
    pub(crate) number: PrivatePool,
    /// Whether the pool hands out whole blocks, never split.
    pub(crate) whole: bool,
}

/// Bookkeeping of every private pool of one engine.
#[derive(Debug, Default)]
pub(crate) struct PrivatePools {
    pools: FxHashMap<PoolId, PoolState>,
    /// The number of every pool that is held or still has segments (kept
    /// after its release while its segments keep it).
    numbers: FxHashMap<PoolId, PrivatePool>,
    /// The pool of each number, by [`PrivatePool::index`]; a spare number's
    /// entry is stale until it is handed out again.
    ids: Vec<Numbered>,
    /// Numbers forgotten, for the next new pools.
    spare: Vec<PrivatePool>,
    /// Open routings over all pools: while any is open the engine behaves
    /// as during a CUDA graph capture (no event queries, nothing returned to
    /// the device).
    routing: u32,
    /// Pools whose segments come from a source of their own; kept after
    /// the pool is released, until its last segment went back.
    sources: Sources,
}

impl PrivatePools {
    /// Whether any allocation routing (a capture) is open.
    #[inline]
    pub(crate) fn capture_underway(&self) -> bool {
        self.routing > 0
    }

    /// Opens a routing to `pool` and counts it as one more holder (as
    /// PyTorch does: every capture into a pool holds it until its graph is
    /// reset), creating the pool on first use.
    pub(crate) fn begin(&mut self, pool: PoolId) {
        let state = self.pools.entry(pool).or_default();
        state.use_count += 1;
        state.routing += 1;
        self.routing += 1;
    }

    /// Closes a routing to `pool`; false if none was open.
    pub(crate) fn end(&mut self, pool: PoolId) -> bool {
        match self.pools.get_mut(&pool) {
            Some(state) if state.routing > 0 => {
                state.routing -= 1;
                self.routing -= 1;
                true
            }
            _ => false,
        }
    }

    /// One more holder of `pool` (a second graph sharing it).
    pub(crate) fn retain(&mut self, pool: PoolId) {
        self.pools.entry(pool).or_default().use_count += 1;
    }

    /// One holder fewer; returns whether `pool` existed. At zero holders and
    /// no open routing the pool is forgotten, so its idle segments become
    /// releasable like any other (and its number goes with the last of them).
    pub(crate) fn release(&mut self, pool: PoolId) -> bool {
        let Some(state) = self.pools.get_mut(&pool) else {
            return false;
        };
        state.use_count = state.use_count.saturating_sub(1);
        if state.use_count == 0 && state.routing == 0 {
            self.pools.remove(&pool);
            self.forget_if_unused(pool);
        }
        true
    }

    /// Whether `pool` exists: held, or with a routing open.
    #[inline]
    pub(crate) fn is_known(&self, pool: PoolId) -> bool {
        self.pools.contains_key(&pool)
    }

    /// Fails with [`AllocError::UnknownPool`] unless `pool` exists.
    pub(crate) fn check_known(&self, pool: PoolId) -> Result<(), AllocError> {
        if self.is_known(pool) {
            Ok(())
        } else {
            Err(AllocError::UnknownPool { pool })
        }
    }

    /// Holders of `pool` (0 if unknown).
    pub(crate) fn use_count(&self, pool: PoolId) -> u32 {
        self.pools.get(&pool).map_or(0, |s| s.use_count)
    }

    /// Makes `pool` hand out whole blocks; false if the pool is unknown.
    pub(crate) fn set_no_split(&mut self, pool: PoolId) -> bool {
        self.pools
            .get_mut(&pool)
            .map(|s| s.no_split = true)
            .is_some()
    }

    /// Whether `pool` hands out whole blocks.
    #[inline]
    pub(crate) fn no_split(&self, pool: PoolId) -> bool {
        self.pools.get(&pool).is_some_and(|s| s.no_split)
    }

    /// The number blocks and segments of `pool` carry, given on first use
    /// (a spare one if any); [`AllocError::UnknownPool`] unless the pool
    /// exists.
    pub(crate) fn number(&mut self, pool: PoolId) -> Result<PrivatePool, AllocError> {
        self.check_known(pool)?;
        if let Some(&number) = self.numbers.get(&pool) {
            return Ok(number);
        }
        let number = match self.spare.pop() {
            Some(n) => {
                self.ids[n.index()] = Numbered { pool, segments: 0 };
                n
            }
            None => {
                self.ids.push(Numbered { pool, segments: 0 });
                PrivatePool::from_index(self.ids.len() - 1)
            }
        };
        self.numbers.insert(pool, number);
        Ok(number)
    }

    /// How an allocation from `pool` is served: its number (given on first
    /// use) and whether it hands out whole blocks;
    /// [`AllocError::UnknownPool`] unless the pool exists.
    #[inline]
    pub(crate) fn route(&mut self, pool: PoolId) -> Result<Route, AllocError> {
        let number = self.number(pool)?;
        Ok(Route {
            number,
            whole: self.no_split(pool),
        })
    }

    /// A segment of the cache `key` was made.
    pub(crate) fn segment_added(&mut self, key: CacheKey) {
        if let Some(n) = key.private_pool {
            self.ids[n.index()].segments += 1;
        }
    }

    /// A segment of the cache `key` went back: the last one of a released
    /// pool takes its number with it.
    pub(crate) fn segment_removed(&mut self, key: CacheKey) {
        if let Some(n) = key.private_pool {
            let entry = &mut self.ids[n.index()];
            entry.segments = entry.segments.saturating_sub(1);
            let pool = entry.pool;
            self.forget_if_unused(pool);
        }
    }

    /// Forgets the number of `pool` when nothing holds the pool and no
    /// segment carries the number.
    fn forget_if_unused(&mut self, pool: PoolId) {
        if self.pools.contains_key(&pool) {
            return;
        }
        let Some(&n) = self.numbers.get(&pool) else {
            return;
        };
        if self.ids[n.index()].segments == 0 {
            self.numbers.remove(&pool);
            self.spare.push(n);
        }
    }

    /// Pools with a number (held, or released with segments left): what
    /// the bookkeeping keeps.
    #[cfg(test)]
    pub(crate) fn numbered(&self) -> usize {
        self.numbers.len()
    }

    /// Entries of every table, spare numbers included: bounded by the most
    /// pools numbered at once.
    pub(crate) fn table_len(&self) -> usize {
        self.pools.len() + self.numbers.len() + self.ids.len()
    }

    /// Checks the bookkeeping against the cache keys of every segment: each
    /// number's segment count, and that every number in use is held or
    /// carried by a segment (else it should have been forgotten).
    pub(crate) fn check(&self, segments: impl Iterator<Item = CacheKey>) -> Result<(), String> {
        let mut counts: FxHashMap<PrivatePool, u32> = FxHashMap::default();
        for n in segments.filter_map(|k| k.private_pool) {
            *counts.entry(n).or_default() += 1;
        }
        for (&pool, &n) in &self.numbers {
            let entry = self.ids[n.index()];
            let carried = counts.remove(&n).unwrap_or(0);
            if entry.pool != pool || entry.segments != carried {
                return Err(format!(
                    "private pool {pool:?}: number {} counts {} segments for {:?}, {carried} carry it",
                    n.index(),
                    entry.segments,
                    entry.pool
                ));
            }
            if carried == 0 && !self.pools.contains_key(&pool) {
                return Err(format!(
                    "private pool {pool:?}: released and unused, not forgotten"
                ));
            }
        }
        match counts.into_keys().next() {
            Some(n) => Err(format!(
                "segments carry the forgotten pool number {}",
                n.index()
            )),
            None => Ok(()),
        }
    }

    /// The pool behind a cache key, if it names one.
    #[inline]
    pub(crate) fn pool_of(&self, key: CacheKey) -> Option<PoolId> {
        key.private_pool.map(|p| self.ids[p.index()].pool)
    }

    /// The segments of `pool` in `heap`, in address order.
    pub(crate) fn segments(&self, heap: &Heap, pool: PoolId) -> Vec<SegmentId> {
        heap.segments()
            .filter(|(_, s)| self.pool_of(s.key()) == Some(pool))
            .map(|(id, _)| id)
            .collect()
    }

    /// The idle segments of `pool` in `heap`, in address order.
    pub(crate) fn idle_segments(&self, heap: &Heap, pool: PoolId) -> Vec<SegmentId> {
        heap.segments()
            .filter(|(_, s)| s.is_idle() && self.pool_of(s.key()) == Some(pool))
            .map(|(id, _)| id)
            .collect()
    }

    /// Makes the held `pool`, which has no segment in `heap` yet, take its
    /// segments from `source` and give them back to it.
    pub(crate) fn set_source(
        &mut self,
        heap: &Heap,
        pool: PoolId,
        source: Box<dyn SegmentSource>,
    ) -> Result<(), AllocError> {
        if self.use_count(pool) == 0 {
            return Err(AllocError::UnknownPool { pool });
        }
        if !self.segments(heap, pool).is_empty() || self.is_sourced(pool) || self.is_tagged(pool) {
            return Err(AllocError::InvalidArgument(format!(
                "private pool {pool:?} already has segments, a source of its own, or a sleep tag"
            )));
        }
        self.sources.0.insert(pool, source);
        Ok(())
    }

    /// Whether `pool` takes its segments from a source of its own.
    pub(crate) fn is_sourced(&self, pool: PoolId) -> bool {
        self.sources.0.contains_key(&pool)
    }

    /// The source the segments of the cache `key` come from, if its pool
    /// has one.
    pub(crate) fn source(&mut self, key: CacheKey) -> Option<&mut dyn SegmentSource> {
        if self.sources.0.is_empty() {
            return None;
        }
        let pool = self.pool_of(key)?;
        Some(self.sources.0.get_mut(&pool)?.as_mut())
    }

    /// Drops the source of every released pool whose last segment in
    /// `heap` went back.
    pub(crate) fn drop_spent_sources(&mut self, heap: &Heap) {
        if self.sources.0.is_empty() {
            return;
        }
        let spent: Vec<PoolId> = self
            .sources
            .0
            .keys()
            .copied()
            .filter(|&p| self.use_count(p) == 0 && self.segments(heap, p).is_empty())
            .collect();
        for p in spent {
            self.sources.0.remove(&p);
        }
    }

    /// Whether a segment of the cache `key` may go back to the device:
    /// always for the device-wide cache; for a pool's once nobody holds the
    /// pool, or for a tagged pool (not paused, no routing open) once nobody
    /// but its tag does.
    #[inline]
    pub(crate) fn releasable(&self, key: CacheKey) -> bool {
        match self.pool_of(key).and_then(|p| self.pools.get(&p)) {
            None => true,
            Some(s) => s.tag_holds > 0 && !s.paused && s.routing == 0 && s.use_count <= s.tag_holds,
        }
    }

    /// Makes `pool` a sleep tag's pool: holds it once more for the tag and
    /// counts every hold it has now as the tag's. Creates the pool if new.
    pub(crate) fn tag(&mut self, pool: PoolId) {
        let state = self.pools.entry(pool).or_default();
        state.use_count += 1;
        state.tag_holds = state.use_count;
    }

    /// Whether `pool` is a sleep tag's pool.
    #[inline]
    pub(crate) fn is_tagged(&self, pool: PoolId) -> bool {
        self.pools.get(&pool).is_some_and(|s| s.tag_holds > 0)
    }

    /// Whether the cache `key` is a sleep tag's pool.
    pub(crate) fn is_tagged_key(&self, key: CacheKey) -> bool {
        self.pool_of(key).is_some_and(|p| self.is_tagged(p))
    }

    /// Marks `pool` paused or resumed.
    pub(crate) fn set_paused(&mut self, pool: PoolId, paused: bool) {
        if let Some(s) = self.pools.get_mut(&pool) {
            s.paused = paused;
        }
    }

    /// Whether `pool` is paused.
    #[inline]
    pub(crate) fn is_paused(&self, pool: PoolId) -> bool {
        self.pools.get(&pool).is_some_and(|s| s.paused)
    }

    /// Whether the cache `key` is a paused pool's.
    pub(crate) fn is_paused_key(&self, key: CacheKey) -> bool {
        self.pool_of(key).is_some_and(|p| self.is_paused(p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::StreamId;

    #[test]
    fn numbers_are_distinct_per_pool_and_map_back() {
        let mut p = PrivatePools::default();
        p.retain((1, 0));
        p.retain((2, 0));
        let a = p.number((1, 0)).unwrap();
        let b = p.number((2, 0)).unwrap();
        assert_eq!(a, p.number((1, 0)).unwrap());
        assert_ne!(a, b);
        let key = |stream, private_pool| CacheKey {
            stream: StreamId(stream),
            private_pool,
        };
        assert_eq!(p.pool_of(key(7, Some(a))), Some((1, 0)));
        assert_eq!(p.pool_of(key(7, Some(b))), Some((2, 0)));
        assert_eq!(p.pool_of(key(7, None)), None);
        // Any stream value, the top bit included, is a stream.
        assert_eq!(p.pool_of(key(1 << 63, None)), None);
    }

    #[test]
    fn pool_segments_are_kept_while_held() {
        let mut p = PrivatePools::default();
        p.begin((3, 1));
        let key = CacheKey {
            stream: StreamId(0),
            private_pool: Some(p.number((3, 1)).unwrap()),
        };
        assert!(p.capture_underway());
        assert!(!p.releasable(key));
        assert!(p.end((3, 1)));
        assert!(!p.end((3, 1)), "no routing left to close");
        assert!(!p.capture_underway());
        assert_eq!(p.use_count((3, 1)), 1);
        p.retain((3, 1));
        assert_eq!(p.use_count((3, 1)), 2);
        assert!(p.release((3, 1)));
        assert!(!p.releasable(key), "one holder left");
        assert!(p.release((3, 1)));
        assert!(p.releasable(key));
        assert!(!p.release((3, 1)), "forgotten");
        assert!(p.releasable(CacheKey::shared(StreamId(5))));
    }

    #[test]
    fn a_tagged_pool_is_ordinary_cache_unless_held_by_others_or_paused() {
        let mut p = PrivatePools::default();
        let pool = (0, 9);
        p.retain(pool); // a MemPool object holds it
        let key = CacheKey {
            stream: StreamId(0),
            private_pool: Some(p.number(pool).unwrap()),
        };
        p.tag(pool); // bound to a tag: the tag's hold and the MemPool's
        assert!(p.is_tagged(pool) && p.is_tagged_key(key));
        assert_eq!(p.use_count(pool), 2);
        assert!(p.releasable(key), "only the tag holds it");
        p.begin(pool); // a region (use_mem_pool) or a capture
        assert!(!p.releasable(key), "a routing is open");
        assert!(p.end(pool));
        assert!(!p.releasable(key), "the capture's graph holds it");
        assert!(p.release(pool)); // the graph is reset
        assert!(p.releasable(key));
        p.set_paused(pool, true);
        assert!(p.is_paused(pool) && p.is_paused_key(key));
        assert!(!p.releasable(key), "paused memory is never released");
        p.set_paused(pool, false);
        assert!(p.releasable(key));
        assert!(p.release(pool) && p.release(pool));
        assert_eq!(p.use_count(pool), 0);
        assert!(!p.is_tagged(pool), "forgotten with its last holder");
    }

    #[test]
    fn unknown_pools_get_no_number() {
        let mut p = PrivatePools::default();
        assert_eq!(
            p.number((4, 2)),
            Err(AllocError::UnknownPool { pool: (4, 2) })
        );
        p.retain((4, 2));
        assert!(p.number((4, 2)).is_ok());
        assert!(p.release((4, 2)));
        assert!(p.number((4, 2)).is_err(), "released");
        assert_eq!(p.numbered(), 0);
    }

    #[test]
    fn a_number_lives_while_segments_carry_it_then_serves_a_new_pool() {
        let mut p = PrivatePools::default();
        p.retain((1, 1));
        let n = p.number((1, 1)).unwrap();
        let key = CacheKey {
            stream: StreamId(0),
            private_pool: Some(n),
        };
        p.segment_added(key);
        p.segment_added(key);
        assert!(p.release((1, 1)));
        assert_eq!(p.pool_of(key), Some((1, 1)), "its segments keep it");
        assert_eq!(p.numbered(), 1);
        p.segment_removed(key);
        assert_eq!(p.numbered(), 1, "one segment left");
        assert!(p.check([key].into_iter()).is_ok());
        assert!(p.check(std::iter::empty()).is_err(), "a segment uncounted");
        p.segment_removed(key);
        assert_eq!(p.numbered(), 0, "forgotten with its last segment");
        p.retain((2, 2));
        assert_eq!(p.number((2, 2)).unwrap(), n, "the spare number is reused");
        assert_eq!(p.pool_of(key), Some((2, 2)));
    }

    #[test]
    fn many_pools_made_used_and_released_keep_the_tables_bounded() {
        let mut p = PrivatePools::default();
        for i in 0..200_000u64 {
            let pool = (i + 1, i);
            p.retain(pool);
            p.begin(pool);
            let key = CacheKey {
                stream: StreamId(i),
                private_pool: Some(p.number(pool).unwrap()),
            };
            p.segment_added(key);
            assert!(p.end(pool));
            assert!(p.release(pool));
            assert!(p.release(pool));
            p.segment_removed(key);
            assert!(
                p.table_len() <= 2,
                "{} entries after pool {i}",
                p.table_len()
            );
        }
        assert_eq!(p.numbered(), 0);
    }

    /// A source that hands out consecutive addresses.
    struct Counter(u64);

    impl SegmentSource for Counter {
        fn allocate(&mut self, size: u64) -> Result<u64, crate::BackendError> {
            self.0 += size;
            Ok(self.0 - size)
        }

        fn free(&mut self, _addr: u64, _size: u64) -> Result<(), crate::BackendError> {
            Ok(())
        }
    }

    #[test]
    fn a_pool_source_serves_its_keys_and_goes_with_the_pools_last_segment() {
        use crate::types::Pool;
        let mut p = PrivatePools::default();
        let mut heap = Heap::new(u64::MAX);
        let pool = (3, 3);
        assert!(
            p.set_source(&heap, pool, Box::new(Counter(0))).is_err(),
            "not held"
        );
        p.retain(pool);
        p.set_source(&heap, pool, Box::new(Counter(0x1000)))
            .unwrap();
        assert!(p.is_sourced(pool));
        assert!(
            p.set_source(&heap, pool, Box::new(Counter(0))).is_err(),
            "has one"
        );
        let key = CacheKey {
            stream: StreamId(0),
            private_pool: Some(p.number(pool).unwrap()),
        };
        assert!(
            p.source(CacheKey::default()).is_none(),
            "the device's cache"
        );
        let addr = p.source(key).expect("sourced").allocate(64).unwrap();
        assert_eq!(addr, 0x1000);
        let (seg, _) = heap.add_segment(addr, 64, Pool::Small, key);
        p.segment_added(key);
        assert_eq!(p.idle_segments(&heap, pool), vec![seg]);
        assert!(p.release(pool));
        p.drop_spent_sources(&heap);
        assert!(p.is_sourced(pool), "a segment is left");
        heap.remove_segment(seg);
        p.segment_removed(key);
        p.drop_spent_sources(&heap);
        assert!(!p.is_sourced(pool));
    }

    #[test]
    fn a_route_names_the_pools_number_and_whether_it_splits() {
        let mut p = PrivatePools::default();
        assert_eq!(
            p.route((1, 2)),
            Err(AllocError::UnknownPool { pool: (1, 2) })
        );
        p.retain((1, 2));
        let route = p.route((1, 2)).unwrap();
        assert_eq!(route.number, p.number((1, 2)).unwrap());
        assert!(!route.whole);
        assert!(p.set_no_split((1, 2)));
        assert!(p.route((1, 2)).unwrap().whole);
    }
}
