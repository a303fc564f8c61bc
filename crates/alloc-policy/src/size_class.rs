//! Size-class free lists carved from slabs, in the manner of slab allocators
//! and the per-bin free lists of TensorFlow's and Caffe2's allocators.
//!
//! Every request is rounded up to a size class: four classes per power of
//! two (steps of a quarter of the power, never below 512 bytes) from 512 B
//! to 1 MiB in the small pool and from 1 MiB to 1 GiB in the large pool, so
//! above 2 KiB rounding adds at most a quarter. Requests above the largest
//! class get a dedicated segment rounded to 2 MiB.
//!
//! Free blocks are kept per (stream, pool, class) in LIFO lists and reused
//! only by requests of exactly their class: class blocks are never split nor
//! merged ([`Capabilities::coalesces`] is false), except that (with
//! [`SizeClassSettings::reuse_idle_slabs`], the default) a slab whose blocks
//! are all free again becomes one tail, unless it is one class block before
//! a tail that already holds every class the whole slab would (the shape an
//! alloc+free pair goes through in a small-pool slab). A request whose list
//! is empty is carved from the uncarved remainder ("tail") of a slab of its stream and
//! pool, the smallest tail that fits; failing that, a new slab segment is
//! allocated (2 MiB in the small pool; 64 MiB or the class rounded to 2 MiB in
//! the large pool) and carved. Tails are indexed in buckets by the largest
//! class they can hold, with a bit mask of non-empty buckets, so every
//! operation of the hot path is O(1).
//!
//! Idle memory is cached like PyTorch's: before a new segment is allocated,
//! wholly idle segments go back to the device, oldest first, only while the
//! bytes they hold exceed [`SizeClassSettings::idle_limit`]
//! (`idle_slab_limit_mb`; unlimited by default, since every `cudaFree`
//! synchronizes the device) or, with `garbage_collection_threshold` set,
//! while reserved memory exceeds threshold x limit. When the device refuses
//! a slab, the request's idle segments go back and the slab shrinks to the
//! class size for the retries.

use alloc_core::config::SizeClassConfig;
use alloc_core::pytorch::{MIN_BLOCK_SIZE, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE};
use alloc_core::{
    AllocatorConfig, Audit, BlockId, BlockState, CacheKey, Capabilities, ConfigError, Heap,
    OomRelease, Policy, Pool, Pressure, Reclaim, Request, SegmentId, GIB, MIB,
};

use crate::free_index::PRUNE_AT;
use crate::idle::idle_oldest_first;
use crate::per_key::PerKey;

/// The largest class; larger requests get a dedicated segment.
pub const MAX_CLASS_SIZE: u64 = GIB;
/// Number of small-pool classes (indices `0..SMALL_CLASSES`).
pub const SMALL_CLASSES: usize = 40;
/// Number of classes in both pools (indices `SMALL_CLASSES..NUM_CLASSES` are
/// the large pool's).
pub const NUM_CLASSES: usize = 80;
/// Default slab size of the large pool (at least the class, rounded to
/// [`ROUND_LARGE`]). The other sizes are PyTorch's: the smallest class and
/// the granularity of the classes below 2 KiB is [`MIN_BLOCK_SIZE`], the
/// largest small-pool class [`SMALL_SIZE`],
/// the small pool's slab
/// [`SMALL_BUFFER`], and dedicated segments and slabs are rounded to
/// [`ROUND_LARGE`].
pub const LARGE_SLAB: u64 = 64 * MIB;
/// Slab sizes are capped at this, so rounding can never overflow.
const MAX_SLAB: u64 = 1 << 40;

/// Bin of a slab's uncarved remainder (class blocks are binned by their
/// class index).
const BIN_TAIL: u32 = u32::MAX - 1;
/// Bin of a block that is a whole dedicated segment.
const BIN_DEDICATED: u32 = u32::MAX;

/// The class of a block of `size` bytes, or `None` above [`MAX_CLASS_SIZE`].
///
/// Classes are 512, 1024, 1536, 2048 B, then four per power of two: the
/// class of a size in (2^k, 2^(k+1)] is 2^k + j x 2^(k-2) for the smallest
/// j in 1..=4 that covers it.
#[inline]
pub fn class_of(size: u64) -> Option<usize> {
    if size > MAX_CLASS_SIZE {
        return None;
    }
    let s = size.saturating_sub(1);
    if s < 4 * MIN_BLOCK_SIZE {
        return Some((s / MIN_BLOCK_SIZE) as usize);
    }
    let k = 63 - s.leading_zeros() as usize; // s in [2^k, 2^(k+1)), k >= 11
    let sub = ((s >> (k - 2)) & 3) as usize;
    Some(4 + (k - 11) * 4 + sub)
}

/// Size in bytes of class `class` (`0..NUM_CLASSES`); indices past the last
/// class give [`MAX_CLASS_SIZE`].
#[inline]
pub fn class_size(class: usize) -> u64 {
    if class < 4 {
        return (class as u64 + 1) * MIN_BLOCK_SIZE;
    }
    let class = class.min(NUM_CLASSES - 1);
    let k = 11 + (class - 4) / 4;
    let sub = ((class - 4) % 4) as u64;
    (1u64 << k) + (sub + 1) * (1u64 << (k - 2))
}

/// The pool of class `class`.
#[inline]
pub fn class_pool(class: usize) -> Pool {
    if class < SMALL_CLASSES {
        Pool::Small
    } else {
        Pool::Large
    }
}

/// The largest class a free remainder of `size` bytes can hold, or `None`
/// below the smallest class.
#[inline]
fn floor_class(size: u64) -> Option<usize> {
    if size < MIN_BLOCK_SIZE {
        return None;
    }
    match class_of(size) {
        None => Some(NUM_CLASSES - 1),
        Some(c) if class_size(c) == size => Some(c),
        Some(c) => Some(c - 1),
    }
}

/// Rounds `size` up to a multiple of `unit` (a power of two); unchanged if
/// that would overflow.
#[inline]
fn round_up(size: u64, unit: u64) -> u64 {
    size.checked_next_multiple_of(unit).unwrap_or(size)
}

/// Settings of the size-class policy. The configuration string has no keys
/// for them: [`SizeClassSettings::from`] gives the defaults.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SizeClassSettings {
    /// Bytes of wholly idle segments kept cached; above it the oldest idle
    /// segments go back to the device whenever a new segment is needed.
    /// `u64::MAX` (the default, `idle_slab_limit_mb` unset) keeps them until
    /// memory runs short: each `cudaFree` synchronizes the device, so a
    /// bound that releases slabs every step stalls the host's run-ahead
    /// (docs/policies.md, section `size-class`).
    pub idle_limit: u64,
    /// Slab (segment) size of the small pool; rounded up to 2 MiB.
    pub small_slab: u64,
    /// Slab size of the large pool; a slab is at least its class, rounded up
    /// to 2 MiB.
    pub large_slab: u64,
    /// When a slab becomes wholly idle, merge its blocks back into one tail
    /// so that any class can be carved from it again, where that lets it
    /// hold a larger class (on by default; off, class blocks are never
    /// merged and an idle slab serves only the classes it was carved for).
    pub reuse_idle_slabs: bool,
}

impl Default for SizeClassSettings {
    fn default() -> Self {
        SizeClassSettings {
            idle_limit: u64::MAX,
            small_slab: SMALL_BUFFER,
            large_slab: LARGE_SLAB,
            reuse_idle_slabs: true,
        }
    }
}

impl From<&SizeClassConfig> for SizeClassSettings {
    /// The defaults, or with `idle_slab_limit_mb` set the bounded mode: at
    /// most that many idle bytes cached, and idle slabs kept for their own
    /// classes (not reset), which in replay reserves less on variable-length
    /// traces than resetting them, at the price of a device free (a
    /// device-wide synchronization) per slab released. The configuration's
    /// `garbage_collection_threshold` reaches the policy through
    /// [`Pressure::threshold`].
    fn from(cfg: &SizeClassConfig) -> Self {
        match cfg.idle_slab_limit {
            None => SizeClassSettings::default(),
            Some(limit) => SizeClassSettings {
                idle_limit: limit,
                reuse_idle_slabs: false,
                ..SizeClassSettings::default()
            },
        }
    }
}

impl From<&AllocatorConfig> for SizeClassSettings {
    /// The flat view's `idle_slab_limit_mb`, as from [`SizeClassConfig`].
    fn from(cfg: &AllocatorConfig) -> Self {
        SizeClassSettings::from(&cfg.size_class())
    }
}

/// Whether the slab `seg` should be reset into one tail now: it is wholly
/// idle, not a dedicated segment, and the merge would let it serve a larger
/// class of its pool than its tail already does. A slab of one class block
/// before its tail, the shape a slab holding a single short-lived block goes
/// through on every allocation, often gains nothing (a small-pool slab's
/// tail holds the pool's largest class already); merging it only to split it
/// again at the next request would double the cost of such an alloc+free
/// pair.
fn worth_resetting(heap: &Heap, seg: SegmentId) -> bool {
    let segment = heap.segment(seg);
    if !segment.is_idle() {
        return false;
    }
    let head = heap.block(segment.first);
    if head.bin == BIN_DEDICATED {
        return false;
    }
    let Some(tail) = head.next.map(|n| heap.block(n)) else {
        return true; // one class block: a tail serves more classes
    };
    if tail.bin != BIN_TAIL || tail.next.is_some() {
        return true;
    }
    let largest = match segment.pool {
        Pool::Small => SMALL_CLASSES - 1,
        Pool::Large => NUM_CLASSES - 1,
    };
    let holds = |size| floor_class(size).map(|c| c.min(largest));
    holds(tail.size) != holds(segment.size)
}

/// Which list of a pool's lists a free block belongs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// The free list of a class.
    Class(usize),
    /// The tail bucket of the largest class the tail can hold.
    Tail(usize),
    /// Tails too small for any class (never handed out).
    Scrap,
    /// Whole dedicated segments.
    Dedicated,
}

impl Slot {
    /// Where a free block goes, from its bin and size.
    #[inline]
    fn of(bin: u32, size: u64) -> Slot {
        match bin {
            BIN_DEDICATED => Slot::Dedicated,
            t if (t as usize) < NUM_CLASSES && class_size(t as usize) == size => {
                Slot::Class(t as usize)
            }
            // Tails, and (defensively) any block whose bin does not match
            // its size: indexed by what it can hold, so never handed out to
            // a request larger than itself.
            _ => match floor_class(size) {
                Some(b) => Slot::Tail(b),
                None => Slot::Scrap,
            },
        }
    }
}

/// The free blocks of one stream in one pool.
#[derive(Debug, Clone)]
struct PoolLists {
    /// LIFO free list per class.
    classes: Vec<Vec<BlockId>>,
    /// Slab tails, bucketed by the largest class they can hold.
    tails: Vec<Vec<BlockId>>,
    /// Bit `b` set when `tails[b]` is non-empty.
    tail_mask: u128,
    /// Tails smaller than the smallest class.
    scraps: Vec<BlockId>,
    /// Free dedicated segments.
    dedicated: Vec<BlockId>,
}

impl Default for PoolLists {
    fn default() -> Self {
        PoolLists {
            classes: vec![Vec::new(); NUM_CLASSES],
            tails: vec![Vec::new(); NUM_CLASSES],
            tail_mask: 0,
            scraps: Vec::new(),
            dedicated: Vec::new(),
        }
    }
}

impl PoolLists {
    /// Whether no free block is listed.
    fn is_empty(&self) -> bool {
        self.tail_mask == 0
            && self.scraps.is_empty()
            && self.dedicated.is_empty()
            && self.classes.iter().chain(&self.tails).all(Vec::is_empty)
    }

    #[inline]
    fn list_mut(&mut self, slot: Slot) -> &mut Vec<BlockId> {
        match slot {
            Slot::Class(c) => &mut self.classes[c],
            Slot::Tail(b) => &mut self.tails[b],
            Slot::Scrap => &mut self.scraps,
            Slot::Dedicated => &mut self.dedicated,
        }
    }

    /// Appends `id` to its list, recording its position.
    #[inline]
    fn push(&mut self, pos: &mut Vec<u32>, slot: Slot, id: BlockId) {
        let list = self.list_mut(slot);
        let at = list.len() as u32;
        list.push(id);
        if pos.len() <= id.index() {
            pos.resize(id.index() + 1, u32::MAX);
        }
        pos[id.index()] = at;
        if let Slot::Tail(b) = slot {
            self.tail_mask |= 1u128 << b;
        }
    }

    /// Removes `id` from its list in O(1) (the last entry takes its place).
    fn remove(&mut self, pos: &mut [u32], slot: Slot, id: BlockId) {
        let list = self.list_mut(slot);
        let at = match pos.get(id.index()) {
            Some(&p) if list.get(p as usize) == Some(&id) => p as usize,
            // Not where recorded: should not happen; search rather than fail.
            _ => match list.iter().position(|&x| x == id) {
                Some(p) => p,
                None => return,
            },
        };
        list.swap_remove(at);
        if let Some(&moved) = list.get(at) {
            pos[moved.index()] = at as u32;
        }
        if let Slot::Tail(b) = slot {
            if self.tails[b].is_empty() {
                self.tail_mask &= !(1u128 << b);
            }
        }
    }

    /// Pops the smallest tail that holds class `class`.
    #[inline]
    fn pop_tail(&mut self, class: usize) -> Option<BlockId> {
        let fitting = self.tail_mask.checked_shr(class as u32).unwrap_or(0);
        if fitting == 0 {
            return None;
        }
        let b = class + fitting.trailing_zeros() as usize;
        let id = self.tails[b].pop();
        if self.tails[b].is_empty() {
            self.tail_mask &= !(1u128 << b);
        }
        id
    }

    /// Every slot with its list.
    fn slots(&self) -> impl Iterator<Item = (Slot, &Vec<BlockId>)> + '_ {
        let classes = self
            .classes
            .iter()
            .enumerate()
            .map(|(c, l)| (Slot::Class(c), l));
        let tails = self
            .tails
            .iter()
            .enumerate()
            .map(|(b, l)| (Slot::Tail(b), l));
        classes.chain(tails).chain([
            (Slot::Scrap, &self.scraps),
            (Slot::Dedicated, &self.dedicated),
        ])
    }
}

/// Size-class free lists carved from slabs (see the module documentation).
#[derive(Debug, Clone, Default)]
pub struct SizeClass {
    settings: SizeClassSettings,
    /// The free lists of each cache key seen, for both pools.
    lanes: PerKey<[PoolLists; 2]>,
    /// Keys with lists after the last pruning of empty ones: the next
    /// prunes once there are twice as many (at least [`PRUNE_AT`]).
    pruned_len: usize,
    /// Position of each indexed block in its list, by block index.
    pos: Vec<u32>,
    /// Set once the device refused a slab during the current request: slabs
    /// shrink to the class size until the next request.
    shrink_slabs: bool,
}

impl SizeClass {
    /// A policy with the given settings.
    pub fn new(settings: SizeClassSettings) -> Self {
        SizeClass {
            settings,
            lanes: PerKey::default(),
            pruned_len: 0,
            pos: Vec::new(),
            shrink_slabs: false,
        }
    }

    /// The settings in use.
    pub fn settings(&self) -> &SizeClassSettings {
        &self.settings
    }

    /// The lists of `key` in `pool`, created on first use.
    #[inline]
    fn lists_mut(&mut self, key: CacheKey, pool: Pool) -> (&mut PoolLists, &mut Vec<u32>) {
        if self.lanes.len() >= (2 * self.pruned_len).max(PRUNE_AT)
            && self.lanes.position(key).is_none()
        {
            // A stream made per use leaves lists behind once its blocks are
            // gone: forgotten here, at a cost shared by the new keys.
            self.forget_empty_keys();
        }
        let pools = self.lanes.get_or_insert_with(key, Default::default);
        (&mut pools[pool.index()], &mut self.pos)
    }

    /// Indexes the free block `id` according to its bin and size.
    #[inline]
    fn index(&mut self, heap: &Heap, id: BlockId) {
        let b = heap.block(id);
        let slot = Slot::of(b.bin, b.size);
        let (lists, pos) = self.lists_mut(b.key(), b.pool);
        lists.push(pos, slot, id);
    }

    /// Turns the wholly idle slab `seg` into one free tail: unindexes its
    /// free blocks (all but `fresh`, which is not indexed yet) and merges
    /// them.
    fn reset_slab(&mut self, heap: &mut Heap, seg: SegmentId, fresh: BlockId) {
        let first = heap.segment(seg).first;
        let mut next = Some(first);
        while let Some(id) = next {
            next = heap.block(id).next;
            if id != fresh {
                self.unindex(heap, id);
            }
        }
        while heap.block(first).next.is_some() {
            heap.merge_next(first);
        }
        heap.set_bin(first, BIN_TAIL);
        self.index(heap, first);
    }

    /// Takes the indexed free block `id` out of its list.
    #[inline]
    fn unindex(&mut self, heap: &Heap, id: BlockId) {
        let b = heap.block(id);
        let slot = Slot::of(b.bin, b.size);
        if let Some(pools) = self.lanes.get_mut(b.key()) {
            pools[b.pool.index()].remove(&mut self.pos, slot, id);
        }
    }

    /// Segment size for a class or dedicated request; `shrink` gives the
    /// smallest segment that holds it.
    fn segment_bytes(&self, req: &Request, shrink: bool) -> u64 {
        let Some(class) = class_of(req.size) else {
            return round_up(req.size, ROUND_LARGE);
        };
        let size = class_size(class);
        let slab = match (shrink, class_pool(class)) {
            (true, _) => 0,
            (false, Pool::Small) => self.settings.small_slab,
            (false, Pool::Large) => self.settings.large_slab,
        };
        round_up(size.max(slab.min(MAX_SLAB)), ROUND_LARGE)
    }
}

impl Policy for SizeClass {
    fn name(&self) -> &str {
        "size-class"
    }

    /// `idle_slab_limit_mb` chooses how slabs are kept and cannot change
    /// once slabs exist; no other setting reaches this policy.
    fn reconfigure(&mut self, cfg: &AllocatorConfig) -> Result<(), ConfigError> {
        let wanted = SizeClassSettings::from(cfg);
        if wanted == self.settings {
            return Ok(());
        }
        Err(ConfigError::InvalidValue {
            key: "idle_slab_limit_mb".into(),
            value: cfg
                .idle_slab_limit
                .map_or("unset".into(), |b| (b >> 20).to_string()),
            reason: "policy `size-class` keeps its slab mode until the process restarts".into(),
        })
    }

    #[inline]
    fn round_request(&self, requested: u64, key: CacheKey) -> Request {
        let size = match class_of(requested) {
            Some(c) => class_size(c),
            None => round_up(requested, ROUND_LARGE),
        };
        // The small pool's classes are those of at most SMALL_SIZE bytes
        // (`class_pool`), and an unclassed size is above them all.
        Request::new(requested, size, key, SMALL_SIZE)
    }

    fn segment_size(&self, req: &Request) -> u64 {
        self.segment_bytes(req, self.shrink_slabs)
    }

    #[inline]
    fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId> {
        // A new request: back to full slabs.
        self.shrink_slabs = false;
        let lists = &mut self.lanes.get_mut(req.key)?[req.pool.index()];
        match class_of(req.size) {
            Some(class) => {
                if let Some(id) = lists.classes[class].pop() {
                    return Some(id);
                }
                lists.pop_tail(class)
            }
            None => {
                // Best fit among free dedicated segments wasting at most a
                // quarter of the request.
                let most = req.size.saturating_add(req.size / 4);
                let (at, _) = lists
                    .dedicated
                    .iter()
                    .enumerate()
                    .map(|(i, &id)| (i, heap.block(id).size))
                    .filter(|&(_, size)| size >= req.size && size <= most)
                    .min_by_key(|&(_, size)| size)?;
                let id = lists.dedicated[at];
                lists.remove(&mut self.pos, Slot::Dedicated, id);
                Some(id)
            }
        }
    }

    #[inline]
    fn carve(&mut self, heap: &mut Heap, block: BlockId, req: &Request) -> BlockId {
        let Some(class) = class_of(req.size) else {
            heap.set_bin(block, BIN_DEDICATED);
            return block;
        };
        let size = class_size(class);
        let have = heap.block(block).size;
        if have > size {
            let rest = heap.split(block, size);
            heap.set_bin(rest, BIN_TAIL);
            self.index(heap, rest);
        }
        // A block smaller than its class (never from the engine) is binned as
        // a tail so that, once free, it is indexed by what it can hold.
        heap.set_bin(block, if have >= size { class as u32 } else { BIN_TAIL });
        block
    }

    #[inline]
    fn insert_free(&mut self, heap: &mut Heap, block: BlockId) {
        if self.settings.reuse_idle_slabs {
            let seg = heap.block(block).segment;
            if worth_resetting(heap, seg) {
                self.reset_slab(heap, seg, block);
                return;
            }
        }
        self.index(heap, block);
    }

    fn remove_free(&mut self, heap: &Heap, block: BlockId) {
        self.unindex(heap, block);
    }

    /// Free blocks carry their size class in their bin, which carving a
    /// checkpointed layout from the front cannot recreate.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            coalesces: false,
            rebuilds_layouts: false,
            ..Capabilities::default()
        }
    }
}

impl Reclaim for SizeClass {
    /// Gives back the request's idle segments of its stream and pool, oldest
    /// first, until they add up to the segment it needs; from now until the
    /// next request, segments shrink to the class size.
    fn release_for_oom(&mut self, heap: &Heap, req: &Request) -> OomRelease {
        let full = self.segment_bytes(req, false);
        self.shrink_slabs = true;
        let need = self.segment_bytes(req, true);
        let mut released = 0;
        let mut segments = Vec::new();
        for idle in idle_oldest_first(heap, |s, _| s.key() == req.key && s.pool == req.pool) {
            if released >= need {
                break;
            }
            released += idle.size;
            segments.push(idle.id);
        }
        OomRelease {
            // A smaller segment is worth one more try even with nothing freed.
            sufficient: released >= need || need < full,
            segments,
        }
    }

    /// Gives back wholly idle segments, oldest first, while their bytes
    /// exceed [`SizeClassSettings::idle_limit`] or, with
    /// `garbage_collection_threshold` set, while reserved memory exceeds
    /// threshold x limit.
    fn collect_garbage(&mut self, heap: &Heap, pressure: &Pressure) -> Vec<SegmentId> {
        let line = pressure
            .threshold
            .map(|t| (t * pressure.limit as f64) as u64);
        let mut reserved = pressure.reserved;
        let over = |idle: u64, reserved: u64| {
            idle > self.settings.idle_limit || line.is_some_and(|l| reserved > l)
        };
        let idle_bytes: u64 = heap
            .segments()
            .filter(|(_, s)| s.is_idle())
            .map(|(_, s)| s.size)
            .sum();
        if !over(idle_bytes, reserved) {
            return Vec::new();
        }
        let mut idle = idle_bytes;
        let mut released = Vec::new();
        for segment in idle_oldest_first(heap, |_, _| true) {
            if !over(idle, reserved) {
                break;
            }
            idle -= segment.size;
            reserved = reserved.saturating_sub(segment.size);
            released.push(segment.id);
        }
        released
    }

    fn forget_empty_keys(&mut self) {
        self.lanes
            .retain(|pools| !pools.iter().all(PoolLists::is_empty));
        self.pruned_len = self.lanes.len();
    }
}

impl Audit for SizeClass {
    fn indexed_blocks(&self) -> Vec<BlockId> {
        self.lanes
            .iter()
            .flat_map(|(_, pools)| pools.iter())
            .flat_map(|p| p.slots().flat_map(|(_, l)| l.iter().copied()))
            .collect()
    }

    fn check(&self, heap: &Heap) -> Result<(), String> {
        for (key, pools) in self.lanes.iter() {
            for (pool, lists) in [Pool::Small, Pool::Large].iter().zip(pools) {
                for (slot, list) in lists.slots() {
                    if let Slot::Tail(b) = slot {
                        if list.is_empty() == (lists.tail_mask >> b & 1 == 1) {
                            return Err(format!("size-class tail mask wrong for bucket {b}"));
                        }
                    }
                    for (at, &id) in list.iter().enumerate() {
                        let blk = heap.block(id);
                        let here = format!("block {:#x} ({slot:?})", blk.addr);
                        if blk.key() != key || blk.pool != *pool {
                            return Err(format!("{here}: indexed under another stream or pool"));
                        }
                        if blk.state != BlockState::Free {
                            return Err(format!("{here}: indexed but not free"));
                        }
                        if Slot::of(blk.bin, blk.size) != slot {
                            return Err(format!("{here}: bin {} in the wrong list", blk.bin));
                        }
                        if self.pos.get(id.index()) != Some(&(at as u32)) {
                            return Err(format!("{here}: stale list position"));
                        }
                        if let Slot::Class(c) = slot {
                            if class_pool(c) != *pool {
                                return Err(format!("{here}: class {c} in the wrong pool"));
                            }
                        }
                    }
                }
            }
        }
        for (_, b) in heap.blocks() {
            let ok = match b.bin {
                BIN_TAIL => b.state == BlockState::Free,
                BIN_DEDICATED => heap.segment(b.segment).blocks == 1,
                t => {
                    (t as usize) < NUM_CLASSES
                        && class_size(t as usize) == b.size
                        && class_pool(t as usize) == b.pool
                }
            };
            if !ok {
                return Err(format!(
                    "block {:#x} of {} bytes ({:?}) has bin {}: neither a class block, a free tail nor a dedicated segment",
                    b.addr, b.size, b.state, b.bin
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc_core::pytorch::SMALL_SIZE;
    use alloc_core::StreamId;
    use alloc_core::{Engine, EngineOptions, SimMemory, SimStreams, KIB};

    type TestEngine = Engine<SizeClass, SimMemory, SimStreams>;

    fn engine_with(settings: SizeClassSettings, capacity: u64) -> TestEngine {
        Engine::new(
            SizeClass::new(settings),
            SimMemory::new(capacity),
            SimStreams::new(),
            EngineOptions::default(),
        )
    }

    fn engine() -> TestEngine {
        engine_with(SizeClassSettings::default(), 64 * GIB)
    }

    #[test]
    fn lists_of_streams_that_hold_nothing_are_forgotten_as_new_streams_come() {
        // A stream per use on a device that the streams' slabs fill: the
        // slabs of old streams go back, and their empty lists with them.
        let mut e = engine_with(SizeClassSettings::default(), GIB);
        for s in 1..=4000 {
            let a = e.malloc(4 * MIB, StreamId(s)).unwrap();
            e.free(a.addr).unwrap();
        }
        let held = e.heap().segments().count();
        let lanes = e.policy().lanes.len();
        assert!(
            lanes <= 2 * held.max(PRUNE_AT) + 1,
            "{lanes} keys with lists for {held} segments"
        );
        e.assert_valid();
    }

    #[test]
    fn class_rounding_table() {
        let p = SizeClass::default();
        let table: &[(u64, u64, Pool)] = &[
            (1, 512, Pool::Small),
            (512, 512, Pool::Small),
            (513, 1024, Pool::Small),
            (1536, 1536, Pool::Small),
            (2048, 2048, Pool::Small),
            (2049, 2560, Pool::Small),
            (3000, 3072, Pool::Small),
            (4096, 4096, Pool::Small),
            (4097, 5 * KIB, Pool::Small),
            (100 * KIB, 112 * KIB, Pool::Small),
            (MIB - 1, MIB, Pool::Small),
            (MIB, MIB, Pool::Small),
            (MIB + 1, MIB + 256 * KIB, Pool::Large),
            (3 * MIB, 3 * MIB, Pool::Large),
            (5 * MIB + 1, 6 * MIB, Pool::Large),
            (100 * MIB, 112 * MIB, Pool::Large),
            (GIB - 1, GIB, Pool::Large),
            (GIB, GIB, Pool::Large),
            // Beyond the largest class: a dedicated segment, 2 MiB granules.
            (GIB + 1, GIB + 2 * MIB, Pool::Large),
            (5 * GIB + 3 * MIB, 5 * GIB + 4 * MIB, Pool::Large),
        ];
        for &(requested, size, pool) in table {
            let r = p.round_request(requested, StreamId(7).into());
            assert_eq!((r.size, r.pool), (size, pool), "request of {requested} B");
            assert_eq!((r.requested, r.key.stream), (requested, StreamId(7)));
        }
        assert_eq!(class_of(512), Some(0));
        assert_eq!(class_of(MIB), Some(SMALL_CLASSES - 1));
        assert_eq!(class_of(MAX_CLASS_SIZE), Some(NUM_CLASSES - 1));
        assert_eq!(class_of(MAX_CLASS_SIZE + 1), None);
    }

    #[test]
    fn classes_are_consistent() {
        let mut prev = 0;
        for c in 0..NUM_CLASSES {
            let size = class_size(c);
            assert!(size > prev, "class {c} not increasing");
            assert_eq!(size % MIN_BLOCK_SIZE, 0);
            assert_eq!(class_of(size), Some(c));
            assert_eq!(class_of(prev + 1), Some(c));
            // At most a quarter wasted (beyond the 512-byte minimum).
            assert!(prev < 4 * MIN_BLOCK_SIZE || (size - prev - 1) * 4 <= prev + 1);
            assert_eq!(floor_class(size), Some(c));
            assert_eq!(floor_class(size + MIN_BLOCK_SIZE / 2).unwrap(), c);
            assert_eq!(class_pool(c) == Pool::Small, size <= SMALL_SIZE);
            prev = size;
        }
        assert_eq!(prev, MAX_CLASS_SIZE);
        assert_eq!(floor_class(511), None);
        assert_eq!(floor_class(4 * GIB), Some(NUM_CLASSES - 1));
    }

    #[test]
    fn exact_class_reuse_returns_the_same_block() {
        let mut e = engine();
        let a = e.malloc(1000, StreamId(0)).unwrap();
        assert_eq!(a.size, 1024);
        e.free(a.addr).unwrap();
        // 900 B is the same class: the block comes back.
        let b = e.malloc(900, StreamId(0)).unwrap();
        assert_eq!((b.addr, b.size), (a.addr, 1024));
        // Another stream never sees it.
        e.free(b.addr).unwrap();
        let c = e.malloc(1000, StreamId(1)).unwrap();
        assert_ne!(c.addr, a.addr);
        e.assert_valid();
        let d = e.malloc(1000, StreamId(0)).unwrap();
        assert_eq!(d.addr, a.addr);
        assert_eq!(e.stats().num_device_alloc, 2);
        e.assert_valid();
    }

    #[test]
    fn carving_from_tails() {
        let mut e = engine();
        let a = e.malloc(1000, StreamId(0)).unwrap();
        let b = e.malloc(3000, StreamId(0)).unwrap();
        let c = e.malloc(MIB, StreamId(0)).unwrap();
        assert_eq!(
            e.stats().num_device_alloc,
            1,
            "one 2 MiB slab for all three"
        );
        assert_eq!(b.addr, a.addr + 1024);
        assert_eq!(c.addr, b.addr + 3072);
        let snap = e.snapshot();
        assert_eq!(snap.segments.len(), 1);
        assert_eq!(snap.segments[0].total_size, SMALL_BUFFER);
        let sizes: Vec<u64> = snap.segments[0].blocks.iter().map(|b| b.size).collect();
        assert_eq!(sizes, vec![1024, 3072, MIB, MIB - 4096]);
        e.assert_valid();
        // The tail (1 MiB - 4 KiB) is too small for another 1 MiB block.
        let d = e.malloc(MIB, StreamId(0)).unwrap();
        assert_eq!(e.stats().num_device_alloc, 2);
        assert!(e.heap().segment_containing(d.addr) != e.heap().segment_containing(a.addr));
        // ... but serves a smaller class.
        let f = e.malloc(600 * KIB, StreamId(0)).unwrap();
        assert_eq!(f.addr, c.addr + MIB);
        assert_eq!(e.stats().num_device_alloc, 2);
        // Freed blocks are neither merged nor split.
        for x in [a, b, c] {
            e.free(x.addr).unwrap();
        }
        let g = e.malloc(2000, StreamId(0)).unwrap();
        assert_ne!(g.addr, a.addr);
        assert_eq!(g.addr, f.addr + 640 * KIB);
        assert_eq!(e.snapshot().segments[0].blocks.len(), 6);
        e.assert_valid();
    }

    #[test]
    fn large_slabs_and_pools() {
        let mut e = engine();
        let a = e.malloc(MIB + 1, StreamId(0)).unwrap();
        assert_eq!(a.size, MIB + 256 * KIB);
        let b = e.malloc(3 * MIB, StreamId(0)).unwrap();
        assert_eq!(b.addr, a.addr + a.size);
        let snap = e.snapshot();
        assert_eq!(snap.segments.len(), 1);
        assert_eq!(snap.segments[0].total_size, LARGE_SLAB);
        assert_eq!(snap.segments[0].segment_type, Pool::Large);
        // Small requests never come from large slabs.
        let s = e.malloc(512, StreamId(0)).unwrap();
        assert_eq!(e.snapshot().segments.len(), 2);
        assert!(e.heap().segment_containing(s.addr) != e.heap().segment_containing(a.addr));
        // A class above the slab size gets a slab of its own size.
        let c = e.malloc(100 * MIB, StreamId(0)).unwrap();
        assert_eq!(c.size, 112 * MIB);
        let seg = e.heap().segment_containing(c.addr).unwrap();
        assert_eq!(e.heap().segment(seg).size, 112 * MIB);
        e.assert_valid();
    }

    #[test]
    fn dedicated_segments_for_huge_requests() {
        // No idle limit: the idle 1 GiB segment stays while others are made.
        let settings = SizeClassSettings {
            idle_limit: u64::MAX,
            ..SizeClassSettings::default()
        };
        let mut e = engine_with(settings, 64 * GIB);
        let a = e.malloc(GIB + 1, StreamId(0)).unwrap();
        assert_eq!(a.size, GIB + 2 * MIB);
        let snap = e.snapshot();
        assert_eq!(snap.segments.len(), 1);
        assert_eq!(snap.segments[0].total_size, GIB + 2 * MIB);
        assert_eq!(snap.segments[0].blocks.len(), 1);
        e.free(a.addr).unwrap();
        e.assert_valid();
        // Reused by a request it covers with at most a quarter to spare.
        let b = e.malloc(GIB + MIB, StreamId(0)).unwrap();
        assert_eq!((b.addr, b.size), (a.addr, GIB + 2 * MIB));
        e.free(b.addr).unwrap();
        let c = e.malloc(2 * GIB, StreamId(0)).unwrap();
        assert_ne!(c.addr, a.addr);
        assert_eq!(c.size, 2 * GIB);
        e.free(c.addr).unwrap();
        // Best fit among several.
        let d = e.malloc(GIB + 2 * MIB, StreamId(0)).unwrap();
        assert_eq!(d.addr, a.addr);
        assert_eq!(e.stats().num_device_alloc, 2);
        e.assert_valid();
        e.free(d.addr).unwrap();
        e.empty_cache().unwrap();
        assert_eq!(e.memory().used(), 0);
        e.assert_valid();
    }

    #[test]
    fn idle_segments_over_the_limit_go_back_oldest_first() {
        let settings = SizeClassSettings {
            idle_limit: 2 * MIB,
            ..SizeClassSettings::default()
        };
        let mut e = engine_with(settings, 64 * GIB);
        // Two small slabs on stream 0, each holding two 1 MiB blocks.
        let blocks: Vec<_> = (0..4)
            .map(|_| e.malloc(MIB, StreamId(0)).unwrap())
            .collect();
        let segs = e.snapshot().segment_addresses();
        assert_eq!(segs.len(), 2);
        e.free(blocks[0].addr).unwrap();
        e.free(blocks[1].addr).unwrap();
        // 2 MiB idle: at the limit, kept when stream 1 needs a slab.
        e.malloc(512, StreamId(1)).unwrap();
        assert_eq!(e.stats().num_device_free, 0);
        e.free(blocks[2].addr).unwrap();
        e.free(blocks[3].addr).unwrap();
        // 4 MiB idle: the older slab goes back when stream 2 needs one.
        e.malloc(512, StreamId(2)).unwrap();
        assert_eq!(e.stats().num_device_free, 1);
        let now = e.snapshot().segment_addresses();
        assert!(!now.contains(&segs[0]), "the oldest idle slab went back");
        assert!(now.contains(&segs[1]));
        e.assert_valid();
    }

    #[test]
    fn garbage_collection_threshold_bounds_reserved_memory() {
        // Idle slabs kept whole, so the 2 MiB requests below come from the
        // 64 MiB slab and the 128 MiB slabs stay idle.
        let settings = SizeClassSettings {
            reuse_idle_slabs: false,
            ..SizeClassSettings::default()
        };
        let mut e = Engine::new(
            SizeClass::new(settings),
            SimMemory::new(GIB),
            SimStreams::new(),
            EngineOptions {
                garbage_collection_threshold: Some(0.5),
                ..EngineOptions::default()
            },
        );
        // Limit 512 MiB, collection above 256 MiB reserved.
        e.set_memory_fraction(0.5).unwrap();
        // A 64 MiB slab whose tail serves 2 MiB requests (ticking the clock
        // of the large pool without new segments), and three 128 MiB slabs.
        e.malloc(2 * MIB, StreamId(0)).unwrap();
        let a: Vec<_> = (0..3)
            .map(|_| e.malloc(128 * MIB, StreamId(0)).unwrap())
            .collect();
        assert_eq!(e.stats().num_device_free, 0);
        for x in &a {
            e.free(x.addr).unwrap();
            e.malloc(2 * MIB, StreamId(0)).unwrap();
        }
        assert_eq!(e.stats().num_device_alloc, 4);
        // 448 MiB reserved: the two oldest idle slabs go back (to 192 MiB).
        e.malloc(100 * MIB, StreamId(0)).unwrap();
        assert_eq!(e.stats().num_device_free, 2);
        let now = e.snapshot().segment_addresses();
        assert!(!now.contains(&a[0].addr) && !now.contains(&a[1].addr));
        assert!(now.contains(&a[2].addr));
        e.assert_valid();
    }

    #[test]
    fn out_of_memory_shrinks_the_slab() {
        // 40 MiB device: a 64 MiB large slab cannot be had.
        let mut e = engine_with(SizeClassSettings::default(), 40 * MIB);
        let a = e.malloc(3 * MIB, StreamId(0)).unwrap();
        assert_eq!(e.snapshot().segments[0].total_size, 4 * MIB);
        // The next request is back to full slabs, and shrinks again.
        let b = e.malloc(3 * MIB, StreamId(0)).unwrap();
        let seg = |addr| e.heap().segment_containing(addr);
        assert_ne!(seg(b.addr), seg(a.addr));
        let c = e.malloc(8 * MIB, StreamId(0)).unwrap();
        assert_eq!(c.size, 8 * MIB);
        e.assert_valid();
        // Over the capacity: a clean out-of-memory error.
        assert!(e.malloc(64 * MIB, StreamId(0)).is_err());
        for x in [a, b, c] {
            e.free(x.addr).unwrap();
        }
        // Idle slabs of the stream go back to make room.
        let d = e.malloc(30 * MIB, StreamId(0)).unwrap();
        assert_eq!(d.size, 32 * MIB);
        assert_eq!(e.snapshot().segments.len(), 1);
        e.assert_valid();
    }

    #[test]
    fn streams_and_segment_release_keep_the_index() {
        for reuse_idle_slabs in [false, true] {
            let settings = SizeClassSettings {
                idle_limit: 8 * MIB,
                reuse_idle_slabs,
                ..SizeClassSettings::default()
            };
            let mut e = engine_with(settings, 64 * GIB);
            let mut live = Vec::new();
            let mut x = 12345u64;
            for i in 0..600u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if live.is_empty() || x % 5 < 3 {
                    let size = (((x >> 8) % (3 * MIB)) >> (x % 12)) + 1;
                    live.push(e.malloc(size, StreamId(i % 3)).unwrap().addr);
                } else {
                    let addr = live.swap_remove((x >> 4) as usize % live.len());
                    e.free(addr).unwrap();
                }
                if i % 7 == 0 {
                    e.assert_valid();
                }
            }
            for addr in live.drain(..) {
                e.free(addr).unwrap();
            }
            e.assert_valid();
            e.empty_cache().unwrap();
            assert_eq!(e.memory().used(), 0);
            assert!(e.policy().indexed_blocks().is_empty());
            e.assert_valid();
        }
    }

    #[test]
    fn an_idle_slab_is_reset_only_when_that_serves_a_larger_class() {
        let mut e = engine();
        // Small pool: the tail of a 2 MiB slab after one 64 KiB block holds
        // the pool's largest class (1 MiB) already: no merge, no split.
        let a = e.malloc(64 * KIB, StreamId(0)).unwrap();
        e.free(a.addr).unwrap();
        assert_eq!(e.snapshot().segments[0].blocks.len(), 2);
        let b = e.malloc(64 * KIB, StreamId(0)).unwrap();
        assert_eq!(b.addr, a.addr);
        e.free(b.addr).unwrap();
        e.assert_valid();
        // Large pool: after an 8 MiB block, a 64 MiB slab's 56 MiB tail
        // cannot hold the 64 MiB class: reset into one tail.
        let c = e.malloc(8 * MIB, StreamId(0)).unwrap();
        e.free(c.addr).unwrap();
        let large = e.heap().segment_containing(c.addr).unwrap();
        assert_eq!(e.heap().segment_blocks(large).count(), 1);
        let d = e.malloc(64 * MIB, StreamId(0)).unwrap();
        assert_eq!(d.addr, c.addr, "the whole slab serves the 64 MiB class");
        assert_eq!(e.stats().num_device_alloc, 2);
        e.assert_valid();
    }

    #[test]
    fn idle_slabs_serve_other_classes_when_asked() {
        for reuse_idle_slabs in [false, true] {
            let settings = SizeClassSettings {
                reuse_idle_slabs,
                ..SizeClassSettings::default()
            };
            let mut e = engine_with(settings, 64 * GIB);
            // Four 512 KiB blocks fill one 2 MiB slab exactly.
            let a: Vec<_> = (0..4)
                .map(|_| e.malloc(512 * KIB, StreamId(0)).unwrap())
                .collect();
            assert_eq!(e.stats().num_device_alloc, 1);
            for x in &a {
                e.free(x.addr).unwrap();
            }
            let blocks = e.snapshot().segments[0].blocks.len();
            assert_eq!(blocks, if reuse_idle_slabs { 1 } else { 4 });
            e.assert_valid();
            // A 1 MiB block: carved from the idle slab only when it was reset.
            let b = e.malloc(MIB, StreamId(0)).unwrap();
            if reuse_idle_slabs {
                assert_eq!(b.addr, a[0].addr);
                assert_eq!(e.stats().num_device_alloc, 1);
            } else {
                assert_eq!(e.stats().num_device_alloc, 2);
            }
            e.assert_valid();
            // The same class still comes back from its list or the tail.
            e.free(b.addr).unwrap();
            let c = e.malloc(MIB - 5, StreamId(0)).unwrap();
            assert_eq!(c.addr, b.addr);
            e.assert_valid();
        }
    }
}
