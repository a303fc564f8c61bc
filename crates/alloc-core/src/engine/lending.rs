//! Lending idle free blocks across streams (`lend_idle_blocks`).
//!
//! Under a level (the reserved peak, a memory budget, a budget over the
//! allocated peak) a stream whose growth would pass it gets pages moved to
//! its growable segment from the free pages of the others: an unmap and a
//! map per page. Where streams take turns at their peaks (FSDP's
//! all-gather stream and its compute stream) the same pages go back and
//! forth every step. A free block of another stream's segment that the GPU
//! is known to be done with (every page under it freed before a mark that
//! has completed) can serve the request where it lies, with no driver call
//! and no wait: the allocating stream's work cannot meet the lender's. The
//! block is then used by a stream other than its segment's, as after
//! `record_stream`: its free records an event on the borrowing stream, and
//! the block goes back to its own stream's cache once that event has
//! completed.
//!
//! This part chooses the block; the engine carves it and records the use.

use super::growable::{Growable, SegmentKey};
use crate::heap::{Block, BlockState, Heap};
use crate::policy::Request;
use crate::types::{BlockId, Pool};

/// Whether free blocks of other streams' growable segments serve large
/// requests whose growth would pass the level.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Lending {
    on: bool,
}

impl Lending {
    /// Lending on or off (`lend_idle_blocks`).
    pub(super) fn new(on: bool) -> Self {
        Lending { on }
    }

    /// Whether `req` may borrow: lending is on and `req` is a large
    /// request outside private pools (small blocks would cost an event at
    /// every free for little memory).
    pub(super) fn may_borrow(&self, req: &Request) -> bool {
        self.on && req.pool == Pool::Large && req.key.private_pool.is_none()
    }

    /// Whether the growable segment `key` may lend to `req`: another
    /// stream's, in `req`'s pool, outside private pools.
    pub(super) fn may_lend(key: &SegmentKey, req: &Request) -> bool {
        let (cache, pool) = key;
        *pool == req.pool && cache.private_pool.is_none() && cache.stream != req.key.stream
    }

    /// The free block of `g`'s segment that would serve `req`: the smallest
    /// (lowest address among equals) of at least `req.size` bytes whose
    /// first `req.size` bytes lie over mapped pages the GPU is done with.
    pub(super) fn best_in<E>(heap: &Heap, g: &Growable<E>, req: &Request) -> Option<BlockId> {
        fitting(heap, g, req)
            .filter(|(_, b)| Self::lendable(g, b.addr, req.size))
            .min_by_key(|(_, b)| (b.size, b.addr))
            .map(|(id, _)| id)
    }

    /// Whether a free block of `g`'s segment of at least `req.size` bytes
    /// lies over mapped pages, idle or not.
    pub(super) fn any_fits<E>(heap: &Heap, g: &Growable<E>, req: &Request) -> bool {
        fitting(heap, g, req).any(|(_, b)| g.is_mapped(b.addr, req.size))
    }

    /// Whether every page of `g` under `[addr, addr + size)` is mapped and
    /// known idle.
    pub(super) fn lendable<E>(g: &Growable<E>, addr: u64, size: u64) -> bool {
        g.is_mapped(addr, size) && g.idle.is_idle_range(addr, addr + size)
    }
}

/// The free blocks of `g`'s segment of at least `req.size` bytes, in
/// address order.
fn fitting<'a, E>(
    heap: &'a Heap,
    g: &Growable<E>,
    req: &'a Request,
) -> impl Iterator<Item = (BlockId, &'a Block)> + 'a {
    let first = Some(heap.segment(g.segment).first);
    std::iter::successors(first, |&id| heap.block(id).next)
        .map(|id| (id, heap.block(id)))
        .filter(|(_, b)| b.state == BlockState::Free && b.size >= req.size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{CacheKey, PrivatePool, StreamId};

    fn request(stream: u64, pool: Pool, private_pool: Option<usize>) -> Request {
        Request {
            requested: 1 << 20,
            size: 1 << 20,
            pool,
            key: CacheKey {
                stream: StreamId(stream),
                private_pool: private_pool.map(PrivatePool::from_index),
            },
        }
    }

    #[test]
    fn only_large_requests_of_the_default_pool_borrow_and_only_when_on() {
        let on = Lending::new(true);
        assert!(on.may_borrow(&request(1, Pool::Large, None)));
        assert!(!on.may_borrow(&request(1, Pool::Small, None)));
        assert!(!on.may_borrow(&request(1, Pool::Large, Some(3))));
        assert!(!Lending::new(false).may_borrow(&request(1, Pool::Large, None)));
    }

    #[test]
    fn only_other_streams_segments_of_the_same_pool_lend() {
        let req = request(1, Pool::Large, None);
        let key = |stream, pool, private: Option<usize>| {
            let cache = CacheKey {
                stream: StreamId(stream),
                private_pool: private.map(PrivatePool::from_index),
            };
            (cache, pool)
        };
        assert!(Lending::may_lend(&key(0, Pool::Large, None), &req));
        assert!(!Lending::may_lend(&key(1, Pool::Large, None), &req));
        assert!(!Lending::may_lend(&key(0, Pool::Small, None), &req));
        assert!(!Lending::may_lend(&key(0, Pool::Large, Some(2)), &req));
    }
}
