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

use super::SegmentKey;
use super::{virtual_memory, Engine};
use crate::backend::{MemoryBackend, StreamBackend};
use crate::error::{AllocError, BackendError};
use crate::heap::BlockState;
use crate::policy::{Policy, Request};
use crate::private_pool::PoolId;
use crate::snapshot::Snapshot;
use crate::tags::{Backup, PauseReport, Paused, ResumeReport, TagInfo};
use crate::types::{CacheKey, PoolKind, SegmentId, StreamId};

/// Receives the live blocks `(addr, size)` of a tag to copy them somewhere
/// before a pause unmaps them (host backup), or to copy them back after a
/// resume mapped them again. The memory is mapped and no queued work uses
/// it while the callback runs.
pub type CopyBlocks<'a> = &'a mut dyn FnMut(&[(u64, u64)]) -> Result<(), BackendError>;

fn tag_error(tag: &str, reason: &'static str) -> AllocError {
    AllocError::Tag {
        tag: tag.to_string(),
        reason,
    }
}

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
        if let Some(pool) = self.tags.pool(tag) {
            return Ok(pool);
        }
        self.check_taggable(tag)?;
        let mut pool = self.tags.fresh_pool();
        while self.pools.use_count(pool) > 0 || !self.pool_segments(pool).is_empty() {
            pool = self.tags.fresh_pool();
        }
        self.pools.tag(pool);
        self.tags.insert(tag, pool);
        Ok(pool)
    }

    /// Makes the existing private pool `pool` (a PyTorch `MemPool`) the
    /// pool of the new sleep tag `tag`, holding it for good. The pool must
    /// have no segment yet, no segment source and split blocks.
    pub fn bind_tag(&mut self, tag: &str, pool: PoolId) -> Result<(), AllocError> {
        match self.tags.pool(tag) {
            Some(p) if p == pool => return Ok(()),
            Some(_) => return Err(tag_error(tag, "already has another pool")),
            None => {}
        }
        self.check_taggable(tag)?;
        if self.tags.tag_of(pool).is_some() {
            return Err(AllocError::InvalidArgument(format!(
                "private pool {pool:?} already belongs to the sleep tag \"{}\"",
                self.tags.tag_of(pool).unwrap_or_default()
            )));
        }
        if !self.pool_segments(pool).is_empty()
            || self.sources.contains_key(&pool)
            || self.pools.no_split(pool)
        {
            return Err(AllocError::InvalidArgument(format!(
                "private pool {pool:?} cannot become a sleep tag's pool: it already has \
                 segments, a segment source of its own, or hands out whole blocks"
            )));
        }
        self.pools.tag(pool);
        self.tags.insert(tag, pool);
        Ok(())
    }

    /// The sleep tag whose pool is `pool`, if any.
    pub fn tag_of_pool(&self, pool: PoolId) -> Option<&str> {
        self.tags.tag_of(pool)
    }

    /// Every sleep tag with its state and memory, by name.
    pub fn tags(&self) -> Vec<TagInfo> {
        self.tags
            .iter()
            .map(|(name, pool, paused)| {
                let (mut reserved, mut allocated, mut segments) = (0, 0, 0);
                for id in self.pool_segments(pool) {
                    let seg = self.heap.segment(id);
                    segments += 1;
                    reserved += seg.size - seg.unmapped;
                    allocated += self
                        .heap
                        .segment_blocks(id)
                        .map(|b| self.heap.block(b))
                        .filter(|b| b.state == BlockState::Allocated)
                        .map(|b| b.size)
                        .sum::<u64>();
                }
                TagInfo {
                    name: name.to_string(),
                    pool,
                    paused: paused.is_some(),
                    backup: paused.map(|p| p.backup),
                    paused_bytes: paused.map_or(0, Paused::bytes),
                    backed_up_bytes: paused.map_or(0, Paused::saved_bytes),
                    reserved_bytes: reserved,
                    allocated_bytes: allocated,
                    segments,
                }
            })
            .collect()
    }

    /// Bytes given back by every paused tag.
    pub fn paused_bytes(&self) -> u64 {
        self.tags
            .iter()
            .filter_map(|t| t.2)
            .map(Paused::bytes)
            .sum()
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
        let pool = self.tag_for_change(tag)?;
        if self.tags.paused(tag).is_some() {
            return Err(tag_error(tag, "is already paused"));
        }
        let segments = self.pool_segments(pool);
        let streams_waited = self.wait_for_tag_work(&segments)?;
        let live: Vec<(u64, u64)> = segments
            .iter()
            .flat_map(|&id| self.heap.segment_blocks(id))
            .map(|b| self.heap.block(b))
            .filter(|b| b.state == BlockState::Allocated)
            .map(|b| (b.addr, b.size))
            .collect();
        let saved = match backup {
            Backup::Host if !live.is_empty() => {
                save(&live)?;
                live
            }
            _ => Vec::new(),
        };
        // Paused from here on, so that a failure midway leaves what was
        // unmapped on record for the resume.
        self.pools.set_paused(pool, true);
        self.tags.set_paused(
            tag,
            Paused {
                backup,
                runs: Vec::new(),
                saved,
            },
        );
        let mut result = Ok(());
        for key in self.segment_keys(&segments) {
            let mut runs = Vec::new();
            result = self.unmap_whole_segment(&key, &mut runs);
            let paused = self.tags.paused_mut(tag).expect("paused above");
            paused
                .runs
                .extend(runs.into_iter().map(|(start, bytes)| (key, start, bytes)));
            if result.is_err() {
                break;
            }
        }
        result.and_then(|()| Ok(virtual_memory(&mut self.memory)?.release_spare()?))?;
        let paused = self.tags.paused(tag).expect("paused above");
        Ok(PauseReport {
            released_bytes: paused.bytes(),
            saved_bytes: paused.saved_bytes(),
            streams_waited,
        })
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
        let pool = self.tag_for_change(tag)?;
        let Some(paused) = self.tags.paused(tag).cloned() else {
            return Err(tag_error(tag, "is not paused"));
        };
        let mut mapped = 0;
        let mut released_cache = false;
        for (i, &(key, start, bytes)) in paused.runs.iter().enumerate() {
            let mut ok = self.map_run_again(&key, start, bytes)?;
            if !ok && !released_cache {
                // Other cache of this allocator may hold the memory.
                released_cache = true;
                self.synchronize_events()?;
                self.release_idle_segments()?;
                ok = self.map_run_again(&key, start, bytes)?;
            }
            if !ok {
                self.unmap_runs_again(&paused.runs[..i])?;
                let requested = paused.bytes() - mapped;
                return Err(self.resume_out_of_memory(requested));
            }
            mapped += bytes;
        }
        self.tags.take_paused(tag);
        self.pools.set_paused(pool, false);
        let restored: Vec<(u64, u64)> = paused
            .saved
            .iter()
            .copied()
            .filter(|&(addr, size)| {
                self.live
                    .get(addr)
                    .is_some_and(|id| self.heap.block(id).size == size)
            })
            .collect();
        if !restored.is_empty() {
            restore(&restored)?;
        }
        Ok(ResumeReport {
            mapped_bytes: mapped,
            restored_bytes: restored.iter().map(|r| r.1).sum(),
        })
    }

    // ----- hooks of the engine's other operations -----

    /// `malloc` from `pool`: refused while the pool's tag is paused.
    pub(super) fn refuse_paused(&self, pool: PoolId) -> Result<(), AllocError> {
        if !self.pools.is_paused(pool) {
            return Ok(());
        }
        let tag = self.tags.tag_of(pool).unwrap_or_default();
        Err(tag_error(
            tag,
            "is paused: its memory was given back; resume it before allocating from it",
        ))
    }

    /// Names the tag and paused state of every tagged segment of `snap`.
    pub(super) fn annotate_tags(&self, snap: &mut Snapshot) {
        if self.tags.is_empty() {
            return;
        }
        for seg in &mut snap.segments {
            if let Some(pool) = seg.private_pool {
                seg.tag = self.tags.tag_of(pool).map(str::to_string);
                seg.paused = self.pools.is_paused(pool);
            }
        }
    }

    // ----- internals -----

    /// Whether a tag named `tag` can be created.
    fn check_taggable(&self, tag: &str) -> Result<(), AllocError> {
        if tag.is_empty() {
            return Err(AllocError::InvalidArgument(
                "a sleep tag needs a name".into(),
            ));
        }
        if !self.caps.supports_growth || self.granularity == 0 {
            return Err(AllocError::InvalidArgument(format!(
                "sleep tags need growable segments (virtual memory), which policy {} or this \
                 device lacks",
                self.policy.name()
            )));
        }
        Ok(())
    }

    /// The pool of `tag` for a pause or resume, refused during a capture.
    fn tag_for_change(&self, tag: &str) -> Result<PoolId, AllocError> {
        let pool = self
            .tags
            .pool(tag)
            .ok_or_else(|| tag_error(tag, "is unknown: no allocation was tagged with it"))?;
        if self.pools.capture_underway() {
            return Err(tag_error(
                tag,
                "cannot pause or resume during a CUDA graph capture or while allocations are \
                 routed to a private pool",
            ));
        }
        Ok(pool)
    }

    /// The growable segments among `segments`, by key.
    fn segment_keys(&self, segments: &[SegmentId]) -> Vec<SegmentKey> {
        segments
            .iter()
            .map(|&id| self.heap.segment(id))
            .filter(|s| s.expandable)
            .map(|s| (s.key(), s.pool))
            .collect()
    }

    /// Waits on the host for the work that may use the blocks of
    /// `segments`: the events of their blocks freed while other streams
    /// used them, then an event recorded now on each stream that allocated
    /// or used (`record_stream`) a live block. Returns the number of
    /// streams waited for.
    fn wait_for_tag_work(&mut self, segments: &[SegmentId]) -> Result<usize, AllocError> {
        let mine = |heap: &crate::heap::Heap, id| segments.contains(&heap.block(id).segment);
        // Streams whose work the host waits for, for the report.
        let mut waited: FxHashSet<StreamId> = FxHashSet::default();
        // Events a free could not record are recorded now, to be waited for.
        self.events.record_missing(&mut self.streams)?;
        for (stream, block, event) in self.events.pending() {
            if mine(&self.heap, block) {
                self.streams.synchronize(event)?;
                self.free_pages.wake_stream(stream);
                waited.insert(stream);
            }
        }
        // The events waited for complete in order: their blocks go back now.
        self.poll_events()?;
        // Those events cover work up to the frees only: every stream that
        // allocated or used a block is waited for up to now.
        let mut now: FxHashSet<StreamId> = FxHashSet::default();
        for key in self.segment_keys(segments) {
            // Each segment's marks retire with its own wait (a second one on
            // a stream already waited for returns at once).
            self.wait_for_growable(&key)?;
            now.insert(key.0.stream);
        }
        let mut others: Vec<StreamId> = Vec::new();
        for (id, users) in self.events.users() {
            if mine(&self.heap, id) {
                others.extend(users.iter().copied());
            }
        }
        for stream in others {
            if now.insert(stream) {
                let event = self.streams.record(stream)?;
                let done = self.streams.synchronize(&event);
                self.streams.release(event);
                self.free_pages.wake_stream(stream);
                done?;
            }
        }
        waited.extend(now);
        Ok(waited.len())
    }

    /// Unmaps the `runs` a failed resume had mapped again.
    fn unmap_runs_again(&mut self, runs: &[(SegmentKey, u64, u64)]) -> Result<(), AllocError> {
        for &(key, start, bytes) in runs {
            self.unmap_run_again(&key, start, bytes)?;
        }
        Ok(virtual_memory(&mut self.memory)?.release_spare()?)
    }

    /// The out-of-memory error of a resume that found no room for
    /// `requested` bytes.
    fn resume_out_of_memory(&mut self, requested: u64) -> AllocError {
        self.out_of_memory(&Request {
            requested,
            size: requested,
            pool: PoolKind::Large,
            key: CacheKey::default(),
        })
    }
}
