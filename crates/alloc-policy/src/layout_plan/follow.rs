//! Following a plan: detecting the period, learning it, laying it out and
//! placing requests by it, inside [`PytorchBfc`](crate::PytorchBfc)'s
//! calls (see the parent module).

use std::collections::{BTreeMap, HashMap};

use alloc_core::pytorch::MIN_BLOCK_SIZE;
use alloc_core::{BlockId, BlockState, CacheKey, Heap, Pool, Request};

use super::{pack, Life, PeriodDetector, PlanStats};
use crate::free_index::FreeIndex;

/// The fewest requests whose mismatches and conflicts are judged together:
/// with a period of one request (a run of equal sizes), counts reset every
/// request would never reach the limit that drops a plan that no longer fits.
const MIN_SPAN: u64 = 64;

/// A block of the learned period.
#[derive(Debug, Clone, Copy)]
struct Recorded {
    size: u64,
    /// Requests since the start of the learned period when it was freed.
    freed: Option<u64>,
}

/// A block allocated while learning: of the recorded period, or the same
/// place in a later one.
#[derive(Debug, Clone, Copy)]
enum Learned {
    First(usize),
    Second(usize),
}

#[derive(Debug, Clone)]
enum Phase {
    Detecting,
    Learning {
        origin: u64,
        period: u64,
        recorded: Vec<Recorded>,
        live: HashMap<BlockId, Learned>,
        /// The request to switch to the plan at, once the recorded
        /// lifetimes are known: the quietest place of the period.
        switch_at: Option<u64>,
    },
    Following {
        origin: u64,
        /// (size, planned address) per place in the period.
        slots: Vec<(u64, Option<u64>)>,
        /// The start of the planned segment.
        base: u64,
        /// The end of the highest planned block.
        top: u64,
        /// Mismatched sizes and conflicts in the current period.
        mismatches: u64,
        conflicts: u64,
        /// Whole periods followed.
        periods: u64,
        /// Requests since the counts above were last reset: a short period's
        /// counts are judged over [`MIN_SPAN`] requests at least.
        counted: u64,
    },
}

/// Whether `id` is a free large-pool block of stream `key` starting at
/// `start`.
fn is_free_start(heap: &Heap, key: Option<CacheKey>, start: u64, id: BlockId) -> bool {
    let b = heap.block(id);
    b.addr == start
        && b.size > 0
        && b.state == BlockState::Free
        && b.pool == Pool::Large
        && Some(b.key()) == key
}

/// The place in the period where the fewest bytes of the recorded blocks
/// are allocated across it (between steps, where activations are gone):
/// switching to the plan there leaves the fewest blocks of the last
/// unplanned period where they are, kept there by the plan.
fn quietest_place(recorded: &[Recorded], period: u64) -> u64 {
    // Bytes of blocks allocated before place p and freed after request p
    // (a block lives over places start + 1 .. freed, wrapping around the
    // period), as a sum of differences.
    let mut delta = vec![0i128; period as usize + 1];
    for (start, r) in recorded.iter().enumerate() {
        let Some(freed) = r.freed.filter(|&f| f - start as u64 <= period) else {
            continue;
        };
        let (from, to) = (start as u64 + 1, freed);
        let size = i128::from(r.size);
        let wrapped = (from.saturating_sub(period), to.saturating_sub(period));
        for (a, b) in [(from, to.min(period)), wrapped] {
            if a < b {
                delta[a as usize] += size;
                delta[b as usize] -= size;
            }
        }
    }
    let mut live = 0i128;
    let mut best = (i128::MAX, 0);
    for (place, d) in delta.iter().take(period as usize).enumerate() {
        live += d;
        if live < best.0 {
            best = (live, place as u64);
        }
    }
    best.1
}

/// The layout planner of one [`PytorchBfc`](crate::PytorchBfc) (see the
/// module docs).
#[derive(Debug, Clone)]
pub struct LayoutPlan {
    /// The stream whose large pool is planned: the first to ask.
    key: Option<CacheKey>,
    detector: PeriodDetector,
    phase: Phase,
    /// Requests of `key` in the large pool served so far.
    clock: u64,
    /// Start address -> block, for every free block of `key`'s large pool
    /// while following (and stale entries, checked when read).
    starts: BTreeMap<u64, BlockId>,
    /// The free block `take` chose and the address to carve it at.
    pending: Option<(BlockId, u64)>,
    stats: PlanStats,
}

impl Default for LayoutPlan {
    fn default() -> Self {
        LayoutPlan {
            key: None,
            detector: PeriodDetector::default(),
            phase: Phase::Detecting,
            clock: 0,
            starts: BTreeMap::new(),
            pending: None,
            stats: PlanStats::default(),
        }
    }
}

impl LayoutPlan {
    /// What the plan did so far.
    pub fn stats(&self) -> PlanStats {
        self.stats
    }

    /// The stream whose large pool is planned, once one asked: the only key
    /// [`LayoutPlan::kept_mapped`] can answer for.
    pub(crate) fn planned_key(&self) -> Option<CacheKey> {
        self.key
    }

    /// The planned range of `key`'s segment once a whole period followed it
    /// (the first one meets the last unplanned period's blocks): every step
    /// uses its pages again, so they stay mapped
    /// ([`Reclaim::kept_mapped`](alloc_core::Reclaim::kept_mapped)).
    pub(crate) fn kept_mapped(&self, key: CacheKey) -> Option<(u64, u64)> {
        match self.phase {
            Phase::Following {
                base, top, periods, ..
            } if periods >= 1 && self.key == Some(key) => Some((base, top)),
            _ => None,
        }
    }

    /// Whether `req` is one the plan follows.
    fn follows(&mut self, key: CacheKey, pool: Pool) -> bool {
        if pool != Pool::Large || key.private_pool.is_some() {
            return false;
        }
        *self.key.get_or_insert(key) == key
    }

    /// The free block to carve `req` from at its planned address, taken out
    /// of `free`; makes the plan first when the learned periods are over.
    pub(crate) fn take(
        &mut self,
        heap: &Heap,
        free: &mut FreeIndex,
        req: &Request,
    ) -> Option<BlockId> {
        self.pending = None;
        if !self.follows(req.key, req.pool) {
            return None;
        }
        if let Phase::Learning {
            origin,
            period,
            ref recorded,
            ref mut switch_at,
            ..
        } = self.phase
        {
            // `>=`: a request carved without a `take` (none of this stream's
            // today) must not leave the plan unmade for ever.
            if switch_at.is_none() && self.clock >= origin + 2 * period {
                let place = quietest_place(recorded, period);
                let now = (self.clock - origin) % period;
                *switch_at = Some(self.clock + (place + period - now) % period);
            }
            if switch_at.is_some_and(|at| self.clock >= at) {
                self.make_plan(heap, free);
            }
        }
        let Phase::Following {
            origin, slots, top, ..
        } = &self.phase
        else {
            return None;
        };
        let top = *top;
        let (size, addr) = slots[((self.clock - origin) % slots.len() as u64) as usize];
        if size == req.size && addr.is_none() {
            // Unplanned (it outlives a period): above the plan, where it
            // takes no planned block's place.
            let (id, at) = self.free_block_above(heap, top, size)?;
            let b = heap.block(id);
            free.remove(b.key(), b.size, b.addr)?;
            self.pending = Some((id, at));
            return Some(id);
        }
        // Off the plan (another size): best fit. Its place still taken (in
        // the first period, by a block of the last unplanned one): above the
        // plan, where it meets no planned block later either.
        let addr = addr.filter(|_| size == req.size)?;
        let (id, at) = match self.free_block_over(heap, addr, size) {
            Some(id) => (id, addr),
            None => self.free_block_above(heap, top, size)?,
        };
        let b = heap.block(id);
        free.remove(b.key(), b.size, b.addr)?;
        self.pending = Some((id, at));
        Some(id)
    }

    /// A free block of the planned stream that holds `size` bytes at or
    /// above `top`, and the address to carve them at.
    fn free_block_above(&mut self, heap: &Heap, top: u64, size: u64) -> Option<(BlockId, u64)> {
        if let Some(id) = self.free_block_over(heap, top, size) {
            return Some((id, top));
        }
        let mut from = top;
        while let Some((&start, &id)) = self.starts.range(from..).next() {
            if !is_free_start(heap, self.key, start, id) {
                self.starts.remove(&start);
                continue;
            }
            if heap.block(id).size >= size {
                return Some((id, start));
            }
            from = start + 1;
        }
        None
    }

    /// Drops the stale start entries once they outnumber the heap's blocks
    /// (lookups drop only those they meet), so that the map stays the size
    /// of the heap over a long run.
    fn prune_starts(&mut self, heap: &Heap) {
        if self.starts.len() > 2 * heap.block_count() + 64 {
            let key = self.key;
            self.starts
                .retain(|&start, &mut id| is_free_start(heap, key, start, id));
        }
    }

    /// The free block of the planned stream covering `[addr, addr + size)`,
    /// dropping stale entries met on the way.
    fn free_block_over(&mut self, heap: &Heap, addr: u64, size: u64) -> Option<BlockId> {
        while let Some((&start, &id)) = self.starts.range(..=addr).next_back() {
            if is_free_start(heap, self.key, start, id) {
                return (start + heap.block(id).size >= addr + size).then_some(id);
            }
            self.starts.remove(&start);
        }
        None
    }

    /// Carves `block` at the address `take` chose for it, indexing the free
    /// pieces before and after in `free`; `None` when `block` is not the
    /// one `take` chose.
    pub(crate) fn carve(
        &mut self,
        heap: &mut Heap,
        free: &mut FreeIndex,
        block: BlockId,
        req: &Request,
    ) -> Option<BlockId> {
        let (chosen, addr) = self.pending.take()?;
        if chosen != block {
            return None;
        }
        let start = heap.block(block).addr;
        let piece = if addr > start {
            let piece = heap.split(block, addr - start);
            let front = heap.block(block);
            free.insert(front.key(), front.size, front.addr, block);
            self.starts.insert(start, block);
            piece
        } else {
            block
        };
        if heap.block(piece).size - req.size >= MIN_BLOCK_SIZE {
            let rest = heap.split(piece, req.size);
            let r = heap.block(rest);
            free.insert(r.key(), r.size, r.addr, rest);
        }
        Some(piece)
    }

    /// A request of the large pool was served with `piece` (by the plan or
    /// by best fit): advances the clock, and detects, learns or checks.
    pub(crate) fn carved(&mut self, heap: &Heap, piece: BlockId, req: &Request) {
        if !self.follows(req.key, req.pool) {
            return;
        }
        let t = self.clock;
        self.clock += 1;
        // Fed in every phase, so that when a plan fails the detector has
        // followed the sequence (a period inside a step gives way to the
        // step's as soon as the step leaves it).
        let found = self.detector.push(req.size);
        match &mut self.phase {
            Phase::Detecting => {
                if let Some(period) = found {
                    self.phase = Phase::Learning {
                        origin: self.clock,
                        period: period as u64,
                        recorded: Vec::with_capacity(period),
                        live: HashMap::new(),
                        switch_at: None,
                    };
                }
            }
            Phase::Learning {
                origin,
                period,
                recorded,
                live,
                ..
            } => {
                let at = t - *origin;
                let place = (at % *period) as usize;
                if at < *period {
                    live.insert(piece, Learned::First(recorded.len()));
                    recorded.push(Recorded {
                        size: req.size,
                        freed: None,
                    });
                } else if recorded[place].size == req.size {
                    // A later period's block (until the switch).
                    live.insert(piece, Learned::Second(place));
                } else {
                    // Not periodic after all: detect again.
                    self.phase = Phase::Detecting;
                }
            }
            Phase::Following {
                origin,
                slots,
                mismatches,
                conflicts,
                periods,
                counted,
                ..
            } => {
                let period = slots.len() as u64;
                let place = ((t - *origin) % period) as usize;
                let (size, addr) = slots[place];
                if size != req.size {
                    *mismatches += 1;
                    self.stats.mismatches += 1;
                } else if addr == Some(heap.block(piece).addr) {
                    self.stats.placed += 1;
                } else if addr.is_some() {
                    *conflicts += 1;
                    self.stats.conflicts += 1;
                }
                // A few stray requests are tolerated; more mean the steps
                // changed (or the period was a part of a step).
                let span = period.max(MIN_SPAN);
                *counted += 1;
                let failed = *mismatches > 2.max(span / 16);
                // A period ended, and with it the span its counts cover.
                let ended =
                    place + 1 == slots.len() && (period >= MIN_SPAN || *counted >= MIN_SPAN);
                // Past the first period (which meets the blocks of the last
                // unplanned one), planned places must be free: the steps
                // changed how long blocks live, so learn them again.
                let blocked = ended && *periods >= 1 && *conflicts > 2.max(span / 32);
                if failed || blocked {
                    // A plan that never lasted two periods was made from a
                    // part of a step: do not propose that period again.
                    if failed && *periods < 2 {
                        self.detector.ban(period as usize);
                    }
                    self.drop_plan();
                    return;
                }
                if ended {
                    *periods += 1;
                    *mismatches = 0;
                    *conflicts = 0;
                    *counted = 0;
                    self.prune_starts(heap);
                }
                // A best-fit carve may have split off a free remainder.
                if let Some(next) = heap.block(piece).next {
                    let n = heap.block(next);
                    if n.state == BlockState::Free {
                        self.starts.insert(n.addr, next);
                    }
                }
            }
        }
    }

    /// `block` of the planned stream is about to become free (before it
    /// merges with its neighbours).
    pub(crate) fn freeing(&mut self, block: BlockId) {
        if let Phase::Learning {
            recorded,
            live,
            origin,
            ..
        } = &mut self.phase
        {
            if let Some(Learned::First(i)) = live.remove(&block) {
                recorded[i].freed = Some(self.clock - *origin);
            }
        }
    }

    /// `survivor` is the free block that `freeing`'s block became part of.
    pub(crate) fn freed(&mut self, heap: &Heap, survivor: BlockId) {
        if matches!(self.phase, Phase::Following { .. }) {
            let b = heap.block(survivor);
            if Some(b.key()) == self.key && b.pool == Pool::Large {
                self.starts.insert(b.addr, survivor);
            }
        }
    }

    fn drop_plan(&mut self) {
        self.stats.dropped += 1;
        self.stats.period = 0;
        self.starts.clear();
        self.phase = Phase::Detecting;
    }

    /// Lays out the learned period and starts following it.
    fn make_plan(&mut self, heap: &Heap, free: &FreeIndex) {
        let Phase::Learning {
            origin,
            period,
            recorded,
            live,
            ..
        } = std::mem::replace(&mut self.phase, Phase::Detecting)
        else {
            return;
        };
        let key = self.key.expect("a learned stream");
        let Some(segment) = heap
            .segments()
            .find(|(_, s)| s.key() == key && s.pool == Pool::Large && s.expandable)
            .map(|(id, _)| id)
        else {
            self.detector.ban(period as usize);
            return;
        };
        // Blocks freed within a period of their request are planned.
        let plannable = |r: &Recorded, start: u64| r.freed.filter(|&f| f - start <= period);
        // The blocks of the second period still allocated now, by place:
        // the first period followed frees them where they are, so their
        // places keep those addresses in the plan (no conflict at the switch).
        let mut crossing: HashMap<usize, BlockId> = HashMap::new();
        for (&id, l) in &live {
            if let Learned::Second(i) = *l {
                crossing.insert(i, id);
            }
        }
        // The blocks of the last unplanned period still allocated now are
        // planned afresh, not kept where best fit put them (that would cut
        // the plan's space for ever): until they are freed, the first
        // period's requests whose planned range they hold go above the plan.
        let (mut lives, mut places) = (Vec::new(), Vec::new());
        let mut replaced = Vec::new();
        for (start, r) in recorded.iter().enumerate() {
            if let Some(freed) = plannable(r, start as u64) {
                lives.push(Life {
                    size: r.size,
                    start: start as u64,
                    length: freed - start as u64,
                });
                replaced.extend(crossing.get(&start).copied());
                places.push(start);
            }
        }
        // Everything else allocated in the segment stays where it is.
        let fixed: Vec<(u64, u64)> = heap
            .segment_blocks(segment)
            .filter(|&id| heap.block(id).state != BlockState::Free && !replaced.contains(&id))
            .map(|id| (heap.block(id).addr, heap.block(id).size))
            .collect();
        let base = heap.segment(segment).addr;
        let addrs = pack(&lives, period, base, &fixed, MIN_BLOCK_SIZE);
        let top = lives
            .iter()
            .zip(&addrs)
            .map(|(l, a)| a + l.size)
            .max()
            .unwrap_or(base);
        let mut slots: Vec<(u64, Option<u64>)> = recorded.iter().map(|r| (r.size, None)).collect();
        for (place, addr) in places.into_iter().zip(addrs) {
            slots[place].1 = Some(addr);
        }
        self.starts = free
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, e)| (e.addr, e.id))
            .collect();
        self.stats.plans += 1;
        self.stats.period = period;
        self.phase = Phase::Following {
            origin,
            slots,
            base,
            top,
            mismatches: 0,
            conflicts: 0,
            periods: 0,
            counted: 0,
        };
    }

    /// Every free block of the planned stream's large pool in `free` has its
    /// start recorded (while following).
    pub(crate) fn check(&self, free: &FreeIndex) -> Result<(), String> {
        if !matches!(self.phase, Phase::Following { .. }) {
            return Ok(());
        }
        for (k, e) in free.iter() {
            if Some(k) == self.key && self.starts.get(&e.addr) != Some(&e.id) {
                return Err(format!("plan_layout lost the free block at {:#x}", e.addr));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(size: u64, freed: u64) -> Recorded {
        Recorded {
            size,
            freed: Some(freed),
        }
    }

    /// A block wrapping around the period counts at both ends; blocks that
    /// outlive a period or were never freed do not count.
    #[test]
    fn the_quietest_place_has_the_fewest_bytes_across_it() {
        let unfreed = Recorded {
            size: 1 << 30,
            freed: None,
        };
        let mut recorded = vec![unfreed; 10];
        recorded[3] = block(10, 6); // across places 4 and 5
        recorded[8] = block(100, 13); // across 9, 0, 1 and 2
        recorded[5] = block(1 << 30, 16); // outlives the period
        assert_eq!(quietest_place(&recorded, 10), 3);
        // Fill place 3 and the quietest moves to the first empty place after.
        recorded[2] = block(1000, 4); // across place 3
        assert_eq!(quietest_place(&recorded, 10), 6);
    }
}
