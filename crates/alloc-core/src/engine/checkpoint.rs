//! The engine's side of private pools' checkpoints (`crate::checkpoint`):
//! events polled first, the pool's live blocks freed, the checkpoint's
//! blocks carved again, their pages mapped and handed out.

use std::collections::HashSet;
use std::hash::BuildHasher;

use super::Engine;
use crate::backend::{MemoryBackend, StreamBackend};
use crate::checkpoint::{self, PoolCheckpoint, RestoreOutcome, SegmentCheckpoint};
use crate::error::AllocError;
use crate::heap::BlockState;
use crate::policy::Policy;
use crate::private_pool::PoolId;
use crate::types::{Allocation, BlockId};

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
            return Err(self.unrestorable(checkpoint.live_addresses().next().unwrap_or(0)));
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

    /// Recreates one segment's blocks by carving them from the front of its
    /// free space in address order, then frees the ones that were free.
    fn restore_segment(
        &mut self,
        cp: &SegmentCheckpoint,
        allocated: &mut Vec<Allocation>,
    ) -> Result<(), AllocError> {
        // Blocks free in the checkpoint are held allocated while the segment
        // is carved, so that they do not merge into the free space the next
        // block is carved from; they go back once done, or on failure.
        let mut to_free = Vec::new();
        let result = self.carve_segment(cp, allocated, &mut to_free);
        for id in to_free {
            self.release_to_cache(id);
        }
        result
    }

    /// The carving of [`Engine::restore_segment`]: live blocks go to
    /// `allocated`, blocks free in the checkpoint to `to_free`.
    fn carve_segment(
        &mut self,
        cp: &SegmentCheckpoint,
        allocated: &mut Vec<Allocation>,
        to_free: &mut Vec<BlockId>,
    ) -> Result<(), AllocError> {
        for b in &cp.blocks {
            let Some(piece) = cp.carve(&mut self.policy, &mut self.heap, b) else {
                return Err(self.unrestorable(b.addr));
            };
            if !b.allocated {
                self.heap
                    .set_state(piece, BlockState::Allocated, b.requested.max(1));
                to_free.push(piece);
                continue;
            }
            if self.options.unmap_free_pages && !self.map_pages_under(piece)? {
                self.policy.insert_free(&mut self.heap, piece);
                return Err(AllocError::InvalidArgument(format!(
                    "restore: no device memory to map the pages under block {:#x}",
                    b.addr
                )));
            }
            self.heap
                .set_state(piece, BlockState::Allocated, b.requested);
            self.live.insert(b.addr, piece);
            allocated.push(cp.allocation(b));
        }
        Ok(())
    }

    fn unrestorable(&self, addr: u64) -> AllocError {
        AllocError::InvalidArgument(format!(
            "restore: policy {} cannot recreate the checkpointed block at {addr:#x}",
            self.policy.name()
        ))
    }
}
