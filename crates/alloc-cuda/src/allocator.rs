//! The thread-safe allocator handle: one engine per device behind a lock,
//! and the facade a user needs every day (construction, `malloc`, `free`,
//! `record_stream`, `empty_cache`, statistics, settings). The rest is
//! reached through parts, each a type in a file of its own above this one
//! that borrows the allocator: [`crate::Pools`] (`pools()`: private pools
//! and their checkpoints), [`crate::SleepWake`] (`sleep()`: sleep tags),
//! [`crate::Ipc`] (`ipc()`: sharing with another process) and
//! [`crate::Diagnostics`] (`diagnostics()`: checks, counters, the engine
//! itself). What the allocator holds for them is kept here: [`BufferRanges`]
//! keeps live typed buffers' blocks apart, [`HostBackups`] copies paused
//! sleep tags to the host and back. The handles that hold an allocator
//! ([`crate::DeviceBuffer`], [`crate::Tag`]) are built in their own files
//! too, so that no file uses one that uses it back.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use alloc_core::{
    Allocation, AllocatorConfig, ConfigError, Engine, EngineOptions, Policy, PoolId, Snapshot,
    Stats, StreamId,
};
use alloc_policy::AnyPolicy;
use cudarc::driver::{CudaContext, CudaStream};

use crate::buffer_ranges::BufferRanges;
use crate::driver;
use crate::error::{driver_error, CudaError};
use crate::events::CudaStreams;
use crate::lock::{lock_consistent, SpinParkGuard, SpinParkMutex};
use crate::memory::CudaMemory;
use crate::notice::NO_VIRTUAL_MEMORY;
use crate::observer::ObserverSlot;
use crate::sleep::HostBackups;
use crate::stream::{stream_ref, AsStream, StreamRef};
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

    /// [`malloc_registered`] on `stream`, registered first.
    fn malloc(
        &mut self,
        size: u64,
        stream: StreamRef<'_>,
        pool: Option<PoolId>,
    ) -> Result<Allocation, CudaError> {
        let id = self.register(stream)?;
        malloc_registered(&mut self.engine, size, id, pool)
    }
}

/// The engine's `malloc_in` on a registered stream; while a capture is
/// underway, driver allocations run in relaxed capture mode so that a graph
/// captured in global mode stays valid.
pub(crate) fn malloc_registered<P: Policy>(
    engine: &mut CudaEngine<P>,
    size: u64,
    stream: StreamId,
    pool: Option<PoolId>,
) -> Result<Allocation, CudaError> {
    let _relaxed = if engine.capture_underway() {
        Some(driver::RelaxedCaptureMode::enter()?)
    } else {
        None
    };
    Ok(engine.malloc_in(size, stream, pool)?)
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

/// Refuses `engine_per_stream`: this allocator runs one engine a device
/// (no driver call).
fn one_engine_a_device(config: &AllocatorConfig) -> Result<(), CudaError> {
    if config.engine_per_stream {
        return Err(ConfigError::InvalidValue {
            key: "engine_per_stream".into(),
            value: "True".into(),
            reason: "CudaAllocator runs one engine a device: an engine per stream is \
                     StreamEngines' (which the C library serves under this setting)"
                .into(),
        }
        .into());
    }
    Ok(())
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

    /// The configuration the process-wide allocators are made with
    /// ([`CudaAllocator::configure_global`], default settings otherwise).
    pub fn global_config() -> AllocatorConfig {
        lock_consistent(&GLOBAL_CONFIG).clone().unwrap_or_default()
    }

    /// [`CudaAllocator::update_settings`] for the process-wide allocators:
    /// every one that exists, and the configuration later ones are made
    /// with. Stops at the first allocator that refuses (earlier ones keep
    /// the change).
    pub fn update_global_settings(settings: &str) -> Result<(), CudaError> {
        let mut slot = lock_consistent(&GLOBAL_CONFIG);
        let was = slot.clone().unwrap_or_default();
        let wanted = was.with_settings(settings)?;
        policy_for(&wanted)?;
        if wanted.engine_per_stream != was.engine_per_stream {
            return Err(CudaError::Alloc(alloc_core::AllocError::InvalidArgument(
                "`engine_per_stream` cannot change once configured (gpualloc_configure or \
                 GPUALLOC_CONF decide it)"
                    .into(),
            )));
        }
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
        one_engine_a_device(config)?;
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
        one_engine_a_device(&wanted)?;
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

    /// The engine, locked, and whether a live [`crate::DeviceBuffer`]
    /// holds a block of `pool` (what would free a pool's blocks wholesale
    /// must not run then: the buffer would go on using the memory).
    pub(crate) fn engine_and_buffers_in(
        &self,
        pool: PoolId,
    ) -> Result<(EngineGuard<'_, P>, bool), CudaError> {
        let state = self.state()?;
        let held = state.buffers.in_pool(pool);
        Ok((EngineGuard(state), held))
    }

    /// The host copies of paused sleep tags.
    pub(crate) fn host_backups(&self) -> &HostBackups {
        &self.inner.sleep
    }

    /// Where segment events are reported.
    pub(crate) fn observer_slot(&self) -> &ObserverSlot {
        &self.inner.observer
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
    /// (see [`crate::Pools::begin_allocate_to`]). While a capture is
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
