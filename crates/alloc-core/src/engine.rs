//! The caching allocator: generic over the policy, the memory backend and the
//! stream/event backend. Owns the policy, the heap (with the statistics), the
//! pointer table and the out-of-memory path; the rest is parts that own their
//! state and are handed what they need: stream ordering (`StreamOrder`),
//! growable segments and page recycling (`GrowableSegments`, driving the
//! backends with what the engine lends it, `expandable.rs`), private pools,
//! sleep tags and pool checkpoints; `sleep.rs` and `checkpoint.rs` coordinate
//! them for a pause, a resume and a restore.

use std::collections::BTreeSet;

use smallvec::SmallVec;

use crate::backend::{MemoryBackend, SegmentSource, StreamBackend};
use crate::config::AllocatorConfig;
use crate::device_totals::Levels;
use crate::error::{AllocError, BackendError, OomReport};
use crate::heap::{BlockState, Heap};
use crate::live_stats::Quantity;

mod capture_reuse;
mod checkpoint;
mod empty_segments;
mod event_queues;
mod expandable;
mod free_page_index;
mod growable;
mod growable_segments;
mod idle_pages;
mod lending;
pub(crate) mod live_table;
mod settings;
mod sleep;
mod stream_order;
pub use crate::checkpoint::{BlockCheckpoint, PoolCheckpoint, RestoreOutcome, SegmentCheckpoint};
use crate::policy::{Capabilities, Policy, Pressure, Request};
use crate::private_pool::{PoolId, PrivatePools};
use crate::snapshot::Snapshot;
use crate::stats::Stats;
pub use crate::tags::CopyBlocks;
use crate::tags::SleepTags;
pub use crate::types::Allocation;
pub use crate::types::MAX_REQUEST;
use crate::types::{BlockId, CacheKey, SegmentId, StreamId};
use event_queues::Users;
use expandable::{passes_limit, reserved, Lent};
use growable::SegmentKey;
use growable_segments::GrowableSegments;
pub(crate) use live_table::LiveTable;
pub use settings::EngineOptions;
use stream_order::StreamOrder;

/// The error for a request of `size` bytes, zero or larger than
/// [`MAX_REQUEST`].
#[cold]
#[inline(never)]
fn invalid_size(size: u64) -> AllocError {
    AllocError::InvalidSize {
        size,
        reason: if size == 0 {
            "zero-byte allocations have no address"
        } else {
            "larger than any device (1 PiB)"
        },
    }
}

/// The caching allocator.
///
/// A block is reused only on the stream it was allocated for, unless the
/// other streams that used it (`record_stream`) are done, as the events
/// recorded on them at its free prove:
///
/// ```
/// use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, GIB, MIB};
/// use alloc_policy::AnyPolicy;
///
/// let cfg = AllocatorConfig::default();
/// let mut engine = AnyPolicy::engine(&cfg, SimMemory::new(GIB), SimStreams::new())?;
/// let (compute, copy) = (StreamId(1), StreamId(2));
/// let a = engine.malloc(4 * MIB, compute)?;
/// engine.record_stream(a.addr, copy)?; // the copy stream reads the block too
/// engine.free(a.addr)?; // records an event on the copy stream
/// assert_eq!(engine.awaiting_events(), 1);
/// let b = engine.malloc(4 * MIB, compute)?; // the copy may still run: fresh memory
/// assert_ne!(b.addr, a.addr);
///
/// engine.streams_mut().complete_stream(copy); // the simulated GPU finishes it
/// let c = engine.malloc(4 * MIB, compute)?; // now the block is reused
/// assert_eq!(c.addr, a.addr);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Engine<P: Policy, M: MemoryBackend, S: StreamBackend> {
    policy: P,
    memory: M,
    streams: S,
    heap: Heap,
    options: EngineOptions,
    /// Address of every allocated block.
    live: LiveTable,
    /// When blocks other streams used (`record_stream`) may be reused:
    /// their events, frees deferred by captures, early reuse.
    order: StreamOrder<S::Event>,
    /// Reserved-bytes limit from `set_memory_fraction`.
    limit: Option<u64>,
    /// Growable segments and the recycling of their free pages.
    segments: GrowableSegments<S::Event>,
    /// Private pools (CUDA graphs, `MemPool`s), their segment sources, and
    /// whether a capture is on.
    pools: PrivatePools,
    /// Sleep tags: pools whose memory can be paused and resumed.
    tags: SleepTags,
    /// The policy's capabilities, read at construction and after each
    /// reconfiguration.
    caps: Capabilities,
}

/// The limit on reserved bytes that PyTorch's per-process memory fraction
/// sets on a device of `capacity` bytes (`set_per_process_memory_fraction`;
/// 0: no new segment at all), rounded down as PyTorch rounds it; a fraction
/// outside `[0, 1]` is an error. One engine applies it to itself
/// ([`Engine::set_memory_fraction`]); several engines of one device
/// can share it.
///
/// ```
/// use alloc_core::fraction_limit;
///
/// assert_eq!(fraction_limit(1000, 0.25)?, 250);
/// assert!(fraction_limit(1000, 1.5).is_err());
/// # Ok::<(), alloc_core::AllocError>(())
/// ```
pub fn fraction_limit(capacity: u64, fraction: f64) -> Result<u64, AllocError> {
    if !(0.0..=1.0).contains(&fraction) {
        return Err(AllocError::InvalidArgument(format!(
            "memory fraction {fraction} must be in [0, 1]"
        )));
    }
    Ok((capacity as f64 * fraction) as u64)
}

impl<P: Policy, M: MemoryBackend, S: StreamBackend> Engine<P, M, S> {
    /// A new, empty allocator.
    pub fn new(policy: P, mut memory: M, streams: S, options: EngineOptions) -> Self {
        let caps = policy.capabilities();
        let heap = Heap::new(caps.oversize_threshold);
        let granularity = memory.virtual_memory().map_or(0, |vm| vm.granularity());
        let mut segments = GrowableSegments::new(
            granularity,
            options.expandable_segments && caps.supports_growth,
            options.unmap_free_pages,
            options.unmap_pages,
        );
        segments.set_idle_mark(options.idle_mark);
        segments.set_lending(options.lend_idle_blocks);
        Engine {
            policy,
            memory,
            streams,
            heap,
            options,
            live: LiveTable::default(),
            order: StreamOrder::new(
                options.stream_wait_reuse,
                options.graph_capture_record_stream_reuse,
            ),
            limit: None,
            segments,
            pools: PrivatePools::default(),
            tags: SleepTags::default(),
            caps,
        }
    }

    /// Takes the settings of `cfg` (a configuration changed with
    /// [`AllocatorConfig::with_settings`]) from now on. Refused, with nothing
    /// changed, when it changes an option fixed at creation or one the
    /// policy cannot change; `cfg.per_process_memory_fraction` and
    /// `cfg.policy` are the caller's to apply
    /// ([`Engine::set_memory_fraction`]; the policy is chosen once).
    ///
    /// ```
    /// use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, GIB, MIB};
    /// use alloc_policy::AnyPolicy;
    ///
    /// let cfg = AllocatorConfig::default();
    /// let mut engine = AnyPolicy::engine(&cfg, SimMemory::new(GIB), SimStreams::new())?;
    /// let before = engine.malloc(84 * MIB, StreamId(1))?;
    /// assert_eq!(before.size, 84 * MIB);
    /// engine.reconfigure(&cfg.with_settings("roundup_power2_divisions:4")?)?;
    /// let after = engine.malloc(84 * MIB, StreamId(1))?;
    /// assert_eq!(after.size, 96 * MIB); // the next quarter step above 64 MiB
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reconfigure(&mut self, cfg: &AllocatorConfig) -> Result<(), AllocError> {
        let wanted = EngineOptions::from(cfg);
        self.options.check_change(&wanted)?;
        self.policy.reconfigure(cfg)?;
        self.caps = self.policy.capabilities();
        // Without virtual memory, segments stay ordinary ones, as at
        // construction ([`Engine::expandable_fallback`]).
        self.segments
            .set_expandable(wanted.expandable_segments && self.caps.supports_growth);
        self.segments.set_idle_mark(wanted.idle_mark);
        self.segments.set_lending(wanted.lend_idle_blocks);
        self.order.set_options(
            wanted.stream_wait_reuse,
            wanted.graph_capture_record_stream_reuse,
        );
        self.options = wanted;
        self.heap
            .set_oversize_threshold(self.caps.oversize_threshold);
        Ok(())
    }

    /// The policy's capabilities, as read when the engine was built or last
    /// reconfigured.
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// Whether segments grow (expandable segments were asked for and both
    /// the policy and the backend support them).
    pub fn expandable(&self) -> bool {
        self.segments.expandable()
    }

    /// Whether expandable segments were asked for on a backend without
    /// virtual memory, so that segments are ordinary ones instead, as
    /// PyTorch falls back where the driver lacks virtual memory management
    /// (the caller says so once).
    pub fn expandable_fallback(&self) -> bool {
        self.options.expandable_segments && self.segments.granularity() == 0
    }

    /// Allocates at least `size` bytes for use on `stream`.
    pub fn malloc(&mut self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        self.malloc_in(size, stream, None)
    }

    /// Allocates at least `size` bytes for use on `stream`, from the private
    /// `pool` if one is given (see [`Engine::begin_allocate_to_pool`]).
    #[inline]
    pub fn malloc_in(
        &mut self,
        size: u64,
        stream: StreamId,
        pool: Option<PoolId>,
    ) -> Result<Allocation, AllocError> {
        let (addr, block_size) = match self.hand_out(size, stream, pool) {
            Ok(placed) => placed,
            Err(e) => return self.malloc_failed(e),
        };
        self.end_malloc();
        Ok(Allocation {
            addr,
            size: block_size,
            requested: size,
            stream,
        })
    }

    /// What every malloc does last: the statistics settle, spare pages go.
    #[inline(always)]
    fn end_malloc(&mut self) {
        self.heap.ledger.settle();
        if self.segments.recycles_pages() {
            if self.segments.too_many_empty() {
                self.forget_empty_segments();
            }
            self.release_spare_pages();
        }
    }

    /// [`Engine::end_malloc`] for a failed malloc, out of line, so that a
    /// malloc does not keep its result's error bytes across the settle.
    #[cold]
    #[inline(never)]
    fn malloc_failed(&mut self, e: AllocError) -> Result<Allocation, AllocError> {
        self.end_malloc();
        Err(e)
    }

    /// Physical pages unmapped for the call that ends and not mapped again
    /// go back now. A failure leaves them to the next call (or to
    /// empty_cache, which reports it): the allocation's own outcome is what
    /// the caller gets.
    #[inline(never)]
    fn release_spare_pages(&mut self) {
        if let Some(vm) = self.memory.virtual_memory() {
            let _ = vm.release_spare();
        }
    }

    /// Gives back the growable segments that became empty first (every
    /// page unmapped, no block in use) while more are empty than may be
    /// kept: their address ranges, the heap's and the policy's records of
    /// them. Called at the end of a malloc; a failure leaves the segment to
    /// `empty_cache`.
    #[cold]
    #[inline(never)]
    fn forget_empty_segments(&mut self) {
        loop {
            let pools = &self.pools;
            let next = self
                .segments
                .next_to_forget(&self.heap, |key| pools.releasable(*key));
            let Some(next) = next else {
                break;
            };
            let Some(segment) = next else {
                continue; // in use again, or not ours to give back now
            };
            if self.release_segments(&[segment]).is_err() {
                break;
            }
        }
    }

    /// The growable segments, and what the engine lends them for one call.
    fn lend(&mut self) -> (&mut GrowableSegments<S::Event>, Lent<'_, S::Event>) {
        let cx = Lent {
            heap: &mut self.heap,
            policy: &mut self.policy,
            memory: &mut self.memory,
            streams: &mut self.streams,
            pools: &mut self.pools,
            limit: self.limit,
            budget: self.options.memory_budget,
        };
        (&mut self.segments, cx)
    }

    /// The address and size of the block handed out for a request, before
    /// the statistics settle.
    // Address and size, not the block: read again after the settle (a
    // call), the block cost a bounds check and its loads once more.
    #[inline]
    fn hand_out(
        &mut self,
        size: u64,
        stream: StreamId,
        pool: Option<PoolId>,
    ) -> Result<(u64, u64), AllocError> {
        if size.wrapping_sub(1) >= MAX_REQUEST {
            return Err(invalid_size(size));
        }
        // Each part is asked one question: may the sleep tags allocate from
        // the pool, has stream ordering work to settle, how do the private
        // pools serve the pool.
        if let Some(pool) = pool {
            self.tags.admit(pool, &self.pools)?;
        }
        if self.order.due_at_malloc() {
            self.settle_stream_order(stream)?;
        }
        let (private_pool, whole) = match pool {
            Some(p) => {
                let route = self.pools.route(p)?;
                (Some(route.number), route.whole)
            }
            None => (None, false),
        };
        let key = CacheKey {
            stream,
            private_pool,
        };
        let req = self.policy.round_request(size, key);
        self.heap.tick(req.pool);
        // A no-split pool hands the free block out whole (one block per
        // segment, as PyTorch's `MemPool(no_split=True)`).
        let piece = match self.policy.take_free(&self.heap, &req) {
            Some(block) if whole => block,
            Some(block) => self.policy.carve(&mut self.heap, block, &req),
            None => self.no_cached_block(req, whole)?,
        };
        if self.segments.recycles_pages() {
            self.map_or_refuse(piece, req)?;
        }
        // Read before the state changes, whose stores would make them
        // loads again.
        let b = self.heap.block(piece);
        let (addr, block_size) = (b.addr, b.size);
        // The one block-state change of a malloc (blocks released above by
        // events are tallied, and then so is this).
        self.heap
            .set_state_counted_now(piece, BlockState::Allocated, size);
        self.live.insert(addr, piece);
        Ok((addr, block_size))
    }

    /// The block to hand out for `req` when no cached block fits: carved
    /// (unless `whole`) from a new segment, or under pressure from one
    /// awaiting events that stream-wait reuse hands over (see `grow`).
    // Out of line: inlined, the cached block was tested twice, and the
    // stack frame of every malloc held what this path needs. The request by
    // value (as in `map_or_refuse`): by reference, its address escaped and
    // every malloc stored it to the stack.
    #[inline(never)]
    fn no_cached_block(&mut self, req: Request, whole: bool) -> Result<BlockId, AllocError> {
        let req = &req;
        let block = self.grow(req)?;
        let piece = if whole {
            block
        } else {
            self.policy.carve(&mut self.heap, block, req)
        };
        // A block lent by another stream's segment (`lend_idle_blocks`) is
        // used by this stream as after `record_stream`: its free records an
        // event here before its own stream's cache takes it back.
        let b = self.heap.block(piece);
        if b.stream != req.key.stream {
            let addr = b.addr;
            let stream = req.key.stream;
            self.order
                .record_use(&mut self.streams, &self.heap, piece, addr, stream, false)?;
        }
        Ok(piece)
    }

    /// Maps the pages under `piece`, the block for `req`; when there is no
    /// room, takes the block back and reports the request out of memory.
    // Out of line, the request by value: see `no_cached_block`; out of line
    // too so that the mallocs of settings that map nothing keep their code.
    #[inline(never)]
    fn map_or_refuse(&mut self, piece: BlockId, req: Request) -> Result<(), AllocError> {
        // Most blocks lie over mapped pages only: asked before the parts are
        // lent, the call costs them the test alone.
        if !self.heap.has_unmapped_pages(piece) {
            return Ok(());
        }
        let (segments, mut cx) = self.lend();
        if segments.map_pages_under(&mut cx, piece)? {
            return Ok(());
        }
        // No out-of-memory error while free pages of ours, whatever stream
        // cached them, could serve the request.
        if segments.reclaim_free_pages(&mut cx, Some(piece))?
            && segments.map_pages_under(&mut cx, piece)?
        {
            return Ok(());
        }
        self.policy.insert_free(&mut self.heap, piece);
        Err(self.out_of_memory(&req))
    }

    /// Frees a block. If other streams used it (`record_stream`), it becomes
    /// reusable only once events recorded on them now have completed.
    #[inline]
    pub fn free(&mut self, addr: u64) -> Result<(), AllocError> {
        // The error out of line: kept across the settle, the error's bytes
        // were copied on every free.
        match self.take_back(addr) {
            Ok(()) => {
                self.heap.ledger.settle();
                Ok(())
            }
            Err(e) => self.free_failed(e),
        }
    }

    /// Settles the statistics after a failed free and returns its error.
    #[cold]
    #[inline(never)]
    fn free_failed(&mut self, e: AllocError) -> Result<(), AllocError> {
        self.heap.ledger.settle();
        Err(e)
    }

    /// Takes back the block at `addr` (into the cache, or to wait for the
    /// streams that used it), before the statistics settle.
    #[inline]
    fn take_back(&mut self, addr: u64) -> Result<(), AllocError> {
        if self.order.may_defer_free(self.pools.capture_underway()) {
            if let Some(deferred) = self.defer_capture_free(addr) {
                return deferred;
            }
        }
        let Some(id) = self.live.remove(addr) else {
            return Err(self.bad_pointer(addr));
        };
        match self.order.take_users(id) {
            // A free changes no other block's state, and several frees in
            // one call (the end of a capture) all lower the counts.
            None => self.cache_freed_block(id),
            Some(users) => self.await_freed(id, users)?,
        }
        Ok(())
    }

    // The two paths below are out of line: inlined into `free`, their
    // registers and stack were set up on every call.

    /// A free during a capture of a block other streams used: recording
    /// events on them would put the events in the graph, so the decision
    /// waits for the capture's end (or for the graph to join those
    /// streams). `None` when the block is not such a block.
    #[inline(never)]
    fn defer_capture_free(&mut self, addr: u64) -> Option<Result<(), AllocError>> {
        self.order
            .defer_capture_free(&mut self.streams, &self.heap, &self.live, addr)
    }

    /// A freed block that other streams used awaits events recorded on them.
    #[inline(never)]
    fn await_freed(&mut self, id: BlockId, users: Users) -> Result<(), AllocError> {
        self.order
            .await_freed(&mut self.streams, &mut self.heap, id, users)?;
        Ok(())
    }

    /// Marks an allocated block as used by `stream` too, so that a later free
    /// defers its reuse until `stream`'s work queued before the free is done.
    pub fn record_stream(&mut self, addr: u64, stream: StreamId) -> Result<(), AllocError> {
        let Some(id) = self.live.get(addr) else {
            return Err(self.bad_pointer(addr));
        };
        let capturing = self.pools.capture_underway();
        self.order
            .record_use(&mut self.streams, &self.heap, id, addr, stream, capturing)
    }

    /// Polls recorded events; blocks whose events all completed become free.
    pub fn process_events(&mut self) -> Result<(), AllocError> {
        let result = self.poll_events();
        self.heap.ledger.settle();
        result
    }

    #[inline]
    fn poll_events(&mut self) -> Result<(), AllocError> {
        if !self.order.due_poll(self.pools.capture_underway()) {
            return Ok(());
        }
        self.poll_awaiting()
    }

    /// What stream ordering does before an allocation on `stream`: events
    /// polled, frees deferred by a capture whose graph ordered their uses
    /// taken back. Out of line: most allocations have nothing to settle.
    #[inline(never)]
    fn settle_stream_order(&mut self, stream: StreamId) -> Result<(), AllocError> {
        self.poll_events()?;
        let mut done = Vec::new();
        self.order
            .reuse_joined_frees(&mut self.streams, &mut self.live, stream, &mut done);
        self.release_all_to_cache(done);
        Ok(())
    }

    /// [`Engine::poll_events`] with events to poll, out of line: inlined,
    /// its registers and stack were set up on every malloc.
    #[inline(never)]
    fn poll_awaiting(&mut self) -> Result<(), AllocError> {
        let mut done = Vec::new();
        let polled = self.order.poll(&mut self.streams, &mut done);
        self.release_all_to_cache(done);
        Ok(polled?)
    }

    /// Returns every idle cached segment to the device, after waiting for all
    /// outstanding events (as PyTorch's `empty_cache`).
    pub fn empty_cache(&mut self) -> Result<(), AllocError> {
        if self.pools.capture_underway() {
            return Err(AllocError::InvalidArgument(
                "empty_cache during a CUDA graph capture (or while allocations go to a private \
                 pool): it would free device memory and wait on streams"
                    .into(),
            ));
        }
        let result = self
            .synchronize_events()
            .and_then(|()| self.release_idle_segments());
        // Streams whose segments went back hold nothing: forgotten.
        self.policy.forget_empty_keys();
        self.heap.ledger.settle();
        result
    }

    /// Returns the idle segments of the private pool `pool` to the device,
    /// after waiting for all outstanding events, and nothing else: PyTorch's
    /// `emptyCache(mempool_id)`, which a `MemPool` calls as it is destroyed.
    /// A pool still held (a graph replays into it) keeps its segments.
    pub fn empty_pool_cache(&mut self, pool: PoolId) -> Result<(), AllocError> {
        if self.pools.capture_underway() {
            return Err(AllocError::InvalidArgument(
                "empty_cache of a pool during a CUDA graph capture (or while allocations go \
                 to a private pool): it would free device memory and wait on streams"
                    .into(),
            ));
        }
        let result = self
            .synchronize_events()
            .and_then(|()| self.release_idle_pool_segments(pool));
        self.heap.ledger.settle();
        result
    }

    /// Limits reserved memory to `fraction` of the device capacity (0: no
    /// new segment at all, as PyTorch allows).
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), AllocError> {
        self.limit = Some(fraction_limit(self.memory.capacity(), fraction)?);
        Ok(())
    }

    /// The reserved-bytes limit set by [`Engine::set_memory_fraction`].
    pub fn memory_limit(&self) -> Option<u64> {
        self.limit
    }

    /// Current statistics, assembled in PyTorch's model at each call: for
    /// one number read often, [`Engine::allocated_bytes`] and
    /// [`Engine::reserved_bytes`] cost less.
    pub fn stats(&self) -> Stats {
        self.heap.ledger.snapshot()
    }

    /// The present value of every statistic that has a peak, cheaper than
    /// [`Engine::stats`].
    pub fn levels(&self) -> Levels {
        self.heap.ledger.stats.levels()
    }

    /// Adds what the statistics did since the last call to `totals`, the
    /// device-wide statistics of several engines of one device: call it
    /// after each operation of an engine that shares its device. Its own
    /// peaks then count from the last call (the device's are the totals');
    /// see [`crate::DeviceTotals`].
    pub fn publish_to(&mut self, totals: &crate::DeviceTotals) {
        self.heap.ledger.stats.publish_to(totals);
    }

    /// Bytes of blocks handed out to callers now (`allocated_bytes.all.current`).
    pub fn allocated_bytes(&self) -> u64 {
        self.heap.ledger.stats.all_current(Quantity::AllocatedBytes) as u64
    }

    /// Bytes reserved from the device now (`reserved_bytes.all.current`).
    pub fn reserved_bytes(&self) -> u64 {
        reserved(&self.heap)
    }

    /// Makes every peak equal to its current value.
    pub fn reset_peak_stats(&mut self) {
        self.heap.ledger.stats.reset_peaks();
    }

    /// Clears cumulative counters.
    pub fn reset_accumulated_stats(&mut self) {
        self.heap.ledger.stats.reset_accumulated();
    }

    /// Every segment with its blocks.
    pub fn snapshot(&self) -> Snapshot {
        let mut snap = Snapshot::of(&self.heap, &self.pools);
        self.tags.annotate(&mut snap, &self.pools);
        snap
    }

    /// Routes allocations that name `pool` (through [`Engine::malloc_in`])
    /// to that private pool and holds it once more (until
    /// [`Engine::release_pool`]), creating it on first use; and
    /// enters capture mode until every routing is closed: no event is
    /// queried or recorded and nothing goes back to the device, since a CUDA
    /// graph capture forbids both.
    pub fn begin_allocate_to_pool(&mut self, pool: PoolId) {
        self.pools.begin(pool);
    }

    /// Closes a routing opened by [`Engine::begin_allocate_to_pool`]; when
    /// the last one closes, frees deferred during the capture record their
    /// events.
    pub fn end_allocate_to_pool(&mut self, pool: PoolId) -> Result<(), AllocError> {
        if !self.pools.end(pool) {
            return Err(AllocError::InvalidArgument(format!(
                "no allocation routing to pool {pool:?} is open"
            )));
        }
        if self.pools.capture_underway() {
            return Ok(());
        }
        let mut result = Ok(());
        for addr in self.order.end_captures() {
            let freed = self.take_back(addr);
            result = result.and(freed);
        }
        self.heap.ledger.settle();
        result
    }

    /// One more holder of `pool` (a second graph capturing into it).
    pub fn retain_pool(&mut self, pool: PoolId) {
        self.pools.retain(pool);
    }

    /// One holder of `pool` fewer. With none left (and no routing open) its
    /// segments become ordinary cache: the idle ones go back to the device
    /// now (unless a capture is underway), the others once idle at the next
    /// `empty_cache` or out-of-memory retry.
    pub fn release_pool(&mut self, pool: PoolId) -> Result<(), AllocError> {
        if !self.pools.release(pool) {
            return Err(AllocError::UnknownPool { pool });
        }
        if self.pools.use_count(pool) > 0 || self.pools.capture_underway() {
            return Ok(());
        }
        let result = self.release_idle_pool_segments(pool);
        self.heap.ledger.settle();
        result
    }

    /// Makes the private pool `pool` hand out whole blocks, never split
    /// (PyTorch's `MemPool(no_split=True)`): each block is a whole cached
    /// block or a new segment. Refused for growable segments (a block there
    /// is a piece of one range per stream) and for policies that bin blocks
    /// when carving them (size classes).
    pub fn set_pool_no_split(&mut self, pool: PoolId) -> Result<(), AllocError> {
        if self.segments.expandable() || self.pools.is_tagged(pool) || !self.caps.rebuilds_layouts {
            return Err(AllocError::InvalidArgument(format!(
                "a no-split pool needs cudaMalloc segments and a splitting policy, not {}{}",
                self.policy.name(),
                if self.segments.expandable() {
                    " with expandable segments"
                } else {
                    ""
                }
            )));
        }
        if !self.pools.set_no_split(pool) {
            return Err(AllocError::UnknownPool { pool });
        }
        Ok(())
    }

    /// Makes the private pool `pool` take its segments from `source` (and
    /// give them back to it) instead of the device backend, as PyTorch's
    /// `MemPool(allocator)` does; such segments never grow. The pool must
    /// be held and have no segment yet.
    pub fn set_pool_source(
        &mut self,
        pool: PoolId,
        source: Box<dyn SegmentSource>,
    ) -> Result<(), AllocError> {
        self.pools.set_source(&self.heap, pool, source)
    }

    /// Holders of the private pool `pool` (0 once released).
    pub fn pool_use_count(&self, pool: PoolId) -> u32 {
        self.pools.use_count(pool)
    }

    /// Entries of the private pools' tables: bounded by the pools held or
    /// with segments at once, not by every pool id ever named.
    pub fn pool_table_len(&self) -> usize {
        self.pools.table_len()
    }

    /// Whether a capture (an open allocation routing) is underway.
    pub fn capture_underway(&self) -> bool {
        self.pools.capture_underway()
    }

    /// The block sizes handed out for `addr`, if it is allocated.
    pub fn allocation(&self, addr: u64) -> Option<Allocation> {
        let b = self.heap.block(self.live.get(addr)?);
        Some(Allocation {
            addr,
            size: b.size,
            requested: b.requested,
            stream: b.stream,
        })
    }

    /// Growable segments that the unmapping of free pages visited so far
    /// (`unmap_free_pages`): its work, which follows the segments that hold
    /// free mapped pages, not the streams ever seen.
    pub fn free_page_segments_visited(&self) -> u64 {
        self.segments.free_pages().visited()
    }

    /// Growable segments whose free pages the unmapping of free pages
    /// skips until their stream's marks complete (they are all busy).
    pub fn parked_free_page_segments(&self) -> usize {
        self.segments.free_pages().parked()
    }

    /// Every stream the engine may still use: the stream of every segment
    /// (its cached blocks serve later requests on that stream, and a
    /// growable segment records events on it) and every stream recorded on
    /// a live block (its free records an event there, a pause of its sleep
    /// tag waits for it). A stream outside this set is used again only when
    /// a caller names it.
    ///
    /// ```
    /// use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, GIB, MIB};
    /// use alloc_policy::AnyPolicy;
    ///
    /// let cfg = AllocatorConfig::default();
    /// let mut engine = AnyPolicy::engine(&cfg, SimMemory::new(GIB), SimStreams::new())?;
    /// let (compute, copy) = (StreamId(1), StreamId(2));
    /// let a = engine.malloc(4 * MIB, compute)?;
    /// engine.record_stream(a.addr, copy)?;
    /// assert_eq!(engine.streams_in_use().into_iter().collect::<Vec<_>>(), [compute, copy]);
    /// engine.free(a.addr)?; // records an event on the copy stream: done with it
    /// assert_eq!(engine.streams_in_use().into_iter().collect::<Vec<_>>(), [compute]);
    /// engine.streams_mut().complete_stream(copy);
    /// engine.empty_cache()?; // the segment of stream 1 goes back
    /// assert!(engine.streams_in_use().is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn streams_in_use(&self) -> BTreeSet<StreamId> {
        self.order.streams_in_use(&self.heap)
    }

    /// Number of blocks awaiting stream events.
    pub fn awaiting_events(&self) -> usize {
        self.order.awaiting_len()
    }

    /// The policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// The memory backend.
    pub fn memory(&self) -> &M {
        &self.memory
    }

    /// The memory backend, mutably (tests write into a simulated device's
    /// memory, or make another process take simulated memory, here); the
    /// engine's segments must be left as they are. With the `testing`
    /// feature only.
    #[cfg(feature = "testing")]
    pub fn memory_mut(&mut self) -> &mut M {
        &mut self.memory
    }

    /// The stream backend.
    pub fn streams(&self) -> &S {
        &self.streams
    }

    /// The stream backend, mutably (tests complete simulated events here).
    pub fn streams_mut(&mut self) -> &mut S {
        &mut self.streams
    }

    /// The heap (read-only), for inspection.
    pub fn heap(&self) -> &Heap {
        &self.heap
    }

    /// Checks every invariant; returns a description of the first violation.
    pub fn validate(&self) -> Result<(), String> {
        let (awaiting, named) = self.order.awaited();
        crate::validate::check(
            &self.heap,
            &self.policy,
            self.caps.coalesces,
            &self.live,
            awaiting,
            named,
        )?;
        self.pools
            .check(self.heap.segments().map(|(_, s)| s.key()))?;
        let pools = &self.pools;
        self.segments
            .check(&self.heap, |key| pools.is_paused_key(*key))
    }

    /// Panics with the violated invariant when [`Engine::validate`] fails:
    /// for tests that check the state after every step (with the `testing`
    /// feature only).
    #[cfg(feature = "testing")]
    #[track_caller]
    pub fn assert_valid(&self) {
        if let Err(msg) = self.validate() {
            panic!(
                "allocator invariant violated ({}): {msg}",
                self.policy.name()
            );
        }
    }

    // ----- internals -----

    /// The error for `addr`, which is not a live allocation: a double free
    /// if a block handed out at `addr` was freed and still starts there, an
    /// unknown pointer otherwise (a free block never handed out, such as a
    /// split's remainder, included).
    #[cold]
    #[inline(never)]
    fn bad_pointer(&self, addr: u64) -> AllocError {
        match self.heap.block_at(addr).map(|id| self.heap.block(id)) {
            Some(b) if b.state != BlockState::Allocated && b.handed_out => {
                AllocError::DoubleFree { addr }
            }
            _ => AllocError::UnknownPointer { addr },
        }
    }

    /// Puts a block back in the cache, its statistics change counted at the
    /// settle (a block whose streams' events completed, a pool's blocks).
    #[inline]
    fn release_to_cache(&mut self, id: BlockId) {
        self.return_to_cache::<false>(id);
    }

    /// Puts the one block a `free` gives back in the cache, its statistics
    /// change counted now ([`Heap::set_state_counted_now`]).
    #[inline]
    fn cache_freed_block(&mut self, id: BlockId) {
        self.return_to_cache::<true>(id);
    }

    /// [`Engine::release_to_cache`] (`COUNT_NOW` false) or
    /// [`Engine::cache_freed_block`] (`COUNT_NOW` true).
    #[inline]
    fn return_to_cache<const COUNT_NOW: bool>(&mut self, id: BlockId) {
        if self.segments.recycles_pages() {
            if let Some(key) = self.segments.freed(&self.heap, id) {
                self.end_idle_epoch(key);
            }
        }
        if COUNT_NOW {
            self.heap.set_state_counted_now(id, BlockState::Free, 0);
        } else {
            self.heap.set_state(id, BlockState::Free, 0);
        }
        self.policy.insert_free(&mut self.heap, id);
    }

    /// `idle_mark_mb`: a mark for the frees of the growable segment `key`
    /// ([`GrowableSegments::mark_after_frees`]), out of the free's line.
    #[cold]
    #[inline(never)]
    fn end_idle_epoch(&mut self, key: SegmentKey) {
        let (segments, mut cx) = self.lend();
        segments.mark_after_frees(&mut cx, &key);
    }

    /// Blocks whose events are all done go back to the cache, in order.
    fn release_all_to_cache(&mut self, done: Vec<BlockId>) {
        for block in done {
            self.release_to_cache(block);
        }
    }

    /// Waits for every outstanding event on the host.
    fn synchronize_events(&mut self) -> Result<(), AllocError> {
        self.heap.ledger.stats.num_sync_all_streams += 1;
        let mut done = Vec::new();
        let synced = self.order.synchronize(&mut self.streams, &mut done);
        // Marks on the streams waited for may have completed.
        self.segments.free_pages_mut().wake_all();
        self.release_all_to_cache(done);
        Ok(synced?)
    }

    /// Stream-wait reuse: hands blocks still awaiting events on other streams
    /// to `req`'s stream by making it wait on those events. Prefers the
    /// smallest single block that fits; otherwise converts every awaiting
    /// block of the stream and pool so merges can make room. Returns whether
    /// anything was converted.
    #[inline(never)]
    fn reuse_by_stream_wait(&mut self, req: &Request) -> Result<bool, AllocError> {
        let mut done = Vec::new();
        let handed = self
            .order
            .hand_over(&mut self.streams, &self.heap, req, &mut done);
        self.release_all_to_cache(done);
        Ok(handed?)
    }

    /// No cached block fits: garbage-collect, then reserve a new segment,
    /// releasing cache and retrying as PyTorch does; returns its free block.
    #[inline(never)]
    fn grow(&mut self, req: &Request) -> Result<BlockId, AllocError> {
        if self.pools.capture_underway() {
            // Nothing may be freed or waited for: one attempt only.
            if let Some(b) = self.new_segment(req, false)? {
                return Ok(b);
            }
            return Err(self.out_of_memory(req));
        }
        let pressure = Pressure {
            reserved: self.reserved_bytes(),
            limit: self.limit.unwrap_or_else(|| self.memory.capacity()),
            fraction_set: self.limit.is_some(),
            threshold: self.options.garbage_collection_threshold,
        };
        let garbage = self.policy.collect_garbage(&self.heap, &pressure);
        self.release_segments(&garbage)?;
        if let Some(b) = self.new_segment(req, false)? {
            return Ok(b);
        }
        // Under pressure only: with room to grow, PyTorch's allocator maps a
        // new block, and a stream wait would order this stream after work
        // it never waits for there. Out of room, PyTorch waits on the host
        // for every stream; a stream wait on the blocks' own events is less.
        if self.order.may_hand_over(false) && self.reuse_by_stream_wait(req)? {
            if let Some(b) = self.policy.take_free(&self.heap, req) {
                return Ok(b);
            }
        }
        let release = self.policy.release_for_oom(&self.heap, req);
        self.release_segments(&release.segments)?;
        if release.sufficient {
            if let Some(b) = self.new_segment(req, false)? {
                return Ok(b);
            }
        }
        self.synchronize_events()?;
        self.release_idle_segments()?;
        if let Some(b) = self.new_segment(req, true)? {
            return Ok(b);
        }
        Err(self.out_of_memory(req))
    }

    fn out_of_memory(&mut self, req: &Request) -> AllocError {
        self.heap.ledger.stats.num_ooms += 1;
        AllocError::OutOfMemory(Box::new(OomReport {
            requested: req.requested,
            capacity: self.memory.capacity(),
            device_free: self.memory.free_bytes(),
            allocated: self.allocated_bytes(),
            reserved: self.reserved_bytes(),
            limit: self.limit,
        }))
    }

    /// Reserves a segment for `req`; `Ok(None)` when the device or the limit
    /// has no room.
    fn new_segment(
        &mut self,
        req: &Request,
        is_retry: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        if is_retry {
            self.heap.ledger.stats.num_alloc_retries += 1;
        }
        let sourced = self.pools.source(req.key).is_some();
        // A sleep tag's pool always grows (its pages are unmapped at pause).
        if (self.segments.expandable() || self.pools.is_tagged_key(req.key)) && !sourced {
            let (segments, mut cx) = self.lend();
            return segments.grow_segment(&mut cx, req);
        }
        let size = self.policy.segment_size(req);
        if self.would_pass_limit(size) {
            return Ok(None);
        }
        let made = match self.pools.source(req.key) {
            Some(source) => source.allocate(size),
            None => self.memory.allocate(size),
        };
        match made {
            Ok(addr) => {
                self.heap.ledger.stats.num_device_alloc += 1;
                let (_, block) = self.heap.add_segment(addr, size, req.pool, req.key);
                self.pools.segment_added(req.key);
                Ok(Some(block))
            }
            Err(BackendError::OutOfMemory) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn would_pass_limit(&self, extra: u64) -> bool {
        passes_limit(&self.heap, self.limit, extra)
    }

    fn release_idle_segments(&mut self) -> Result<(), AllocError> {
        let (segments, mut cx) = self.lend();
        segments.trim_growable_segments(&mut cx)?;
        segments.reclaim_free_pages(&mut cx, None)?;
        let idle: Vec<SegmentId> = self
            .heap
            .segments()
            .filter(|(_, s)| s.is_idle() && self.pools.releasable(s.key()))
            .map(|(id, _)| id)
            .collect();
        self.release_segments(&idle)
    }

    /// Gives the idle segments of the private pool `pool` back.
    fn release_idle_pool_segments(&mut self, pool: PoolId) -> Result<(), AllocError> {
        let idle = self.pools.idle_segments(&self.heap, pool);
        self.release_segments(&idle)
    }

    fn release_segments(&mut self, segments: &[SegmentId]) -> Result<(), AllocError> {
        for &seg_id in segments {
            let seg = self.heap.segment(seg_id);
            if !seg.is_idle() {
                debug_assert!(false, "policy asked to release a busy segment");
                continue;
            }
            if !self.pools.releasable(seg.key()) {
                continue; // a held private pool: a graph replays into it
            }
            let (addr, size) = (seg.addr, seg.size);
            if let Some(source) = self.pools.source(seg.key()) {
                source.free(addr, size)?;
            } else if seg.expandable {
                let key = (seg.key(), seg.pool);
                let (segments, mut cx) = self.lend();
                segments.release_whole(&mut cx, &key)?;
            } else {
                self.memory.free(seg.addr, seg.size)?;
            }
            let blocks: SmallVec<[BlockId; 8]> = self.heap.segment_blocks(seg_id).collect();
            for b in blocks {
                self.policy.remove_free(&self.heap, b);
            }
            let key = self.heap.segment(seg_id).key();
            self.heap.remove_segment(seg_id);
            self.pools.segment_removed(key);
            self.heap.ledger.stats.num_device_free += 1;
        }
        // A released pool's source goes once its last segment went back.
        self.pools.drop_spent_sources(&self.heap);
        Ok(())
    }
}
