//! Sleep and wake: a tag's pool gives its physical memory back (pause) and
//! takes fresh memory at the same addresses (resume), so that pointers, and
//! CUDA graphs captured over them, stay valid. Tagged pools are private
//! pools on growable segments (virtual memory), cached and served by the
//! policy like any other.
//!
//! A pause waits, through events recorded on them, for the streams that
//! used the tag's blocks: the segments' streams, the streams recorded on
//! live blocks (`record_stream`), and the events of blocks freed while
//! other streams used them. No other stream is waited for. Then, with a
//! host backup, the live blocks go to the caller's saver; then every page
//! of the tag's segments is unmapped and released; the address ranges, the
//! blocks and their states stay. A resume maps fresh memory over exactly
//! the pages the pause unmapped (freeing other cache first if the device is
//! full) and hands the saved blocks still allocated to the caller's
//! restorer.

use rustc_hash::FxHashSet;

use super::expandable::growable_keys;
use super::Engine;
use crate::backend::{MemoryBackend, StreamBackend};
use crate::error::AllocError;
use crate::heap::Heap;
use crate::policy::{Policy, Request};
use crate::private_pool::PoolId;
use crate::tags::{Backup, CopyBlocks, PauseReport, ResumeReport, TagInfo};
use crate::types::{CacheKey, Pool, SegmentId, SegmentKey, StreamId};

impl<P: Policy, M: MemoryBackend, S: StreamBackend> Engine<P, M, S> {
    /// The private pool of the sleep tag `tag`, created (with a pool id of
    /// the engine's choosing) and held for good on first use. Allocate in
    /// it with [`Engine::malloc_in`]. Tagged pools need growable segments:
    /// a policy that supports them and a backend with virtual memory.
    ///
    /// ```
    /// use alloc_core::{AllocatorConfig, Backup, SimMemory, SimStreams, StreamId, GIB, MIB};
    /// use alloc_policy::AnyPolicy;
    ///
    /// let cfg = AllocatorConfig::default();
    /// let mut engine = AnyPolicy::engine(&cfg, SimMemory::new(GIB), SimStreams::new())?;
    /// let kv = engine.tag_pool("kv_cache")?;
    /// let a = engine.malloc_in(64 * MIB, StreamId(0), Some(kv))?;
    /// assert!(engine.memory().used() >= 64 * MIB);
    ///
    /// engine.pause_tag("kv_cache", Backup::None, &mut |_| Ok(()))?;
    /// assert_eq!(engine.memory().used(), 0); // every page given back
    /// assert!(engine.malloc_in(MIB, StreamId(0), Some(kv)).is_err()); // paused
    ///
    /// engine.resume_tag("kv_cache", &mut |_| Ok(()))?;
    /// assert_eq!(engine.allocation(a.addr).unwrap().addr, a.addr); // same address
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn tag_pool(&mut self, tag: &str) -> Result<PoolId, AllocError> {
        let growth = self.growth_for_tags();
        self.tags.pool_for(tag, &mut self.pools, &self.heap, growth)
    }

    /// Makes the existing private pool `pool` (a PyTorch `MemPool`) the
    /// pool of the new sleep tag `tag`, holding it for good. The pool must
    /// have no segment yet, no segment source and split blocks.
    pub fn bind_tag(&mut self, tag: &str, pool: PoolId) -> Result<(), AllocError> {
        let growth = self.growth_for_tags();
        let sourced = self.pools.is_sourced(pool);
        self.tags
            .bind(tag, pool, &mut self.pools, &self.heap, sourced, growth)
    }

    /// The sleep tag whose pool is `pool`, if any.
    pub fn tag_of_pool(&self, pool: PoolId) -> Option<&str> {
        self.tags.tag_of(pool)
    }

    /// Every sleep tag with its state and memory, by name.
    pub fn tags(&self) -> Vec<TagInfo> {
        self.tags.infos(&self.heap, &self.pools)
    }

    /// Bytes given back by every paused tag.
    pub fn paused_bytes(&self) -> u64 {
        self.tags.paused_bytes()
    }

    /// Pauses the sleep tag `tag`: waits for the work of the streams that
    /// used its blocks (events on those streams only, never the whole
    /// device), hands its live blocks to `save` when `backup` is
    /// [`Backup::Host`], then unmaps and releases every page of its
    /// segments, keeping their addresses. Until [`Engine::resume_tag`],
    /// allocating from the tag fails; freeing its blocks works (bookkeeping
    /// only). Pausing a paused or unknown tag, or during a capture, fails
    /// before anything changes.
    pub fn pause_tag(
        &mut self,
        tag: &str,
        backup: Backup,
        save: CopyBlocks<'_>,
    ) -> Result<PauseReport, AllocError> {
        let result = self.pause_unsettled(tag, backup, save);
        self.heap.ledger.settle();
        result
    }

    fn pause_unsettled(
        &mut self,
        tag: &str,
        backup: Backup,
        save: CopyBlocks<'_>,
    ) -> Result<PauseReport, AllocError> {
        let pool = self.tags.for_pause(tag, &self.pools)?;
        let segments = self.pools.segments(&self.heap, pool);
        let keys = growable_keys(&self.heap, &segments);
        let streams_waited = self.wait_for_tag_work(&segments, &keys)?;
        self.tags
            .begin_pause(tag, backup, &self.heap, &mut self.pools, &segments, save)?;
        let (growable, mut cx) = self.lend();
        let (unmapped, result) = growable.unmap_for_pause(&mut cx, &keys);
        for (key, runs) in unmapped {
            self.tags.note_unmapped(tag, key, runs);
        }
        result?;
        Ok(self.tags.pause_report(tag, streams_waited))
    }

    /// Resumes the paused sleep tag `tag`: maps fresh memory over every
    /// page its pause unmapped, at the same addresses (releasing other
    /// cache first if the device is full), then hands the saved blocks
    /// still allocated to `restore`. Out of memory leaves the tag paused.
    /// The tag counts as resumed once its memory is mapped, even if
    /// `restore` fails.
    pub fn resume_tag(
        &mut self,
        tag: &str,
        restore: CopyBlocks<'_>,
    ) -> Result<ResumeReport, AllocError> {
        let result = self.resume_unsettled(tag, restore);
        self.heap.ledger.settle();
        result
    }

    fn resume_unsettled(
        &mut self,
        tag: &str,
        restore: CopyBlocks<'_>,
    ) -> Result<ResumeReport, AllocError> {
        let (_, paused) = self.tags.for_resume(tag, &self.pools)?;
        let runs = &paused.runs;
        let (growable, mut cx) = self.lend();
        let mut done = growable.map_runs_again(&mut cx, runs)?;
        if done < runs.len() {
            // Other cache of this allocator may hold the memory.
            self.synchronize_events()?;
            self.release_idle_segments()?;
            let (growable, mut cx) = self.lend();
            done += growable.map_runs_again(&mut cx, &runs[done..])?;
            if done < runs.len() {
                growable.unmap_runs_again(&mut cx, &runs[..done])?;
                let mapped: u64 = runs[..done].iter().map(|r| r.2).sum();
                return Err(self.resume_out_of_memory(paused.bytes() - mapped));
            }
        }
        let mapped = paused.bytes();
        let (heap, live) = (&self.heap, &self.live);
        let allocated = |addr, size| live.get(addr).is_some_and(|id| heap.block(id).size == size);
        self.tags
            .finish_resume(tag, &paused, mapped, &mut self.pools, allocated, restore)
    }

    // ----- internals -----

    /// Whether the engine can grow segments, which a sleep tag's pool
    /// needs; the error to report if not.
    fn growth_for_tags(&self) -> Result<(), AllocError> {
        if !self.caps.supports_growth || self.segments.granularity() == 0 {
            return Err(AllocError::InvalidArgument(format!(
                "sleep tags need growable segments (virtual memory), which policy {} or this \
                 device lacks",
                self.policy.name()
            )));
        }
        Ok(())
    }

    /// Waits on the host for the work that may use the blocks of
    /// `segments`: the events of their blocks freed while other streams
    /// used them, then an event recorded now on each stream that allocated
    /// or used (`record_stream`) a live block, those of the growable
    /// segments among them (`keys`) first. Returns the number of streams
    /// waited for.
    fn wait_for_tag_work(
        &mut self,
        segments: &[SegmentId],
        keys: &[SegmentKey],
    ) -> Result<usize, AllocError> {
        let mine = |heap: &Heap, id| segments.contains(&heap.block(id).segment);
        // Streams whose work the host waits for, for the report.
        let mut waited: FxHashSet<StreamId> = FxHashSet::default();
        // Events a free could not record are recorded now, to be waited for.
        let (heap, free_pages) = (&self.heap, self.segments.free_pages_mut());
        self.order.synchronize_blocks(
            &mut self.streams,
            |id| mine(heap, id),
            |stream| {
                free_pages.wake_stream(stream);
                waited.insert(stream);
            },
        )?;
        // The events waited for complete in order: their blocks go back now.
        self.poll_events()?;
        // Those events cover work up to the frees only: every stream that
        // allocated or used a block is waited for up to now.
        let others = self.order.users_of_blocks(|id| mine(&self.heap, id));
        let (growable, mut cx) = self.lend();
        waited.extend(growable.wait_for_streams(&mut cx, keys, others)?);
        Ok(waited.len())
    }

    /// The out-of-memory error of a resume that found no room for
    /// `requested` bytes.
    fn resume_out_of_memory(&mut self, requested: u64) -> AllocError {
        self.out_of_memory(&Request {
            requested,
            size: requested,
            pool: Pool::Large,
            key: CacheKey::default(),
        })
    }
}
