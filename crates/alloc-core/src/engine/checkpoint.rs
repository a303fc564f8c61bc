//! Checkpoints of a private pool, as CUDA graph trees (`torch.compile` with
//! `mode="reduce-overhead"`) use them: after recording a graph, the pool's
//! layout is saved; before recording a sibling graph from the same parent,
//! the pool is put back into that layout. Replaying a graph allocates
//! nothing through the allocator, so the live blocks the graph left behind
//! must be recreated at their addresses for later allocations to avoid them.
//!
//! Restoring follows PyTorch's contract (`setCheckpointPoolState`): every
//! block allocated in the pool now is freed and reported; every block
//! allocated in the checkpoint is allocated again at its address and size
//! and reported; the rest of the checkpointed segments is free.

use std::collections::HashSet;
use std::hash::BuildHasher;

use super::Engine;
use crate::backend::{MemoryBackend, StreamBackend};
use crate::error::AllocError;
use crate::heap::BlockState;
use crate::policy::{Policy, Request};
use crate::private_pool::PoolId;
use crate::types::{BlockId, CacheKey, PoolKind};
use crate::Allocation;

/// One block of a checkpointed segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCheckpoint {
    /// Device address.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Bytes asked for (0 for a free block).
    pub requested: u64,
    /// Whether the block was allocated (live) when checkpointed.
    pub allocated: bool,
}

/// One segment of a private pool, block by block in address order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentCheckpoint {
    /// Device address of the segment.
    pub addr: u64,
    /// Its pool (small or large).
    pub pool: PoolKind,
    /// The cache its blocks are served from.
    key: CacheKey,
    /// Its blocks.
    pub blocks: Vec<BlockCheckpoint>,
}

/// The layout of a private pool at one moment: see the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolCheckpoint {
    /// The pool.
    pub pool: PoolId,
    /// Its segments.
    pub segments: Vec<SegmentCheckpoint>,
}

impl PoolCheckpoint {
    /// Addresses of the blocks that were allocated when checkpointed.
    pub fn live_addresses(&self) -> impl Iterator<Item = u64> + '_ {
        self.segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.allocated)
            .map(|b| b.addr)
    }
}

/// What [`Engine::restore_pool`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreOutcome {
    /// Addresses of the blocks that were allocated and were freed.
    pub freed: Vec<u64>,
    /// The blocks of the checkpoint allocated again, which the caller now owns.
    pub allocated: Vec<Allocation>,
}

impl<P: Policy, M: MemoryBackend, S: StreamBackend> Engine<P, M, S> {
    /// Errors unless `pool` is held.
    fn held_pool(&self, pool: PoolId, what: &str) -> Result<(), AllocError> {
        if self.pools.use_count(pool) == 0 {
            return Err(AllocError::InvalidArgument(format!(
                "{what}: private pool {pool:?} is unknown or released"
            )));
        }
        Ok(())
    }

    /// Saves the layout of the private pool `pool`. Fails if the pool is
    /// unknown or released, or a block of the pool still waits
    /// for other streams' events (as PyTorch requires).
    pub fn checkpoint_pool(&mut self, pool: PoolId) -> Result<PoolCheckpoint, AllocError> {
        self.held_pool(pool, "checkpoint")?;
        self.poll_events()?;
        let mut segments = Vec::new();
        for seg_id in self.pools.segments(&self.heap, pool) {
            let seg = self.heap.segment(seg_id);
            let mut blocks = Vec::with_capacity(seg.blocks as usize);
            for id in self.heap.segment_blocks(seg_id) {
                let b = self.heap.block(id);
                if b.state == BlockState::AwaitingEvents {
                    return Err(AllocError::InvalidArgument(format!(
                        "checkpoint: block {:#x} of pool {pool:?} still waits for other \
                         streams' events",
                        b.addr
                    )));
                }
                blocks.push(BlockCheckpoint {
                    addr: b.addr,
                    size: b.size,
                    requested: b.requested,
                    allocated: b.state == BlockState::Allocated,
                });
            }
            segments.push(SegmentCheckpoint {
                addr: seg.addr,
                pool: seg.pool,
                key: seg.key(),
                blocks,
            });
        }
        Ok(PoolCheckpoint { pool, segments })
    }

    /// Whether the blocks allocated in `pool` are exactly `expected`
    /// (PyTorch's `checkPoolLiveAllocations`).
    pub fn pool_live_allocations_are<H: BuildHasher>(
        &self,
        pool: PoolId,
        expected: &HashSet<u64, H>,
    ) -> bool {
        let mut count = 0;
        for seg_id in self.pools.segments(&self.heap, pool) {
            for id in self.heap.segment_blocks(seg_id) {
                let b = self.heap.block(id);
                if b.state == BlockState::Allocated {
                    if !expected.contains(&b.addr) {
                        return false;
                    }
                    count += 1;
                }
            }
        }
        count == expected.len()
    }

    /// Puts the private pool back into the layout of `checkpoint`; see the
    /// module docs. Blocks of the pool used by other streams
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
        let pool = checkpoint.pool;
        self.held_pool(pool, "restore")?;
        if !self.caps.rebuilds_layouts {
            // Carving from the front of merged free space is how the layout
            // is rebuilt; a policy that keeps free blocks apart (size
            // classes) tags them by class in ways this cannot recreate.
            return Err(self.unrestorable(checkpoint.live_addresses().next().unwrap_or(0)));
        }
        self.poll_events()?;
        let segments = self.pools.segments(&self.heap, pool);
        let mut live: Vec<BlockId> = Vec::new();
        for &seg_id in &segments {
            for id in self.heap.segment_blocks(seg_id) {
                match self.heap.block(id).state {
                    BlockState::Free => {}
                    BlockState::Allocated if !self.events.has_users(id) => live.push(id),
                    _ => {
                        return Err(AllocError::InvalidArgument(format!(
                            "restore: block {:#x} of pool {pool:?} is used by another stream",
                            self.heap.block(id).addr
                        )))
                    }
                }
            }
        }
        for cp in &checkpoint.segments {
            let found = self.heap.segment_containing(cp.addr);
            if !found.is_some_and(|s| segments.contains(&s) && self.heap.segment(s).addr == cp.addr)
            {
                return Err(AllocError::InvalidArgument(format!(
                    "restore: segment {:#x} of the checkpoint is no longer in pool {pool:?}",
                    cp.addr
                )));
            }
        }
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
            let found = self.heap.block_at(b.addr).filter(|&id| {
                let blk = self.heap.block(id);
                blk.state == BlockState::Free && blk.size >= b.size
            });
            let Some(free) = found else {
                return Err(self.unrestorable(b.addr));
            };
            self.policy.remove_free(&self.heap, free);
            let req = Request {
                requested: b.requested.max(1),
                size: b.size,
                pool: cp.pool,
                key: cp.key,
            };
            let piece = self.policy.carve(&mut self.heap, free, &req);
            let blk = *self.heap.block(piece);
            if blk.addr != b.addr || blk.size != b.size {
                self.policy.insert_free(&mut self.heap, piece);
                return Err(self.unrestorable(b.addr));
            }
            if !b.allocated {
                self.heap
                    .set_state(piece, BlockState::Allocated, req.requested);
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
            allocated.push(Allocation {
                addr: b.addr,
                size: b.size,
                requested: b.requested,
                stream: cp.key.stream,
            });
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
