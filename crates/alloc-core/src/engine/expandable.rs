//! Expandable segments: one growable segment per (stream, pool), mapped in
//! PyTorch's steps on a range reserved the size of the device; free tails
//! trimmed on `empty_cache`; and with `unmap_free_pages`, holes of unmapped
//! pages under free blocks, so that physical memory serves growth first.

use std::time::Instant;

use super::free_page_index::Visits;
use super::growable::{growth, Growable, SegmentKey};
use super::{detach_pages, virtual_memory, Engine, MAX_REQUEST};
use crate::backend::{MemoryBackend, StreamBackend};
use crate::budget::ReclaimInputs;
use crate::error::{AllocError, BackendError};
use crate::heap::BlockState;
use crate::page_layout::PageLayout;
use crate::page_set::partition_pages;
use crate::policy::{KeptKeys, Policy, Request};
use crate::stats::PageMoves;
use crate::types::{BlockId, PoolKind, StreamId};

/// Keeping a planned range mapped may raise the reserved peak by at most
/// 1/100 of it over the allocator's life: enough for what outlives a step
/// above the plan (ResNet-50's input batch: +0.9%), and a bound when plans
/// that are followed for a while and then dropped keep pages from the
/// requests that vary around them (ViT with random batches: +4.3% before
/// the bound).
const KEPT_MAPPED_SHARE: u64 = 100;

/// Nanoseconds since `started` (saturating).
fn elapsed_ns(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl<P: Policy, M: MemoryBackend, S: StreamBackend> Engine<P, M, S> {
    /// Every growable segment's invariants ([`Growable::check`]), with
    /// `unmap_free_pages` each one with free mapped pages listed for
    /// unmapping, and the empty ones listed as such (`empty_segments.rs`).
    pub(super) fn check_unmapped_pages(&self) -> Result<(), String> {
        for (key, g) in &self.growable {
            let paused = self.pools.is_paused_key(self.heap.segment(g.segment).key());
            g.check(&self.heap, paused)?;
            let unlisted = self.options.unmap_free_pages && !self.free_pages.contains(key);
            if unlisted && !g.free_mapped_runs(&self.heap, None).is_empty() {
                return Err(format!(
                    "segment {:#x} holds free mapped pages but is not listed for unmapping",
                    self.heap.segment(g.segment).addr
                ));
            }
            let seg = self.heap.segment(g.segment);
            let empty = seg.unmapped == seg.size && seg.is_idle() && seg.private_pool.is_none();
            if empty != self.empty.contains(key) {
                return Err(format!(
                    "segment {:#x} is empty: {empty}, listed as empty: {}",
                    seg.addr, !empty
                ));
            }
        }
        if self.empty.len() > self.growable.len() {
            return Err(format!(
                "{} empty segments listed, {} growable segments",
                self.empty.len(),
                self.growable.len()
            ));
        }
        Ok(())
    }

    /// Expandable segments: maps more memory at the end of the stream's
    /// growable segment (reserving its address range first if needed) so that
    /// its free tail covers `req`; returns that free tail.
    pub(super) fn grow_segment(&mut self, req: &Request) -> Result<Option<BlockId>, AllocError> {
        let pages = self.page_layout(req);
        let grown = self
            .growable
            .get(&(req.key, req.pool))
            .map(|g| (g.segment, g.range));
        let (mapped, free_tail) = grown.map_or((0, 0), |(segment, _)| {
            let seg = self.heap.segment(segment);
            let last = self.heap.block(seg.last);
            let tail = if last.state == BlockState::Free {
                last.size
            } else {
                0
            };
            (seg.size, tail)
        });
        let extra = growth(
            req.pool,
            &pages,
            self.granularity,
            mapped,
            req.size,
            free_tail,
        );
        // The free tail grows into the new pages: keep it mapped.
        let tail = grown.map(|(segment, _)| self.heap.segment(segment).last);
        let mover = (req.key.stream, pages.size_at(mapped));
        let reused_busy = self.make_room(extra, tail, mover)?;
        if self.would_pass_limit(extra) {
            return Ok(None);
        }
        let Some((segment, range)) = grown else {
            // The device's size in whole growth steps and largest pages; no
            // request is larger than MAX_REQUEST, so neither is the range of
            // a device that reports more (a backend's value: no overflow).
            let step = growth(req.pool, &pages, self.granularity, 0, 1, 0);
            let capacity = self.memory.capacity().min(MAX_REQUEST + step);
            let range = (capacity.div_ceil(step) * step).next_multiple_of(pages.largest());
            if extra > range {
                return Ok(None); // larger than the device: out of memory
            }
            let addr = virtual_memory(&mut self.memory)?.reserve(range, pages)?;
            let mapped = self.map_pages(addr, extra);
            if !matches!(mapped, Ok(true)) {
                virtual_memory(&mut self.memory)?.release(addr, range)?;
                return mapped.map(|_| None);
            }
            let (segment, block) = self.heap.add_segment(addr, extra, req.pool, req.key);
            self.pools.segment_added(req.key);
            self.heap.set_expandable(segment);
            let grown = Growable::new(segment, addr, pages, range, extra, reused_busy);
            self.growable.insert((req.key, req.pool), grown);
            self.free_pages.note((req.key, req.pool));
            return Ok(Some(block));
        };
        let seg = self.heap.segment(segment);
        let (end, last) = (seg.addr + seg.size, seg.last);
        if seg.size + extra > range {
            return Ok(None);
        }
        if !self.map_pages(end, extra)? {
            return Ok(None);
        }
        let g = self
            .growable
            .get_mut(&(req.key, req.pool))
            .expect("growable");
        g.pages_mapped(end, extra, reused_busy);
        self.free_pages.note((req.key, req.pool));
        self.empty.remove(&(req.key, req.pool));
        if free_tail > 0 {
            self.policy.remove_free(&self.heap, last);
        }
        let tail = self.heap.grow_segment(segment, extra);
        self.mark_epoch(&(req.key, req.pool))?;
        Ok(Some(tail))
    }

    /// The physical pages of a new growable segment for `req`: the
    /// backend's granularity, or the configured large-pool pages (each at
    /// least a granule) with `unmap_free_pages` or in a sleep tag's pool,
    /// where fewer, larger pages make pauses and resumes cheaper.
    fn page_layout(&self, req: &Request) -> PageLayout {
        let granularity = self.granularity;
        let large_pages = self.options.unmap_free_pages || self.pools.is_tagged_key(req.key);
        if large_pages && req.pool == PoolKind::Large {
            self.options.unmap_pages.at_least(granularity)
        } else {
            PageLayout::uniform(granularity)
        }
    }

    /// Unmaps the whole free chunks at the end of every growable segment.
    pub(super) fn trim_growable_segments(&mut self) -> Result<(), AllocError> {
        let keys: Vec<SegmentKey> = self.growable.keys().copied().collect();
        for key in keys {
            let g = &self.growable[&key];
            let seg_id = g.segment;
            let seg = self.heap.segment(seg_id);
            if seg.is_idle() || !self.pools.releasable(seg.key()) {
                continue; // idle ones go back whole with the other idle segments
            }
            let Some(keep_to) = g.trim_point(&self.heap) else {
                continue;
            };
            let (end, last_id) = (seg.addr + seg.size, seg.last);
            let cut = end - keep_to;
            self.settle_detached(&key, keep_to, end)?;
            self.unmap_mapped_runs(&key, keep_to, end)?;
            let g = self.growable.get_mut(&key).expect("growable");
            let pages = *g.pages();
            let unmapped = g.unmapped.remove_in(keep_to, end, &pages);
            self.policy.remove_free(&self.heap, last_id);
            self.heap.shrink_segment(seg_id, cut, unmapped);
            let new_last = self.heap.segment(seg_id).last;
            if self.heap.block(new_last).state == BlockState::Free {
                self.policy.insert_free(&mut self.heap, new_last);
            }
        }
        Ok(())
    }

    /// Whether the backend can detach busy pages ([`DetachPages`](crate::DetachPages)).
    fn can_detach(&mut self) -> bool {
        self.memory
            .virtual_memory()
            .is_some_and(|vm| vm.detach_pages().is_some())
    }

    /// Maps `[addr, addr + bytes)`, counted as a device allocation;
    /// `Ok(false)` when the device has no memory for it.
    fn map_pages(&mut self, addr: u64, bytes: u64) -> Result<bool, AllocError> {
        match virtual_memory(&mut self.memory)?.map(addr, bytes) {
            Ok(()) => {
                self.heap.ledger.stats.num_device_alloc += 1;
                Ok(true)
            }
            Err(BackendError::OutOfMemory) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Unmaps the mapped pages of `[lo, hi)` in the growable segment `key`,
    /// a run per backend call (each counted as a device free).
    pub(super) fn unmap_mapped_runs(
        &mut self,
        key: &SegmentKey,
        lo: u64,
        hi: u64,
    ) -> Result<(), AllocError> {
        for (start, bytes) in self.growable[key].mapped_runs(lo, hi) {
            virtual_memory(&mut self.memory)?.unmap(start, bytes)?;
            self.heap.ledger.stats.num_device_free += 1;
        }
        Ok(())
    }

    /// `unmap_free_pages`: before mapping `needed` more bytes would raise
    /// reserved memory above its peak, unmaps whole free pages of growable
    /// segments (held private pools and `keep` excepted), highest addresses
    /// first, until the mapping fits under the peak or none are left. Only
    /// peak-raising mappings pay for it, so a steady state maps and unmaps
    /// nothing. The range the policy keeps mapped gives up its pages last,
    /// once its growth allowance ([`KEPT_MAPPED_SHARE`]) is spent. `mover`
    /// is the real stream and page size of the mapping to come (the size of
    /// its first page). Returns whether busy pages were detached for it
    /// ([`Engine::unmap_free_pages`]).
    pub(super) fn make_room(
        &mut self,
        needed: u64,
        keep: Option<BlockId>,
        mover: (StreamId, u64),
    ) -> Result<bool, AllocError> {
        if !self.options.unmap_free_pages || self.pools.capture_underway() {
            return Ok(false);
        }
        let peak = self.heap.ledger.stats.reserved_bytes.all_peak() as u64;
        let reserved = self.reserved_bytes();
        let level = ReclaimInputs {
            budget: self.options.memory_budget,
            capacity: self.memory.capacity(),
            peak,
            reserved,
            limit: self.limit,
        }
        .level(|| self.memory.free_bytes());
        let mut deficit = reserved.saturating_add(needed).saturating_sub(level);
        if deficit == 0 {
            return Ok(false);
        }
        // At a budget the host waits for streams whose free pages the GPU
        // may still use rather than pass it; at the peak it never waits.
        let wait = self.options.memory_budget.is_some();
        let mut detached = self.unmap_free_pages(keep, &mut deficit, Some(mover), true, wait)?;
        if deficit > 0 && self.keeps_pages_mapped() {
            // The policy's kept range may raise the peak by its allowance
            // only; beyond it, its free pages move too.
            let allowance = (peak / KEPT_MAPPED_SHARE).saturating_sub(self.kept_growth);
            if deficit > allowance {
                let mut over = deficit - allowance;
                detached |= self.unmap_free_pages(keep, &mut over, Some(mover), false, wait)?;
                deficit = allowance + over;
            }
            self.kept_growth += deficit.min(allowance);
        }
        Ok(detached)
    }

    /// With `unmap_free_pages`: unmaps every free page of ours (`keep`'s
    /// excepted), waiting on the host for streams whose pages the GPU may
    /// still use, and gives the physical memory back to the device: what
    /// runs before a mapping the device (or the limit) refused is tried
    /// again, and what `empty_cache` does. Returns whether reserved memory
    /// went down.
    pub(super) fn reclaim_free_pages(&mut self, keep: Option<BlockId>) -> Result<bool, AllocError> {
        // Without virtual memory (expandable segments fell back to ordinary
        // ones) no page was ever unmapped: nothing to reclaim or settle.
        if !self.options.unmap_free_pages || self.granularity == 0 || self.pools.capture_underway()
        {
            return Ok(false);
        }
        let before = self.reserved_bytes();
        let mut everything = u64::MAX;
        self.unmap_free_pages(keep, &mut everything, None, false, true)?;
        // Detached memory is physically freed when its old mapping goes.
        let keys: Vec<SegmentKey> = self.growable.keys().copied().collect();
        for key in keys {
            self.settle_detached(&key, 0, u64::MAX)?;
        }
        virtual_memory(&mut self.memory)?.release_spare()?;
        Ok(self.reserved_bytes() < before)
    }

    /// Whether the policy keeps part of a growable segment mapped
    /// ([`Reclaim::kept_mapped`](crate::Reclaim::kept_mapped)).
    fn keeps_pages_mapped(&self) -> bool {
        let kept = |key: &SegmentKey, g: &Growable<S::Event>| {
            key.1 == PoolKind::Large
                && self
                    .policy
                    .kept_mapped(self.heap.segment(g.segment).key())
                    .is_some()
        };
        match self.policy.kept_mapped_keys() {
            KeptKeys::None => false,
            KeptKeys::One(cache) => {
                let key = (cache, PoolKind::Large);
                self.growable.get(&key).is_some_and(|g| kept(&key, g))
            }
            KeptKeys::Any => self.growable.iter().any(|(key, g)| kept(key, g)),
        }
    }

    /// Unmaps whole free pages of growable segments (highest addresses
    /// first; held private pools and `keep` excepted, and with `spare_kept`
    /// the range the policy keeps mapped) until `budget` bytes are
    /// unmapped; `u64::MAX` unmaps all of them. Pages the GPU is known
    /// to be done with go first, without waiting. Then busy ones: for a
    /// mapping to come (`mover`: its real stream and page size), those of
    /// its stream and page size are detached for it (its work is queued
    /// after theirs) and the others stay, so that the host never waits here
    /// and the mapping raises the peak by what is missing; with no mapping
    /// to come (emptying the cache) or with `wait` (at a memory budget),
    /// the host waits for each stream with busy pages that stay and unmaps
    /// them too, at a budget those of parked segments last
    /// ([`Engine::wait_for_parked`]). Returns whether pages were detached.
    pub(super) fn unmap_free_pages(
        &mut self,
        keep: Option<BlockId>,
        budget: &mut u64,
        mover: Option<(StreamId, u64)>,
        spare_kept: bool,
        wait: bool,
    ) -> Result<bool, AllocError> {
        // Emptying the cache takes every page: every parked segment wakes.
        // A walk for a mapping wakes those that may give something without
        // a wait; at a budget, it waits for the parked ones last, if still
        // short (so that a wait is paid once per segment, not a visit of
        // every busy segment per growth).
        let waits = mover.is_none() || wait;
        self.wake_parked(mover.map(|m| m.0))?;
        // Busy runs per segment: those that can move to `mover` without a
        // wait, and the others. Idle pages of every segment go first.
        let (mut movable, mut waiting) = (Vec::new(), Vec::new());
        let mut visits = Visits::new(&self.free_pages);
        while let Some(key) = visits.next(&self.free_pages) {
            if *budget == 0 {
                break;
            }
            self.free_pages.count_visit();
            let g = &self.growable[&key];
            let (seg_id, pages) = (g.segment, *g.pages());
            let seg_key = self.heap.segment(seg_id).key();
            if !self.pools.releasable(seg_key) {
                continue;
            }
            let mut runs = g.free_mapped_runs(&self.heap, keep);
            let keeps_one = keep.is_some_and(|b| self.heap.block(b).segment == seg_id);
            if runs.is_empty() && !keeps_one {
                // Nothing to find here until a free or a mapping notes it.
                self.free_pages.forget(&key);
                continue;
            }
            // Making room for a mapping, the pages the policy keeps mapped
            // stay (a plan uses them again every step) within their
            // allowance; emptying the cache takes them too.
            if spare_kept && key.1 == PoolKind::Large {
                if let Some((lo, hi)) = self.policy.kept_mapped(seg_key) {
                    runs = outside(runs, (pages.floor(lo), pages.ceil(hi)));
                }
            }
            if runs.is_empty() {
                continue;
            }
            // End the epoch here: an idle stream has passed the new mark at
            // once, and later rounds find what was freed so far idle.
            self.heap.ledger.stats.page_moves.rounds += 1;
            self.mark_epoch(&key)?;
            self.poll_marks(&key)?;
            let (idle, busy) = self.growable[&key].idle.split_runs(&runs);
            let none_idle = idle.is_empty();
            self.unmap_runs(&key, idle, budget, false)?;
            // Busy pages of the mover's stream and page size can move.
            let (same, other) = match mover {
                Some((stream, size)) if stream == seg_key.stream && self.can_detach() => {
                    partition_pages(&pages, &busy, |_, page| page == size)
                }
                _ => (Vec::new(), busy),
            };
            // Every free page busy, none to move, and no mark to record:
            // the next walk for a mapping would find the same until a mark
            // completes (the kept range aside, which walks see in part).
            let kept = key.1 == PoolKind::Large && self.policy.kept_mapped(seg_key).is_some();
            if mover.is_some() && none_idle && same.is_empty() && !keeps_one && !kept {
                let idle_pages = &self.growable[&key].idle;
                if let (false, Some(mark)) =
                    (idle_pages.wants_mark(), idle_pages.oldest_mark_number())
                {
                    self.free_pages.park(key, mark);
                }
            }
            if !same.is_empty() {
                movable.push((key, same));
            }
            if !other.is_empty() {
                waiting.push((key, other));
            }
        }
        let mut detached = false;
        for (key, busy) in movable {
            if *budget == 0 {
                break;
            }
            detached = true;
            self.unmap_runs(&key, busy, budget, true)?;
        }
        if waits {
            // Emptying the cache, or at a budget: wait for every stream with
            // busy pages visited, then at a budget for parked ones.
            for (key, busy) in waiting {
                if *budget == 0 {
                    break;
                }
                self.wait_for_growable(&key)?;
                self.unmap_runs(&key, busy, budget, false)?;
            }
        }
        if mover.is_some() && wait {
            self.wait_for_parked(keep, budget)?;
        }
        Ok(detached)
    }

    /// At a budget, still short after a walk: waits for the streams of
    /// parked segments, oldest mark first (the first to complete on a GPU
    /// the host runs ahead of), and unmaps their free pages, now idle,
    /// until `budget` bytes are unmapped or none is parked.
    fn wait_for_parked(
        &mut self,
        keep: Option<BlockId>,
        budget: &mut u64,
    ) -> Result<(), AllocError> {
        while *budget > 0 {
            let Some(key) = self.free_pages.oldest_parked() else {
                break;
            };
            // Woken: walks visit it again, and it leaves this loop.
            self.free_pages.wake(&key);
            self.free_pages.count_visit();
            let seg_key = self.heap.segment(self.growable[&key].segment).key();
            if !self.pools.releasable(seg_key) {
                continue;
            }
            let runs = self.growable[&key].free_mapped_runs(&self.heap, keep);
            if runs.is_empty() {
                continue;
            }
            self.heap.ledger.stats.page_moves.rounds += 1;
            self.wait_for_growable(&key)?;
            self.unmap_runs(&key, runs, budget, false)?;
        }
        Ok(())
    }

    /// `unmap_free_pages`: ends the epoch of the growable segment `key` with
    /// a mark on its stream (unless too many are outstanding), so that the
    /// pages freed so far become idle once the GPU passes it. Called at
    /// unmap rounds and after mappings, the moments around which later
    /// rounds look for idle pages.
    fn mark_epoch(&mut self, key: &SegmentKey) -> Result<(), AllocError> {
        if !self.options.unmap_free_pages || self.pools.capture_underway() {
            return Ok(());
        }
        self.poll_marks(key)?;
        if self.growable[key].idle.wants_mark() {
            let stream = self.heap.segment(self.growable[key].segment).stream;
            let mark = self.streams.record(stream)?;
            let number = self.free_pages.number_mark();
            self.growable
                .get_mut(key)
                .expect("growable")
                .idle
                .end_epoch(mark, number);
        }
        Ok(())
    }

    /// Wakes the parked segments (see `free_page_index.rs`) a walk may get
    /// something from without waiting: with `stream` (a mapping on it to
    /// come), its own and those whose oldest mark completed, polled oldest
    /// first and one more in turn; with `None` (emptying the cache), all of
    /// them.
    fn wake_parked(&mut self, stream: Option<StreamId>) -> Result<(), AllocError> {
        let Some(stream) = stream else {
            self.free_pages.wake_all();
            return Ok(());
        };
        // A segment's oldest outstanding mark has completed (or it has none).
        let (growable, streams) = (&self.growable, &mut self.streams);
        self.free_pages
            .wake_for(stream, |key| match growable[key].idle.oldest_mark() {
                Some(mark) => Ok(streams.is_complete(mark)?),
                None => Ok(true),
            })
    }

    /// Unmaps page runs of the growable segment `key`, from the highest
    /// address down, no more than `budget` bytes (whole pages); with
    /// `detach`, busy runs whose memory goes to the next mapping while their
    /// old mapping stays until the GPU is done with it.
    fn unmap_runs(
        &mut self,
        key: &SegmentKey,
        runs: Vec<(u64, u64)>,
        budget: &mut u64,
        detach: bool,
    ) -> Result<(), AllocError> {
        let (seg_id, layout) = (self.growable[key].segment, *self.growable[key].pages());
        for (start, bytes) in runs.into_iter().rev() {
            if *budget == 0 {
                break;
            }
            let take = layout.tail(start, start + bytes, *budget);
            let start = start + bytes - take;
            let started = Instant::now();
            let pages = layout.count(start, start + take);
            if detach {
                detach_pages(&mut self.memory)?.detach(start, take)?;
                self.count_move(started, |m| {
                    m.pages_unmapped += pages;
                    m.busy_pages_reused += pages;
                });
            } else {
                virtual_memory(&mut self.memory)?.unmap_idle(start, take)?;
                self.count_move(started, |m| m.pages_unmapped += pages);
            }
            self.heap.ledger.stats.num_device_free += 1;
            let g = self.growable.get_mut(key).expect("growable");
            g.pages_unmapped(start, take, detach);
            self.heap.pages_unmapped(seg_id, take);
            *budget = budget.saturating_sub(take);
        }
        let seg = self.heap.segment(seg_id);
        if seg.unmapped == seg.size && seg.is_idle() && seg.private_pool.is_none() {
            self.empty.note(*key);
        }
        Ok(())
    }

    /// Gives back the growable segments that became empty first (every
    /// page unmapped, no block in use) while more are empty than may be
    /// kept (`empty_segments.rs`): their address ranges, the heap's and the
    /// policy's records of them. Pages of their streams come from a new
    /// segment the next time. Called at the end of a malloc; a failure
    /// leaves the segment to `empty_cache`.
    #[cold]
    #[inline(never)]
    pub(super) fn forget_empty_segments(&mut self) {
        while self.empty.too_many(self.growable.len()) {
            let Some(key) = self.empty.pop_oldest() else {
                break;
            };
            let Some(g) = self.growable.get(&key) else {
                continue;
            };
            let seg = self.heap.segment(g.segment);
            let empty = seg.unmapped == seg.size && seg.is_idle();
            let detached = g.idle.detached_runs().next().is_some();
            if !empty || detached || !self.pools.releasable(seg.key()) {
                continue; // in use again, or not ours to give back now
            }
            if self.release_segments(&[g.segment]).is_err() {
                break;
            }
        }
    }

    /// Forgets the growable segment `key` (its segment is gone), releasing
    /// its marks.
    pub(super) fn drop_growable(&mut self, key: &SegmentKey) {
        self.free_pages.forget(key);
        self.empty.remove(key);
        if let Some(mut g) = self.growable.remove(key) {
            debug_assert!(
                g.idle.detached_runs().next().is_none(),
                "segment dropped with detached pages still mapped"
            );
            for mark in g.idle.take_marks() {
                self.streams.release(mark);
            }
        }
    }

    /// Counts a page move (`count` updates the counters) and the host time
    /// since `started` in the statistics.
    fn count_move(&mut self, started: Instant, count: impl FnOnce(&mut PageMoves)) {
        let moves = &mut self.heap.ledger.stats.page_moves;
        count(moves);
        moves.host_ns += elapsed_ns(started);
    }

    /// Retires the completed marks of the growable segment `key`, and drops
    /// the old mappings of detached pages the GPU is now done with.
    fn poll_marks(&mut self, key: &SegmentKey) -> Result<(), AllocError> {
        let g = self.growable.get_mut(key).expect("growable");
        while let Some(mark) = g.idle.oldest_mark() {
            if !self.streams.is_complete(mark)? {
                break;
            }
            let mark = g.idle.oldest_mark_done().expect("a mark");
            self.streams.release(mark);
        }
        for (start, bytes) in g.idle.take_idle_detached() {
            detach_pages(&mut self.memory)?.unmap_detached(start, bytes)?;
        }
        Ok(())
    }

    /// Drops the old mappings of the detached pages of `key` that overlap
    /// `[lo, hi)` (all of the segment's with `0..u64::MAX`), before those
    /// addresses are mapped again or given back. If the GPU may still use
    /// them, the host first waits for the mark that ends the epoch of their
    /// last free, which is usually well behind the end of the stream's
    /// queue (the whole stream only when no mark covers it).
    pub(super) fn settle_detached(
        &mut self,
        key: &SegmentKey,
        lo: u64,
        hi: u64,
    ) -> Result<(), AllocError> {
        self.poll_marks(key)?;
        let Some(epoch) = self.growable[key].idle.detached_epoch_in(lo, hi) else {
            return Ok(());
        };
        match self.growable[key].idle.mark_ending(epoch) {
            Some(mark) => {
                let started = Instant::now();
                self.streams.synchronize(mark)?;
                self.free_pages.wake_stream(key.0.stream);
                self.count_move(started, |m| m.stream_waits += 1);
                let g = self.growable.get_mut(key).expect("growable");
                for mark in g.idle.waited_for_epoch(epoch) {
                    self.streams.release(mark);
                }
            }
            None => self.wait_for_growable(key)?,
        }
        self.poll_marks(key)
    }

    /// Waits on the host for the stream of the growable segment `key`: every
    /// page freed so far becomes idle, and its marks go back.
    pub(super) fn wait_for_growable(&mut self, key: &SegmentKey) -> Result<(), AllocError> {
        let started = Instant::now();
        self.wait_for_stream(self.heap.segment(self.growable[key].segment).stream)?;
        self.count_move(started, |m| m.stream_waits += 1);
        let g = self.growable.get_mut(key).expect("growable");
        for mark in g.idle.waited() {
            self.streams.release(mark);
        }
        Ok(())
    }

    /// Unmaps every mapped page of the growable segment `key`, live blocks'
    /// too, giving the physical memory back (a sleep tag's pause); pushes
    /// each run unmapped onto `out` as it goes, so that a failure midway
    /// leaves a record of what to map again. The caller waited for the work
    /// that used the segment.
    pub(super) fn unmap_whole_segment(
        &mut self,
        key: &SegmentKey,
        out: &mut Vec<(u64, u64)>,
    ) -> Result<(), AllocError> {
        self.settle_detached(key, 0, u64::MAX)?;
        let seg_id = self.growable[key].segment;
        let seg = self.heap.segment(seg_id);
        let runs = self.growable[key].mapped_runs(seg.addr, seg.addr + seg.size);
        for (start, bytes) in runs {
            virtual_memory(&mut self.memory)?.unmap_idle(start, bytes)?;
            self.heap.ledger.stats.num_device_free += 1;
            let g = self.growable.get_mut(key).expect("growable");
            g.pages_unmapped(start, bytes, false);
            self.heap.pages_unmapped(seg_id, bytes);
            out.push((start, bytes));
        }
        Ok(())
    }

    /// Maps the run `[start, start + bytes)` of the growable segment `key`
    /// again (a sleep tag's resume): fresh, unused memory at the same
    /// addresses. `Ok(false)` when the device (or the memory fraction) has
    /// no room.
    pub(super) fn map_run_again(
        &mut self,
        key: &SegmentKey,
        start: u64,
        bytes: u64,
    ) -> Result<bool, AllocError> {
        if self.would_pass_limit(bytes) || !self.map_pages(start, bytes)? {
            return Ok(false);
        }
        let seg_id = self.growable[key].segment;
        let g = self.growable.get_mut(key).expect("growable");
        g.pages_mapped(start, bytes, false);
        self.heap.pages_mapped(seg_id, bytes);
        self.free_pages.note(*key);
        self.empty.remove(key);
        Ok(true)
    }

    /// Undoes [`Engine::map_run_again`] for a resume that failed midway:
    /// nothing ran on the pages since, so no wait.
    pub(super) fn unmap_run_again(
        &mut self,
        key: &SegmentKey,
        start: u64,
        bytes: u64,
    ) -> Result<(), AllocError> {
        virtual_memory(&mut self.memory)?.unmap_idle(start, bytes)?;
        let g = self.growable.get_mut(key).expect("growable");
        let seg_id = g.segment;
        g.pages_unmapped(start, bytes, false);
        self.heap.pages_unmapped(seg_id, bytes);
        Ok(())
    }

    /// `unmap_free_pages`: stamps the pages under the block `id`, about to
    /// become free, with the current epoch.
    pub(super) fn note_freed(&mut self, id: BlockId) {
        let b = self.heap.block(id);
        let seg = self.heap.segment(b.segment);
        if !seg.expandable {
            return;
        }
        let (lo, hi) = (b.addr, b.addr + b.size);
        let key = (seg.key(), seg.pool);
        if let Some(g) = self.growable.get_mut(&key) {
            g.idle.freed(lo, hi);
            self.free_pages.note(key);
        }
    }

    /// Maps the unmapped pages under the free block `block` before it is
    /// handed out; `Ok(false)` when the device (or the memory fraction) has
    /// no room.
    pub(super) fn map_pages_under(&mut self, block: BlockId) -> Result<bool, AllocError> {
        let b = self.heap.block(block);
        let size = b.size;
        let seg = self.heap.segment(b.segment);
        if !seg.expandable || seg.unmapped == 0 {
            return Ok(true);
        }
        let (seg_id, key) = (b.segment, (seg.key(), seg.pool));
        let g = &self.growable[&key];
        let layout = *g.pages();
        let (lo, hi) = g.covering(b.addr, size);
        let runs = g.unmapped_runs(lo, hi);
        let needed = runs.iter().map(|r| r.1).sum();
        let runs_empty = runs.is_empty();
        if !runs_empty {
            // Pages shared with free neighbours, and those of a mapping that
            // fails midway, are free mapped pages.
            self.free_pages.note(key);
            // Detached pages lie only in unmapped runs: a block with none
            // pays no event query here.
            self.settle_detached(&key, lo, hi)?;
        }
        let mover = (
            key.0.stream,
            runs.first().map_or(0, |r| layout.size_at(r.0)),
        );
        let reused_busy = self.make_room(needed, Some(block), mover)?;
        for (start, bytes) in runs {
            if self.would_pass_limit(bytes) {
                return Ok(false);
            }
            let started = Instant::now();
            if !self.map_pages(start, bytes)? {
                return Ok(false);
            }
            let pages = layout.count(start, start + bytes);
            self.count_move(started, |m| m.pages_mapped += pages);
            let g = self.growable.get_mut(&key).expect("growable");
            g.pages_mapped(start, bytes, reused_busy);
            self.heap.pages_mapped(seg_id, bytes);
            self.empty.remove(&key);
        }
        if !runs_empty {
            self.mark_epoch(&key)?;
        }
        Ok(true)
    }

    /// Waits on the host for the work queued so far on `stream`. A growable
    /// segment serves one stream, and a block used on other streams becomes
    /// free only once their events completed, so its free pages are idle
    /// when this stream is.
    fn wait_for_stream(&mut self, stream: StreamId) -> Result<(), AllocError> {
        let event = self.streams.record(stream)?;
        let waited = self.streams.synchronize(&event);
        self.streams.release(event);
        self.free_pages.wake_stream(stream);
        Ok(waited?)
    }
}

/// The parts of page runs `(start, bytes)` outside `[lo, hi)` (page
/// boundaries).
fn outside(runs: Vec<(u64, u64)>, (lo, hi): (u64, u64)) -> Vec<(u64, u64)> {
    let mut out = Vec::with_capacity(runs.len());
    for (start, bytes) in runs {
        let end = start + bytes;
        if end <= lo || start >= hi {
            out.push((start, bytes));
            continue;
        }
        out.extend((start < lo).then(|| (start, lo - start)));
        out.extend((end > hi).then(|| (hi, end - hi)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::outside;

    #[test]
    fn runs_are_cut_to_what_lies_outside_the_kept_range() {
        let runs = vec![(0, 4), (8, 8), (20, 4), (30, 2)];
        assert_eq!(
            outside(runs, (10, 22)),
            vec![(0, 4), (8, 2), (22, 2), (30, 2)]
        );
        assert_eq!(outside(vec![(0, 8)], (0, 8)), vec![]);
        assert_eq!(outside(vec![(4, 4)], (0, 2)), vec![(4, 4)]);
    }
}
