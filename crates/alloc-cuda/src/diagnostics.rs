//! What the allocator holds, read for checks, tests and tools, reached as
//! `alloc.diagnostics()`: the engine's invariant check, counters of the
//! stream and event backends, the block at an address, the policy, a
//! segment observer, and the engine itself under the allocator's lock.

use alloc_core::{Allocation, Policy};
use alloc_policy::layout_plan::PlanStats;
use alloc_policy::AnyPolicy;

use crate::allocator::CudaAllocator;
use crate::driver;
use crate::error::CudaError;
use crate::events::{EventRecyclerStats, StreamOpCounts};
use crate::observer::SegmentObserver;
use crate::CudaEngine;

/// The diagnostics of a [`CudaAllocator`] (from
/// [`CudaAllocator::diagnostics`]).
///
/// ```no_run
/// use alloc_cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::global(0)?;
/// let diagnostics = alloc.diagnostics();
/// diagnostics.validate()?.expect("the engine's invariants hold");
/// let reserved = diagnostics.inspect(|engine| engine.reserved_bytes())?;
/// println!("{}: {reserved} bytes reserved", diagnostics.policy_name()?);
/// # Ok::<(), alloc_cuda::CudaError>(())
/// ```
pub struct Diagnostics<'a, P: Policy> {
    alloc: &'a CudaAllocator<P>,
}

impl<P: Policy> CudaAllocator<P> {
    /// Checks, counters and the engine itself, for tests and tools.
    pub fn diagnostics(&self) -> Diagnostics<'_, P> {
        Diagnostics { alloc: self }
    }
}

impl<P: Policy> Diagnostics<'_, P> {
    /// Checks the engine's invariants; `Ok(Err(description))` on a violation.
    pub fn validate(&self) -> Result<Result<(), String>, CudaError> {
        Ok(self.alloc.engine()?.validate())
    }

    /// The block at `ptr`, if allocated.
    pub fn allocation(&self, ptr: u64) -> Result<Option<Allocation>, CudaError> {
        Ok(self.alloc.engine()?.allocation(ptr))
    }

    /// Blocks freed while other streams still used them.
    pub fn awaiting_events(&self) -> Result<usize, CudaError> {
        Ok(self.alloc.engine()?.awaiting_events())
    }

    /// What the engine asked of streams and events (host waits, stream
    /// waits, event records and queries) since creation or the last
    /// [`CudaAllocator::reset_accumulated_stats`].
    pub fn stream_op_counts(&self) -> Result<StreamOpCounts, CudaError> {
        Ok(self.alloc.engine()?.streams().op_counts())
    }

    /// Counters of the CUDA event recycler.
    pub fn event_stats(&self) -> Result<EventRecyclerStats, CudaError> {
        Ok(self.alloc.engine()?.streams().event_stats())
    }

    /// The policy's name.
    pub fn policy_name(&self) -> Result<String, CudaError> {
        Ok(self.alloc.engine()?.policy().name().to_string())
    }

    /// `(free, total)` bytes of the device from `cuMemGetInfo` (no lock).
    pub fn mem_get_info(&self) -> Result<(u64, u64), CudaError> {
        driver::bind(self.alloc.context())?;
        driver::mem_get_info()
    }

    /// Reports every later segment allocation, free, mapping and unmapping
    /// of this allocator to `observer` (`None` stops it). The observer runs
    /// with the allocator's lock held and must not call back into it.
    pub fn set_segment_observer(&self, observer: Option<SegmentObserver>) {
        self.alloc.observer_slot().set(observer);
    }

    /// Runs `f` on the engine, read-only, under the allocator's lock (its
    /// heap, statistics, snapshot, backends). Keep `f` short: every other
    /// thread using this device's allocator waits for it.
    pub fn inspect<R>(&self, f: impl FnOnce(&CudaEngine<P>) -> R) -> Result<R, CudaError> {
        Ok(f(&*self.alloc.engine()?))
    }

    /// Runs `f` on the engine, mutably, under the allocator's lock. Stream
    /// ids reach the driver only once registered with the stream backend
    /// (`f` may register [`crate::StreamHandle`]s there); unregistered ones
    /// make the engine's calls fail instead.
    ///
    /// # Safety
    /// `f` must not free a block that a live [`crate::DeviceBuffer`] of
    /// this allocator owns (`Engine::free` of its address, or
    /// `Engine::restore_pool` of its sleep tag's pool): the buffer would go
    /// on using memory handed out again. A segment source it sets
    /// (`Engine::set_pool_source`) must meet the contract of
    /// [`crate::Pools::set_source`].
    pub unsafe fn with_engine<R>(
        &self,
        f: impl FnOnce(&mut CudaEngine<P>) -> R,
    ) -> Result<R, CudaError> {
        Ok(f(&mut *self.alloc.engine()?))
    }
}

impl Diagnostics<'_, AnyPolicy> {
    /// What `plan_layout` did so far (`None` unless it is on, with
    /// `pytorch-bfc`).
    pub fn plan_stats(&self) -> Result<Option<PlanStats>, CudaError> {
        Ok(self.alloc.engine()?.policy().plan_stats())
    }
}

/// Over a driver: the null driver (`crates/alloc-cuda/null-driver/run.sh
/// --tests`, no GPU) or a GPU.
#[cfg(test)]
mod null_driver_tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::observer::{SegmentAction, SegmentEvent};

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn diagnostics_read_what_the_allocator_did() {
        let alloc = CudaAllocator::with_config_str(0, "policy:buddy").unwrap();
        let stream = alloc.context().new_stream().unwrap();
        let seen: Arc<Mutex<Vec<SegmentEvent>>> = Arc::default();
        let log = seen.clone();
        let diagnostics = alloc.diagnostics();
        diagnostics.set_segment_observer(Some(Arc::new(move |e| log.lock().unwrap().push(e))));

        let ptr = alloc.malloc(1 << 20, &stream).unwrap();
        let block = diagnostics.allocation(ptr).unwrap().unwrap();
        assert_eq!(block.addr, ptr);
        assert!(block.size >= 1 << 20);
        assert_eq!(
            diagnostics.allocation(ptr + 1).unwrap(),
            None,
            "not a block's start"
        );
        assert_eq!(diagnostics.policy_name().unwrap(), "buddy");
        assert_eq!(diagnostics.plan_stats().unwrap(), None, "no plan_layout");
        assert_eq!(
            diagnostics.inspect(|e| e.reserved_bytes()).unwrap(),
            alloc.reserved_bytes().unwrap()
        );
        {
            let events = seen.lock().unwrap();
            assert_eq!(events.len(), 1, "{events:?}");
            assert_eq!(events[0].action, SegmentAction::Alloc);
        }

        let other = alloc.context().new_stream().unwrap();
        alloc.record_stream(ptr, &other).unwrap();
        alloc.free(ptr).unwrap();
        assert!(diagnostics.stream_op_counts().unwrap().recorded >= 1);
        diagnostics.set_segment_observer(None);
        alloc.empty_cache().unwrap();
        assert_eq!(diagnostics.awaiting_events().unwrap(), 0);
        assert_eq!(
            seen.lock().unwrap().len(),
            1,
            "nothing after the observer left"
        );
        let (free, total) = diagnostics.mem_get_info().unwrap();
        assert!(0 < free && free <= total);
        diagnostics.validate().unwrap().unwrap();
    }
}
