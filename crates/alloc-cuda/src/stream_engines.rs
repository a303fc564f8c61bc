//! Engines per stream: an allocator for one device that runs an engine for
//! each stream its allocations are made on, so that threads allocating on
//! their own streams do not queue on one lock (docs/architecture.md,
//! "Threads"). In PyTorch's model a block is only ever reused on its own
//! stream, so splitting the engine by stream changes no decision; what the
//! engines share is the device's statistics ([`DeviceTotals`], one atomic
//! add a changed value) and, for frees, a table from address to engine in
//! stripes with a lock each. What spans streams visits every engine, one
//! lock at a time: emptying the cache, and before an out-of-memory error,
//! emptying the other engines' caches and trying again. Until a second
//! stream allocates, the one engine's statistics are the device's and no
//! table is kept, so a program with one stream pays little for the design
//! (docs/benchmarks.md, "Engines per stream in the library").
//!
//! The memory fraction (`per_process_memory_fraction`,
//! [`StreamEngines::set_memory_fraction`]) is one limit on the bytes all
//! the engines reserve together, counted by their memory backends before
//! each driver call that would grow them. Settings whose decisions span
//! streams are refused for now: `stream_wait_reuse`, `unmap_free_pages`
//! and the memory budget, and `garbage_collection_threshold` (which reads
//! the device's reserved bytes on every allocation).
//! Private pools, sleep tags, IPC and typed buffers are [`crate::CudaAllocator`]'s.
//! The C library serves each device through this type under
//! `engine_per_stream:True` ([`AllocatorConfig::engine_per_stream`]). With
//! `engine_per_thread:True` too ([`AllocatorConfig::engine_per_thread`])
//! each stream has an engine for each thread that allocates on it, so that
//! threads sharing a stream do not queue on one lock either.
//! An engine holds the cudarc streams it served until the allocator is
//! dropped (so no new stream takes a live one's handle value).
//!
//! ```no_run
//! use alloc_cuda::StreamEngines;
//!
//! let alloc = StreamEngines::with_config_str(0, "max_split_size_mb:128")?;
//! let (a, b) = (alloc.context().new_stream()?, alloc.context().new_stream()?);
//! let x = alloc.malloc(1 << 20, &a)?; // served by the engine of `a`
//! let y = alloc.malloc(1 << 20, &b)?; // by the engine of `b`, under its own lock
//! assert_eq!(alloc.allocated_bytes()?, 2 << 20);
//! alloc.free(x)?;
//! alloc.free(y)?;
//! assert_eq!(alloc.stats()?.allocated_bytes.all.peak, 2 << 20);
//! alloc.empty_cache()?;
//! # Ok::<(), alloc_cuda::CudaError>(())
//! ```

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use alloc_core::{
    fraction_limit, AllocError, AllocatorConfig, ConfigError, DeviceTotals, Engine, EngineOptions,
    Levels, Snapshot, SnapshotState, Stats, StreamId,
};
use alloc_policy::AnyPolicy;
use cudarc::driver::CudaContext;

use crate::allocator::malloc_registered;
use crate::device_limit::DeviceLimit;
use crate::error::{driver_error, CudaError};
use crate::events::CudaStreams;
use crate::lock::{lock_consistent, SpinParkGuard, SpinParkMutex};
use crate::memory::CudaMemory;
use crate::observer::ObserverSlot;
use crate::stream::{stream_ref, AsStream, StreamRef};
use crate::{driver, CudaEngine};

/// Engines a device may have; a stream beyond them shares the last one
/// (an engine serves any number of streams, as [`crate::CudaAllocator`]'s
/// one does).
pub const MAX_STREAM_ENGINES: usize = 256;

/// One stream's engine.
struct ShardState {
    engine: CudaEngine,
}

impl ShardState {
    /// Publishes what the last operation changed, once the device has more
    /// than one engine ([`Inner::shared`]).
    #[inline]
    fn publish(&mut self, inner: &Inner) {
        if inner.shared.load(Ordering::Acquire) {
            self.engine.publish_to(&inner.totals);
        }
    }
}

/// An engine behind its lock.
struct Shard(SpinParkMutex<ShardState>);

impl Shard {
    fn lock(&self) -> Result<SpinParkGuard<'_, ShardState>, CudaError> {
        self.0.lock_checked(|s| s.engine.validate())
    }
}

impl Drop for Shard {
    fn drop(&mut self) {
        // As CudaAllocator's: idle segments go back; live ones stay.
        let _ = self.0.get_mut().engine.empty_cache();
    }
}

/// Hashes an address: blocks are 512-byte aligned, so the bits above
/// those, spread by a multiply.
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(SPREAD);
        }
    }
    fn write_u64(&mut self, addr: u64) {
        self.0 = (addr >> 9).wrapping_mul(SPREAD);
    }
}

const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;
const STRIPES: usize = 64;

/// Which engine holds each live block, for frees: one stripe of the
/// table, on cache lines of its own.
#[repr(align(128))]
#[derive(Default)]
struct Stripe(SpinParkMutex<HashMap<u64, u32, BuildHasherDefault<AddrHasher>>>);

fn stripe_of(addr: u64) -> usize {
    ((addr >> 9).wrapping_mul(SPREAD) >> (64 - STRIPES.trailing_zeros())) as usize
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Numbers threads for `engine_per_thread` (0: no thread of its own).
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

/// The numbers of threads that ended, which new threads take first: a new
/// thread takes over an ended thread's engines and what they cache, so a
/// pool whose threads come and go keeps as many engines as it has threads
/// at once.
static ENDED_THREADS: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// A thread's number under `engine_per_thread`, given back when the thread
/// ends.
struct ThreadNumber(Cell<u64>);

impl ThreadNumber {
    /// The number, taken on first use: an ended thread's, else a new one.
    fn get(&self) -> u64 {
        if self.0.get() == 0 {
            let ended = lock_consistent(&ENDED_THREADS).pop();
            self.0
                .set(ended.unwrap_or_else(|| NEXT_THREAD.fetch_add(1, Ordering::Relaxed)));
        }
        self.0.get()
    }
}

impl Drop for ThreadNumber {
    fn drop(&mut self) {
        let n = self.0.get();
        if n != 0 {
            lock_consistent(&ENDED_THREADS).push(n);
        }
    }
}

thread_local! {
    /// This thread's number under `engine_per_thread`, taken on its first
    /// new stream there.
    static THREAD: ThreadNumber = const { ThreadNumber(Cell::new(0)) };
    /// The engines this thread used last: (allocator, stream, engine).
    static RECENT: RefCell<Vec<(u64, StreamId, u32)>> = const { RefCell::new(Vec::new()) };
    /// The one it used last of all, read first (allocator ids start at 1).
    static LAST: Cell<(u64, u64, u32)> = const { Cell::new((0, 0, 0)) };
}

/// Entries a thread remembers.
const RECENT_LEN: usize = 8;

struct Inner {
    /// Tells this allocator's entries in a thread's memory from others'.
    id: u64,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    config: AllocatorConfig,
    /// The policy the engines run, as the configuration resolves it.
    policy: String,
    observer: ObserverSlot,
    /// The engines, made on a stream's first allocation.
    shards: Box<[OnceLock<Shard>]>,
    /// Which engine serves each stream, and under `engine_per_thread` each
    /// stream and thread (read on a thread's first use of a stream only).
    by_stream: Mutex<HashMap<(StreamId, u64), u32>>,
    owners: Box<[Stripe]>,
    totals: DeviceTotals,
    /// The memory fraction's limit on the engines' reserved bytes together.
    limit: Arc<DeviceLimit>,
    /// The device's memory (`cuMemGetInfo`'s total), which a fraction is of.
    capacity: u64,
    /// Set when a second engine is made. Until then the one engine's
    /// statistics are the device's and nothing is published (a program
    /// with one stream pays nothing for the totals); then every engine
    /// publishes after each operation, the first one catching up at once
    /// with all it did (its peaks, never started again, are the device's).
    shared: AtomicBool,
    /// Allocations tried again after emptying the other engines' caches:
    /// the first try's engine counted an out-of-memory error that PyTorch's
    /// one engine, which empties every stream's cache before it gives up,
    /// would not have (the second try counts the one it would).
    retried_ooms: AtomicU64,
}

/// A caching allocator for one CUDA device with an engine for each stream
/// (see the module's documentation): `Send + Sync`, cheap to clone (clones
/// share the allocator). Statistics are the device's, exact as
/// [`crate::CudaAllocator`]'s; the streams are cudarc streams of the
/// device's primary context or [`crate::StreamHandle`]s.
#[derive(Clone)]
pub struct StreamEngines {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for StreamEngines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamEngines")
            .field("ordinal", &self.inner.ordinal)
            .field("engines", &self.engine_count())
            .finish_non_exhaustive()
    }
}

/// Refuses the settings whose decisions span streams (module docs).
fn check_config(config: &AllocatorConfig) -> Result<(), CudaError> {
    match config.spanning_streams() {
        Some((key, value)) => Err(ConfigError::InvalidValue {
            key: key.into(),
            value,
            reason: alloc_core::config::SPANS_STREAMS.into(),
        }
        .into()),
        None => Ok(()),
    }
}

impl StreamEngines {
    /// An allocator for device `ordinal` (its primary context) with the
    /// policy and settings of `config`; settings whose decisions span
    /// streams are a [`CudaError::Config`].
    pub fn new(ordinal: usize, config: &AllocatorConfig) -> Result<Self, CudaError> {
        check_config(config)?;
        let policy = AnyPolicy::typed(config)?.policy_name();
        let count = driver::device_count()?;
        if ordinal >= count {
            return Err(CudaError::InvalidDevice { ordinal, count });
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e.0))?;
        driver::bind(&ctx)?;
        let (_, capacity) = driver::mem_get_info()?;
        let limit = Arc::new(DeviceLimit::default());
        if let Some(f) = config.per_process_memory_fraction {
            limit.set(Some(fraction_limit(capacity, f)?));
        }
        Ok(StreamEngines {
            inner: Arc::new(Inner {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                ordinal,
                ctx,
                config: config.clone(),
                policy,
                observer: ObserverSlot::default(),
                shards: (0..MAX_STREAM_ENGINES).map(|_| OnceLock::new()).collect(),
                by_stream: Mutex::new(HashMap::new()),
                owners: (0..STRIPES).map(|_| Stripe::default()).collect(),
                totals: DeviceTotals::new(),
                limit,
                capacity,
                shared: AtomicBool::new(false),
                retried_ooms: AtomicU64::new(0),
            }),
        })
    }

    /// [`StreamEngines::new`] with a configuration string.
    pub fn with_config_str(ordinal: usize, config: &str) -> Result<Self, CudaError> {
        Self::new(ordinal, &AllocatorConfig::parse(config)?)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// Limits the bytes all the engines reserve together to `fraction` of
    /// the device's memory (PyTorch's `set_per_process_memory_fraction`;
    /// 0: no new segment at all). An engine that would pass it empties its
    /// cache and then the other engines' before it fails with out of
    /// memory.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), CudaError> {
        let inner = &self.inner;
        inner
            .limit
            .set(Some(fraction_limit(inner.capacity, fraction)?));
        Ok(())
    }

    /// The limit on reserved bytes that the memory fraction set, if any.
    pub fn memory_limit(&self) -> Option<u64> {
        self.inner.limit.limit()
    }

    /// The configuration the engines were made with.
    pub fn config(&self) -> &AllocatorConfig {
        &self.inner.config
    }

    /// The name of the policy the engines run (`policy:` as the
    /// configuration resolves it: the build's default where it names none).
    pub fn policy_name(&self) -> &str {
        &self.inner.policy
    }

    /// The device's primary context: create streams here.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// How many engines there are (streams allocated on, up to
    /// [`MAX_STREAM_ENGINES`]).
    pub fn engine_count(&self) -> usize {
        self.inner
            .shards
            .iter()
            .take_while(|s| s.get().is_some())
            .count()
    }

    /// A new engine with this allocator's configuration.
    fn make_shard(&self) -> Result<Shard, CudaError> {
        let inner = &self.inner;
        let typed = AnyPolicy::typed(&inner.config)?;
        let policy = AnyPolicy::from_typed(&typed)?;
        let options = EngineOptions::from(&typed);
        let memory = CudaMemory::with_observer(
            inner.ctx.clone(),
            inner.observer.clone(),
            options.unmap_worker,
        )?
        .sharing_limit(inner.limit.clone());
        let engine = Engine::new(policy, memory, CudaStreams::new(inner.ctx.clone()), options);
        Ok(Shard(SpinParkMutex::new(ShardState { engine })))
    }

    /// The engine of `stream`, made on its first use: from the thread's
    /// memory of its last engines, else from the table of streams.
    #[inline]
    fn shard_of(&self, stream: StreamId) -> Result<(u32, &Shard), CudaError> {
        let id = self.inner.id;
        let (a, s, i) = LAST.get();
        if a == id && s == stream.0 {
            return Ok((i, self.shard(i)));
        }
        self.shard_of_slow(stream)
    }

    /// [`Self::shard_of`] past the last engine the thread used.
    #[cold]
    fn shard_of_slow(&self, stream: StreamId) -> Result<(u32, &Shard), CudaError> {
        let id = self.inner.id;
        let known = RECENT.with(|r| {
            r.borrow()
                .iter()
                .find(|&&(a, s, _)| a == id && s == stream)
                .map(|&(_, _, i)| i)
        });
        let index = match known {
            Some(i) => i,
            None => {
                let i = self.index_of(stream)?;
                RECENT.with(|r| {
                    let mut r = r.borrow_mut();
                    r.retain(|&(a, s, _)| !(a == id && s == stream));
                    r.insert(0, (id, stream, i));
                    r.truncate(RECENT_LEN);
                });
                i
            }
        };
        LAST.set((id, stream.0, index));
        Ok((index, self.shard(index)))
    }

    /// The engine index of `stream` (and of the calling thread under
    /// `engine_per_thread`), a new engine for a new one.
    #[cold]
    fn index_of(&self, stream: StreamId) -> Result<u32, CudaError> {
        let key = (stream, self.thread_key());
        let mut by_stream = lock_consistent(&self.inner.by_stream);
        if let Some(&i) = by_stream.get(&key) {
            return Ok(i);
        }
        let next = self.engine_count();
        let index = next.min(MAX_STREAM_ENGINES - 1);
        if next < MAX_STREAM_ENGINES {
            let shard = self.make_shard()?;
            if next == 1 {
                self.share_the_device()?;
            }
            let _ = self.inner.shards[index].set(shard);
        }
        by_stream.insert(key, index as u32);
        Ok(index as u32)
    }

    /// The calling thread's number under `engine_per_thread`, else 0 (the
    /// engines are the streams').
    fn thread_key(&self) -> u64 {
        if !self.inner.config.engine_per_thread {
            return 0;
        }
        // A thread whose number is already given back (an allocation in
        // another thread-local's destructor) shares the stream's engine 0.
        THREAD.try_with(ThreadNumber::get).unwrap_or(0)
    }

    /// The device gets its second engine: under the first engine's lock
    /// (so that each of its operations falls wholly before or after), its
    /// live blocks go into the table of owners, the device starts
    /// publishing ([`Inner::shared`]), and what the first engine did so far
    /// goes to the totals.
    #[cold]
    fn share_the_device(&self) -> Result<(), CudaError> {
        let mut first = self.shard(0).lock()?;
        for segment in first.engine.snapshot().segments {
            for block in segment.blocks {
                if block.state == SnapshotState::ActiveAllocated {
                    self.stripe(block.address)?.insert(block.address, 0);
                }
            }
        }
        self.inner.shared.store(true, Ordering::Release);
        first.engine.publish_to(&self.inner.totals);
        Ok(())
    }

    /// The engine at `index` (made: indexes come from [`Self::index_of`]).
    fn shard(&self, index: u32) -> &Shard {
        self.inner.shards[index as usize]
            .get()
            .expect("an engine index is handed out once its engine is made")
    }

    /// Every engine made so far, in index order.
    fn shards(&self) -> impl Iterator<Item = &Shard> {
        self.inner.shards.iter().map_while(|s| s.get())
    }

    fn stripe(
        &self,
        addr: u64,
    ) -> Result<SpinParkGuard<'_, HashMap<u64, u32, BuildHasherDefault<AddrHasher>>>, CudaError>
    {
        self.inner.owners[stripe_of(addr)]
            .0
            .lock_checked(|_| Ok(()))
    }

    /// Allocates at least `size` bytes for use on `stream`; returns the
    /// device address. Out of memory after every engine's cache was
    /// emptied is an [`alloc_core::AllocError::OutOfMemory`].
    pub fn malloc<S: AsStream + ?Sized>(&self, size: u64, stream: &S) -> Result<u64, CudaError> {
        let sref = stream_ref(stream);
        let key = match sref {
            StreamRef::Cudarc(s) => crate::stream_id(s),
            StreamRef::Raw(id) => id,
        };
        let (index, shard) = self.shard_of(key)?;
        let (addr, shared) = match self.malloc_on(shard, size, sref) {
            Err(CudaError::Alloc(AllocError::OutOfMemory(_))) if self.engine_count() > 1 => {
                self.inner.retried_ooms.fetch_add(1, Ordering::Relaxed);
                self.empty_caches(Some(index))?;
                self.malloc_on(shard, size, sref)?
            }
            other => other?,
        };
        // With one engine, frees need no table (`share_the_device` fills it).
        if shared {
            self.stripe(addr)?.insert(addr, index);
        }
        Ok(addr)
    }

    /// The allocation on one engine, its change published; and whether the
    /// device had several engines then (read under the engine's lock).
    fn malloc_on(
        &self,
        shard: &Shard,
        size: u64,
        stream: StreamRef<'_>,
    ) -> Result<(u64, bool), CudaError> {
        let mut state = shard.lock()?;
        let id = state.engine.streams_mut().register_ref(stream)?;
        let got = malloc_registered(&mut state.engine, size, id, None);
        state.publish(&self.inner);
        Ok((got?.addr, self.inner.shared.load(Ordering::Acquire)))
    }

    /// Gives every engine's idle segments but `except`'s back to the
    /// driver, one engine at a time (no lock held while another is taken).
    #[cold]
    fn empty_caches(&self, except: Option<u32>) -> Result<(), CudaError> {
        for (i, shard) in self.shards().enumerate() {
            if Some(i as u32) != except {
                let mut state = shard.lock()?;
                let emptied = state.engine.empty_cache();
                state.publish(&self.inner);
                emptied?;
            }
        }
        Ok(())
    }

    /// The engine index that holds the live block at `ptr`; `take` also
    /// forgets it (a free).
    fn owner(&self, ptr: u64, take: bool) -> Result<u32, CudaError> {
        let unknown = || CudaError::Alloc(AllocError::UnknownPointer { addr: ptr });
        if !self.inner.shared.load(Ordering::Acquire) {
            // One engine, or none yet: whatever was handed out is its.
            return match self.inner.shards[0].get() {
                Some(_) => Ok(0),
                None => Err(unknown()),
            };
        }
        let mut stripe = self.stripe(ptr)?;
        let found = if take {
            stripe.remove(&ptr)
        } else {
            stripe.get(&ptr).copied()
        };
        found.ok_or_else(unknown)
    }

    /// Frees a block from [`StreamEngines::malloc`] into its stream's
    /// engine; a pointer this allocator did not hand out (or already
    /// freed) is [`alloc_core::AllocError::UnknownPointer`].
    pub fn free(&self, ptr: u64) -> Result<(), CudaError> {
        let index = self.owner(ptr, true)?;
        let mut state = self.shard(index).lock()?;
        let freed = state.engine.free(ptr);
        state.publish(&self.inner);
        Ok(freed?)
    }

    /// Marks the block at `ptr` as used by `stream` too
    /// (`Tensor.record_stream`): its free then waits for that stream's
    /// work, as [`crate::CudaAllocator::record_stream`] does.
    pub fn record_stream<S: AsStream + ?Sized>(
        &self,
        ptr: u64,
        stream: &S,
    ) -> Result<(), CudaError> {
        let index = self.owner(ptr, false)?;
        let mut state = self.shard(index).lock()?;
        let id = state
            .engine
            .streams_mut()
            .register_ref(stream_ref(stream))?;
        Ok(state.engine.record_stream(ptr, id)?)
    }

    /// Waits for pending events and gives every engine's idle segments
    /// back to the driver.
    pub fn empty_cache(&self) -> Result<(), CudaError> {
        self.empty_caches(None)
    }

    /// The device's current values: the totals', or the one engine's.
    fn levels(&self) -> Result<Levels, CudaError> {
        if self.inner.shared.load(Ordering::Acquire) {
            return Ok(self.inner.totals.current());
        }
        match self.shards().next() {
            Some(one) => Ok(one.lock()?.engine.levels()),
            None => Ok(Levels::default()),
        }
    }

    /// Bytes handed out now, device-wide.
    pub fn allocated_bytes(&self) -> Result<u64, CudaError> {
        Ok(self.levels()?.allocated_bytes() as u64)
    }

    /// Bytes reserved from the device now.
    pub fn reserved_bytes(&self) -> Result<u64, CudaError> {
        Ok(self.levels()?.reserved_bytes() as u64)
    }

    /// Every engine, locked in index order (so that two callers of this
    /// never wait on each other crosswise).
    fn lock_all(&self) -> Result<Vec<SpinParkGuard<'_, ShardState>>, CudaError> {
        self.shards().map(Shard::lock).collect()
    }

    /// The device's statistics in PyTorch's model: current values and
    /// peaks device-wide, exact (see [`DeviceTotals`]).
    pub fn stats(&self) -> Result<Stats, CudaError> {
        let states = self.lock_all()?;
        let each: Vec<Stats> = states.iter().map(|s| s.engine.stats()).collect();
        if !self.inner.shared.load(Ordering::Acquire) {
            return Ok(each.into_iter().next().unwrap_or_default());
        }
        let mut stats = self.inner.totals.combine(&each);
        stats.num_ooms = stats
            .num_ooms
            .saturating_sub(self.inner.retried_ooms.load(Ordering::Relaxed));
        Ok(stats)
    }

    /// Makes every peak equal to its current value.
    pub fn reset_peak_stats(&self) -> Result<(), CudaError> {
        let mut states = self.lock_all()?;
        for s in &mut states {
            s.engine.reset_peak_stats();
            s.publish(&self.inner);
        }
        if self.inner.shared.load(Ordering::Acquire) {
            self.inner.totals.reset_peaks();
        }
        Ok(())
    }

    /// Clears cumulative counters.
    pub fn reset_accumulated_stats(&self) -> Result<(), CudaError> {
        let states = self.lock_all()?;
        for mut s in states {
            s.engine.reset_accumulated_stats();
        }
        self.inner.retried_ooms.store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Every engine's segments with their blocks, in address order.
    pub fn snapshot(&self) -> Result<Snapshot, CudaError> {
        let states = self.lock_all()?;
        let mut segments: Vec<_> = states
            .iter()
            .flat_map(|s| s.engine.snapshot().segments)
            .collect();
        segments.sort_by_key(|s| s.address);
        Ok(Snapshot { segments })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_that_span_streams_are_refused_before_any_driver_call() {
        for conf in [
            "stream_wait_reuse:True",
            "expandable_segments:True,unmap_free_pages:True",
            "garbage_collection_threshold:0.8",
        ] {
            let e = StreamEngines::with_config_str(0, conf).unwrap_err();
            assert!(matches!(e, CudaError::Config(_)), "{conf}: {e}");
            assert!(e.to_string().contains("span streams"), "{e}");
        }
    }

    #[test]
    fn stripes_spread_neighbouring_blocks() {
        let used: std::collections::BTreeSet<usize> = (0..64u64)
            .map(|k| stripe_of(0x7f00_0000_0000 + k * 512))
            .collect();
        assert!(used.len() > 32, "{used:?}");
        assert!(used.iter().all(|&s| s < STRIPES));
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn handle_is_send_and_sync() {
        assert_send_sync::<StreamEngines>();
    }
}

#[cfg(test)]
mod null_driver_tests {
    use super::*;
    use cudarc::driver::CudaStream;
    use std::sync::Barrier;

    const MIB: u64 = 1 << 20;

    /// An allocator under `config` and two streams of its device.
    pub(super) fn two_streams(config: &str) -> (StreamEngines, Arc<CudaStream>, Arc<CudaStream>) {
        let alloc = StreamEngines::with_config_str(0, config).unwrap();
        let new = || alloc.context().new_stream().unwrap();
        let (a, b) = (new(), new());
        (alloc, a, b)
    }

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn the_policy_is_named_as_the_configuration_resolves_it() {
        let names = alloc_policy::policy_names();
        for name in &names {
            let alloc = StreamEngines::with_config_str(0, &format!("policy:{name}")).unwrap();
            assert_eq!(alloc.policy_name(), name);
        }
        let default = StreamEngines::with_config_str(0, "").unwrap();
        assert_eq!(default.policy_name(), names[0]);
    }

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn the_memory_fraction_limits_the_engines_together() {
        // 64 MiB of the device, whatever its size (80 GiB under the null
        // driver); a power-of-two total makes the fraction exact.
        let total = StreamEngines::with_config_str(0, "")
            .unwrap()
            .context()
            .total_mem()
            .unwrap() as u64;
        let fraction = (64 * MIB) as f64 / total as f64;
        let (alloc, a, b) = two_streams(&format!("per_process_memory_fraction:{fraction}"));
        let limit = alloc.memory_limit().unwrap();
        assert!(limit.abs_diff(64 * MIB) < MIB, "{limit}");
        let x = alloc.malloc(40 * MIB, &a).unwrap();
        // 40 + 40 passes 64 MiB, whichever engine asks.
        let e = alloc.malloc(40 * MIB, &b).unwrap_err();
        assert!(
            matches!(e, CudaError::Alloc(AllocError::OutOfMemory(_))),
            "{e}"
        );
        assert_eq!(alloc.stats().unwrap().num_ooms, 1);
        // Freed into `a`'s cache, the 40 MiB go back when `b` needs them.
        alloc.free(x).unwrap();
        let y = alloc.malloc(40 * MIB, &b).unwrap();
        let stats = alloc.stats().unwrap();
        assert_eq!(stats.reserved_bytes.all.current as u64, 40 * MIB);
        assert!(stats.reserved_bytes.all.peak as u64 <= limit);
        // A new fraction applies to growth from then on.
        alloc.set_memory_fraction(0.0).unwrap();
        assert!(
            alloc.malloc(1 << 20, &a).is_err(),
            "fraction 0: no new segment"
        );
        assert!(alloc.set_memory_fraction(1.5).is_err());
        alloc.free(y).unwrap();
    }

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn streams_get_engines_and_the_peak_is_the_devices() {
        let (alloc, a, b) = two_streams("");
        // One engine: its statistics are the device's, nothing published.
        let big = alloc.malloc(6 * MIB, &a).unwrap();
        alloc.free(big).unwrap();
        let x = alloc.malloc(3 * MIB, &a).unwrap();
        assert_eq!(
            alloc.stats().unwrap().allocated_bytes.all.peak,
            6 * MIB as i64
        );
        // A second engine: the first one's past, peak included, joins the totals.
        let y = alloc.malloc(5 * MIB, &b).unwrap();
        assert_eq!(alloc.engine_count(), 2);
        assert_eq!(alloc.allocated_bytes().unwrap(), 8 * MIB);
        assert_eq!(
            alloc.stats().unwrap().allocated_bytes.all.peak,
            8 * MIB as i64
        );
        alloc.free(x).unwrap();
        let e = alloc.free(x).unwrap_err();
        assert!(
            matches!(e, CudaError::Alloc(AllocError::UnknownPointer { .. })),
            "{e}"
        );
        alloc.record_stream(y, &a).unwrap();
        alloc.free(y).unwrap();
        let stats = alloc.stats().unwrap();
        assert_eq!(stats.allocated_bytes.all.current, 0);
        assert_eq!(stats.allocated_bytes.all.peak, 8 * MIB as i64);
        assert_eq!(stats.allocation.all.allocated, 3);
        assert_eq!(
            stats.reserved_bytes.all.current as u64,
            alloc.reserved_bytes().unwrap()
        );
        assert_eq!(
            alloc.snapshot().unwrap().segments.len() as i64,
            stats.segment.all.current
        );
        alloc.reset_peak_stats().unwrap();
        assert_eq!(alloc.stats().unwrap().allocated_bytes.all.peak, 0);
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.reserved_bytes().unwrap(), 0);
    }

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn threads_on_their_own_streams_free_each_others_blocks() {
        let alloc = StreamEngines::with_config_str(0, "").unwrap();
        threads_free_each_others_blocks(&alloc, None);
        assert_eq!(alloc.engine_count(), THREADS);
    }

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn threads_on_one_stream_get_engines_of_their_own_under_engine_per_thread() {
        let per_thread =
            StreamEngines::with_config_str(0, "engine_per_stream:True,engine_per_thread:True")
                .unwrap();
        // A thread that ends leaves its engine, and what it caches, to the
        // next thread: one after another, three threads share one engine
        // (of an allocator of their own, so that the threads at once below
        // count alone).
        let taken_over =
            StreamEngines::with_config_str(0, "engine_per_stream:True,engine_per_thread:True")
                .unwrap();
        let other = taken_over.context().new_stream().unwrap();
        let one_after_another = || {
            // Joined: a join returns once the thread's destructors ran.
            std::thread::scope(|s| {
                s.spawn(|| {
                    taken_over
                        .free(taken_over.malloc(3 * MIB, &other).unwrap())
                        .unwrap()
                })
                .join()
                .unwrap();
            });
        };
        one_after_another();
        let reserved = taken_over.reserved_bytes().unwrap();
        one_after_another();
        one_after_another();
        assert_eq!(taken_over.engine_count(), 1);
        assert_eq!(
            taken_over.reserved_bytes().unwrap(),
            reserved,
            "the cache taken over"
        );
        // Threads at once on one stream: an engine each.
        let stream = per_thread.context().new_stream().unwrap();
        threads_free_each_others_blocks(&per_thread, Some(&stream));
        assert_eq!(per_thread.engine_count(), THREADS);
        // The same threads without it share the stream's one engine.
        let per_stream = StreamEngines::with_config_str(0, "engine_per_stream:True").unwrap();
        let stream = per_stream.context().new_stream().unwrap();
        threads_free_each_others_blocks(&per_stream, Some(&stream));
        assert_eq!(per_stream.engine_count(), 1);
    }

    const THREADS: usize = 8;

    /// `THREADS` threads allocate 2,000 blocks each, on `one` stream or a
    /// stream each, freeing some as they go; each frees the rest of
    /// another's; then the device's statistics add up and the cache empties.
    fn threads_free_each_others_blocks(alloc: &StreamEngines, one: Option<&Arc<CudaStream>>) {
        let barrier = Barrier::new(THREADS);
        let handed: Vec<Mutex<Vec<u64>>> = (0..THREADS).map(|_| Mutex::new(Vec::new())).collect();
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (barrier, handed) = (&barrier, &handed);
                s.spawn(move || {
                    let stream = match one {
                        Some(s) => s.clone(),
                        None => alloc.context().new_stream().unwrap(),
                    };
                    let mut live = Vec::new();
                    for k in 0..2000u64 {
                        let size = 512 << ((k * 7 + t as u64) % 12);
                        live.push(alloc.malloc(size, &stream).unwrap());
                        if live.len() > 16 {
                            alloc
                                .free(live.swap_remove((k as usize * 5) % live.len()))
                                .unwrap();
                        }
                    }
                    // The rest goes to the next thread, which frees it.
                    *handed[(t + 1) % THREADS].lock().unwrap() = live;
                    barrier.wait();
                    for ptr in std::mem::take(&mut *handed[t].lock().unwrap()) {
                        alloc.free(ptr).unwrap();
                    }
                });
            }
        });
        let stats = alloc.stats().unwrap();
        assert_eq!(stats.allocated_bytes.all.current, 0);
        assert_eq!(stats.allocation.all.allocated, stats.allocation.all.freed);
        assert_eq!(stats.allocation.all.allocated, THREADS as u64 * 2000);
        assert!(stats.allocated_bytes.all.peak > 0);
        let segments = alloc.snapshot().unwrap().segments;
        for pair in segments.windows(2) {
            assert!(
                pair[0].address + pair[0].total_size <= pair[1].address,
                "overlap"
            );
        }
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.reserved_bytes().unwrap(), 0);
    }
}

/// Tests that make driver calls fail: run alone (`run.sh --tests` runs this
/// module in a process of its own), since a failure armed in the null
/// driver is the whole process's.
#[cfg(test)]
mod null_driver_fault_tests {
    use super::null_driver_tests::two_streams;
    use super::*;

    const MIB: u64 = 1 << 20;

    /// The null driver's `null_cuda_fail_times`: `count` calls of `name`
    /// from its `nth` next one fail with `code`.
    fn fail_times(name: &str, nth: i64, count: i64, code: i32) {
        type FailTimes = unsafe extern "C" fn(*const std::ffi::c_char, i64, i64, i32) -> i32;
        let name = std::ffi::CString::new(name).unwrap();
        // SAFETY: the loaded libcuda is the null driver (run.sh puts it on
        // the library path), whose null_cuda_fail_times has this signature
        // and copies nothing from the name past the call.
        let armed = unsafe {
            let lib = cudarc::driver::sys::culib();
            let f: FailTimes = *lib
                .get(b"null_cuda_fail_times")
                .expect("the null driver is the loaded libcuda");
            f(name.as_ptr(), nth, count, code)
        };
        assert_eq!(armed, 0);
    }

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn out_of_memory_empties_the_other_engines_first() {
        let (alloc, a, b) = two_streams("");
        let x = alloc.malloc(64 * MIB, &a).unwrap();
        alloc.free(x).unwrap();
        assert_eq!(
            alloc.reserved_bytes().unwrap(),
            64 * MIB,
            "cached by the engine of `a`"
        );
        // The device is full for `b`'s engine until `a`'s cache goes back:
        // its first try and its own retry fail (2 = out of memory).
        fail_times("cuMemAlloc_v2", 1, 2, 2);
        let y = alloc.malloc(32 * MIB, &b).unwrap();
        let stats = alloc.stats().unwrap();
        assert_eq!(
            stats.reserved_bytes.all.current as u64,
            32 * MIB,
            "`a`'s segment went back"
        );
        assert_eq!(
            stats.num_ooms, 0,
            "served: no out-of-memory error, as PyTorch counts"
        );
        assert_eq!(stats.allocated_bytes.all.current as u64, 32 * MIB);
        alloc.free(y).unwrap();
        // Every engine full: the error reaches the caller, and is counted.
        fail_times("cuMemAlloc_v2", 1, 100, 2);
        alloc.empty_cache().unwrap();
        let e = alloc.malloc(32 * MIB, &a).unwrap_err();
        assert!(
            matches!(e, CudaError::Alloc(AllocError::OutOfMemory(_))),
            "{e}"
        );
        fail_times("cuMemAlloc_v2", 0, 0, 0);
        assert_eq!(alloc.stats().unwrap().num_ooms, 1);
    }
}
