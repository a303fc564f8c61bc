//! Growable segments driving the backends (expandable segments,
//! `unmap_free_pages`, a sleep tag's pages): one growable segment per
//! (stream, pool), mapped in PyTorch's steps on a range reserved the size of
//! the device; free tails trimmed on `empty_cache`; with `unmap_free_pages`,
//! holes of unmapped pages under free blocks, so that physical memory serves
//! growth first.
//!
//! [`GrowableSegments`] owns the segments' records; what it works on but
//! does not own (the heap, the policy's free-block index, the backends, the
//! private pools, the limits on reserved memory) the engine lends it for
//! one call as a [`Lent`].

use std::time::Instant;

use rustc_hash::FxHashSet;

use super::free_page_index::Visits;
use super::growable::Growable;
use super::growable_segments::GrowableSegments;
use super::lending::Lending;
use crate::backend::{DetachPages, MemoryBackend, StreamBackend, VirtualMemory};
use crate::budget::{MemoryBudget, ReclaimInputs};
use crate::error::{AllocError, BackendError};
use crate::heap::{BlockState, Heap};
use crate::live_stats::Quantity;
use crate::page_set::partition_pages;
use crate::policy::{Policy, Request};
use crate::private_pool::PrivatePools;
use crate::stats::PageMoves;
use crate::types::{BlockId, Pool, SegmentId, SegmentKey, StreamId, MAX_REQUEST};

/// The virtual memory of `memory`, which growable segments need: the engine
/// makes none unless the backend has it, so its absence here is a backend
/// that withdrew it, reported as an error.
fn virtual_memory(memory: &mut dyn MemoryBackend) -> Result<&mut dyn VirtualMemory, BackendError> {
    memory.virtual_memory().ok_or_else(|| {
        BackendError::Other("the memory backend no longer offers virtual memory".into())
    })
}

/// The page detaching of `memory`'s virtual memory: the engine detaches pages
/// only after asking whether the backend can.
fn detach_pages(memory: &mut dyn MemoryBackend) -> Result<&mut dyn DetachPages, BackendError> {
    virtual_memory(memory)?
        .detach_pages()
        .ok_or_else(|| BackendError::Other("the memory backend no longer detaches pages".into()))
}

/// Bytes reserved from the device now (`reserved_bytes.all.current`).
pub(super) fn reserved(heap: &Heap) -> u64 {
    heap.ledger.stats.all_current(Quantity::ReservedBytes) as u64
}

/// Whether reserving `extra` more bytes would pass the reserved-bytes
/// `limit`.
pub(super) fn passes_limit(heap: &Heap, limit: Option<u64>, extra: u64) -> bool {
    limit.is_some_and(|limit| reserved(heap).saturating_add(extra) > limit)
}

/// The growable segments among `segments`, by key.
pub(super) fn growable_keys(heap: &Heap, segments: &[SegmentId]) -> Vec<SegmentKey> {
    segments
        .iter()
        .map(|&id| heap.segment(id))
        .filter(|s| s.expandable)
        .map(|s| (s.key(), s.pool))
        .collect()
}

/// The page runs `(start, bytes)` unmapped in one growable segment.
pub(super) type UnmappedRuns = (SegmentKey, Vec<(u64, u64)>);

/// Nanoseconds since `started` (saturating).
fn elapsed_ns(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// What the engine lends [`GrowableSegments`] for one call (`E`: the stream
/// backend's event).
pub(super) struct Lent<'a, E> {
    /// The block arena and its statistics.
    pub(super) heap: &'a mut Heap,
    /// The policy, whose index of free blocks follows a segment's tail.
    pub(super) policy: &'a mut dyn Policy,
    /// The device memory, with its virtual memory.
    pub(super) memory: &'a mut dyn MemoryBackend,
    /// The streams, on which marks and waits are recorded.
    pub(super) streams: &'a mut dyn StreamBackend<Event = E>,
    /// The private pools: which segments are held, tagged, or being captured.
    pub(super) pools: &'a mut PrivatePools,
    /// The reserved-bytes limit (`set_memory_fraction`).
    pub(super) limit: Option<u64>,
    /// The memory budget of `unmap_free_pages`.
    pub(super) budget: Option<MemoryBudget>,
}

impl<E> Lent<'_, E> {
    /// Bytes reserved from the device now.
    fn reserved_bytes(&self) -> u64 {
        reserved(self.heap)
    }

    /// Whether reserving `extra` more bytes would pass the limit.
    fn would_pass_limit(&self, extra: u64) -> bool {
        passes_limit(self.heap, self.limit, extra)
    }

    /// The device's virtual memory.
    fn vm(&mut self) -> Result<&mut dyn VirtualMemory, BackendError> {
        virtual_memory(self.memory)
    }

    /// The device's page detaching.
    fn detach(&mut self) -> Result<&mut dyn DetachPages, BackendError> {
        detach_pages(self.memory)
    }

    /// Whether the backend can detach busy pages ([`DetachPages`]).
    fn can_detach(&mut self) -> bool {
        self.memory
            .virtual_memory()
            .is_some_and(|vm| vm.detach_pages().is_some())
    }

    /// Maps `[addr, addr + bytes)`, counted as a device allocation;
    /// `Ok(false)` when the device has no memory for it.
    fn map_pages(&mut self, addr: u64, bytes: u64) -> Result<bool, AllocError> {
        match self.vm()?.map(addr, bytes) {
            Ok(()) => {
                self.heap.ledger.stats.num_device_alloc += 1;
                Ok(true)
            }
            Err(BackendError::OutOfMemory) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Counts a page move (`count` updates the counters) and the host time
    /// since `started` in the statistics.
    fn count_move(&mut self, started: Instant, count: impl FnOnce(&mut PageMoves)) {
        let moves = &mut self.heap.ledger.stats.page_moves;
        count(moves);
        moves.host_ns += elapsed_ns(started);
    }
}

impl<E> GrowableSegments<E> {
    /// Expandable segments: maps more memory at the end of the stream's
    /// growable segment (reserving its address range first if needed) so that
    /// its free tail covers `req`; returns that free tail.
    pub(super) fn grow_segment(
        &mut self,
        cx: &mut Lent<'_, E>,
        req: &Request,
    ) -> Result<Option<BlockId>, AllocError> {
        let key = (req.key, req.pool);
        let tagged = cx.pools.is_tagged_key(req.key);
        let pages = self.page_layout(req.pool, tagged);
        let grown = self.get(&key).map(|g| (g.segment, g.range));
        let extra = self.growth(cx.heap, &key, &pages, req.size);
        // The free tail grows into the new pages: keep it mapped.
        let tail = grown.map(|(segment, _)| cx.heap.segment(segment).last);
        let free_tail = tail.is_some_and(|b| cx.heap.block(b).state == BlockState::Free);
        let mapped = grown.map_or(0, |(segment, _)| cx.heap.segment(segment).size);
        let mover = (req.key.stream, pages.size_at(mapped));
        let deficit = self.growth_deficit(cx, extra, req.size);
        if deficit > 0 && self.lending.may_borrow(req) && !tagged {
            if let Some(block) = self.lend_idle_block(cx, req)? {
                return Ok(Some(block));
            }
        }
        let reused_busy = self.make_room(cx, deficit, tail, mover)?;
        if cx.would_pass_limit(extra) {
            return Ok(None);
        }
        let Some((segment, range)) = grown else {
            let capacity = cx.memory.capacity();
            let range = self.new_range(req.pool, &pages, capacity, MAX_REQUEST);
            if extra > range {
                return Ok(None); // larger than the device: out of memory
            }
            let addr = cx.vm()?.reserve(range, pages)?;
            let mapped = cx.map_pages(addr, extra);
            if !matches!(mapped, Ok(true)) {
                cx.vm()?.release(addr, range)?;
                return mapped.map(|_| None);
            }
            let (segment, block) = cx.heap.add_segment(addr, extra, req.pool, req.key);
            cx.pools.segment_added(req.key);
            cx.heap.set_expandable(segment);
            let grown = Growable::new(segment, addr, pages, range, extra, reused_busy);
            self.add(key, grown);
            return Ok(Some(block));
        };
        let seg = cx.heap.segment(segment);
        let (end, last) = (seg.addr + seg.size, seg.last);
        if seg.size + extra > range {
            return Ok(None);
        }
        if !cx.map_pages(end, extra)? {
            return Ok(None);
        }
        self.pages_mapped(&key, end, extra, reused_busy);
        self.free_pages_mut().note(key);
        if free_tail {
            cx.policy.remove_free(cx.heap, last);
        }
        let tail = cx.heap.grow_segment(segment, extra);
        self.mark_epoch(cx, &key)?;
        Ok(Some(tail))
    }

    /// Gives the idle growable segment `key` back: its detached pages
    /// settled, its mapped pages unmapped, its address range released and
    /// its record dropped. The heap's record of the segment is the caller's.
    pub(super) fn release_whole(
        &mut self,
        cx: &mut Lent<'_, E>,
        key: &SegmentKey,
    ) -> Result<(), AllocError> {
        let g = &self[key];
        let seg = cx.heap.segment(g.segment);
        let (addr, end, range) = (seg.addr, seg.addr + seg.size, g.range);
        self.settle_detached(cx, key, addr, end)?;
        self.unmap_mapped_runs(cx, key, addr, end)?;
        cx.vm()?.release(addr, range)?;
        self.drop_growable(cx, key);
        Ok(())
    }

    /// Unmaps the whole free chunks at the end of every growable segment.
    pub(super) fn trim_growable_segments(
        &mut self,
        cx: &mut Lent<'_, E>,
    ) -> Result<(), AllocError> {
        let keys = self.keys();
        for key in keys {
            let g = &self[&key];
            let seg_id = g.segment;
            let seg = cx.heap.segment(seg_id);
            if seg.is_idle() || !cx.pools.releasable(seg.key()) {
                continue; // idle ones go back whole with the other idle segments
            }
            let Some(keep_to) = g.trim_point(cx.heap) else {
                continue;
            };
            let (end, last_id) = (seg.addr + seg.size, seg.last);
            let cut = end - keep_to;
            self.settle_detached(cx, &key, keep_to, end)?;
            self.unmap_mapped_runs(cx, &key, keep_to, end)?;
            let g = self.get_mut(&key);
            let pages = *g.pages();
            let unmapped = g.unmapped.remove_in(keep_to, end, &pages);
            cx.policy.remove_free(cx.heap, last_id);
            cx.heap.shrink_segment(seg_id, cut, unmapped);
            let new_last = cx.heap.segment(seg_id).last;
            if cx.heap.block(new_last).state == BlockState::Free {
                cx.policy.insert_free(cx.heap, new_last);
            }
        }
        Ok(())
    }

    /// Unmaps the mapped pages of `[lo, hi)` in the growable segment `key`,
    /// a run per backend call (each counted as a device free).
    fn unmap_mapped_runs(
        &mut self,
        cx: &mut Lent<'_, E>,
        key: &SegmentKey,
        lo: u64,
        hi: u64,
    ) -> Result<(), AllocError> {
        for (start, bytes) in self[key].mapped_runs(lo, hi) {
            cx.vm()?.unmap(start, bytes)?;
            cx.heap.ledger.stats.num_device_free += 1;
        }
        Ok(())
    }

    /// `unmap_free_pages`: before a mapping would take reserved memory
    /// `deficit` bytes past its level ([`GrowableSegments::growth_deficit`]),
    /// unmaps whole free pages of growable segments (held private pools and
    /// `keep` excepted), highest addresses first, until the mapping fits
    /// under the level or none are left. Only mappings past the level pay
    /// for it, so a steady state maps and unmaps nothing. The range the
    /// policy keeps mapped gives up its pages last, once its growth allowance
    /// ([`GrowableSegments::kept_allowance`]) is spent. `mover`
    /// is the real stream and page size of the mapping to come (the size of
    /// its first page). Returns whether busy pages were detached for it
    /// ([`GrowableSegments::unmap_free_pages`]).
    pub(super) fn make_room(
        &mut self,
        cx: &mut Lent<'_, E>,
        mut deficit: u64,
        keep: Option<BlockId>,
        mover: (StreamId, u64),
    ) -> Result<bool, AllocError> {
        if deficit == 0 {
            return Ok(false);
        }
        let peak = cx.heap.ledger.stats.reserved_mark() as u64;
        // At a budget that is a shortage the host waits for streams whose
        // free pages the GPU may still use rather than pass it; otherwise
        // it never waits.
        let wait = cx.budget.is_some_and(|b| b.is_shortage());
        let mut detached =
            self.unmap_free_pages(cx, keep, &mut deficit, Some(mover), true, wait)?;
        if deficit > 0 && self.keeps_pages_mapped(cx) {
            // The policy's kept range may raise the peak by its allowance
            // only; beyond it, its free pages move too.
            let allowance = self.kept_allowance(peak);
            if deficit > allowance {
                let mut over = deficit - allowance;
                detached |= self.unmap_free_pages(cx, keep, &mut over, Some(mover), false, wait)?;
                deficit = allowance + over;
            }
            self.kept_grew(deficit.min(allowance));
        }
        Ok(detached)
    }

    /// The bytes by which mapping `needed` more would take reserved memory
    /// past its level (the reserved peak, a memory budget, a budget over
    /// the allocated peak); `adds` is what the allocation it serves adds to
    /// allocated memory. 0 when the mapping fits, when pages are not
    /// recycled, and during a capture (nothing may move then).
    fn growth_deficit(&self, cx: &Lent<'_, E>, needed: u64, adds: u64) -> u64 {
        if !self.recycles_pages() || cx.pools.capture_underway() {
            return 0;
        }
        // The allocated peak once this allocation is counted: a level over
        // the allocated peak rises with an allocation that raises the peak,
        // so the heap grows with it instead of first moving the pages of its
        // allowance (reserved stays within the level of the peak it reaches).
        let stats = &cx.heap.ledger.stats;
        let allocated_now = stats.all_current(Quantity::AllocatedBytes).max(0) as u64;
        let allocated_peak =
            (stats.allocated_mark() as u64).max(allocated_now.saturating_add(adds));
        ReclaimInputs {
            budget: cx.budget,
            capacity: cx.memory.capacity(),
            peak: stats.reserved_mark() as u64,
            allocated_peak,
            reserved: cx.reserved_bytes(),
            limit: cx.limit,
        }
        .deficit(needed, || cx.memory.free_bytes())
    }

    /// `lend_idle_blocks`: a free block of another stream's growable segment
    /// for `req` whose pages the GPU is done with ([`Lending::best_in`]),
    /// carved in its own stream's cache (the rest stays there) and counted;
    /// `None` when no segment has one. The caller records the borrowing
    /// stream's use.
    fn lend_idle_block(
        &mut self,
        cx: &mut Lent<'_, E>,
        req: &Request,
    ) -> Result<Option<BlockId>, AllocError> {
        let mut best: Option<(u64, u64, SegmentKey, BlockId)> = None;
        for key in self.keys() {
            let cache = cx.heap.segment(self[&key].segment).key();
            if !Lending::may_lend(&key, req) || !cx.pools.releasable(cache) {
                continue;
            }
            // Marks completed since the last look make more pages idle.
            self.poll_marks(cx, &key)?;
            let mut found = Lending::best_in(cx.heap, &self[&key], req);
            if found.is_none() && Lending::any_fits(cx.heap, &self[&key], req) {
                // A block that fits was freed after the last mark: one now,
                // which a stream that has gone quiet has passed at once (as
                // an unmap walk would record before moving its pages).
                self.mark_epoch(cx, &key)?;
                self.poll_marks(cx, &key)?;
                found = Lending::best_in(cx.heap, &self[&key], req);
            }
            let Some(id) = found else {
                continue;
            };
            let b = cx.heap.block(id);
            if best.is_none_or(|(size, addr, _, _)| (b.size, b.addr) < (size, addr)) {
                best = Some((b.size, b.addr, key, id));
            }
        }
        let Some((_, _, key, block)) = best else {
            return Ok(None);
        };
        let own = Request {
            key: cx.heap.block(block).key(),
            ..*req
        };
        cx.policy.remove_free(cx.heap, block);
        let piece = cx.policy.carve(cx.heap, block, &own);
        let p = cx.heap.block(piece);
        // The policy may hand out more than the request (a rest too small
        // to split): all of it must be idle.
        if !Lending::lendable(&self[&key], p.addr, p.size) {
            cx.policy.insert_free(cx.heap, piece); // merges the rest back
            return Ok(None);
        }
        cx.heap.ledger.stats.page_moves.blocks_lent += 1;
        Ok(Some(piece))
    }

    /// With `unmap_free_pages`: unmaps every free page of ours (`keep`'s
    /// excepted), waiting on the host for streams whose pages the GPU may
    /// still use, and gives the physical memory back to the device: what
    /// runs before a mapping the device (or the limit) refused is tried
    /// again, and what `empty_cache` does. Returns whether reserved memory
    /// went down.
    pub(super) fn reclaim_free_pages(
        &mut self,
        cx: &mut Lent<'_, E>,
        keep: Option<BlockId>,
    ) -> Result<bool, AllocError> {
        // Without virtual memory (expandable segments fell back to ordinary
        // ones) no page was ever unmapped: nothing to reclaim or settle.
        let recycles = self.recycles_pages() && self.granularity() > 0;
        if !recycles || cx.pools.capture_underway() {
            return Ok(false);
        }
        let before = cx.reserved_bytes();
        let mut everything = u64::MAX;
        self.unmap_free_pages(cx, keep, &mut everything, None, false, true)?;
        // Detached memory is physically freed when its old mapping goes.
        let keys = self.keys();
        for key in keys {
            self.settle_detached(cx, &key, 0, u64::MAX)?;
        }
        cx.vm()?.release_spare()?;
        Ok(cx.reserved_bytes() < before)
    }

    /// Whether the policy keeps part of a growable segment mapped
    /// ([`Reclaim::kept_mapped`](crate::Reclaim::kept_mapped)).
    fn keeps_pages_mapped(&self, cx: &Lent<'_, E>) -> bool {
        let policy = &cx.policy;
        let keys = policy.kept_mapped_keys();
        self.keeps_range(cx.heap, keys, |cache| policy.kept_mapped(cache).is_some())
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
    /// ([`GrowableSegments::wait_for_parked`]). Returns whether pages were detached.
    pub(super) fn unmap_free_pages(
        &mut self,
        cx: &mut Lent<'_, E>,
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
        self.wake_parked(cx, mover.map(|m| m.0))?;
        // Busy runs per segment: those that can move to `mover` without a
        // wait, and the others. Idle pages of every segment go first.
        let (mut movable, mut waiting) = (Vec::new(), Vec::new());
        let mut visits = Visits::new(self.free_pages());
        while let Some(key) = visits.next(self.free_pages()) {
            if *budget == 0 {
                break;
            }
            self.free_pages_mut().count_visit();
            let pages = *self[&key].pages();
            let seg_key = cx.heap.segment(self[&key].segment).key();
            if !cx.pools.releasable(seg_key) {
                continue;
            }
            // Making room for a mapping, the pages the policy keeps mapped
            // stay (a plan uses them again every step) within their
            // allowance; emptying the cache takes them too.
            let policy = &cx.policy;
            let spared = |cache| {
                let spares = spare_kept && key.1 == Pool::Large;
                spares.then(|| policy.kept_mapped(cache)).flatten()
            };
            let Some(runs) = self.runs_to_take(cx.heap, &key, keep, spared) else {
                continue;
            };
            // End the epoch here: an idle stream has passed the new mark at
            // once, and later rounds find what was freed so far idle.
            cx.heap.ledger.stats.page_moves.rounds += 1;
            self.mark_epoch(cx, &key)?;
            self.poll_marks(cx, &key)?;
            let (idle, busy) = self[&key].idle.split_runs(&runs);
            let none_idle = idle.is_empty();
            self.unmap_runs(cx, &key, idle, budget, false)?;
            // Busy pages of the mover's stream and page size can move.
            let (same, other) = match mover {
                Some((stream, size)) if stream == seg_key.stream && cx.can_detach() => {
                    partition_pages(&pages, &busy, |_, page| page == size)
                }
                _ => (Vec::new(), busy),
            };
            // Every free page busy, none to move, and no mark to record:
            // the next walk for a mapping would find the same until a mark
            // completes (the kept range aside, which walks see in part).
            let kept = key.1 == Pool::Large && cx.policy.kept_mapped(seg_key).is_some();
            if mover.is_some() && none_idle && same.is_empty() && !kept {
                self.park_if_stuck(cx.heap, key, keep);
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
            self.unmap_runs(cx, &key, busy, budget, true)?;
        }
        if waits {
            // Emptying the cache, or at a budget: wait for every stream with
            // busy pages visited, then at a budget for parked ones.
            for (key, busy) in waiting {
                if *budget == 0 {
                    break;
                }
                self.wait_for_growable(cx, &key)?;
                self.unmap_runs(cx, &key, busy, budget, false)?;
            }
        }
        if mover.is_some() && wait {
            self.wait_for_parked(cx, keep, budget)?;
        }
        Ok(detached)
    }

    /// At a budget, still short after a walk: waits for the streams of
    /// parked segments, oldest mark first (the first to complete on a GPU
    /// the host runs ahead of), and unmaps their free pages, now idle,
    /// until `budget` bytes are unmapped or none is parked.
    fn wait_for_parked(
        &mut self,
        cx: &mut Lent<'_, E>,
        keep: Option<BlockId>,
        budget: &mut u64,
    ) -> Result<(), AllocError> {
        while *budget > 0 {
            let Some(key) = self.free_pages_mut().oldest_parked() else {
                break;
            };
            // Woken: walks visit it again, and it leaves this loop.
            self.free_pages_mut().wake(&key);
            self.free_pages_mut().count_visit();
            let seg_key = cx.heap.segment(self[&key].segment).key();
            if !cx.pools.releasable(seg_key) {
                continue;
            }
            let runs = self[&key].free_mapped_runs(cx.heap, keep);
            if runs.is_empty() {
                continue;
            }
            cx.heap.ledger.stats.page_moves.rounds += 1;
            self.wait_for_growable(cx, &key)?;
            self.unmap_runs(cx, &key, runs, budget, false)?;
        }
        Ok(())
    }

    /// `idle_mark_mb`: enough was freed in the growable segment `key` since
    /// its last mark to end its epoch with another, so that what was freed
    /// so far is known idle once the GPU passes it. The count starts again
    /// whether or not a mark could be recorded (the segment has all the
    /// marks it may keep outstanding, or the backend's event calls failed):
    /// those pages only stay busy longer, as without the option, and the
    /// frees that follow do not try again one by one.
    pub(super) fn mark_after_frees(&mut self, cx: &mut Lent<'_, E>, key: &SegmentKey) {
        self.get_mut(key).idle.restart_free_count();
        let _ = self.mark_epoch(cx, key);
    }

    /// `unmap_free_pages`: ends the epoch of the growable segment `key` with
    /// a mark on its stream (unless too many are outstanding), so that the
    /// pages freed so far become idle once the GPU passes it. Called at
    /// unmap rounds and after mappings, the moments around which later
    /// rounds look for idle pages, and after frees
    /// ([`GrowableSegments::mark_after_frees`]).
    fn mark_epoch(&mut self, cx: &mut Lent<'_, E>, key: &SegmentKey) -> Result<(), AllocError> {
        if !self.recycles_pages() || cx.pools.capture_underway() {
            return Ok(());
        }
        self.poll_marks(cx, key)?;
        if self[key].idle.wants_mark() {
            let stream = cx.heap.segment(self[key].segment).stream;
            let mark = cx.streams.record(stream)?;
            let number = self.free_pages_mut().number_mark();
            self.get_mut(key).idle.end_epoch(mark, number);
        }
        Ok(())
    }

    /// Wakes the parked segments (see `free_page_index.rs`) a walk may get
    /// something from without waiting: with `stream` (a mapping on it to
    /// come), its own and those whose oldest mark completed, polled oldest
    /// first and one more in turn; with `None` (emptying the cache), all of
    /// them.
    fn wake_parked(
        &mut self,
        cx: &mut Lent<'_, E>,
        stream: Option<StreamId>,
    ) -> Result<(), AllocError> {
        let Some(stream) = stream else {
            self.free_pages_mut().wake_all();
            return Ok(());
        };
        // A segment's oldest outstanding mark has completed (or it has none).
        let streams = &mut cx.streams;
        self.wake_for(stream, |mark| {
            Ok::<_, AllocError>(streams.is_complete(mark)?)
        })
    }

    /// Unmaps page runs of the growable segment `key`, from the highest
    /// address down, no more than `budget` bytes (whole pages); with
    /// `detach`, busy runs whose memory goes to the next mapping while their
    /// old mapping stays until the GPU is done with it.
    fn unmap_runs(
        &mut self,
        cx: &mut Lent<'_, E>,
        key: &SegmentKey,
        runs: Vec<(u64, u64)>,
        budget: &mut u64,
        detach: bool,
    ) -> Result<(), AllocError> {
        let layout = *self[key].pages();
        for (start, bytes) in runs.into_iter().rev() {
            if *budget == 0 {
                break;
            }
            let take = layout.tail(start, start + bytes, *budget);
            let start = start + bytes - take;
            let started = Instant::now();
            let pages = layout.count(start, start + take);
            if detach {
                cx.detach()?.detach(start, take)?;
                cx.count_move(started, |m| {
                    m.pages_unmapped += pages;
                    m.busy_pages_reused += pages;
                });
            } else {
                cx.vm()?.unmap_idle(start, take)?;
                cx.count_move(started, |m| m.pages_unmapped += pages);
            }
            cx.heap.ledger.stats.num_device_free += 1;
            self.pages_unmapped(cx.heap, key, start, take, detach);
            *budget = budget.saturating_sub(take);
        }
        self.note_if_empty(cx.heap, key);
        Ok(())
    }

    /// Forgets the growable segment `key` (its segment is gone), releasing
    /// its marks.
    fn drop_growable(&mut self, cx: &mut Lent<'_, E>, key: &SegmentKey) {
        if let Some(mut g) = self.remove(key) {
            debug_assert!(
                g.idle.detached_runs().next().is_none(),
                "segment dropped with detached pages still mapped"
            );
            for mark in g.idle.take_marks() {
                cx.streams.release(mark);
            }
        }
    }

    /// Retires the completed marks of the growable segment `key`, and drops
    /// the old mappings of detached pages the GPU is now done with.
    fn poll_marks(&mut self, cx: &mut Lent<'_, E>, key: &SegmentKey) -> Result<(), AllocError> {
        let g = self.get_mut(key);
        while let Some(mark) = g.idle.oldest_mark() {
            if !cx.streams.is_complete(mark)? {
                break;
            }
            let mark = g.idle.oldest_mark_done().expect("a mark");
            cx.streams.release(mark);
        }
        for (start, bytes) in g.idle.take_idle_detached() {
            cx.detach()?.unmap_detached(start, bytes)?;
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
        cx: &mut Lent<'_, E>,
        key: &SegmentKey,
        lo: u64,
        hi: u64,
    ) -> Result<(), AllocError> {
        self.poll_marks(cx, key)?;
        let Some(epoch) = self[key].idle.detached_epoch_in(lo, hi) else {
            return Ok(());
        };
        match self[key].idle.mark_ending(epoch) {
            Some(mark) => {
                let started = Instant::now();
                cx.streams.synchronize(mark)?;
                self.free_pages_mut().wake_stream(key.0.stream);
                cx.count_move(started, |m| m.stream_waits += 1);
                let g = self.get_mut(key);
                for mark in g.idle.waited_for_epoch(epoch) {
                    cx.streams.release(mark);
                }
            }
            None => self.wait_for_growable(cx, key)?,
        }
        self.poll_marks(cx, key)
    }

    /// Waits on the host for the stream of the growable segment `key`: every
    /// page freed so far becomes idle, and its marks go back.
    fn wait_for_growable(
        &mut self,
        cx: &mut Lent<'_, E>,
        key: &SegmentKey,
    ) -> Result<(), AllocError> {
        let started = Instant::now();
        let stream = cx.heap.segment(self[key].segment).stream;
        self.wait_for_stream(cx, stream)?;
        cx.count_move(started, |m| m.stream_waits += 1);
        let g = self.get_mut(key);
        for mark in g.idle.waited() {
            cx.streams.release(mark);
        }
        Ok(())
    }

    /// Unmaps every mapped page of the growable segments `keys` (a sleep
    /// tag's pause), live blocks' too, in order until one fails, then gives
    /// the physical memory back. The caller waited for the work that used
    /// them. Returns the runs unmapped per segment, so that a failure midway
    /// leaves a record of what to map again, and the outcome.
    pub(super) fn unmap_for_pause(
        &mut self,
        cx: &mut Lent<'_, E>,
        keys: &[SegmentKey],
    ) -> (Vec<UnmappedRuns>, Result<(), AllocError>) {
        let mut unmapped = Vec::with_capacity(keys.len());
        let mut result = Ok(());
        for &key in keys {
            let mut runs = Vec::new();
            result = self.unmap_whole_segment(cx, &key, &mut runs);
            unmapped.push((key, runs));
            if result.is_err() {
                break;
            }
        }
        let result = result.and_then(|()| Ok(cx.vm()?.release_spare()?));
        (unmapped, result)
    }

    /// Maps the paused `runs` (segment, start, bytes) again (a sleep tag's
    /// resume), in order, until one finds no room; returns how many were
    /// mapped.
    pub(super) fn map_runs_again(
        &mut self,
        cx: &mut Lent<'_, E>,
        runs: &[(SegmentKey, u64, u64)],
    ) -> Result<usize, AllocError> {
        for (i, &(key, start, bytes)) in runs.iter().enumerate() {
            if !self.map_run_again(cx, &key, start, bytes)? {
                return Ok(i);
            }
        }
        Ok(runs.len())
    }

    /// Unmaps the `runs` a failed resume had mapped again (nothing ran on
    /// their pages since, so no wait) and gives the memory back.
    pub(super) fn unmap_runs_again(
        &mut self,
        cx: &mut Lent<'_, E>,
        runs: &[(SegmentKey, u64, u64)],
    ) -> Result<(), AllocError> {
        for &(key, start, bytes) in runs {
            self.unmap_run_again(cx, &key, start, bytes)?;
        }
        Ok(cx.vm()?.release_spare()?)
    }

    /// Waits on the host, up to now, for the stream of each growable
    /// segment of `keys` (their marks retire with it) and for the streams
    /// `others`; returns every stream waited for.
    pub(super) fn wait_for_streams(
        &mut self,
        cx: &mut Lent<'_, E>,
        keys: &[SegmentKey],
        others: Vec<StreamId>,
    ) -> Result<FxHashSet<StreamId>, AllocError> {
        let mut waited = FxHashSet::default();
        for key in keys {
            // A second wait on a stream already waited for returns at once.
            self.wait_for_growable(cx, key)?;
            waited.insert(key.0.stream);
        }
        for stream in others {
            if waited.insert(stream) {
                self.wait_for_stream(cx, stream)?;
            }
        }
        Ok(waited)
    }

    /// Unmaps every mapped page of the growable segment `key`, live blocks'
    /// too, giving the physical memory back (a sleep tag's pause); pushes
    /// each run unmapped onto `out` as it goes, so that a failure midway
    /// leaves a record of what to map again. The caller waited for the work
    /// that used the segment.
    fn unmap_whole_segment(
        &mut self,
        cx: &mut Lent<'_, E>,
        key: &SegmentKey,
        out: &mut Vec<(u64, u64)>,
    ) -> Result<(), AllocError> {
        self.settle_detached(cx, key, 0, u64::MAX)?;
        let seg_id = self[key].segment;
        let seg = cx.heap.segment(seg_id);
        let runs = self[key].mapped_runs(seg.addr, seg.addr + seg.size);
        for (start, bytes) in runs {
            cx.vm()?.unmap_idle(start, bytes)?;
            cx.heap.ledger.stats.num_device_free += 1;
            self.pages_unmapped(cx.heap, key, start, bytes, false);
            out.push((start, bytes));
        }
        Ok(())
    }

    /// Maps the run `[start, start + bytes)` of the growable segment `key`
    /// again (a sleep tag's resume): fresh, unused memory at the same
    /// addresses. `Ok(false)` when the device (or the memory fraction) has
    /// no room.
    fn map_run_again(
        &mut self,
        cx: &mut Lent<'_, E>,
        key: &SegmentKey,
        start: u64,
        bytes: u64,
    ) -> Result<bool, AllocError> {
        if cx.would_pass_limit(bytes) || !cx.map_pages(start, bytes)? {
            return Ok(false);
        }
        let seg_id = self[key].segment;
        self.pages_mapped(key, start, bytes, false);
        cx.heap.pages_mapped(seg_id, bytes);
        self.free_pages_mut().note(*key);
        Ok(true)
    }

    /// Undoes [`GrowableSegments::map_run_again`] for a resume that failed midway:
    /// nothing ran on the pages since, so no wait.
    fn unmap_run_again(
        &mut self,
        cx: &mut Lent<'_, E>,
        key: &SegmentKey,
        start: u64,
        bytes: u64,
    ) -> Result<(), AllocError> {
        cx.vm()?.unmap_idle(start, bytes)?;
        self.pages_unmapped(cx.heap, key, start, bytes, false);
        Ok(())
    }

    /// Maps the unmapped pages under the free block `block` before it is
    /// handed out; `Ok(false)` when the device (or the memory fraction) has
    /// no room.
    pub(super) fn map_pages_under(
        &mut self,
        cx: &mut Lent<'_, E>,
        block: BlockId,
    ) -> Result<bool, AllocError> {
        let Some(plan) = self.runs_to_map(cx.heap, block) else {
            return Ok(true);
        };
        let (key, (lo, hi), layout) = (plan.key, plan.span, plan.pages);
        let runs_empty = plan.runs.is_empty();
        if !runs_empty {
            // Pages shared with free neighbours, and those of a mapping that
            // fails midway, are free mapped pages.
            self.free_pages_mut().note(key);
            // Detached pages lie only in unmapped runs: a block with none
            // pays no event query here.
            self.settle_detached(cx, &key, lo, hi)?;
        }
        let mover = (key.0.stream, plan.first_page());
        let adds = cx.heap.block(block).size;
        let deficit = self.growth_deficit(cx, plan.bytes(), adds);
        let reused_busy = self.make_room(cx, deficit, Some(block), mover)?;
        for (start, bytes) in plan.runs {
            if cx.would_pass_limit(bytes) {
                return Ok(false);
            }
            let started = Instant::now();
            if !cx.map_pages(start, bytes)? {
                return Ok(false);
            }
            let pages = layout.count(start, start + bytes);
            cx.count_move(started, |m| m.pages_mapped += pages);
            self.pages_mapped(&key, start, bytes, reused_busy);
            cx.heap.pages_mapped(plan.segment, bytes);
        }
        if !runs_empty {
            self.mark_epoch(cx, &key)?;
        }
        Ok(true)
    }

    /// Waits on the host for the work queued so far on `stream`. A growable
    /// segment serves one stream, and a block used on other streams becomes
    /// free only once their events completed, so its free pages are idle
    /// when this stream is.
    fn wait_for_stream(
        &mut self,
        cx: &mut Lent<'_, E>,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let event = cx.streams.record(stream)?;
        let waited = cx.streams.synchronize(&event);
        cx.streams.release(event);
        self.free_pages_mut().wake_stream(stream);
        Ok(waited?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page_layout::PageLayout;
    use crate::policy::FreeList;
    use crate::sim::{SimEvent, SimMemory, SimStreams};
    use crate::types::{CacheKey, GIB, MIB};

    /// What the engine would lend: a simulated device and streams, a heap,
    /// a free-list policy, no private pool.
    struct World {
        memory: SimMemory,
        streams: SimStreams,
        heap: Heap,
        policy: FreeList,
        pools: PrivatePools,
        limit: Option<u64>,
    }

    impl World {
        /// A device of 1 GiB and growable segments of 2 MiB pages.
        fn new() -> (World, GrowableSegments<SimEvent>) {
            let mut memory = SimMemory::new(GIB);
            let granularity = memory.virtual_memory().unwrap().granularity();
            let segments =
                GrowableSegments::new(granularity, true, false, PageLayout::uniform(2 * MIB));
            let world = World {
                memory,
                streams: SimStreams::new(),
                heap: Heap::new(u64::MAX),
                policy: FreeList::default(),
                pools: PrivatePools::default(),
                limit: None,
            };
            (world, segments)
        }

        fn lend(&mut self) -> Lent<'_, SimEvent> {
            Lent {
                heap: &mut self.heap,
                policy: &mut self.policy,
                memory: &mut self.memory,
                streams: &mut self.streams,
                pools: &mut self.pools,
                limit: self.limit,
                budget: None,
            }
        }

        /// The growable segment of `key`: its address and size.
        fn segment(&self, segments: &GrowableSegments<SimEvent>, key: &SegmentKey) -> (u64, u64) {
            let s = self.heap.segment(segments[key].segment);
            (s.addr, s.size)
        }
    }

    /// A large request of `bytes` on stream 1.
    fn request(bytes: u64) -> Request {
        Request::new(bytes, bytes, CacheKey::shared(StreamId(1)), 0)
    }

    fn key() -> SegmentKey {
        (CacheKey::shared(StreamId(1)), Pool::Large)
    }

    #[test]
    fn a_segment_grows_at_its_end_trims_its_free_tail_and_goes_back_whole() {
        let (mut w, mut segments) = World::new();
        let first = segments.grow_segment(&mut w.lend(), &request(5 * MIB));
        let first = first.unwrap().expect("room on the device");
        let (addr, size) = w.segment(&segments, &key());
        assert!(size >= 5 * MIB && w.heap.block(first).state == BlockState::Free);
        assert_eq!(w.memory.used(), size, "every byte of the segment mapped");
        w.heap.set_state(first, BlockState::Allocated, size);

        // The next growth maps pages at the end: the new tail starts there.
        let tail = segments.grow_segment(&mut w.lend(), &request(30 * MIB));
        let tail = tail.unwrap().expect("room on the device");
        let (same_addr, grown) = w.segment(&segments, &key());
        assert_eq!((same_addr, w.heap.block(tail).addr), (addr, addr + size));
        assert!(grown >= size + 30 * MIB);
        assert_eq!(w.memory.used(), grown);

        // Past the limit, nothing is mapped.
        w.limit = Some(grown);
        assert_eq!(
            segments
                .grow_segment(&mut w.lend(), &request(GIB / 2))
                .unwrap(),
            None
        );
        assert_eq!(w.memory.used(), grown);
        w.limit = None;

        // A free tail goes back on `empty_cache`, out of the policy's index.
        w.heap.set_state(tail, BlockState::Free, 0);
        w.policy.insert_free(&mut w.heap, tail);
        segments.trim_growable_segments(&mut w.lend()).unwrap();
        assert_eq!(w.segment(&segments, &key()), (addr, size));
        assert_eq!(w.memory.used(), size);
        assert!(w.policy.0.is_empty(), "the trimmed tail left the index");

        // Idle, the segment goes back whole, its range released.
        w.heap.set_state(first, BlockState::Free, 0);
        segments.release_whole(&mut w.lend(), &key()).unwrap();
        assert_eq!(w.memory.used(), 0);
        assert!(segments.get(&key()).is_none());
    }

    #[test]
    fn a_paused_segment_maps_its_pages_again_at_the_same_addresses() {
        let (mut w, mut segments) = World::new();
        let block = segments.grow_segment(&mut w.lend(), &request(7 * MIB));
        let block = block.unwrap().expect("room on the device");
        w.heap.set_state(block, BlockState::Allocated, 7 * MIB);
        let (addr, size) = w.segment(&segments, &key());

        let (unmapped, result) = segments.unmap_for_pause(&mut w.lend(), &[key()]);
        result.unwrap();
        assert_eq!(w.memory.used(), 0, "a live block's pages go too");
        assert_eq!(unmapped.len(), 1);
        let runs: Vec<_> = unmapped[0].1.iter().map(|&(s, b)| (key(), s, b)).collect();
        assert_eq!(runs.iter().map(|r| r.2).sum::<u64>(), size);

        // No room: nothing mapped, the caller decides what to free.
        w.limit = Some(0);
        assert_eq!(segments.map_runs_again(&mut w.lend(), &runs).unwrap(), 0);
        assert_eq!(w.memory.used(), 0);
        w.limit = None;
        assert_eq!(
            segments.map_runs_again(&mut w.lend(), &runs).unwrap(),
            runs.len()
        );
        assert_eq!(w.memory.used(), size);
        assert!(w.memory.is_accessible(addr, size));

        // A resume that fails later unmaps what it mapped, without a wait.
        segments.unmap_runs_again(&mut w.lend(), &runs).unwrap();
        assert_eq!(w.memory.used(), 0);
        assert!(!w.memory.is_accessible(addr, size));
    }

    #[test]
    fn each_stream_is_waited_for_once_and_reported() {
        let (mut w, mut segments) = World::new();
        segments.grow_segment(&mut w.lend(), &request(MIB)).unwrap();
        let others = vec![StreamId(2), StreamId(1), StreamId(2)];
        let waited = segments
            .wait_for_streams(&mut w.lend(), &[key()], others)
            .unwrap();
        let mut waited: Vec<_> = waited.into_iter().collect();
        waited.sort();
        assert_eq!(waited, [StreamId(1), StreamId(2)]);
        // The segment's own wait counts as a page-recycling wait.
        assert_eq!(w.heap.ledger.stats.page_moves.stream_waits, 1);
        assert_eq!(w.streams.pending(), 0, "every event waited for went back");
    }
}
