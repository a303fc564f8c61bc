//! Private memory pools, as PyTorch keeps them for CUDA graphs and
//! `torch.cuda.MemPool`: while allocations are routed to a pool, its blocks
//! come only from its own segments, and those segments stay reserved while
//! the pool is in use (a captured graph replays into them).
//!
//! The engine and the policies key cached blocks by stream. A pool's blocks
//! get a stream key of their own per (pool, stream), so every policy keeps
//! them apart without knowing about pools. Keys have the top bit set; real
//! stream handles (host pointers, or 0 for the default stream) never do.

use rustc_hash::FxHashMap;

use crate::types::StreamId;

/// Identifies a private pool: PyTorch's `MempoolId_t` pair.
pub type PoolId = (u64, u64);

/// Set in every private-pool stream key.
const KEY_BIT: u64 = 1 << 63;

/// Whether `stream` can be a caller's stream: real stream handles (host
/// addresses, or 0) never have the top bit, which private-pool keys use.
#[inline]
pub(crate) fn is_caller_stream(stream: StreamId) -> bool {
    stream & KEY_BIT == 0
}

#[derive(Debug, Default)]
struct PoolState {
    /// Holders of the pool (graphs, `MemPool` objects); released at zero.
    use_count: u32,
    /// Open `begin_allocate_to_pool` calls.
    routing: u32,
    /// Blocks are handed out whole, never split (`MemPool(no_split=True)`).
    no_split: bool,
}

/// Bookkeeping of every private pool of one engine.
#[derive(Debug, Default)]
pub(crate) struct PrivatePools {
    pools: FxHashMap<PoolId, PoolState>,
    /// Stream key of (pool, real stream).
    keys: FxHashMap<(PoolId, StreamId), StreamId>,
    /// (pool, real stream) of every stream key.
    owners: FxHashMap<StreamId, (PoolId, StreamId)>,
    /// Open routings over all pools: while any is open the engine behaves
    /// as during a CUDA graph capture (no event queries, nothing returned to
    /// the device).
    routing: u32,
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
    /// releasable like any other.
    pub(crate) fn release(&mut self, pool: PoolId) -> bool {
        let Some(state) = self.pools.get_mut(&pool) else {
            return false;
        };
        state.use_count = state.use_count.saturating_sub(1);
        if state.use_count == 0 && state.routing == 0 {
            self.pools.remove(&pool);
        }
        true
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

    /// The stream key for allocations of `pool` on `stream`.
    pub(crate) fn key(&mut self, pool: PoolId, stream: StreamId) -> StreamId {
        let next = KEY_BIT | self.owners.len() as u64;
        let key = *self.keys.entry((pool, stream)).or_insert(next);
        self.owners.entry(key).or_insert((pool, stream));
        key
    }

    /// The real stream behind a stream key (itself for real streams).
    #[inline]
    pub(crate) fn real_stream(&self, key: StreamId) -> StreamId {
        if key & KEY_BIT == 0 {
            key
        } else {
            self.owners[&key].1
        }
    }

    /// The pool behind a stream key, if it is one.
    pub(crate) fn pool_of(&self, key: StreamId) -> Option<PoolId> {
        if key & KEY_BIT == 0 {
            None
        } else {
            self.owners.get(&key).map(|o| o.0)
        }
    }

    /// Whether a segment keyed by `key` may go back to the device: always
    /// for ordinary streams, for a pool's only once nobody holds the pool.
    #[inline]
    pub(crate) fn releasable(&self, key: StreamId) -> bool {
        key & KEY_BIT == 0
            || !self
                .pool_of(key)
                .is_some_and(|p| self.pools.contains_key(&p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_distinct_per_pool_and_stream_and_map_back() {
        let mut p = PrivatePools::default();
        let a = p.key((1, 0), 7);
        let b = p.key((1, 0), 8);
        let c = p.key((2, 0), 7);
        assert_eq!(a, p.key((1, 0), 7));
        assert!(a != b && a != c && b != c);
        assert_eq!(p.real_stream(a), 7);
        assert_eq!(p.real_stream(c), 7);
        assert_eq!(p.real_stream(7), 7);
        assert_eq!(p.pool_of(b), Some((1, 0)));
        assert_eq!(p.pool_of(8), None);
    }

    #[test]
    fn pool_segments_are_kept_while_held() {
        let mut p = PrivatePools::default();
        let key = p.key((3, 1), 0);
        p.begin((3, 1));
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
        assert!(p.releasable(5));
    }
}
