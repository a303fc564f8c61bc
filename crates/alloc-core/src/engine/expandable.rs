//! Expandable segments: one growable segment per (stream, pool), mapped in
//! PyTorch's steps on a range reserved the size of the device; free tails
//! trimmed on `empty_cache`; and with `unmap_free_pages`, holes of unmapped
//! pages under free blocks, so that physical memory serves growth first.

use std::time::Instant;

use super::free_page_index::Visits;
use super::growable::Growable;
use super::{detach_pages, virtual_memory, Engine, MAX_REQUEST};
use crate::backend::{MemoryBackend, StreamBackend};
use crate::budget::ReclaimInputs;
use crate::error::{AllocError, BackendError};
use crate::heap::BlockState;
use crate::page_set::partition_pages;
use crate::policy::{Policy, Request};
use crate::stats::PageMoves;
use crate::types::{BlockId, Pool, SegmentKey, StreamId};

/// Nanoseconds since `started` (saturating).
fn elapsed_ns(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl<P: Policy, M: MemoryBackend, S: StreamBackend> Engine<P, M, S> {
    /// Every growable segment's invariants, its pages' records among them
    /// ([`GrowableSegments::check`](super::growable_segments::GrowableSegments::check)).
    pub(super) fn check_unmapped_pages(&self) -> Result<(), String> {
        let pools = &self.pools;
        self.segments
            .check(&self.heap, |key| pools.is_paused_key(*key))
    }

    /// Expandable segments: maps more memory at the end of the stream's
    /// growable segment (reserving its address range first if needed) so that
    /// its free tail covers `req`; returns that free tail.
    pub(super) fn grow_segment(&mut self, req: &Request) -> Result<Option<BlockId>, AllocError> {
        let key = (req.key, req.pool);
        let tagged = self.pools.is_tagged_key(req.key);
        let pages = self.segments.page_layout(req.pool, tagged);
        let grown = self.segments.get(&key).map(|g| (g.segment, g.range));
        let extra = self.segments.growth(&self.heap, &key, &pages, req.size);
        // The free tail grows into the new pages: keep it mapped.
        let tail = grown.map(|(segment, _)| self.heap.segment(segment).last);
        let free_tail = tail.is_some_and(|b| self.heap.block(b).state == BlockState::Free);
        let mapped = grown.map_or(0, |(segment, _)| self.heap.segment(segment).size);
        let mover = (req.key.stream, pages.size_at(mapped));
        let reused_busy = self.make_room(extra, tail, mover)?;
        if self.would_pass_limit(extra) {
            return Ok(None);
        }
        let Some((segment, range)) = grown else {
            let capacity = self.memory.capacity();
            let range = self
                .segments
                .new_range(req.pool, &pages, capacity, MAX_REQUEST);
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
            self.segments.add(key, grown);
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
        self.segments.pages_mapped(&key, end, extra, reused_busy);
        self.segments.free_pages_mut().note(key);
        if free_tail {
            self.policy.remove_free(&self.heap, last);
        }
        let tail = self.heap.grow_segment(segment, extra);
        self.mark_epoch(&key)?;
        Ok(Some(tail))
    }

    /// Unmaps the whole free chunks at the end of every growable segment.
    pub(super) fn trim_growable_segments(&mut self) -> Result<(), AllocError> {
        let keys = self.segments.keys();
        for key in keys {
            let g = &self.segments[&key];
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
            let g = self.segments.get_mut(&key);
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
        for (start, bytes) in self.segments[key].mapped_runs(lo, hi) {
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
    /// once its growth allowance
    /// ([`GrowableSegments::kept_allowance`](super::growable_segments::GrowableSegments::kept_allowance)) is spent. `mover`
    /// is the real stream and page size of the mapping to come (the size of
    /// its first page). Returns whether busy pages were detached for it
    /// ([`Engine::unmap_free_pages`]).
    pub(super) fn make_room(
        &mut self,
        needed: u64,
        keep: Option<BlockId>,
        mover: (StreamId, u64),
    ) -> Result<bool, AllocError> {
        if !self.segments.recycles_pages() || self.pools.capture_underway() {
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
            let allowance = self.segments.kept_allowance(peak);
            if deficit > allowance {
                let mut over = deficit - allowance;
                detached |= self.unmap_free_pages(keep, &mut over, Some(mover), false, wait)?;
                deficit = allowance + over;
            }
            self.segments.kept_grew(deficit.min(allowance));
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
        let recycles = self.segments.recycles_pages() && self.segments.granularity() > 0;
        if !recycles || self.pools.capture_underway() {
            return Ok(false);
        }
        let before = self.reserved_bytes();
        let mut everything = u64::MAX;
        self.unmap_free_pages(keep, &mut everything, None, false, true)?;
        // Detached memory is physically freed when its old mapping goes.
        let keys = self.segments.keys();
        for key in keys {
            self.settle_detached(&key, 0, u64::MAX)?;
        }
        virtual_memory(&mut self.memory)?.release_spare()?;
        Ok(self.reserved_bytes() < before)
    }

    /// Whether the policy keeps part of a growable segment mapped
    /// ([`Reclaim::kept_mapped`](crate::Reclaim::kept_mapped)).
    fn keeps_pages_mapped(&self) -> bool {
        let policy = &self.policy;
        let keys = policy.kept_mapped_keys();
        self.segments.keeps_range(&self.heap, keys, |cache| {
            policy.kept_mapped(cache).is_some()
        })
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
        let mut visits = Visits::new(self.segments.free_pages());
        while let Some(key) = visits.next(self.segments.free_pages()) {
            if *budget == 0 {
                break;
            }
            self.segments.free_pages_mut().count_visit();
            let pages = *self.segments[&key].pages();
            let seg_key = self.heap.segment(self.segments[&key].segment).key();
            if !self.pools.releasable(seg_key) {
                continue;
            }
            // Making room for a mapping, the pages the policy keeps mapped
            // stay (a plan uses them again every step) within their
            // allowance; emptying the cache takes them too.
            let policy = &self.policy;
            let spared = |cache| {
                let spares = spare_kept && key.1 == Pool::Large;
                spares.then(|| policy.kept_mapped(cache)).flatten()
            };
            let Some(runs) = self.segments.runs_to_take(&self.heap, &key, keep, spared) else {
                continue;
            };
            // End the epoch here: an idle stream has passed the new mark at
            // once, and later rounds find what was freed so far idle.
            self.heap.ledger.stats.page_moves.rounds += 1;
            self.mark_epoch(&key)?;
            self.poll_marks(&key)?;
            let (idle, busy) = self.segments[&key].idle.split_runs(&runs);
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
            let kept = key.1 == Pool::Large && self.policy.kept_mapped(seg_key).is_some();
            if mover.is_some() && none_idle && same.is_empty() && !kept {
                self.segments.park_if_stuck(&self.heap, key, keep);
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
            let Some(key) = self.segments.free_pages_mut().oldest_parked() else {
                break;
            };
            // Woken: walks visit it again, and it leaves this loop.
            self.segments.free_pages_mut().wake(&key);
            self.segments.free_pages_mut().count_visit();
            let seg_key = self.heap.segment(self.segments[&key].segment).key();
            if !self.pools.releasable(seg_key) {
                continue;
            }
            let runs = self.segments[&key].free_mapped_runs(&self.heap, keep);
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
        if !self.segments.recycles_pages() || self.pools.capture_underway() {
            return Ok(());
        }
        self.poll_marks(key)?;
        if self.segments[key].idle.wants_mark() {
            let stream = self.heap.segment(self.segments[key].segment).stream;
            let mark = self.streams.record(stream)?;
            let number = self.segments.free_pages_mut().number_mark();
            self.segments.get_mut(key).idle.end_epoch(mark, number);
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
            self.segments.free_pages_mut().wake_all();
            return Ok(());
        };
        // A segment's oldest outstanding mark has completed (or it has none).
        let streams = &mut self.streams;
        self.segments.wake_for(stream, |mark| {
            Ok::<_, AllocError>(streams.is_complete(mark)?)
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
        let layout = *self.segments[key].pages();
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
            let segments = &mut self.segments;
            segments.pages_unmapped(&mut self.heap, key, start, take, detach);
            *budget = budget.saturating_sub(take);
        }
        self.segments.note_if_empty(&self.heap, key);
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

    /// Forgets the growable segment `key` (its segment is gone), releasing
    /// its marks.
    pub(super) fn drop_growable(&mut self, key: &SegmentKey) {
        if let Some(mut g) = self.segments.remove(key) {
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
        let g = self.segments.get_mut(key);
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
        let Some(epoch) = self.segments[key].idle.detached_epoch_in(lo, hi) else {
            return Ok(());
        };
        match self.segments[key].idle.mark_ending(epoch) {
            Some(mark) => {
                let started = Instant::now();
                self.streams.synchronize(mark)?;
                self.segments.free_pages_mut().wake_stream(key.0.stream);
                self.count_move(started, |m| m.stream_waits += 1);
                let g = self.segments.get_mut(key);
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
        self.wait_for_stream(self.heap.segment(self.segments[key].segment).stream)?;
        self.count_move(started, |m| m.stream_waits += 1);
        let g = self.segments.get_mut(key);
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
        let seg_id = self.segments[key].segment;
        let seg = self.heap.segment(seg_id);
        let runs = self.segments[key].mapped_runs(seg.addr, seg.addr + seg.size);
        for (start, bytes) in runs {
            virtual_memory(&mut self.memory)?.unmap_idle(start, bytes)?;
            self.heap.ledger.stats.num_device_free += 1;
            let segments = &mut self.segments;
            segments.pages_unmapped(&mut self.heap, key, start, bytes, false);
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
        let seg_id = self.segments[key].segment;
        self.segments.pages_mapped(key, start, bytes, false);
        self.heap.pages_mapped(seg_id, bytes);
        self.segments.free_pages_mut().note(*key);
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
        let segments = &mut self.segments;
        segments.pages_unmapped(&mut self.heap, key, start, bytes, false);
        Ok(())
    }

    /// Maps the unmapped pages under the free block `block` before it is
    /// handed out; `Ok(false)` when the device (or the memory fraction) has
    /// no room.
    pub(super) fn map_pages_under(&mut self, block: BlockId) -> Result<bool, AllocError> {
        let Some(plan) = self.segments.runs_to_map(&self.heap, block) else {
            return Ok(true);
        };
        let (key, (lo, hi), layout) = (plan.key, plan.span, plan.pages);
        let runs_empty = plan.runs.is_empty();
        if !runs_empty {
            // Pages shared with free neighbours, and those of a mapping that
            // fails midway, are free mapped pages.
            self.segments.free_pages_mut().note(key);
            // Detached pages lie only in unmapped runs: a block with none
            // pays no event query here.
            self.settle_detached(&key, lo, hi)?;
        }
        let mover = (key.0.stream, plan.first_page());
        let reused_busy = self.make_room(plan.bytes(), Some(block), mover)?;
        for (start, bytes) in plan.runs {
            if self.would_pass_limit(bytes) {
                return Ok(false);
            }
            let started = Instant::now();
            if !self.map_pages(start, bytes)? {
                return Ok(false);
            }
            let pages = layout.count(start, start + bytes);
            self.count_move(started, |m| m.pages_mapped += pages);
            self.segments.pages_mapped(&key, start, bytes, reused_busy);
            self.heap.pages_mapped(plan.segment, bytes);
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
        self.segments.free_pages_mut().wake_stream(stream);
        Ok(waited?)
    }
}
