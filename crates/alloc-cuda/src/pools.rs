//! The allocator's private pools (a CUDA graph's, a PyTorch `MemPool`'s,
//! a sleep tag's), reached as `alloc.pools()`: routing allocations to a
//! pool, holding and releasing it, emptying its cache, and checkpointing
//! and restoring its layout (CUDA graph trees). The engine keeps the pools;
//! [`Pools`] borrows the allocator and locks it once per call.

use std::collections::HashSet;

use alloc_core::{AllocError, Policy, PoolCheckpoint, PoolId, RestoreOutcome, SegmentSource};

use crate::allocator::CudaAllocator;
use crate::error::CudaError;

/// The private pools of a [`CudaAllocator`] (from
/// [`CudaAllocator::pools`]).
///
/// ```no_run
/// use alloc_cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::global(0)?;
/// let stream = alloc.context().new_stream()?;
/// let pool = (7, 1); // a graph's pool id
/// alloc.pools().begin_allocate_to(pool)?; // a capture begins
/// let ptr = alloc.malloc_in_pool(1 << 20, &stream, Some(pool))?;
/// alloc.pools().end_allocate_to(pool)?;
/// let saved = alloc.pools().checkpoint(pool)?;
/// alloc.free(ptr)?;
/// alloc.pools().restore(&saved)?; // the block is allocated again
/// # Ok::<(), alloc_cuda::CudaError>(())
/// ```
pub struct Pools<'a, P: Policy> {
    alloc: &'a CudaAllocator<P>,
}

impl<P: Policy> CudaAllocator<P> {
    /// The allocator's private pools.
    pub fn pools(&self) -> Pools<'_, P> {
        Pools { alloc: self }
    }
}

impl<P: Policy> Pools<'_, P> {
    /// Starts routing allocations that name `pool` to that private pool (a
    /// CUDA graph capture or a `MemPool` context begins) and holds the pool.
    /// Until the matching [`Pools::end_allocate_to`], no event is queried or
    /// recorded and no memory goes back to the driver.
    pub fn begin_allocate_to(&self, pool: PoolId) -> Result<(), CudaError> {
        self.alloc.engine()?.begin_allocate_to_pool(pool);
        Ok(())
    }

    /// Ends a routing begun by [`Pools::begin_allocate_to`].
    pub fn end_allocate_to(&self, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.alloc.engine()?.end_allocate_to_pool(pool)?)
    }

    /// One more holder of `pool`.
    pub fn retain(&self, pool: PoolId) -> Result<(), CudaError> {
        self.alloc.engine()?.retain_pool(pool);
        Ok(())
    }

    /// One holder of `pool` fewer (a graph was deleted); with none left its
    /// idle segments go back to the driver.
    pub fn release(&self, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.alloc.engine()?.release_pool(pool)?)
    }

    /// Holders of `pool`.
    pub fn use_count(&self, pool: PoolId) -> Result<u32, CudaError> {
        Ok(self.alloc.engine()?.pool_use_count(pool))
    }

    /// Returns the idle segments of `pool` to the driver, and nothing else
    /// (see [`alloc_core::Engine::empty_pool_cache`]).
    pub fn empty_cache(&self, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.alloc.engine()?.empty_pool_cache(pool)?)
    }

    /// Makes `pool` hand out whole blocks, never split; see
    /// [`alloc_core::Engine::set_pool_no_split`].
    pub fn set_no_split(&self, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.alloc.engine()?.set_pool_no_split(pool)?)
    }

    /// Makes `pool` take its segments from `source` and give them back to
    /// it; see [`alloc_core::Engine::set_pool_source`].
    ///
    /// # Safety
    /// Every segment `source` hands out is device memory of this device's
    /// primary context, of the size asked for, used by nothing else until
    /// it is given back.
    pub unsafe fn set_source(
        &self,
        pool: PoolId,
        source: Box<dyn SegmentSource>,
    ) -> Result<(), CudaError> {
        Ok(self.alloc.engine()?.set_pool_source(pool, source)?)
    }

    /// Saves the layout of `pool` (CUDA graph trees); see
    /// [`alloc_core::Engine::checkpoint_pool`].
    pub fn checkpoint(&self, pool: PoolId) -> Result<PoolCheckpoint, CudaError> {
        Ok(self.alloc.engine()?.checkpoint_pool(pool)?)
    }

    /// Puts a pool back into a checkpointed layout; see
    /// [`alloc_core::Engine::restore_pool`]. A pool holding a live
    /// [`crate::DeviceBuffer`]'s block (a sleep tag's) is refused: the
    /// restore would free it under the buffer.
    pub fn restore(&self, checkpoint: &PoolCheckpoint) -> Result<RestoreOutcome, CudaError> {
        let (mut engine, buffered) = self.alloc.engine_and_buffers_in(checkpoint.pool)?;
        if buffered {
            return Err(buffer_in_pool(checkpoint.pool));
        }
        Ok(engine.restore_pool(checkpoint)?)
    }

    /// Whether the blocks allocated in `pool` are exactly `expected`.
    pub fn live_allocations_are(
        &self,
        pool: PoolId,
        expected: &HashSet<u64>,
    ) -> Result<bool, CudaError> {
        Ok(self
            .alloc
            .engine()?
            .pool_live_allocations_are(pool, expected))
    }
}

/// The refusal of a restore of `pool` while a typed buffer holds one of
/// its blocks.
fn buffer_in_pool(pool: PoolId) -> CudaError {
    CudaError::Alloc(AllocError::InvalidArgument(format!(
        "restore_pool of pool {pool:?}: a live DeviceBuffer holds a block of it"
    )))
}

/// Over a driver: the null driver (`crates/alloc-cuda/null-driver/run.sh
/// --tests`, no GPU) or a GPU.
#[cfg(test)]
mod null_driver_tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const POOL: PoolId = (7, 1);

    // While a routing is open, allocations run in relaxed capture mode,
    // which the null driver lacks: the pools are held with `retain` here,
    // and routing is opened and closed around no allocation.

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn a_pool_is_held_checkpointed_restored_and_emptied() {
        let alloc = CudaAllocator::with_config_str(0, "").unwrap();
        let stream = alloc.context().new_stream().unwrap();
        let pools = alloc.pools();
        pools.retain(POOL).unwrap();
        let ptr = alloc.malloc_in_pool(MIB, &stream, Some(POOL)).unwrap();
        assert_eq!(pools.use_count(POOL).unwrap(), 1);
        assert!(pools
            .live_allocations_are(POOL, &HashSet::from([ptr]))
            .unwrap());

        let saved = pools.checkpoint(POOL).unwrap();
        alloc.free(ptr).unwrap();
        assert!(pools.live_allocations_are(POOL, &HashSet::new()).unwrap());
        let outcome = pools.restore(&saved).unwrap();
        assert_eq!(outcome.allocated.len(), 1);
        assert_eq!(outcome.allocated[0].addr, ptr, "the same block again");
        assert!(pools
            .live_allocations_are(POOL, &HashSet::from([ptr]))
            .unwrap());
        alloc.free(ptr).unwrap();

        pools.begin_allocate_to(POOL).unwrap();
        assert_eq!(pools.use_count(POOL).unwrap(), 2, "the routing holds it");
        pools.end_allocate_to(POOL).unwrap();
        pools.release(POOL).unwrap();
        assert_eq!(
            pools.use_count(POOL).unwrap(),
            1,
            "the routing's hold stays"
        );
        pools.empty_cache(POOL).unwrap();
        assert!(
            alloc.reserved_bytes().unwrap() > 0,
            "a held pool keeps its segment"
        );
        pools.release(POOL).unwrap();
        assert_eq!(pools.use_count(POOL).unwrap(), 0);
        assert_eq!(
            alloc.reserved_bytes().unwrap(),
            0,
            "the last holder gave it back"
        );
        alloc.diagnostics().validate().unwrap().unwrap();
    }

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn a_restore_waits_for_the_buffers_of_the_pool() {
        let alloc = CudaAllocator::with_config_str(0, "").unwrap();
        let stream = alloc.context().new_stream().unwrap();
        let pools = alloc.pools();
        pools.retain(POOL).unwrap();
        let saved = pools.checkpoint(POOL).unwrap();
        let buffer = alloc.alloc_block::<u8>(4096, &stream, Some(POOL)).unwrap();
        let e = pools.restore(&saved).unwrap_err();
        assert!(e.to_string().contains("live DeviceBuffer"), "{e}");
        assert!(
            alloc
                .diagnostics()
                .allocation(buffer.device_address())
                .unwrap()
                .is_some(),
            "the refused restore freed nothing"
        );
        drop(buffer);
        let outcome = pools.restore(&saved).unwrap();
        assert!(
            outcome.freed.is_empty(),
            "the buffer's drop freed its block"
        );
        pools.release(POOL).unwrap();
    }
}
