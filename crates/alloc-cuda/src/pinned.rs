//! A caching allocator for pinned (page-locked) host memory: the host side
//! of sleep tags' backups, and usable on its own.
//!
//! `cuMemHostAlloc` pins pages one by one (about a second for 10 GiB) and
//! `cuMemFreeHost` unpins them, so blocks are cached by size and reused: a
//! tag paused every step with the same live blocks pins its backup memory
//! once. Sizes are rounded (powers of two below 1 MiB, multiples of 2 MiB
//! above) and a cached block serves a request of up to a quarter less.
//! A block that streams used (an async copy) goes back to the cache only
//! once events recorded on those streams at its free have completed, as in
//! PyTorch's `CachingHostAllocator`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::CudaContext;

use crate::driver::{self, HostPtr, RawEvent};
use crate::error::{driver_error, CudaError};
use crate::events::EventRecycler;
use crate::lock::lock_checked;
use crate::stream::{stream_ref, AsStream, StreamHandle};

const MIB: u64 = 1 << 20;

/// The size of the block that serves a request of `size` bytes: a power of
/// two (at least 4 KiB) up to 1 MiB, whole 2 MiB above.
pub fn pinned_block_size(size: u64) -> u64 {
    if size <= MIB {
        size.max(4096).next_power_of_two()
    } else {
        size.div_ceil(2 * MIB) * 2 * MIB
    }
}

/// Counters of a [`PinnedAllocator`], in bytes of whole blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinnedStats {
    /// Bytes handed out now.
    pub allocated_bytes: u64,
    /// Bytes idle in the cache.
    pub cached_bytes: u64,
    /// Bytes freed while streams still used them, awaiting their events.
    pub pending_bytes: u64,
    /// Bytes pinned from the driver now (the three above).
    pub reserved_bytes: u64,
    /// Highest `reserved_bytes` so far.
    pub peak_reserved_bytes: u64,
    /// Requests served.
    pub requests: u64,
    /// Requests served from the cache.
    pub cache_hits: u64,
    /// `cuMemHostAlloc` calls.
    pub host_allocs: u64,
    /// `cuMemFreeHost` calls.
    pub host_frees: u64,
}

impl PinnedStats {
    /// The counters as `(name, value)` pairs, for flat maps (the C ABI's JSON).
    pub fn named(&self) -> [(&'static str, u64); 9] {
        [
            ("allocated_bytes", self.allocated_bytes),
            ("cached_bytes", self.cached_bytes),
            ("pending_bytes", self.pending_bytes),
            ("reserved_bytes", self.reserved_bytes),
            ("peak_reserved_bytes", self.peak_reserved_bytes),
            ("requests", self.requests),
            ("cache_hits", self.cache_hits),
            ("host_allocs", self.host_allocs),
            ("host_frees", self.host_frees),
        ]
    }
}

/// The cache of a [`PinnedAllocator`], generic over the block handle `H` and the
/// event type `E` so that its rules are tested without a GPU.
#[derive(Debug)]
pub struct HostCache<H, E> {
    /// Idle blocks by size.
    free: BTreeMap<u64, Vec<H>>,
    /// Freed blocks with the events that must complete first.
    pending: Vec<(H, u64, Vec<E>)>,
    stats: PinnedStats,
}

impl<H, E> Default for HostCache<H, E> {
    fn default() -> Self {
        HostCache {
            free: BTreeMap::new(),
            pending: Vec::new(),
            stats: PinnedStats::default(),
        }
    }
}

impl<H, E> HostCache<H, E> {
    /// A cached block for a request of `size` bytes (see
    /// [`pinned_block_size`]) and its size, after moving the pending blocks
    /// whose events `done` reports complete back to the cache (their events
    /// go to `release`). `None`: make a block of `pinned_block_size(size)`
    /// and report it with [`HostCache::created`].
    pub fn take(
        &mut self,
        size: u64,
        mut done: impl FnMut(&E) -> bool,
        mut release: impl FnMut(E),
    ) -> Option<(H, u64)> {
        self.stats.requests += 1;
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].2.iter().all(&mut done) {
                let (h, bytes, events) = self.pending.swap_remove(i);
                events.into_iter().for_each(&mut release);
                self.stats.pending_bytes -= bytes;
                self.stats.cached_bytes += bytes;
                self.free.entry(bytes).or_default().push(h);
            } else {
                i += 1;
            }
        }
        let want = pinned_block_size(size);
        let limit = want + want / 4;
        let (&bytes, list) = self.free.range_mut(want..=limit).next()?;
        let h = list.pop().expect("no empty lists are kept");
        if list.is_empty() {
            self.free.remove(&bytes);
        }
        self.stats.cached_bytes -= bytes;
        self.stats.allocated_bytes += bytes;
        self.stats.cache_hits += 1;
        Some((h, bytes))
    }

    /// A new block of `bytes` was pinned for the request.
    pub fn created(&mut self, bytes: u64) {
        self.stats.host_allocs += 1;
        self.stats.allocated_bytes += bytes;
        self.stats.reserved_bytes += bytes;
        self.stats.peak_reserved_bytes = self
            .stats
            .peak_reserved_bytes
            .max(self.stats.reserved_bytes);
    }

    /// A block of `bytes` comes back; reusable once `events` complete.
    pub fn put(&mut self, h: H, bytes: u64, events: Vec<E>) {
        self.stats.allocated_bytes -= bytes;
        if events.is_empty() {
            self.stats.cached_bytes += bytes;
            self.free.entry(bytes).or_default().push(h);
        } else {
            self.stats.pending_bytes += bytes;
            self.pending.push((h, bytes, events));
        }
    }

    /// Removes every idle block (to unpin them), counted as freed.
    pub fn drain_idle(&mut self) -> Vec<(H, u64)> {
        let mut out = Vec::new();
        for (bytes, list) in std::mem::take(&mut self.free) {
            out.extend(list.into_iter().map(|h| (h, bytes)));
        }
        let freed: u64 = out.iter().map(|b| b.1).sum();
        self.stats.cached_bytes -= freed;
        self.stats.reserved_bytes -= freed;
        self.stats.host_frees += out.len() as u64;
        out
    }

    /// The counters.
    pub fn stats(&self) -> PinnedStats {
        self.stats
    }

    /// Makes the counters of idle and pending bytes agree with the lists,
    /// and the reserved bytes with the three kinds (after a panic left a
    /// change half-done); returns whether any was off.
    pub fn repair(&mut self) -> bool {
        let cached: u64 = self.free.iter().map(|(b, l)| b * l.len() as u64).sum();
        let pending: u64 = self.pending.iter().map(|p| p.1).sum();
        let s = &mut self.stats;
        let reserved = s.allocated_bytes + cached + pending;
        let off =
            (s.cached_bytes, s.pending_bytes, s.reserved_bytes) != (cached, pending, reserved);
        s.cached_bytes = cached;
        s.pending_bytes = pending;
        s.reserved_bytes = reserved;
        s.peak_reserved_bytes = s.peak_reserved_bytes.max(reserved);
        off
    }
}

struct PinnedState {
    cache: HostCache<HostPtr, RawEvent>,
    events: EventRecycler<RawEvent>,
}

/// Pinned host memory, cached: see the module docs. Blocks are portable
/// (usable with every context of the process).
///
/// ```no_run
/// use alloc_cuda::{CudaAllocator, PinnedAllocator};
///
/// let pinned = PinnedAllocator::global()?;
/// let mut staging = pinned.alloc(64 << 20)?; // 64 MiB of page-locked memory
/// staging.as_mut_slice().fill(7);
/// drop(staging); // cached: the next request of this size pins nothing
/// let again = pinned.alloc(64 << 20)?;
/// assert_eq!(pinned.stats()?.host_allocs, 1);
/// # drop(again);
/// # Ok::<(), alloc_cuda::CudaError>(())
/// ```
pub struct PinnedAllocator {
    ctx: Arc<CudaContext>,
    state: Mutex<PinnedState>,
}

impl std::fmt::Debug for PinnedAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedAllocator")
            .field("device", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

static GLOBAL: OnceLock<Arc<PinnedAllocator>> = OnceLock::new();

impl PinnedAllocator {
    /// A new, empty allocator whose driver calls run in `ctx`.
    pub fn new(ctx: Arc<CudaContext>) -> Arc<Self> {
        Arc::new(PinnedAllocator {
            ctx,
            state: Mutex::new(PinnedState {
                cache: HostCache::default(),
                events: EventRecycler::new(),
            }),
        })
    }

    /// The process-wide allocator (in device 0's primary context), created on
    /// first use; sleep tags back up into it.
    pub fn global() -> Result<Arc<Self>, CudaError> {
        if let Some(p) = GLOBAL.get() {
            return Ok(p.clone());
        }
        driver::device_count()?;
        let ctx = CudaContext::new(0).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e.0))?;
        Ok(GLOBAL.get_or_init(|| Self::new(ctx)).clone())
    }

    /// The cache, locked; after a panic with the lock held, its counters
    /// are made to agree with its lists again (see [`crate::lock`]).
    fn state(&self) -> Result<MutexGuard<'_, PinnedState>, CudaError> {
        lock_checked(&self.state, |st| {
            st.cache.repair();
            Ok(())
        })
    }

    /// A buffer of at least `len` bytes of pinned host memory. A new block
    /// is zeroed; a cached one holds what its last user left.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<PinnedBuffer, CudaError> {
        driver::bind(&self.ctx)?;
        let mut st = self.state()?;
        let PinnedState { cache, events } = &mut *st;
        let taken = cache.take(
            len as u64,
            |e| driver::event_query(e).unwrap_or(false),
            |e| events.release(e),
        );
        let (ptr, bytes) = match taken {
            Some(found) => found,
            None => {
                let bytes = pinned_block_size(len as u64);
                let ptr = driver::host_alloc(bytes as usize)?;
                // SAFETY: `ptr` is a fresh block of `bytes` bytes owned here.
                unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes as usize) };
                cache.created(bytes);
                (ptr, bytes)
            }
        };
        Ok(PinnedBuffer {
            ptr: Some(ptr),
            len,
            bytes,
            users: Vec::new(),
            allocator: self.clone(),
        })
    }

    /// Unpins every cached block.
    pub fn empty_cache(&self) -> Result<(), CudaError> {
        driver::bind(&self.ctx)?;
        let idle = self.state()?.cache.drain_idle();
        for (ptr, _) in idle {
            driver::host_free(ptr)?;
        }
        Ok(())
    }

    /// The allocator's counters.
    pub fn stats(&self) -> Result<PinnedStats, CudaError> {
        Ok(self.state()?.cache.stats())
    }

    /// Takes a block back, reusable once events recorded now on `users`
    /// complete. A failed record keeps the block out of reuse (a leak, never
    /// a hazard).
    fn give_back(&self, ptr: HostPtr, bytes: u64, users: &[StreamHandle]) {
        let Ok(mut st) = self.state() else { return };
        let mut recorded = Vec::with_capacity(users.len());
        if !users.is_empty() && driver::bind(&self.ctx).is_err() {
            return;
        }
        for stream in users {
            let Ok(event) = st.events.acquire(driver::event_create) else {
                return;
            };
            // SAFETY: the handle holds a cudarc stream alive, or its
            // creator vouched (`StreamHandle::from_raw`) that the raw stream
            // lives while it is used.
            match unsafe { driver::event_record(&event, stream.id().0) } {
                Ok(()) => recorded.push(event),
                Err(_) => {
                    st.events.release(event);
                    return;
                }
            }
        }
        st.cache.put(ptr, bytes, recorded);
    }
}

impl Drop for PinnedAllocator {
    fn drop(&mut self) {
        if driver::bind(&self.ctx).is_err() {
            return;
        }
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for (ptr, _) in st.cache.drain_idle() {
            let _ = driver::host_free(ptr);
        }
        for event in st.events.drain() {
            let _ = driver::event_destroy(event);
        }
    }
}

/// Pinned host memory from a [`PinnedAllocator`], back to its cache when
/// dropped.
pub struct PinnedBuffer {
    ptr: Option<HostPtr>,
    len: usize,
    bytes: u64,
    /// Streams that used it (kept alive until the drop has recorded its
    /// events on them): its reuse waits for their work queued before the
    /// drop.
    users: Vec<StreamHandle>,
    allocator: Arc<PinnedAllocator>,
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &self.as_ptr())
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedBuffer {
    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte was asked for.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte (for copies and foreign code).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ref().map_or(std::ptr::null(), |p| p.as_ptr())
    }

    /// The first byte, writable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
            .as_ref()
            .map_or(std::ptr::null_mut(), |p| p.as_ptr())
    }

    /// The bytes. Queue no copy into the buffer while this view lives.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes (zeroed when the block was made)
        // owned by this buffer; no copy writes them through safe code.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        // SAFETY: as in `as_slice`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), len) }
    }

    /// Declares that work queued on `stream` (a cudarc stream, kept alive
    /// until the drop, or a [`StreamHandle`]) uses the buffer, an async copy
    /// for instance: its reuse after the drop waits for that work.
    pub fn record_stream<S: AsStream + ?Sized>(&mut self, stream: &S) {
        let stream = stream_ref(stream);
        if !self.users.iter().any(|u| u.id() == stream.id()) {
            self.users.push(stream.to_handle());
        }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if let Some(ptr) = self.ptr.take() {
            self.allocator.give_back(ptr, self.bytes, &self.users);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes() {
        assert_eq!(pinned_block_size(1), 4096);
        assert_eq!(pinned_block_size(5000), 8192);
        assert_eq!(pinned_block_size(MIB), MIB);
        assert_eq!(pinned_block_size(MIB + 1), 2 * MIB);
        assert_eq!(pinned_block_size(5 * MIB), 6 * MIB);
    }

    #[test]
    fn cache_reuses_close_sizes_and_waits_for_pending_events() {
        let mut c: HostCache<u32, u8> = HostCache::default();
        let never = |_: &u8| false;
        assert!(c.take(10 * MIB, never, |_| {}).is_none());
        c.created(10 * MIB);
        c.put(1, 10 * MIB, vec![]);
        assert!(c.take(20 * MIB, never, |_| {}).is_none(), "too small");
        c.created(20 * MIB);
        assert!(
            c.take(4 * MIB, never, |_| {}).is_none(),
            "10 MiB is too large for 4"
        );
        c.created(4 * MIB);
        assert_eq!(c.take(9 * MIB, never, |_| {}), Some((1, 10 * MIB)));
        let s = c.stats();
        assert_eq!((s.requests, s.cache_hits, s.host_allocs), (4, 1, 3));
        assert_eq!(s.reserved_bytes, 34 * MIB);
        assert_eq!(s.allocated_bytes, 34 * MIB);

        // A block used by a stream waits for its event.
        c.put(1, 10 * MIB, vec![7]);
        assert_eq!(c.stats().pending_bytes, 10 * MIB);
        assert!(
            c.take(10 * MIB, never, |_| {}).is_none(),
            "its copy may still run"
        );
        let mut released = Vec::new();
        let got = c.take(10 * MIB, |&e| e == 7, |e| released.push(e));
        assert_eq!(got, Some((1, 10 * MIB)));
        assert_eq!(released, vec![7]);
        assert_eq!(c.stats().pending_bytes, 0);

        c.put(1, 10 * MIB, vec![]);
        let drained = c.drain_idle();
        assert_eq!(drained, vec![(1, 10 * MIB)]);
        let s = c.stats();
        assert_eq!(
            (s.cached_bytes, s.reserved_bytes, s.host_frees),
            (0, 24 * MIB, 1)
        );
        assert_eq!(s.peak_reserved_bytes, 34 * MIB);
    }

    #[test]
    fn repair_makes_the_counters_agree_with_the_lists() {
        let mut c: HostCache<u32, u8> = HostCache::default();
        c.created(4 * MIB);
        c.put(1, 4 * MIB, vec![]);
        c.created(2 * MIB);
        c.put(2, 2 * MIB, vec![9]);
        let sound = c.stats();
        assert!(!c.repair(), "nothing to repair");
        assert_eq!(c.stats(), sound);
        c.stats.cached_bytes = 0; // as if a change stopped halfway
        c.stats.reserved_bytes += MIB;
        assert!(c.repair());
        assert_eq!(c.stats(), sound);
    }
}
