//! The thread-safe allocator handle: one engine per device behind a mutex,
//! and the facade over the parts it holds. The engine does the allocating;
//! [`BufferRanges`] keeps live typed buffers' blocks apart, [`HostBackups`]
//! copies paused sleep tags to the host and back, and `ipc.rs` reads what a
//! live block shares with another process. The handles that hold an
//! allocator ([`crate::DeviceBuffer`], [`crate::Tag`]) are built in their
//! own files, above this one, so that no file uses one that uses it back.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use alloc_core::{
    Allocation, AllocatorConfig, Backup, ConfigError, Engine, EngineOptions, PauseReport, Policy,
    PoolCheckpoint, PoolId, RestoreOutcome, ResumeReport, SegmentSource, Snapshot, Stats, StreamId,
    TagInfo,
};
use alloc_policy::AnyPolicy;
use cudarc::driver::{CudaContext, CudaStream};

use crate::buffer_ranges::BufferRanges;
use crate::driver;
use crate::error::{driver_error, CudaError};
use crate::events::{CudaStreams, EventRecyclerStats, StreamOpCounts};
use crate::ipc::{self, SharedRange};
use crate::lock::{lock_consistent, SpinParkGuard, SpinParkMutex};
use crate::memory::CudaMemory;
use crate::notice::NO_VIRTUAL_MEMORY;
use crate::observer::{ObserverSlot, SegmentObserver};
use crate::pinned::PinnedAllocator;
use crate::sleep::HostBackups;
use crate::stream::{stream_ref, AsStream, StreamRef};
use crate::vmm::SharedPages;
use crate::CudaEngine;

/// Highest number of devices [`CudaAllocator::global`] serves.
pub const MAX_DEVICES: usize = 64;

static GLOBALS: [OnceLock<CudaAllocator>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
/// Serialises the creation of global allocators and their configuration.
static GLOBAL_CONFIG: Mutex<Option<AllocatorConfig>> = Mutex::new(None);

struct Inner<P: Policy> {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    /// The configuration in effect (settings may change at run time).
    config: Mutex<AllocatorConfig>,
    /// Taken by every allocation and free of the device: a lock that spins
    /// before it parks (see [`crate::lock`]).
    state: SpinParkMutex<State<P>>,
    observer: ObserverSlot,
    /// Host backups of paused sleep tags, and the stream that copies them.
    sleep: HostBackups,
}

/// The engine and the blocks of live typed buffers, under one lock.
struct State<P: Policy> {
    engine: CudaEngine<P>,
    buffers: BufferRanges,
}

impl<P: Policy> State<P> {
    /// Registers `stream` with the stream backend (so that the engine may
    /// hand its id to the driver); first lets go of the streams the engine
    /// no longer uses, once enough were registered since the last time.
    fn register(&mut self, stream: StreamRef<'_>) -> Result<StreamId, CudaError> {
        if self.engine.streams().wants_pruning() {
            self.prune_streams();
        }
        self.engine.streams_mut().register_ref(stream)
    }

    /// Lets go of every registered stream the engine no longer uses.
    fn prune_streams(&mut self) {
        let in_use = self.engine.streams_in_use();
        self.engine.streams_mut().retain(|id| in_use.contains(&id));
    }

    /// The engine's `malloc_in`; while a capture is underway, driver
    /// allocations run in relaxed capture mode so that a graph captured in
    /// global mode stays valid.
    fn malloc(
        &mut self,
        size: u64,
        stream: StreamRef<'_>,
        pool: Option<PoolId>,
    ) -> Result<Allocation, CudaError> {
        let id = self.register(stream)?;
        let _relaxed = if self.engine.capture_underway() {
            Some(driver::RelaxedCaptureMode::enter()?)
        } else {
            None
        };
        Ok(self.engine.malloc_in(size, id, pool)?)
    }
}

/// The engine of a locked allocator.
pub(crate) struct EngineGuard<'a, P: Policy>(SpinParkGuard<'a, State<P>>);

impl<P: Policy> Deref for EngineGuard<'_, P> {
    type Target = CudaEngine<P>;
    fn deref(&self) -> &CudaEngine<P> {
        &self.0.engine
    }
}

impl<P: Policy> DerefMut for EngineGuard<'_, P> {
    fn deref_mut(&mut self) -> &mut CudaEngine<P> {
        &mut self.0.engine
    }
}

impl<P: Policy> Drop for Inner<P> {
    fn drop(&mut self) {
        // Give every idle segment back to the driver; segments that still
        // hold live raw allocations stay (a leak, never a hazard).
        let _ = self.state.get_mut().engine.empty_cache();
    }
}

/// A caching allocator for one CUDA device: `Send + Sync`, cheap to clone
/// (clones share the allocator). Every call takes the allocator's lock only
/// for the engine operation itself.
///
/// Addresses are `CUdeviceptr` values. Streams are cudarc streams of the
/// device's primary context (`&Arc<CudaStream>`, kept alive by the
/// allocator while it may use them) or [`crate::StreamHandle`]s, which wrap
/// a raw `CUstream` only through an `unsafe` constructor.
///
/// The policy is [`AnyPolicy`] (chosen by the configuration's `policy:`
/// key) unless one of your own is given to [`CudaAllocator::with_policy`].
///
/// ```no_run
/// use alloc_cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::with_config_str(0, "policy:pytorch-bfc,max_split_size_mb:128")?;
/// let stream = alloc.context().new_stream()?;
/// let ptr = alloc.malloc(64 << 20, &stream)?; // a `CUdeviceptr` for work on `stream`
/// assert_eq!(alloc.allocated_bytes()?, 64 << 20);
/// alloc.free(ptr)?; // cached for the next request on `stream`
/// alloc.empty_cache()?;
/// assert_eq!(alloc.reserved_bytes()?, 0);
/// # Ok::<(), alloc_cuda::CudaError>(())
/// ```
pub struct CudaAllocator<P: Policy = AnyPolicy> {
    inner: Arc<Inner<P>>,
}

impl<P: Policy> Clone for CudaAllocator<P> {
    fn clone(&self) -> Self {
        CudaAllocator {
            inner: self.inner.clone(),
        }
    }
}

impl<P: Policy> std::fmt::Debug for CudaAllocator<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaAllocator")
            .field("ordinal", &self.inner.ordinal)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// Builds the policy (rejecting, e.g., expandable segments with a policy
/// that cannot grow segments): no driver call.
fn policy_for(config: &AllocatorConfig) -> Result<AnyPolicy, CudaError> {
    Ok(AnyPolicy::from_config(config)?)
}

/// Refuses a configuration that a policy of the caller's own cannot
/// honour: one naming a policy, or asking for expandable segments from a
/// policy that cannot grow segments. No driver call.
fn check_own_policy<P: Policy>(policy: &P, config: &AllocatorConfig) -> Result<(), CudaError> {
    if let Some(name) = &config.policy {
        return Err(ConfigError::InvalidValue {
            key: "policy".into(),
            value: alloc_core::config::excerpt(name),
            reason: format!(
                "the allocator is given a policy of its own (`{}`)",
                policy.name()
            ),
        }
        .into());
    }
    Ok(alloc_core::check_growth(policy, config)?)
}

impl CudaAllocator {
    /// A new, independent allocator for device `ordinal` (in its primary
    /// context) with the policy the configuration names. Prefer
    /// [`CudaAllocator::global`] for the process-wide one.
    pub fn new(ordinal: usize, config: &AllocatorConfig) -> Result<Self, CudaError> {
        let typed = AnyPolicy::typed(config)?;
        let policy = AnyPolicy::from_typed(&typed)?;
        Self::build(ordinal, policy, EngineOptions::from(&typed), config)
    }

    /// What `plan_layout` did so far (`None` unless it is on, with
    /// `pytorch-bfc`).
    pub fn plan_stats(&self) -> Result<Option<alloc_policy::layout_plan::PlanStats>, CudaError> {
        Ok(self.engine()?.policy().plan_stats())
    }

    /// [`CudaAllocator::new`] with a configuration string in the syntax of
    /// `PYTORCH_CUDA_ALLOC_CONF` (e.g. `policy:buddy,stream_wait_reuse:true`).
    pub fn with_config_str(ordinal: usize, config: &str) -> Result<Self, CudaError> {
        Self::new(ordinal, &AllocatorConfig::parse(config)?)
    }

    /// The process-wide allocator of device `ordinal`, created on first use
    /// with the configuration given to [`CudaAllocator::configure_global`]
    /// (default settings otherwise).
    pub fn global(ordinal: usize) -> Result<Self, CudaError> {
        let Some(slot) = GLOBALS.get(ordinal) else {
            return Err(CudaError::InvalidDevice {
                ordinal,
                count: driver::device_count()?,
            });
        };
        if let Some(a) = slot.get() {
            return Ok(a.clone());
        }
        let config = lock_consistent(&GLOBAL_CONFIG);
        if let Some(a) = slot.get() {
            return Ok(a.clone());
        }
        let alloc = Self::new(ordinal, &config.clone().unwrap_or_default())?;
        Ok(slot.get_or_init(|| alloc).clone())
    }

    /// Sets the configuration of the global allocators (a configuration
    /// string, or a setting's name such as `bound`, alone or followed by
    /// options: `alloc_core::config::NAMED_SETTINGS`); fails once one of
    /// them exists.
    pub fn configure_global(config: &str) -> Result<(), CudaError> {
        let parsed = AllocatorConfig::parse(config)?;
        policy_for(&parsed)?;
        let mut slot = lock_consistent(&GLOBAL_CONFIG);
        if let Some(ordinal) = GLOBALS.iter().position(|g| g.get().is_some()) {
            return Err(CudaError::AlreadyInitialized { ordinal });
        }
        *slot = Some(parsed);
        Ok(())
    }

    /// [`CudaAllocator::update_settings`] for the process-wide allocators:
    /// every one that exists, and the configuration later ones are made
    /// with. Stops at the first allocator that refuses (earlier ones keep
    /// the change).
    pub fn update_global_settings(settings: &str) -> Result<(), CudaError> {
        let mut slot = lock_consistent(&GLOBAL_CONFIG);
        let wanted = slot.clone().unwrap_or_default().with_settings(settings)?;
        policy_for(&wanted)?;
        for alloc in GLOBALS.iter().filter_map(|g| g.get()) {
            alloc.update_settings(settings)?;
        }
        *slot = Some(wanted);
        Ok(())
    }
}

impl<P: Policy> CudaAllocator<P> {
    /// A new allocator for device `ordinal` (in its primary context) that
    /// runs `policy`, a policy of your own (see `examples/custom_policy.rs`).
    /// The configuration's engine settings apply (`expandable_segments`,
    /// which the policy must support, `stream_wait_reuse`,
    /// `unmap_free_pages`, `garbage_collection_threshold`,
    /// `per_process_memory_fraction`); it must not name a `policy:`, and the
    /// settings of this crate's policies (`max_split_size_mb`, ...) are the
    /// policy's to read ([`Policy::reconfigure`]) or ignore.
    pub fn with_policy(
        ordinal: usize,
        policy: P,
        config: &AllocatorConfig,
    ) -> Result<Self, CudaError> {
        check_own_policy(&policy, config)?;
        Self::build(ordinal, policy, EngineOptions::from(config), config)
    }

    /// The allocator running `policy` with the engine `options`; `config`
    /// is the flat view they came from, kept for run-time settings.
    fn build(
        ordinal: usize,
        policy: P,
        options: EngineOptions,
        config: &AllocatorConfig,
    ) -> Result<Self, CudaError> {
        let count = driver::device_count()?;
        if ordinal >= count {
            return Err(CudaError::InvalidDevice { ordinal, count });
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e.0))?;
        let observer = ObserverSlot::default();
        let memory =
            CudaMemory::with_observer(ctx.clone(), observer.clone(), options.unmap_worker)?;
        let streams = CudaStreams::new(ctx.clone());
        let mut engine = Engine::new(policy, memory, streams, options);
        if engine.expandable_fallback() {
            NO_VIRTUAL_MEMORY.say();
        }
        if let Some(fraction) = config.per_process_memory_fraction {
            engine.set_memory_fraction(fraction)?;
        }
        Ok(CudaAllocator {
            inner: Arc::new(Inner {
                ordinal,
                ctx,
                config: Mutex::new(config.clone()),
                state: SpinParkMutex::new(State {
                    engine,
                    buffers: BufferRanges::default(),
                }),
                observer,
                sleep: HostBackups::default(),
            }),
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device's primary context: create streams here
    /// (`alloc.context().new_stream()`).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The configuration in effect: the one the allocator was made with,
    /// changed by [`CudaAllocator::update_settings`].
    pub fn config(&self) -> AllocatorConfig {
        self.lock_config().clone()
    }

    fn lock_config(&self) -> MutexGuard<'_, AllocatorConfig> {
        // A configuration is replaced whole, never left half-written.
        lock_consistent(&self.inner.config)
    }

    /// Changes the settings that `settings` names (in the configuration's
    /// syntax) from the next allocation on, as PyTorch's
    /// `torch.cuda.memory._set_allocator_settings` does: rounding,
    /// `max_split_size_mb`, garbage collection, expandable segments, stream
    /// reuse, `per_process_memory_fraction` (applied as
    /// [`CudaAllocator::set_memory_fraction`]). A string naming an option
    /// that cannot change any more (the policy, `unmap_free_pages`) is
    /// refused and nothing changes.
    pub fn update_settings(&self, settings: &str) -> Result<(), CudaError> {
        let mut engine = self.engine()?;
        let mut config = self.lock_config();
        let wanted = config.with_settings(settings)?;
        if wanted.policy != config.policy {
            return Err(CudaError::Alloc(alloc_core::AllocError::InvalidArgument(
                "`policy` cannot change while the allocator runs".into(),
            )));
        }
        engine.reconfigure(&wanted)?;
        if engine.expandable_fallback() {
            NO_VIRTUAL_MEMORY.say();
        }
        if wanted.per_process_memory_fraction != config.per_process_memory_fraction {
            if let Some(fraction) = wanted.per_process_memory_fraction {
                engine.set_memory_fraction(fraction)?;
            }
        }
        *config = wanted;
        Ok(())
    }

    /// Whether two handles share one allocator.
    pub fn same_allocator(&self, other: &CudaAllocator<P>) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Runs `f` on the engine, read-only, under the allocator's lock (its
    /// heap, statistics, snapshot, backends). Keep `f` short: every other
    /// thread using this device's allocator waits for it.
    pub fn inspect<R>(&self, f: impl FnOnce(&CudaEngine<P>) -> R) -> Result<R, CudaError> {
        Ok(f(&*self.engine()?))
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
    /// [`CudaAllocator::set_pool_source`].
    pub unsafe fn with_engine<R>(
        &self,
        f: impl FnOnce(&mut CudaEngine<P>) -> R,
    ) -> Result<R, CudaError> {
        Ok(f(&mut *self.engine()?))
    }

    /// The engine and buffers, locked; after a panic with the lock held,
    /// only once the engine passes its own invariant check (see
    /// [`crate::lock`]).
    #[inline]
    fn state(&self) -> Result<SpinParkGuard<'_, State<P>>, CudaError> {
        self.inner
            .state
            .lock_checked(|state| state.engine.validate())
    }

    /// The engine, locked.
    pub(crate) fn engine(&self) -> Result<EngineGuard<'_, P>, CudaError> {
        Ok(EngineGuard(self.state()?))
    }

    /// Allocates at least `size` bytes for use on `stream` (a cudarc
    /// stream, or a [`crate::StreamHandle`]); returns the device address.
    /// Out of memory (after freeing the cache) is an
    /// [`alloc_core::AllocError::OutOfMemory`] with the device's capacity and
    /// free bytes; a cudarc stream of another context is
    /// [`CudaError::WrongContext`].
    pub fn malloc<S: AsStream + ?Sized>(&self, size: u64, stream: &S) -> Result<u64, CudaError> {
        self.malloc_in_pool(size, stream, None)
    }

    /// [`CudaAllocator::malloc`] from the private `pool` when one is given
    /// (see [`CudaAllocator::begin_allocate_to_pool`]). While a capture is
    /// underway, driver allocations run in relaxed capture mode so that a
    /// graph captured in global mode stays valid.
    pub fn malloc_in_pool<S: AsStream + ?Sized>(
        &self,
        size: u64,
        stream: &S,
        pool: Option<PoolId>,
    ) -> Result<u64, CudaError> {
        let allocation = self.state()?.malloc(size, stream_ref(stream), pool)?;
        Ok(allocation.addr)
    }

    /// A block for a typed buffer on `stream` (from `pool` if one is
    /// given), claimed as the buffer's: the policy's block must not overlap
    /// another live buffer's, and only [`CudaAllocator::free_buffer`] frees
    /// it.
    pub(crate) fn malloc_buffer(
        &self,
        size: u64,
        stream: &Arc<CudaStream>,
        pool: Option<PoolId>,
    ) -> Result<u64, CudaError> {
        let mut state = self.state()?;
        let block = state.malloc(size, StreamRef::Cudarc(stream), pool)?;
        if !state.buffers.claim(block.addr, block.size, pool) {
            // Left allocated: handing it back to a policy that gives blocks
            // out twice would only spread the damage.
            return Err(CudaError::OverlappingBlock {
                addr: block.addr,
                size: block.size,
            });
        }
        Ok(block.addr)
    }

    /// Frees the block of a typed buffer being dropped.
    pub(crate) fn free_buffer(&self, ptr: u64) -> Result<(), CudaError> {
        let mut state = self.state()?;
        state.buffers.release(ptr);
        Ok(state.engine.free(ptr)?)
    }

    /// Starts routing allocations that name `pool` to that private pool (a
    /// CUDA graph capture or a `MemPool` context begins) and holds the pool.
    /// Until the matching [`CudaAllocator::end_allocate_to_pool`], no event is
    /// queried or recorded and no memory goes back to the driver.
    pub fn begin_allocate_to_pool(&self, pool: PoolId) -> Result<(), CudaError> {
        self.engine()?.begin_allocate_to_pool(pool);
        Ok(())
    }

    /// Ends a routing begun by [`CudaAllocator::begin_allocate_to_pool`].
    pub fn end_allocate_to_pool(&self, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.engine()?.end_allocate_to_pool(pool)?)
    }

    /// One more holder of `pool`.
    pub fn retain_pool(&self, pool: PoolId) -> Result<(), CudaError> {
        self.engine()?.retain_pool(pool);
        Ok(())
    }

    /// One holder of `pool` fewer (a graph was deleted); with none left its
    /// idle segments go back to the driver.
    pub fn release_pool(&self, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.engine()?.release_pool(pool)?)
    }

    /// Returns the idle segments of the private pool `pool` to the driver,
    /// and nothing else (see [`alloc_core::Engine::empty_pool_cache`]).
    pub fn empty_pool_cache(&self, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.engine()?.empty_pool_cache(pool)?)
    }

    /// Reports every later segment allocation, free, mapping and unmapping
    /// of this allocator to `observer` (`None` stops it). The observer runs
    /// with the allocator's lock held and must not call back into it.
    pub fn set_segment_observer(&self, observer: Option<SegmentObserver>) {
        self.inner.observer.set(observer);
    }

    /// Makes the private `pool` take its segments from `source` and give
    /// them back to it; see [`alloc_core::Engine::set_pool_source`].
    ///
    /// # Safety
    /// Every segment `source` hands out is device memory of this device's
    /// primary context, of the size asked for, used by nothing else until
    /// it is given back.
    pub unsafe fn set_pool_source(
        &self,
        pool: PoolId,
        source: Box<dyn SegmentSource>,
    ) -> Result<(), CudaError> {
        Ok(self.engine()?.set_pool_source(pool, source)?)
    }

    /// Makes `pool` hand out whole blocks, never split; see
    /// [`alloc_core::Engine::set_pool_no_split`].
    pub fn set_pool_no_split(&self, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.engine()?.set_pool_no_split(pool)?)
    }

    /// Holders of `pool`.
    pub fn pool_use_count(&self, pool: PoolId) -> Result<u32, CudaError> {
        Ok(self.engine()?.pool_use_count(pool))
    }

    /// Saves the layout of the private pool `pool` (CUDA graph trees); see
    /// [`alloc_core::Engine::checkpoint_pool`].
    pub fn checkpoint_pool(&self, pool: PoolId) -> Result<PoolCheckpoint, CudaError> {
        Ok(self.engine()?.checkpoint_pool(pool)?)
    }

    /// Puts a private pool back into a checkpointed layout; see
    /// [`alloc_core::Engine::restore_pool`]. A pool holding a live
    /// [`crate::DeviceBuffer`]'s block (a sleep tag's) is refused: the
    /// restore would free it under the buffer.
    pub fn restore_pool(&self, checkpoint: &PoolCheckpoint) -> Result<RestoreOutcome, CudaError> {
        let mut state = self.state()?;
        if state.buffers.in_pool(checkpoint.pool) {
            return Err(CudaError::Alloc(alloc_core::AllocError::InvalidArgument(
                format!(
                    "restore_pool of pool {:?}: a live DeviceBuffer holds a block of it",
                    checkpoint.pool
                ),
            )));
        }
        Ok(state.engine.restore_pool(checkpoint)?)
    }

    /// Whether the blocks allocated in `pool` are exactly `expected`.
    pub fn pool_live_allocations_are(
        &self,
        pool: PoolId,
        expected: &std::collections::HashSet<u64>,
    ) -> Result<bool, CudaError> {
        Ok(self.engine()?.pool_live_allocations_are(pool, expected))
    }

    /// Frees a block from [`CudaAllocator::malloc`]. If other streams used
    /// it (`record_stream`), it becomes reusable once events recorded on
    /// them now have completed. A block a live [`crate::DeviceBuffer`]
    /// owns is refused ([`CudaError::OwnedByBuffer`]): dropping the buffer
    /// frees it.
    pub fn free(&self, ptr: u64) -> Result<(), CudaError> {
        let mut state = self.state()?;
        if state.buffers.owns(ptr) {
            return Err(CudaError::OwnedByBuffer { addr: ptr });
        }
        Ok(state.engine.free(ptr)?)
    }

    /// Marks the block at `ptr` as used by `stream` too (PyTorch's
    /// `Tensor.record_stream`): its free records an event there and defers
    /// reuse until that event completes. The allocator keeps a cudarc
    /// stream alive until then.
    pub fn record_stream<S: AsStream + ?Sized>(
        &self,
        ptr: u64,
        stream: &S,
    ) -> Result<(), CudaError> {
        let mut state = self.state()?;
        let id = state.register(stream_ref(stream))?;
        Ok(state.engine.record_stream(ptr, id)?)
    }

    /// Polls pending events now (`malloc` does it too).
    pub fn process_events(&self) -> Result<(), CudaError> {
        Ok(self.engine()?.process_events()?)
    }

    /// Waits for every pending event, then returns every unused cached
    /// segment to the driver, and lets go of the streams the allocator no
    /// longer uses (a cudarc stream its owner dropped is destroyed now).
    pub fn empty_cache(&self) -> Result<(), CudaError> {
        let mut state = self.state()?;
        let emptied = state.engine.empty_cache();
        state.prune_streams();
        Ok(emptied?)
    }

    /// Limits reserved memory to `fraction` [0, 1] of the device's capacity.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), CudaError> {
        Ok(self.engine()?.set_memory_fraction(fraction)?)
    }

    /// The reserved-bytes limit from [`CudaAllocator::set_memory_fraction`].
    pub fn memory_limit(&self) -> Result<Option<u64>, CudaError> {
        Ok(self.engine()?.memory_limit())
    }

    /// The block at `ptr`, if allocated.
    pub fn allocation(&self, ptr: u64) -> Result<Option<Allocation>, CudaError> {
        Ok(self.engine()?.allocation(ptr))
    }

    /// A copy of the statistics (PyTorch's `memory_stats` model).
    pub fn stats(&self) -> Result<Stats, CudaError> {
        Ok(self.engine()?.stats())
    }

    /// Bytes currently reserved from the device.
    pub fn reserved_bytes(&self) -> Result<u64, CudaError> {
        Ok(self.engine()?.reserved_bytes())
    }

    /// Bytes currently handed out.
    pub fn allocated_bytes(&self) -> Result<u64, CudaError> {
        Ok(self.engine()?.allocated_bytes())
    }

    /// Makes every peak statistic equal to its current value.
    pub fn reset_peak_stats(&self) -> Result<(), CudaError> {
        self.engine()?.reset_peak_stats();
        Ok(())
    }

    /// Clears cumulative counters.
    pub fn reset_accumulated_stats(&self) -> Result<(), CudaError> {
        let mut engine = self.engine()?;
        engine.reset_accumulated_stats();
        engine.streams_mut().reset_op_counts();
        Ok(())
    }

    /// Every segment with its blocks.
    pub fn snapshot(&self) -> Result<Snapshot, CudaError> {
        Ok(self.engine()?.snapshot())
    }

    /// Checks the engine's invariants; `Ok(Err(description))` on a violation.
    pub fn validate(&self) -> Result<Result<(), String>, CudaError> {
        Ok(self.engine()?.validate())
    }

    /// Blocks freed while other streams still used them.
    pub fn awaiting_events(&self) -> Result<usize, CudaError> {
        Ok(self.engine()?.awaiting_events())
    }

    /// What the engine asked of streams and events (host waits, stream
    /// waits, event records and queries) since creation or the last
    /// [`CudaAllocator::reset_accumulated_stats`].
    pub fn stream_op_counts(&self) -> Result<StreamOpCounts, CudaError> {
        Ok(self.engine()?.streams().op_counts())
    }

    /// Counters of the CUDA event recycler.
    pub fn event_stats(&self) -> Result<EventRecyclerStats, CudaError> {
        Ok(self.engine()?.streams().event_stats())
    }

    /// The policy's name.
    pub fn policy_name(&self) -> Result<String, CudaError> {
        Ok(self.engine()?.policy().name().to_string())
    }

    /// Makes the existing private pool `pool` (a PyTorch `MemPool` with no
    /// segment yet) the pool of the new sleep tag `name`.
    pub fn bind_tag(&self, name: &str, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.engine()?.bind_tag(name, pool)?)
    }

    /// Every sleep tag with its state and memory.
    pub fn tags(&self) -> Result<Vec<TagInfo>, CudaError> {
        Ok(self.engine()?.tags())
    }

    /// The process-wide pinned host pool that backups go to.
    pub fn pinned_pool(&self) -> Result<Arc<PinnedAllocator>, CudaError> {
        PinnedAllocator::global()
    }

    /// Pauses the sleep tag `tag`: waits (host, through events) for the
    /// streams that used its blocks, never the whole device; with
    /// [`Backup::Host`] copies its live blocks to pinned host memory; then
    /// unmaps and releases every page of its segments (`cuMemUnmap`,
    /// `cuMemRelease`), keeping the address ranges. `cuMemGetInfo` shows
    /// the memory given back. Allocating from the tag fails until
    /// [`CudaAllocator::resume`]; freeing its blocks is fine.
    pub fn pause(&self, tag: &str, backup: Backup) -> Result<PauseReport, CudaError> {
        self.inner
            .sleep
            .pause(&self.inner.ctx, || self.engine(), tag, backup)
    }

    /// Resumes the paused sleep tag `tag`: maps fresh memory at the same
    /// addresses (freeing this allocator's other idle cache first if the
    /// device is full) and copies host backups back before returning.
    /// Out of memory leaves the tag paused, its backup kept.
    pub fn resume(&self, tag: &str) -> Result<ResumeReport, CudaError> {
        self.inner
            .sleep
            .resume(&self.inner.ctx, || self.engine(), tag)
    }

    /// The memory shared with another process for the live block that
    /// contains `ptr` (see [`SharedRange`]); `Ok(None)` when `ptr` is not
    /// in memory of this allocator.
    pub fn shared_range(&self, ptr: u64) -> Result<Option<SharedRange>, CudaError> {
        self.inspect(|e| ipc::shared_range(e, ptr))?
    }

    /// The pages of an expandable segment under the live block that
    /// contains `ptr`, exported as POSIX file descriptors of this process
    /// (each physical page once; the descriptors stay open, owned by the
    /// allocator, until the page's memory is released). `Ok(None)` when
    /// `ptr` is not in memory of this allocator; an error for a block of a
    /// `cuMemAlloc` segment (shared with `cuIpcGetMemHandle` instead).
    pub fn export_pages(&self, ptr: u64) -> Result<Option<SharedPages>, CudaError> {
        self.inspect(|e| ipc::export_pages(e, ptr))?
    }

    /// `(free, total)` bytes of the device from `cuMemGetInfo` (no lock).
    pub fn mem_get_info(&self) -> Result<(u64, u64), CudaError> {
        driver::bind(&self.inner.ctx)?;
        driver::mem_get_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn handle_is_send_and_sync() {
        assert_send_sync::<CudaAllocator>();
    }

    fn assert_unwind_safe<T: std::panic::UnwindSafe + std::panic::RefUnwindSafe>() {}

    #[test]
    fn handle_can_cross_catch_unwind() {
        // A panic under the lock poisons it, and the next call checks the
        // engine (crate::lock): the handle stays usable after one.
        assert_unwind_safe::<CudaAllocator>();
    }

    // These fail before any driver call, so they run without a GPU and
    // without loading libcuda.
    #[test]
    fn expandable_segments_need_a_growable_policy() {
        let e =
            CudaAllocator::with_config_str(0, "policy:buddy,expandable_segments:True").unwrap_err();
        assert!(matches!(e, CudaError::Config(_)), "{e}");
        assert!(e.to_string().contains("expandable_segments"));
    }

    #[test]
    fn a_policy_of_ones_own_refuses_what_it_cannot_honour() {
        let buddy = AllocatorConfig::parse("policy:buddy").unwrap();
        let own = || AnyPolicy::from_config(&buddy).unwrap();
        // The configuration may not name another policy...
        let e = CudaAllocator::with_policy(0, own(), &buddy).unwrap_err();
        assert!(matches!(e, CudaError::Config(_)), "{e}");
        assert!(
            e.to_string().contains("a policy of its own (`buddy`)"),
            "{e}"
        );
        // ...nor ask for growable segments from a policy without them.
        let grow = AllocatorConfig::parse("expandable_segments:True").unwrap();
        let e = CudaAllocator::with_policy(0, own(), &grow).unwrap_err();
        assert!(matches!(e, CudaError::Config(_)), "{e}");
        assert!(
            e.to_string().contains("does not support growable segments"),
            "{e}"
        );
    }

    #[test]
    fn bad_configuration_is_a_typed_error() {
        let e = CudaAllocator::with_config_str(0, "policy:no-such-policy").unwrap_err();
        assert!(matches!(e, CudaError::Config(_)), "{e}");
        assert!(e.to_string().contains("no-such-policy"));
        let e = CudaAllocator::with_config_str(0, "max_split_size_mb:1").unwrap_err();
        assert!(matches!(e, CudaError::Config(_)), "{e}");
        let e = CudaAllocator::configure_global("bogus:1").unwrap_err();
        assert!(matches!(e, CudaError::Config(_)), "{e}");
    }
}
