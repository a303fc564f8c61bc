//! A binary buddy system (Knuth, *TAOCP* vol. 1, §2.5; PaddlePaddle's
//! `BuddyAllocator`): every block is a power of two between a minimum order
//! and a maximum order equal to the segment size, and lies at an offset (from
//! its segment's start) that is a multiple of its size. A request is rounded
//! up to the next power of two; the smallest free block of at least that
//! order is halved repeatedly, the upper halves going back to the free lists;
//! a freed block merges with its *buddy* (the block at `offset ^ size`) while
//! the buddy is free and whole, doubling each time.
//!
//! Requests of at most 1 MiB (after rounding) use the small pool with 2 MiB
//! segments; larger ones the large pool with 64 MiB segments. A request above
//! the large pool's maximum order gets a dedicated segment of its own size
//! (rounded up to 2 MiB), which is never split; once free it stays cached for
//! requests at least half its size on the same stream, until `empty_cache` or
//! the out-of-memory path returns it.
//!
//! Free lists are intrusive doubly linked lists, one per (pool, stream,
//! order), with a bitmap of non-empty orders per (pool, stream): finding the
//! smallest sufficient order is one mask and one `trailing_zeros`, and
//! unlinking a buddy is O(1). Adjacent free blocks that are not buddies stay
//! separate, so [`Capabilities::coalesces`] is false; [`Audit::check`] verifies the
//! buddy invariants instead.
//!
//! The policy collects no garbage by itself (wrap it in `gc-age` for that);
//! under out-of-memory it offers the idle segments of the request's pool and
//! stream, largest first, before the engine returns every idle segment.

use std::collections::{BTreeSet, HashSet};

use alloc_core::pytorch::{MIN_BLOCK_SIZE, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE};
use alloc_core::{
    AllocatorConfig, Audit, BlockId, BlockState, CacheKey, Capabilities, Heap, OomRelease, Policy,
    Pool, Reclaim, Request, SegmentId, MIB,
};

use crate::per_key::PerKey;

/// Default segment size, and largest order, of the large pool. (The other
/// defaults are PyTorch's: smallest block [`MIN_BLOCK_SIZE`], small pool up
/// to [`SMALL_SIZE`] in segments of [`SMALL_BUFFER`].)
pub const LARGE_SEGMENT: u64 = 64 * MIB;
/// A cached dedicated segment serves a request of at least `1 /
/// OVERSIZE_REUSE_FACTOR` of its size: the same worst-case waste as rounding
/// to a power of two.
pub const OVERSIZE_REUSE_FACTOR: u64 = 2;
/// Block bin of a dedicated (oversize) block; other blocks carry their order
/// (the base-2 logarithm of their size).
pub const OVERSIZE_BIN: u32 = u32::MAX;

/// The two pools, in [`Pool::index`] order.
const POOLS: [Pool; 2] = [Pool::Small, Pool::Large];
/// Number of orders a 64-bit size can have.
const ORDERS: usize = 64;
/// Stream entries kept before entries with no free block are pruned.
const STREAM_PRUNE_AT: usize = 8;

/// Settings of the buddy policy. The allocator configuration has no buddy
/// keys, so [`From<&AllocatorConfig>`] gives the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BuddySettings {
    /// Smallest block (minimum order), a power of two.
    pub min_block: u64,
    /// Requests whose rounded size is at most this use the small pool.
    pub small_size: u64,
    /// Segment size and largest order of the small pool, a power of two.
    pub small_segment: u64,
    /// Segment size and largest order of the large pool, a power of two;
    /// larger requests get dedicated segments.
    pub large_segment: u64,
}

impl Default for BuddySettings {
    fn default() -> Self {
        BuddySettings {
            min_block: MIN_BLOCK_SIZE,
            small_size: SMALL_SIZE,
            small_segment: SMALL_BUFFER,
            large_segment: LARGE_SEGMENT,
        }
    }
}

impl From<&AllocatorConfig> for BuddySettings {
    fn from(_cfg: &AllocatorConfig) -> Self {
        BuddySettings::default()
    }
}

impl BuddySettings {
    /// The settings made consistent: sizes rounded up to powers of two,
    /// `min_block <= small_segment <= large_segment` and `small_size <=
    /// small_segment`. [`Buddy::new`] applies this.
    pub fn normalized(&self) -> Self {
        let min_block = pow2_ceil(self.min_block.max(1));
        let small_segment = pow2_ceil(self.small_segment.max(min_block));
        let large_segment = pow2_ceil(self.large_segment.max(small_segment));
        BuddySettings {
            min_block,
            small_size: self.small_size.min(small_segment),
            small_segment,
            large_segment,
        }
    }

    /// Segment size (largest order) of a pool.
    #[inline]
    pub fn segment(&self, pool: Pool) -> u64 {
        match pool {
            Pool::Small => self.small_segment,
            Pool::Large => self.large_segment,
        }
    }
}

/// The smallest power of two at or above `x` (`2^63` when there is none).
#[inline]
fn pow2_ceil(x: u64) -> u64 {
    x.checked_next_power_of_two().unwrap_or(1 << 63)
}

/// Base-2 logarithm of a power of two.
#[inline]
fn order_of(size: u64) -> u32 {
    size.trailing_zeros()
}

/// Offset (from the segment start) of the buddy of the block at `offset` with
/// power-of-two `size`.
#[inline]
pub fn buddy_offset(offset: u64, size: u64) -> u64 {
    offset ^ size
}

/// Intrusive free-list links of one block, indexed by [`BlockId::index`].
#[derive(Debug, Clone, Copy, Default)]
struct Link {
    prev: Option<BlockId>,
    next: Option<BlockId>,
    listed: bool,
}

/// The free lists of one cache key in one pool.
#[derive(Debug, Clone)]
struct StreamLists {
    /// Bit `k` set when the list of order `k` is non-empty.
    mask: u64,
    heads: [Option<BlockId>; ORDERS],
}

impl StreamLists {
    fn new() -> Self {
        StreamLists {
            mask: 0,
            heads: [None; ORDERS],
        }
    }
}

/// Key of a free dedicated block: (stream, size, address, id).
type OversizeKey = (CacheKey, u64, u64, BlockId);

fn oversize_key(heap: &Heap, id: BlockId) -> OversizeKey {
    let b = heap.block(id);
    (b.key(), b.size, b.addr, id)
}

/// The binary buddy policy.
#[derive(Debug, Clone, Default)]
pub struct Buddy {
    settings: BuddySettings,
    /// Free lists per pool, one entry per stream.
    lists: [PerKey<StreamLists>; 2],
    /// List links per block slot.
    links: Vec<Link>,
    /// Free dedicated blocks (large pool only), best fit by size.
    oversize: BTreeSet<OversizeKey>,
}

impl Buddy {
    /// A policy with the given settings (normalized, see
    /// [`BuddySettings::normalized`]).
    pub fn new(settings: BuddySettings) -> Self {
        Buddy {
            settings: settings.normalized(),
            ..Buddy::default()
        }
    }

    /// The settings in use.
    pub fn settings(&self) -> &BuddySettings {
        &self.settings
    }

    /// Segments whose blocks are all free (those `empty_cache` returns), in
    /// address order.
    pub fn idle_segments(&self, heap: &Heap) -> Vec<SegmentId> {
        heap.segments()
            .filter(|(_, s)| s.is_idle())
            .map(|(id, _)| id)
            .collect()
    }

    /// Whether a rounded request needs a dedicated segment.
    #[inline]
    fn is_oversize(&self, size: u64) -> bool {
        size > self.settings.large_segment
    }

    fn stream_slot(&self, pool: Pool, key: CacheKey) -> Option<usize> {
        self.lists[pool.index()].position(key)
    }

    fn stream_slot_or_insert(&mut self, pool: Pool, key: CacheKey) -> usize {
        let lists = &mut self.lists[pool.index()];
        if lists.len() >= STREAM_PRUNE_AT && lists.position(key).is_none() {
            lists.retain(|l| l.mask != 0);
        }
        lists.position_or_insert_with(key, StreamLists::new)
    }

    fn link_mut(&mut self, id: BlockId) -> &mut Link {
        let i = id.index();
        if i >= self.links.len() {
            self.links.resize(i + 1, Link::default());
        }
        &mut self.links[i]
    }

    fn is_listed(&self, id: BlockId) -> bool {
        self.links.get(id.index()).is_some_and(|l| l.listed)
    }

    /// Pushes `id` onto the list of `order` of stream entry `slot`.
    #[inline]
    fn push_at(&mut self, pool: Pool, slot: usize, order: usize, id: BlockId) {
        let old = self.lists[pool.index()].at(slot).heads[order];
        *self.link_mut(id) = Link {
            prev: None,
            next: old,
            listed: true,
        };
        if let Some(o) = old {
            self.links[o.index()].prev = Some(id);
        }
        let lists = self.lists[pool.index()].at_mut(slot);
        lists.heads[order] = Some(id);
        lists.mask |= 1 << order;
    }

    /// Unlinks a listed buddy block; does nothing for an unlisted one.
    fn unlink(&mut self, heap: &Heap, id: BlockId) {
        if !self.is_listed(id) {
            return;
        }
        let b = heap.block(id);
        let (pool, order) = (b.pool, b.bin as usize % ORDERS);
        if let Some(slot) = self.stream_slot(pool, b.key()) {
            self.unlink_at(pool, slot, order, id);
        }
    }

    /// Unlinks the listed `id` from the list of `order` of stream entry
    /// `slot`.
    #[inline]
    fn unlink_at(&mut self, pool: Pool, slot: usize, order: usize, id: BlockId) {
        let link = std::mem::take(&mut self.links[id.index()]);
        match link.prev {
            Some(p) => self.links[p.index()].next = link.next,
            None => self.lists[pool.index()].at_mut(slot).heads[order] = link.next,
        }
        if let Some(n) = link.next {
            self.links[n.index()].prev = link.prev;
        }
        let lists = self.lists[pool.index()].at_mut(slot);
        if lists.heads[order].is_none() {
            lists.mask &= !(1 << order);
        }
    }

    /// Pops a block of the smallest order >= `order` on `stream`.
    fn pop_at_least(&mut self, pool: Pool, stream: CacheKey, order: u32) -> Option<BlockId> {
        let slot = self.stream_slot(pool, stream)?;
        let lists = self.lists[pool.index()].at_mut(slot);
        let avail = lists.mask & (u64::MAX << (order % ORDERS as u32));
        if avail == 0 {
            return None;
        }
        let k = avail.trailing_zeros() as usize;
        let id = lists.heads[k]?;
        let next = self.links[id.index()].next;
        lists.heads[k] = next;
        if next.is_none() {
            lists.mask &= !(1 << k);
        }
        if let Some(n) = next {
            self.links[n.index()].prev = None;
        }
        self.links[id.index()] = Link::default();
        Some(id)
    }

    /// The blocks of one list, head first.
    fn list(&self, lists: &StreamLists, order: usize) -> ListIter<'_> {
        ListIter {
            links: &self.links,
            next: lists.heads[order],
        }
    }

    /// Checks every free list against its blocks; returns how many blocks
    /// are listed.
    fn check_lists(&self, heap: &Heap, live: &HashSet<BlockId>) -> Result<usize, String> {
        let mut listed = 0usize;
        for pool in POOLS {
            let max_order = order_of(self.settings.segment(pool)) as usize;
            let min_order = order_of(self.settings.min_block) as usize;
            for (key, lists) in self.lists[pool.index()].iter() {
                for order in 0..ORDERS {
                    let head = lists.heads[order];
                    if (lists.mask >> order & 1 == 1) != head.is_some() {
                        return Err(format!(
                            "{} order {order}: mask bit disagrees with list",
                            key
                        ));
                    }
                    if head.is_some() && !(min_order..=max_order).contains(&order) {
                        return Err(format!("{pool:?} pool holds a list of order {order}"));
                    }
                    let mut prev = None;
                    let mut cur = head;
                    while let Some(id) = cur {
                        if !live.contains(&id) {
                            return Err(format!("free list holds retired block {id:?}"));
                        }
                        listed += 1;
                        if listed > live.len() {
                            return Err("free list has a cycle".into());
                        }
                        let b = heap.block(id);
                        let link = self.links.get(id.index()).copied().unwrap_or_default();
                        if !link.listed || link.prev != prev {
                            return Err(format!("block {:#x}: broken free-list links", b.addr));
                        }
                        if b.state != BlockState::Free
                            || b.pool != pool
                            || b.key() != key
                            || b.size != 1 << order
                            || b.bin as usize != order
                        {
                            return Err(format!(
                                "block {:#x}: free-list key ({pool:?}, {}, order \
                                 {order}) does not match the block",
                                b.addr, key
                            ));
                        }
                        prev = cur;
                        cur = link.next;
                    }
                }
            }
        }
        Ok(listed)
    }
}

/// Iterator over one intrusive free list.
struct ListIter<'a> {
    links: &'a [Link],
    next: Option<BlockId>,
}

impl Iterator for ListIter<'_> {
    type Item = BlockId;

    fn next(&mut self) -> Option<BlockId> {
        let id = self.next?;
        self.next = self.links.get(id.index()).and_then(|l| l.next);
        Some(id)
    }
}

impl Policy for Buddy {
    fn name(&self) -> &str {
        "buddy"
    }

    fn round_request(&self, requested: u64, key: CacheKey) -> Request {
        let s = &self.settings;
        let rounded = pow2_ceil(requested.max(s.min_block));
        // An oversize request is above the large segment, hence above
        // `small_size` (at most the small segment): it lands in the large pool.
        let size = if self.is_oversize(rounded) {
            requested
                .checked_next_multiple_of(ROUND_LARGE)
                .unwrap_or(u64::MAX)
        } else {
            rounded
        };
        Request::new(requested, size, key, s.small_size)
    }

    fn segment_size(&self, req: &Request) -> u64 {
        if self.is_oversize(req.size) {
            req.size
        } else {
            self.settings.segment(req.pool)
        }
    }

    fn take_free(&mut self, _heap: &Heap, req: &Request) -> Option<BlockId> {
        if self.is_oversize(req.size) {
            let k = *self
                .oversize
                .range((req.key, req.size, 0, BlockId::MIN)..)
                .next()?;
            if k.0 != req.key || k.1 / OVERSIZE_REUSE_FACTOR > req.size {
                return None;
            }
            self.oversize.remove(&k);
            return Some(k.3);
        }
        self.pop_at_least(req.pool, req.key, order_of(req.size))
    }

    /// Halves `block` until it has the requested order, keeping the lower
    /// half and listing each upper half at its order.
    fn carve(&mut self, heap: &mut Heap, block: BlockId, req: &Request) -> BlockId {
        let mut size = heap.block(block).size;
        if self.is_oversize(req.size) || !size.is_power_of_two() {
            heap.set_bin(block, OVERSIZE_BIN);
            return block;
        }
        let want = req.size.max(self.settings.min_block);
        if size > want {
            let b = heap.block(block);
            let (pool, stream) = (b.pool, b.key());
            let slot = self.stream_slot_or_insert(pool, stream);
            while size > want && size >= 2 {
                size /= 2;
                let upper = heap.split(block, size);
                let order = order_of(size);
                heap.set_bin(upper, order);
                self.push_at(pool, slot, order as usize, upper);
            }
        }
        heap.set_bin(block, order_of(size));
        block
    }

    /// Merges the block with its buddy while the buddy is free and whole,
    /// then lists the result at its order.
    fn insert_free(&mut self, heap: &mut Heap, block: BlockId) {
        let b = heap.block(block);
        if b.bin == OVERSIZE_BIN {
            self.oversize.insert(oversize_key(heap, block));
            return;
        }
        let (pool, stream) = (b.pool, b.key());
        let seg = heap.segment(b.segment);
        let (seg_addr, seg_size) = (seg.addr, seg.size);
        let slot = self.stream_slot_or_insert(pool, stream);
        let mut id = block;
        loop {
            let b = heap.block(id);
            let size = b.size;
            if size >= seg_size {
                break;
            }
            let upper_buddy = (b.addr - seg_addr) & size == 0;
            let (neighbour, lower) = if upper_buddy {
                (b.next, id)
            } else {
                (b.prev, b.prev.unwrap_or(id))
            };
            let Some(n) = neighbour else { break };
            let nb = heap.block(n);
            if nb.state != BlockState::Free || nb.size != size || !self.is_listed(n) {
                break;
            }
            self.unlink_at(pool, slot, order_of(size) as usize, n);
            heap.merge_next(lower);
            id = lower;
        }
        let order = order_of(heap.block(id).size) as usize;
        heap.set_bin(id, order as u32);
        self.push_at(pool, slot, order, id);
    }

    fn remove_free(&mut self, heap: &Heap, block: BlockId) {
        if heap.block(block).bin == OVERSIZE_BIN {
            self.oversize.remove(&oversize_key(heap, block));
        } else {
            self.unlink(heap, block);
        }
    }

    /// Buddies merge, but not every free neighbour. Blocks larger than the
    /// largest order (dedicated segments) are oversize: the threshold is one
    /// byte above it.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            coalesces: false,
            oversize_threshold: self.settings.large_segment.saturating_add(1),
            ..Capabilities::default()
        }
    }
}

impl Reclaim for Buddy {
    /// Idle segments of the request's pool and stream, largest first, until
    /// they add up to the segment the request needs.
    fn release_for_oom(&mut self, heap: &Heap, req: &Request) -> OomRelease {
        let needed = self.segment_size(req);
        let mut idle: Vec<(u64, SegmentId)> = Vec::new();
        if let Some(slot) = self.stream_slot(req.pool, req.key) {
            let max = self.settings.segment(req.pool);
            let lists = self.lists[req.pool.index()].at(slot);
            for id in self.list(lists, order_of(max) as usize) {
                let seg = heap.block(id).segment;
                if heap.segment(seg).is_idle() {
                    idle.push((max, seg));
                }
            }
        }
        if req.pool == Pool::Large {
            for k in self
                .oversize
                .range((req.key, 0, 0, BlockId::MIN)..=(req.key, u64::MAX, u64::MAX, BlockId::MAX))
            {
                idle.push((k.1, heap.block(k.3).segment));
            }
        }
        idle.sort_by_key(|&(size, _)| std::cmp::Reverse(size));
        let mut released = 0u64;
        let mut segments = Vec::new();
        for (size, seg) in idle {
            if released >= needed {
                break;
            }
            released = released.saturating_add(size);
            segments.push(seg);
        }
        OomRelease {
            sufficient: released >= needed,
            segments,
        }
    }

    fn forget_empty_keys(&mut self) {
        for lists in &mut self.lists {
            lists.retain(|l| l.mask != 0);
        }
    }
}

impl Audit for Buddy {
    fn indexed_blocks(&self) -> Vec<BlockId> {
        let mut out: Vec<BlockId> = self.oversize.iter().map(|k| k.3).collect();
        for (_, lists) in self.lists.iter().flat_map(|l| l.iter()) {
            for order in 0..ORDERS {
                out.extend(self.list(lists, order));
            }
        }
        out
    }

    /// Buddy invariants: list keys match their blocks; every buddy block is
    /// a power of two at a multiple of its size within its segment and
    /// binned by its order; no free block has a free buddy of its size;
    /// dedicated segments hold one block.
    fn check(&self, heap: &Heap) -> Result<(), String> {
        let live: HashSet<BlockId> = heap.blocks().map(|(id, _)| id).collect();
        let listed = self.check_lists(heap, &live)?;
        let flagged = self.links.iter().filter(|l| l.listed).count();
        if flagged != listed {
            return Err(format!(
                "{flagged} blocks flagged as listed, {listed} on the lists"
            ));
        }
        for k in &self.oversize {
            if !live.contains(&k.3) {
                return Err(format!("oversize set holds retired block {:?}", k.3));
            }
            let b = heap.block(k.3);
            if oversize_key(heap, k.3) != *k
                || b.state != BlockState::Free
                || b.pool != Pool::Large
                || b.bin != OVERSIZE_BIN
                || !self.is_oversize(b.size)
            {
                return Err(format!("stale oversize key for block at {:#x}", k.2));
            }
            if self.is_listed(k.3) {
                return Err(format!("block {:#x} both listed and oversize", k.2));
            }
        }
        for (seg_id, seg) in heap.segments() {
            if self.is_oversize(seg.size) {
                let b = heap.block(seg.first);
                if seg.pool != Pool::Large || seg.blocks != 1 || b.bin != OVERSIZE_BIN {
                    return Err(format!(
                        "dedicated segment {:#x} is split or in the wrong bin",
                        seg.addr
                    ));
                }
                continue;
            }
            if seg.size != self.settings.segment(seg.pool) {
                return Err(format!(
                    "{:?} segment {:#x} has size {} instead of the largest order",
                    seg.pool, seg.addr, seg.size
                ));
            }
            for id in heap.segment_blocks(seg_id) {
                let b = heap.block(id);
                let off = b.addr - seg.addr;
                if !b.size.is_power_of_two()
                    || b.size < self.settings.min_block
                    || off & (b.size - 1) != 0
                    || b.bin != order_of(b.size)
                {
                    return Err(format!(
                        "block {:#x} (size {}, offset {off}, bin {}) breaks the buddy layout",
                        b.addr, b.size, b.bin
                    ));
                }
                if b.state != BlockState::Free || b.size == seg.size {
                    continue;
                }
                let neighbour = if buddy_offset(off, b.size) > off {
                    b.next
                } else {
                    b.prev
                };
                if let Some(n) = neighbour {
                    let nb = heap.block(n);
                    if nb.state == BlockState::Free && nb.size == b.size {
                        return Err(format!(
                            "free buddies {:#x} and {:#x} not merged",
                            b.addr, nb.addr
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc_core::StreamId;
    use alloc_core::{Engine, EngineOptions, SimMemory, SimStreams, GIB, KIB};

    type SimEngine = Engine<Buddy, SimMemory, SimStreams>;

    fn engine(capacity: u64) -> SimEngine {
        Engine::new(
            Buddy::default(),
            SimMemory::new(capacity),
            SimStreams::new(),
            EngineOptions::default(),
        )
    }

    /// Sizes of the free blocks of the segment holding `addr`, ascending.
    fn free_sizes(e: &SimEngine, addr: u64) -> Vec<u64> {
        let heap = e.heap();
        let seg = heap.segment_containing(addr).unwrap();
        let mut sizes: Vec<u64> = heap
            .segment_blocks(seg)
            .map(|id| heap.block(id))
            .filter(|b| b.state == BlockState::Free)
            .map(|b| b.size)
            .collect();
        sizes.sort_unstable();
        sizes
    }

    #[test]
    fn settings_default_and_normalize() {
        let s = BuddySettings::from(&AllocatorConfig::default());
        assert_eq!(s, BuddySettings::default());
        assert_eq!(s.normalized(), s);
        let odd = BuddySettings {
            min_block: 0,
            small_size: u64::MAX,
            small_segment: 3000,
            large_segment: 5,
        }
        .normalized();
        assert_eq!(odd.min_block, 1);
        assert_eq!(odd.small_segment, 4096);
        assert_eq!(odd.large_segment, 4096);
        assert_eq!(odd.small_size, 4096);
        let huge = BuddySettings {
            min_block: u64::MAX,
            small_size: 0,
            small_segment: 0,
            large_segment: 0,
        }
        .normalized();
        assert_eq!(huge.large_segment, 1 << 63);
    }

    #[test]
    fn plan_rounds_to_powers_of_two_and_picks_pools() {
        let p = Buddy::default();
        let round = |n| {
            let r = p.round_request(n, CacheKey::shared(StreamId(7)));
            (r.size, r.pool, p.segment_size(&r))
        };
        assert_eq!(round(1), (512, Pool::Small, 2 * MIB));
        assert_eq!(round(512), (512, Pool::Small, 2 * MIB));
        assert_eq!(round(513), (KIB, Pool::Small, 2 * MIB));
        assert_eq!(round(MIB), (MIB, Pool::Small, 2 * MIB));
        assert_eq!(round(MIB + 1), (2 * MIB, Pool::Large, 64 * MIB));
        assert_eq!(round(33 * MIB), (64 * MIB, Pool::Large, 64 * MIB));
        assert_eq!(round(64 * MIB), (64 * MIB, Pool::Large, 64 * MIB));
        assert_eq!(round(64 * MIB + 1), (66 * MIB, Pool::Large, 66 * MIB));
        assert_eq!(round(100 * MIB), (100 * MIB, Pool::Large, 100 * MIB));
        assert_eq!(
            p.round_request(3, StreamId(7).into()).key.stream,
            StreamId(7)
        );
        // Never panics, even beyond what the engine accepts.
        assert_eq!(round(u64::MAX).1, Pool::Large);
        assert_eq!(p.capabilities().oversize_threshold, 64 * MIB + 1);
    }

    #[test]
    fn buddy_address_math() {
        assert_eq!(buddy_offset(0, KIB), KIB);
        assert_eq!(buddy_offset(KIB, KIB), 0);
        assert_eq!(buddy_offset(3 * KIB, KIB), 2 * KIB);
        assert_eq!(buddy_offset(4 * KIB, 4 * KIB), 0);
        assert_eq!(buddy_offset(MIB, MIB), 0);
        assert_eq!(order_of(512), 9);
        assert_eq!(order_of(64 * MIB), 26);
    }

    #[test]
    fn split_leaves_one_free_block_per_order_and_merges_back() {
        let mut e = engine(8 * GIB);
        let a = e.malloc(KIB, StreamId(0)).unwrap();
        assert_eq!(a.size, KIB);
        let expected: Vec<u64> = (10..=20).map(|k| 1u64 << k).collect();
        assert_eq!(free_sizes(&e, a.addr), expected);
        assert_eq!(e.policy().indexed_blocks().len(), 11);
        let heap = e.heap();
        let seg = heap.segment(heap.segment_containing(a.addr).unwrap());
        assert_eq!((seg.size, seg.addr), (2 * MIB, a.addr));
        assert_eq!(heap.block(heap.block_at(a.addr).unwrap()).bin, 10);
        e.assert_valid();
        e.free(a.addr).unwrap();
        assert_eq!(free_sizes(&e, a.addr), vec![2 * MIB]);
        let heap = e.heap();
        let seg = heap.segment_containing(a.addr).unwrap();
        assert_eq!(heap.segment(seg).blocks, 1);
        assert_eq!(heap.block(heap.segment(seg).first).bin, 21);
        assert_eq!(e.stats().inactive_split.all.current, 0);
        assert_eq!(e.policy().idle_segments(e.heap()), vec![seg]);
        e.assert_valid();
        e.empty_cache().unwrap();
        assert_eq!(e.memory().used(), 0);
        e.assert_valid();
    }

    #[test]
    fn allocations_take_the_smallest_sufficient_order() {
        let mut e = engine(8 * GIB);
        let a = e.malloc(KIB, StreamId(0)).unwrap();
        // The 1 KiB buddy at a + 1 KiB serves the next 1 KiB request.
        let b = e.malloc(1000, StreamId(0)).unwrap();
        assert_eq!(b.addr, a.addr + KIB);
        // 4 KiB comes from the free 4 KiB block, not from splitting a larger one.
        let c = e.malloc(3 * KIB, StreamId(0)).unwrap();
        assert_eq!((c.addr, c.size), (a.addr + 4 * KIB, 4 * KIB));
        let d = e.malloc(700 * KIB, StreamId(0)).unwrap();
        assert_eq!((d.addr, d.size), (a.addr + MIB, MIB));
        assert_eq!(e.stats().num_device_alloc, 1);
        e.assert_valid();
        for x in [c, a, d, b] {
            e.free(x.addr).unwrap();
            e.assert_valid();
        }
        assert_eq!(free_sizes(&e, a.addr), vec![2 * MIB]);
    }

    #[test]
    fn adjacent_non_buddies_stay_apart() {
        let mut e = engine(8 * GIB);
        let blocks: Vec<_> = (0..4)
            .map(|_| e.malloc(512, StreamId(0)).unwrap())
            .collect();
        for (i, b) in blocks.iter().enumerate() {
            assert_eq!(b.addr, blocks[0].addr + 512 * i as u64);
        }
        // Offsets 512 and 1024 are neighbours but not buddies.
        e.free(blocks[1].addr).unwrap();
        e.free(blocks[2].addr).unwrap();
        e.assert_valid();
        let heap = e.heap();
        for b in &blocks[1..3] {
            let id = heap.block_at(b.addr).unwrap();
            assert_eq!(heap.block(id).size, 512);
            assert_eq!(heap.block(id).state, BlockState::Free);
        }
        // Freeing their buddies merges pairwise, then into 2 KiB and up.
        e.free(blocks[0].addr).unwrap();
        let heap = e.heap();
        assert_eq!(heap.block(heap.block_at(blocks[0].addr).unwrap()).size, KIB);
        e.assert_valid();
        e.free(blocks[3].addr).unwrap();
        assert_eq!(free_sizes(&e, blocks[0].addr), vec![2 * MIB]);
        e.assert_valid();
    }

    #[test]
    fn large_requests_use_64mib_segments() {
        let mut e = engine(8 * GIB);
        let a = e.malloc(3 * MIB, StreamId(0)).unwrap();
        assert_eq!(a.size, 4 * MIB);
        assert_eq!(e.stats().reserved_bytes.large_pool.current, 64 * MIB as i64);
        let b = e.malloc(64 * MIB, StreamId(0)).unwrap();
        assert_eq!(b.size, 64 * MIB);
        assert_eq!(e.stats().num_device_alloc, 2);
        assert_eq!(e.stats().oversize_segments.current, 0);
        e.assert_valid();
        e.free(a.addr).unwrap();
        e.free(b.addr).unwrap();
        e.assert_valid();
        e.empty_cache().unwrap();
        assert_eq!(e.memory().used(), 0);
    }

    #[test]
    fn oversize_requests_get_dedicated_segments() {
        let mut e = engine(8 * GIB);
        let a = e.malloc(100 * MIB + 1, StreamId(0)).unwrap();
        assert_eq!(a.size, 102 * MIB);
        let heap = e.heap();
        let seg = heap.segment(heap.segment_containing(a.addr).unwrap());
        assert_eq!((seg.size, seg.blocks), (102 * MIB, 1));
        assert_eq!(e.stats().oversize_segments.current, 1);
        assert_eq!(e.stats().oversize_allocations.current, 1);
        e.assert_valid();
        e.free(a.addr).unwrap();
        assert_eq!(e.policy().indexed_blocks().len(), 1);
        e.assert_valid();
        // Reused by a request at least half its size on the same stream...
        let b = e.malloc(150 * MIB, StreamId(0)).unwrap();
        assert_ne!(b.addr, a.addr, "150 MiB does not fit in 102 MiB");
        e.free(b.addr).unwrap();
        let c = e.malloc(70 * MIB, StreamId(0)).unwrap();
        assert_eq!((c.addr, c.size), (a.addr, 102 * MIB));
        // ...but not by a much smaller one, nor by another stream.
        let d = e.malloc(65 * MIB, StreamId(0)).unwrap();
        assert_eq!(d.size, 66 * MIB);
        e.free(c.addr).unwrap();
        let f = e.malloc(90 * MIB, StreamId(1)).unwrap();
        assert_ne!(f.addr, a.addr);
        assert_eq!(e.stats().num_device_alloc, 4);
        e.assert_valid();
        for x in [d, f] {
            e.free(x.addr).unwrap();
        }
        e.empty_cache().unwrap();
        assert_eq!(e.memory().used(), 0);
        assert_eq!(e.stats().oversize_segments.current, 0);
        e.assert_valid();
    }

    #[test]
    fn streams_have_separate_free_lists() {
        let mut e = engine(8 * GIB);
        let a = e.malloc(4 * KIB, StreamId(1)).unwrap();
        e.free(a.addr).unwrap();
        let b = e.malloc(4 * KIB, StreamId(2)).unwrap();
        let heap = e.heap();
        assert_ne!(
            heap.segment_containing(a.addr),
            heap.segment_containing(b.addr)
        );
        assert_eq!(e.stats().num_device_alloc, 2);
        let c = e.malloc(4 * KIB, StreamId(1)).unwrap();
        assert_eq!(c.addr, a.addr);
        e.assert_valid();
        // Many short-lived streams: entries are pruned, nothing is lost.
        let mut live = vec![];
        for s in 10..40 {
            live.push(e.malloc(512, StreamId(s)).unwrap());
            e.assert_valid();
        }
        for x in live {
            e.free(x.addr).unwrap();
        }
        e.assert_valid();
        e.free(b.addr).unwrap();
        e.free(c.addr).unwrap();
        e.empty_cache().unwrap();
        assert_eq!(e.memory().used(), 0);
        e.assert_valid();
    }

    #[test]
    fn record_stream_defers_merging() {
        let mut e = engine(8 * GIB);
        let a = e.malloc(KIB, StreamId(0)).unwrap();
        e.record_stream(a.addr, StreamId(5)).unwrap();
        e.free(a.addr).unwrap();
        e.assert_valid();
        let b = e.malloc(KIB, StreamId(0)).unwrap();
        assert_eq!(b.addr, a.addr + KIB, "a awaits its event");
        e.streams_mut().complete_stream(StreamId(5));
        e.free(b.addr).unwrap();
        e.process_events().unwrap();
        assert_eq!(free_sizes(&e, a.addr), vec![2 * MIB]);
        e.assert_valid();
    }

    #[test]
    fn oom_releases_idle_segments_of_the_stream() {
        // Room for one 100 MiB dedicated segment and nothing else of size.
        let mut e = engine(130 * MIB);
        let a = e.malloc(100 * MIB, StreamId(0)).unwrap();
        e.free(a.addr).unwrap();
        let req = e.policy().round_request(20 * MIB, StreamId(0).into());
        let mut p = e.policy().clone();
        let release = p.release_for_oom(e.heap(), &req);
        let seg = e.heap().segment_containing(a.addr).unwrap();
        assert_eq!(release.segments, vec![seg]);
        assert!(release.sufficient);
        let other = p.release_for_oom(e.heap(), &p.round_request(20 * MIB, StreamId(3).into()));
        assert!(other.segments.is_empty() && !other.sufficient);
        // 20 MiB needs a 64 MiB segment: the cached 100 MiB one goes back.
        let b = e.malloc(20 * MIB, StreamId(0)).unwrap();
        assert_eq!(b.size, 32 * MIB);
        assert_eq!(e.stats().reserved_bytes.all.current, 64 * MIB as i64);
        e.assert_valid();
        assert!(matches!(
            e.malloc(100 * MIB, StreamId(0)),
            Err(alloc_core::AllocError::OutOfMemory(_))
        ));
        e.assert_valid();
        e.free(b.addr).unwrap();
        let c = e.malloc(100 * MIB, StreamId(0)).unwrap();
        assert_eq!(c.size, 100 * MIB);
        e.assert_valid();
    }

    #[test]
    fn check_reports_a_corrupt_index() {
        let mut e = engine(8 * GIB);
        let a = e.malloc(KIB, StreamId(0)).unwrap();
        let mut p = e.policy().clone();
        let id = e.heap().block_at(a.addr + KIB).unwrap();
        p.remove_free(e.heap(), id);
        assert!(
            p.check(e.heap()).is_ok(),
            "an unlisted block is the engine's check"
        );
        assert_eq!(p.indexed_blocks().len(), 10);
        let mut q = e.policy().clone();
        q.lists[0].at_mut(0).mask = 0;
        assert!(q.check(e.heap()).is_err());
    }
}
