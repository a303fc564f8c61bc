//! The engine's side of private pools' checkpoints (`crate::checkpoint`):
//! events polled first, the pool's live blocks freed, then each segment
//! recreated by its checkpoint with the pages, the live table and the cache
//! lent to it.

use std::collections::HashSet;
use std::hash::BuildHasher;

use super::expandable::Lent;
use super::Engine;
use crate::backend::{MemoryBackend, StreamBackend};
use crate::checkpoint::{self, PoolCheckpoint, RestoreOutcome, SegmentCheckpoint};
use crate::error::AllocError;
use crate::heap::Heap;
use crate::policy::Policy;
use crate::private_pool::PoolId;
use crate::types::Allocation;

impl<P: Policy, M: MemoryBackend, S: StreamBackend> Engine<P, M, S> {
    /// Saves the layout of the private pool `pool`. Fails if the pool is
    /// unknown or released, or a block of the pool still waits
    /// for other streams' events (as PyTorch requires).
    pub fn checkpoint_pool(&mut self, pool: PoolId) -> Result<PoolCheckpoint, AllocError> {
        checkpoint::check_held(&self.pools, pool, "checkpoint")?;
        self.poll_events()?;
        PoolCheckpoint::take(&self.heap, &self.pools, pool)
    }

    /// Whether the blocks allocated in `pool` are exactly `expected`
    /// (PyTorch's `checkPoolLiveAllocations`).
    pub fn pool_live_allocations_are<H: BuildHasher>(
        &self,
        pool: PoolId,
        expected: &HashSet<u64, H>,
    ) -> bool {
        checkpoint::live_allocations_are(&self.heap, &self.pools, pool, expected)
    }

    /// Puts the private pool back into the layout of `checkpoint`; see
    /// [`PoolCheckpoint`]. Blocks of the pool used by other streams
    /// (`record_stream`) or awaiting events make it fail before anything
    /// changes. A policy that cannot recreate a checkpointed block at its
    /// address (it carves blocks elsewhere than at the front of a free
    /// block) makes it fail with the pool's blocks all free; a policy that
    /// does not merge free neighbours (size classes) is refused before
    /// anything changes.
    pub fn restore_pool(
        &mut self,
        checkpoint: &PoolCheckpoint,
    ) -> Result<RestoreOutcome, AllocError> {
        checkpoint::check_held(&self.pools, checkpoint.pool, "restore")?;
        if !self.caps.rebuilds_layouts {
            // Carving from the front of merged free space is how the layout
            // is rebuilt; a policy that keeps free blocks apart (size
            // classes) tags them by class in ways this cannot recreate.
            let addr = checkpoint.live_addresses().next().unwrap_or(0);
            return Err(checkpoint::unrestorable(self.policy.name(), addr));
        }
        self.poll_events()?;
        let live =
            checkpoint.blocks_to_free(&self.heap, &self.pools, |id| self.order.has_users(id))?;
        let mut outcome = RestoreOutcome::default();
        for id in live {
            let addr = self.heap.block(id).addr;
            self.live.remove(addr);
            self.release_to_cache(id);
            outcome.freed.push(addr);
        }
        let result = checkpoint
            .segments
            .iter()
            .try_for_each(|cp| self.restore_segment(cp, &mut outcome.allocated));
        self.heap.ledger.settle();
        result.map(|()| outcome)
    }

    /// Recreates one segment's blocks ([`SegmentCheckpoint::recreate`]),
    /// lending it the mapping of pages under them (with `unmap_free_pages`)
    /// and the table of live blocks; the blocks free in the checkpoint go
    /// back to the cache once done, or on failure.
    fn restore_segment(
        &mut self,
        cp: &SegmentCheckpoint,
        allocated: &mut Vec<Allocation>,
    ) -> Result<(), AllocError> {
        let (unmaps, budget) = (self.options.unmap_free_pages, self.options.memory_budget);
        let Engine {
            policy,
            heap,
            live,
            segments,
            memory,
            streams,
            pools,
            limit,
            ..
        } = self;
        let map = |policy: &mut P, heap: &mut Heap, piece| {
            if !unmaps {
                return Ok(true);
            }
            let mut cx = Lent {
                heap,
                policy,
                memory: &mut *memory,
                streams: &mut *streams,
                pools: &mut *pools,
                limit: *limit,
                budget,
            };
            segments.map_pages_under(&mut cx, piece)
        };
        let hand_out = |a: Allocation, piece| {
            live.insert(a.addr, piece);
            allocated.push(a);
        };
        let mut to_free = Vec::new();
        let result = cp.recreate(policy, heap, map, hand_out, &mut to_free);
        for id in to_free {
            self.release_to_cache(id);
        }
        result
    }
}
