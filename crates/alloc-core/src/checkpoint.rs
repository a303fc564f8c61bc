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
//!
//! This module reads and checks layouts against the heap and the private
//! pools, and recreates a checkpointed segment's blocks through the policy;
//! the engine (`engine/checkpoint.rs`) frees the pool's live blocks first,
//! and lends the mapping of pages, the table of live blocks and the cache.

use std::collections::HashSet;
use std::hash::BuildHasher;

use crate::error::AllocError;
use crate::heap::{BlockState, Heap};
use crate::policy::{Policy, Request};
use crate::private_pool::{PoolId, PrivatePools};
use crate::types::{Allocation, BlockId, CacheKey, Pool};

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
    pub pool: Pool,
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

/// What [`Engine::restore_pool`](crate::Engine::restore_pool) changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreOutcome {
    /// Addresses of the blocks that were allocated and were freed.
    pub freed: Vec<u64>,
    /// The blocks of the checkpoint allocated again, which the caller now owns.
    pub allocated: Vec<Allocation>,
}

/// The error of a restore whose policy `policy` cannot recreate the
/// checkpointed block at `addr`.
pub(crate) fn unrestorable(policy: &str, addr: u64) -> AllocError {
    AllocError::InvalidArgument(format!(
        "restore: policy {policy} cannot recreate the checkpointed block at {addr:#x}"
    ))
}

/// Errors unless `pool` is held, for the operation `what`.
pub(crate) fn check_held(pools: &PrivatePools, pool: PoolId, what: &str) -> Result<(), AllocError> {
    if pools.use_count(pool) == 0 {
        return Err(AllocError::InvalidArgument(format!(
            "{what}: private pool {pool:?} is unknown or released"
        )));
    }
    Ok(())
}

impl PoolCheckpoint {
    /// The layout of `pool` in `heap` now; fails if a block of the pool
    /// still waits for other streams' events (as PyTorch requires).
    pub(crate) fn take(
        heap: &Heap,
        pools: &PrivatePools,
        pool: PoolId,
    ) -> Result<Self, AllocError> {
        let mut segments = Vec::new();
        for seg_id in pools.segments(heap, pool) {
            let seg = heap.segment(seg_id);
            let mut blocks = Vec::with_capacity(seg.blocks as usize);
            for id in heap.segment_blocks(seg_id) {
                let b = heap.block(id);
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

    /// The blocks of the pool to free before the restore: every allocated
    /// one. Fails before anything changes when a block of the pool is used
    /// by other streams (`used_elsewhere`) or awaits events, or a segment
    /// of the checkpoint is no longer the pool's.
    pub(crate) fn blocks_to_free(
        &self,
        heap: &Heap,
        pools: &PrivatePools,
        used_elsewhere: impl Fn(BlockId) -> bool,
    ) -> Result<Vec<BlockId>, AllocError> {
        let pool = self.pool;
        let segments = pools.segments(heap, pool);
        let mut live = Vec::new();
        for &seg_id in &segments {
            for id in heap.segment_blocks(seg_id) {
                match heap.block(id).state {
                    BlockState::Free => {}
                    BlockState::Allocated if !used_elsewhere(id) => live.push(id),
                    _ => {
                        return Err(AllocError::InvalidArgument(format!(
                            "restore: block {:#x} of pool {pool:?} is used by another stream",
                            heap.block(id).addr
                        )))
                    }
                }
            }
        }
        for cp in &self.segments {
            let found = heap.segment_containing(cp.addr);
            if !found.is_some_and(|s| segments.contains(&s) && heap.segment(s).addr == cp.addr) {
                return Err(AllocError::InvalidArgument(format!(
                    "restore: segment {:#x} of the checkpoint is no longer in pool {pool:?}",
                    cp.addr
                )));
            }
        }
        Ok(live)
    }
}

impl SegmentCheckpoint {
    /// Carves the checkpointed block `b` of this segment, through the
    /// policy's own `carve` (so that its index stays right), from the free
    /// block of `heap` that starts at its address; the piece is left free,
    /// out of the policy's index. `None`, with the heap and the index as
    /// they were, when the policy cannot recreate the block there.
    pub(crate) fn carve<P: Policy>(
        &self,
        policy: &mut P,
        heap: &mut Heap,
        b: &BlockCheckpoint,
    ) -> Option<BlockId> {
        let free = heap.block_at(b.addr).filter(|&id| {
            let blk = heap.block(id);
            blk.state == BlockState::Free && blk.size >= b.size
        })?;
        policy.remove_free(heap, free);
        let req = Request {
            requested: b.requested.max(1),
            size: b.size,
            pool: self.pool,
            key: self.key,
        };
        let piece = policy.carve(heap, free, &req);
        let blk = heap.block(piece);
        if blk.addr != b.addr || blk.size != b.size {
            policy.insert_free(heap, piece);
            return None;
        }
        Some(piece)
    }

    /// Recreates this segment's blocks by carving them from the front of its
    /// free space in address order. A block live in the checkpoint gets its
    /// pages mapped (`map`: `Ok(false)` when the device has no room), is
    /// allocated again and goes to `hand_out` with its id. A block free in
    /// the checkpoint is held allocated meanwhile, so that it does not merge
    /// into the free space the next block is carved from, and goes to
    /// `to_free`, for the caller to put back in the cache whatever the
    /// outcome.
    pub(crate) fn recreate<P: Policy>(
        &self,
        policy: &mut P,
        heap: &mut Heap,
        mut map: impl FnMut(&mut P, &mut Heap, BlockId) -> Result<bool, AllocError>,
        mut hand_out: impl FnMut(Allocation, BlockId),
        to_free: &mut Vec<BlockId>,
    ) -> Result<(), AllocError> {
        for b in &self.blocks {
            let Some(piece) = self.carve(policy, heap, b) else {
                return Err(unrestorable(policy.name(), b.addr));
            };
            if !b.allocated {
                heap.set_state(piece, BlockState::Allocated, b.requested.max(1));
                to_free.push(piece);
                continue;
            }
            if !map(policy, heap, piece)? {
                policy.insert_free(heap, piece);
                return Err(AllocError::InvalidArgument(format!(
                    "restore: no device memory to map the pages under block {:#x}",
                    b.addr
                )));
            }
            heap.set_state(piece, BlockState::Allocated, b.requested);
            hand_out(self.allocation(b), piece);
        }
        Ok(())
    }

    /// The allocation a live block `b` of this segment is handed back as.
    pub(crate) fn allocation(&self, b: &BlockCheckpoint) -> Allocation {
        Allocation {
            addr: b.addr,
            size: b.size,
            requested: b.requested,
            stream: self.key.stream,
        }
    }
}

/// Whether the blocks allocated in `pool` are exactly `expected`
/// (PyTorch's `checkPoolLiveAllocations`).
pub(crate) fn live_allocations_are<H: BuildHasher>(
    heap: &Heap,
    pools: &PrivatePools,
    pool: PoolId,
    expected: &HashSet<u64, H>,
) -> bool {
    let mut count = 0;
    for seg_id in pools.segments(heap, pool) {
        for id in heap.segment_blocks(seg_id) {
            let b = heap.block(id);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::FreeList;
    use crate::types::{StreamId, MIB};

    /// A heap with one segment of the held `pool` cut into blocks of
    /// `sizes`, the `allocated` ones handed out.
    fn pool_heap(pools: &mut PrivatePools, pool: PoolId, sizes: &[(u64, bool)]) -> Heap {
        let mut heap = Heap::new(u64::MAX);
        pools.retain(pool);
        let key = CacheKey {
            stream: StreamId(3),
            private_pool: Some(pools.number(pool).unwrap()),
        };
        heap.add_cut_segment(0x4000_0000, key, sizes);
        pools.segment_added(key);
        heap
    }

    #[test]
    fn a_checkpoint_records_every_block_in_address_order() {
        let mut pools = PrivatePools::default();
        let pool = (1, 1);
        let heap = pool_heap(
            &mut pools,
            pool,
            &[(MIB, true), (2 * MIB, false), (MIB, true)],
        );
        let cp = PoolCheckpoint::take(&heap, &pools, pool).unwrap();
        assert_eq!(cp.segments.len(), 1);
        let seg = &cp.segments[0];
        let blocks: Vec<_> = seg.blocks.iter().map(|b| (b.size, b.allocated)).collect();
        assert_eq!(blocks, vec![(MIB, true), (2 * MIB, false), (MIB, true)]);
        assert_eq!(
            cp.live_addresses().collect::<Vec<_>>(),
            vec![0x4000_0000, 0x4000_0000 + 3 * MIB]
        );
        let live = seg.allocation(&seg.blocks[0]);
        assert_eq!((live.requested, live.stream), (MIB, StreamId(3)));
        let expected: HashSet<u64> = cp.live_addresses().collect();
        assert!(live_allocations_are(&heap, &pools, pool, &expected));
        let fewer: HashSet<u64> = expected.iter().copied().take(1).collect();
        assert!(!live_allocations_are(&heap, &pools, pool, &fewer));
        assert!(check_held(&pools, pool, "checkpoint").is_ok());
        assert!(check_held(&pools, (9, 9), "checkpoint").is_err());
    }

    #[test]
    fn a_restore_is_refused_before_any_change_for_blocks_used_elsewhere_or_segments_gone() {
        let mut pools = PrivatePools::default();
        let pool = (1, 1);
        let mut heap = pool_heap(&mut pools, pool, &[(MIB, true), (MIB, false), (MIB, true)]);
        let cp = PoolCheckpoint::take(&heap, &pools, pool).unwrap();
        let live = cp.blocks_to_free(&heap, &pools, |_| false).unwrap();
        assert_eq!(live.len(), 2);
        assert!(
            cp.blocks_to_free(&heap, &pools, |_| true).is_err(),
            "used elsewhere"
        );
        let awaiting = live[0];
        heap.set_state(awaiting, BlockState::AwaitingEvents, 0);
        assert!(PoolCheckpoint::take(&heap, &pools, pool).is_err());
        assert!(cp.blocks_to_free(&heap, &pools, |_| false).is_err());
        let mut moved = cp.clone();
        moved.segments[0].addr += MIB;
        heap.set_state(awaiting, BlockState::Allocated, 1);
        assert!(
            moved.blocks_to_free(&heap, &pools, |_| false).is_err(),
            "segment gone"
        );
    }

    #[test]
    fn a_segment_is_recreated_from_the_front_its_free_blocks_held_until_done() {
        let pool = (1, 1);
        let mut pools = PrivatePools::default();
        let sizes = [(MIB, true), (2 * MIB, false), (MIB, true)];
        let heap = pool_heap(&mut pools, pool, &sizes);
        let cp = PoolCheckpoint::take(&heap, &pools, pool).unwrap();
        let seg = &cp.segments[0];
        // The same segment, all free, as one block in the policy's index.
        let fresh = || {
            let mut heap = pool_heap(&mut PrivatePools::default(), pool, &[(4 * MIB, false)]);
            let mut policy = FreeList::default();
            let free = heap.block_at(seg.addr).unwrap();
            policy.insert_free(&mut heap, free);
            (heap, policy)
        };

        let (mut heap, mut policy) = fresh();
        let (mut handed, mut to_free, mut mapped) = (Vec::new(), Vec::new(), 0);
        let map = |_: &mut FreeList, _: &mut Heap, _| {
            mapped += 1;
            Ok(true)
        };
        let hand_out = |a: Allocation, id| handed.push((a, id));
        seg.recreate(&mut policy, &mut heap, map, hand_out, &mut to_free)
            .unwrap();
        assert_eq!(mapped, 2, "the pages of live blocks only");
        let addrs: Vec<_> = handed.iter().map(|(a, _)| (a.addr, a.size)).collect();
        assert_eq!(addrs, [(seg.addr, MIB), (seg.addr + 3 * MIB, MIB)]);
        assert!(handed
            .iter()
            .all(|&(_, id)| heap.block(id).state == BlockState::Allocated));
        // The block free in the checkpoint is held, for the caller to free.
        assert_eq!(to_free.len(), 1);
        let held = heap.block(to_free[0]);
        assert_eq!((held.addr, held.size), (seg.addr + MIB, 2 * MIB));
        assert_eq!(held.state, BlockState::Allocated);
        assert!(policy.0.is_empty(), "every byte carved");

        // No room for the pages of the second live block: the error, that
        // block back in the index, the first one handed out.
        let (mut heap, mut policy) = fresh();
        let (mut handed, mut to_free, mut calls) = (Vec::new(), Vec::new(), 0);
        let map = |_: &mut FreeList, _: &mut Heap, _| {
            calls += 1;
            Ok(calls == 1)
        };
        let hand_out = |a: Allocation, _| handed.push(a.addr);
        let err = seg.recreate(&mut policy, &mut heap, map, hand_out, &mut to_free);
        assert!(err.unwrap_err().to_string().contains("no device memory"));
        assert_eq!(handed, [seg.addr]);
        assert_eq!(to_free.len(), 1);
        let back = heap.block_at(seg.addr + 3 * MIB).unwrap();
        assert!(policy.0.contains(&back) && heap.block(back).state == BlockState::Free);
    }
}
