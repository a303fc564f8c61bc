//! The block arena: segments (device allocations) tiled by address-ordered
//! blocks, with the generic split and merge every policy builds on.
//!
//! All mutation goes through a few primitives (`split`, `merge_next`,
//! `set_state`, segment creation and removal) which report each change to
//! the statistics ledger the heap holds (`Ledger`, ledger.rs), so the
//! statistics stay exact and policies never touch them.
//!
//! Outside this crate a `&mut Heap` is the policies' edit handle: it reads
//! blocks and segments and edits them only with [`Heap::split`],
//! [`Heap::merge_next`] and [`Heap::set_bin`] (and [`coalesce`], built on
//! them). Creating, growing, shrinking and removing segments, changing a
//! block's state and the statistics belong to the engine.

use std::collections::BTreeMap;
use std::ops::{Index, IndexMut};

use crate::ledger::Ledger;
/// A block's life-cycle state (defined beside the other plain types, which
/// the ledger reads without the heap).
pub use crate::types::BlockState;
use crate::types::{BlockId, CacheKey, Pool, PrivatePool, SegmentId, StreamId};

/// A contiguous piece of a segment (64 bytes: one cache line).
///
/// Aligned to its line, so that the heap's arena holds each block on one
/// line instead of across two: a malloc or free writes two or three blocks,
/// and with several threads on one device every line written moves to the
/// next thread's core.
#[derive(Clone, Copy, Debug)]
#[repr(align(64))]
pub struct Block {
    /// Device address of the first byte.
    pub addr: u64,
    /// Size in bytes (after rounding).
    pub size: u64,
    /// Bytes the caller asked for (0 while free).
    pub requested: u64,
    /// The segment this block lies in.
    pub segment: SegmentId,
    /// Address-ordered neighbour before this block in the same segment.
    pub prev: Option<BlockId>,
    /// Address-ordered neighbour after this block in the same segment.
    pub next: Option<BlockId>,
    /// Current state.
    pub state: BlockState,
    /// The stream the block (its segment) belongs to.
    pub stream: StreamId,
    /// The private pool of its segment, if any.
    pub private_pool: Option<PrivatePool>,
    /// The pool of its segment.
    pub pool: Pool,
    /// The policy's word for where the block belongs in its index of free
    /// blocks (a size class, a buddy order, ...); the heap only keeps it.
    pub bin: u32,
    /// Per-pool allocator clock value when the block last became free.
    pub freed_at: u64,
    /// Whether the block was handed out since it was made (by a split or a
    /// segment's growth): a free block with it set was freed by the
    /// caller, so freeing it again is a double free, not an unknown pointer.
    pub handed_out: bool,
}

impl Block {
    /// The cache its segment serves ([`Segment::key`]).
    #[inline]
    pub fn key(&self) -> CacheKey {
        CacheKey {
            stream: self.stream,
            private_pool: self.private_pool,
        }
    }
}

/// One device allocation.
#[derive(Clone, Debug)]
pub struct Segment {
    /// Device address of the first byte.
    pub addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// The stream whose requests it serves.
    pub stream: StreamId,
    /// The private pool it belongs to, if any.
    pub private_pool: Option<PrivatePool>,
    /// The pool it belongs to.
    pub pool: Pool,
    /// The lowest-addressed block.
    pub first: BlockId,
    /// The highest-addressed block.
    pub last: BlockId,
    /// True for a growable segment (expandable segments): its blocks tile
    /// the mapped prefix of a larger reserved address range.
    pub expandable: bool,
    /// Bytes of pages inside the segment that are not mapped (growable
    /// segments with `unmap_free_pages`); only free blocks lie over them.
    pub unmapped: u64,
    /// Number of blocks tiling it.
    pub blocks: u32,
    /// Number of blocks that are not free.
    pub busy: u32,
    /// Pool clock value when the last busy block became free (for age-based GC).
    pub idle_since: u64,
}

impl Segment {
    /// The cached blocks it serves: its stream's, in its private pool or the
    /// device-wide cache.
    #[inline]
    pub fn key(&self) -> CacheKey {
        CacheKey {
            stream: self.stream,
            private_pool: self.private_pool,
        }
    }

    /// True when every block in it is free, so it can go back to the device.
    #[inline]
    pub fn is_idle(&self) -> bool {
        self.busy == 0
    }
}

/// The segments by [`SegmentId::index`]. A removed segment's slot is
/// reused by the next segment made, the last removed first, as in a slab;
/// its old contents stay until then, never read.
// Not a `Slab`: its index checked the slot's occupancy too, on every
// access of a malloc, free, split and merge.
#[derive(Debug, Default)]
struct Segments {
    slots: Vec<Segment>,
    /// The slots of removed segments, the last removed on top.
    vacant: Vec<u32>,
}

impl Segments {
    /// The index the next inserted segment gets.
    fn vacant_key(&self) -> usize {
        self.vacant.last().map_or(self.slots.len(), |&i| i as usize)
    }

    /// Puts a segment in the slot [`Segments::vacant_key`] names; returns
    /// its index.
    fn insert(&mut self, seg: Segment) -> usize {
        match self.vacant.pop() {
            Some(i) => {
                self.slots[i as usize] = seg;
                i as usize
            }
            None => {
                self.slots.push(seg);
                self.slots.len() - 1
            }
        }
    }

    /// Removes the segment at `i`; returns it.
    fn remove(&mut self, i: usize) -> Segment {
        debug_assert!(!self.vacant.contains(&(i as u32)), "segment removed twice");
        self.vacant.push(i as u32);
        self.slots[i].clone()
    }

    /// Number of segments.
    fn len(&self) -> usize {
        self.slots.len() - self.vacant.len()
    }
}

impl Index<usize> for Segments {
    type Output = Segment;

    #[inline(always)]
    fn index(&self, i: usize) -> &Segment {
        &self.slots[i]
    }
}

impl IndexMut<usize> for Segments {
    #[inline(always)]
    fn index_mut(&mut self, i: usize) -> &mut Segment {
        &mut self.slots[i]
    }
}

/// Arena of blocks and segments, and the ledger of the statistics they
/// determine.
// `repr(C)` with the ledger first: the ledger's address is the heap's, so
// the settle, called out of line on every operation, needs no address
// computed for it.
#[derive(Debug, Default)]
#[repr(C)]
pub struct Heap {
    /// The statistics: every mutation reports its change to them here;
    /// the engine settles them at the end of each operation and adds its
    /// event counters.
    pub(crate) ledger: Ledger,
    /// Block arena indexed by [`BlockId::index`]. Slot 0 is a placeholder
    /// (ids are non-zero) whose `prev` takes the writes aimed at a missing
    /// neighbour; a retired slot has size 0 and links the next retired
    /// slot through `next` (reused last-in first-out).
    blocks: Vec<Block>,
    segments: Segments,
    by_addr: BTreeMap<u64, SegmentId>,
    /// Per-pool logical clock: one tick per cache lookup, used for ages.
    clock: [u64; 2],
    /// Number of blocks in use (not retired).
    live_blocks: usize,
    /// The most recently retired slot.
    vacant: Option<BlockId>,
}

/// Contents of the placeholder slot 0 and of retired slots.
const VACANT: Block = Block {
    addr: 0,
    size: 0,
    requested: 0,
    segment: SegmentId(0),
    prev: None,
    next: None,
    state: BlockState::Free,
    stream: StreamId::DEFAULT,
    private_pool: None,
    pool: Pool::Small,
    bin: 0,
    freed_at: 0,
    handed_out: false,
};

impl Heap {
    /// An empty heap; blocks and segments of `oversize_threshold` bytes or
    /// more count as oversize in its statistics.
    pub(crate) fn new(oversize_threshold: u64) -> Self {
        Heap {
            ledger: Ledger::new(oversize_threshold),
            ..Heap::default()
        }
    }

    /// The block with this id.
    #[inline]
    pub fn block(&self, id: BlockId) -> &Block {
        &self.blocks[id.index()]
    }

    /// Whether the segment of block `id` has pages that are not mapped
    /// (only a growable segment with `unmap_free_pages` can): the block may
    /// need a mapping before it is handed out.
    #[inline]
    pub fn has_unmapped_pages(&self, id: BlockId) -> bool {
        let seg = self.segment(self.block(id).segment);
        seg.expandable && seg.unmapped > 0
    }

    /// The segment with this id. Ids are reused: the id of a removed
    /// segment names the next one made, and until then its last contents
    /// (debug builds assert that it is in use).
    #[inline]
    pub fn segment(&self, id: SegmentId) -> &Segment {
        debug_assert!(
            !self.segments.vacant.contains(&(id.index() as u32)),
            "segment {id:?} was removed"
        );
        &self.segments[id.index()]
    }

    /// The logical clock of `pool`: one tick per cache lookup in it. Ages
    /// ([`Block::freed_at`], [`Segment::idle_since`]) are read against it.
    #[inline]
    pub fn clock(&self, pool: Pool) -> u64 {
        self.clock[pool.index()]
    }

    /// Sets the policy-private bin of a block (see [`Block::bin`]).
    #[inline]
    pub fn set_bin(&mut self, id: BlockId, bin: u32) {
        self.blocks[id.index()].bin = bin;
    }

    /// Number of segments.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Number of blocks.
    pub fn block_count(&self) -> usize {
        self.live_blocks
    }

    /// All segments in address order.
    pub fn segments(&self) -> impl Iterator<Item = (SegmentId, &Segment)> + '_ {
        self.by_addr
            .values()
            .map(move |&id| (id, &self.segments[id.index()]))
    }

    /// All blocks in arena order.
    pub fn blocks(&self) -> impl Iterator<Item = (BlockId, &Block)> + '_ {
        self.blocks
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, b)| b.size != 0)
            .map(|(i, b)| (BlockId::from_index(i), b))
    }

    /// The blocks of one segment in address order.
    pub fn segment_blocks(&self, seg: SegmentId) -> SegmentBlocks<'_> {
        SegmentBlocks {
            heap: self,
            next: Some(self.segment(seg).first),
        }
    }

    /// Puts a block into a free arena slot; returns its id.
    #[inline]
    fn alloc_slot(&mut self, block: Block) -> BlockId {
        debug_assert!(block.size > 0);
        match self.reuse_slot() {
            Some(id) => {
                self.blocks[id.index()] = block;
                id
            }
            None => self.push_slot(block),
        }
    }

    /// A retired arena slot for a block the caller writes, if there is
    /// one; returns its id.
    #[inline(always)]
    fn reuse_slot(&mut self) -> Option<BlockId> {
        let id = self.vacant?;
        self.vacant = self.blocks[id.index()].next;
        self.live_blocks += 1;
        Some(id)
    }

    /// A new arena slot holding `block`; returns its id.
    #[inline(never)]
    fn push_slot(&mut self, block: Block) -> BlockId {
        self.live_blocks += 1;
        if self.blocks.is_empty() {
            self.blocks.push(VACANT);
        }
        let id = BlockId::from_index(self.blocks.len());
        self.blocks.push(block);
        id
    }

    /// Retires a block's slot: its size becomes 0 (the mark of a retired
    /// slot) and `next` links the retired slots; the other fields are left
    /// as they were, never read again.
    #[inline]
    fn retire_slot(&mut self, id: BlockId) {
        self.live_blocks -= 1;
        let slot = &mut self.blocks[id.index()];
        slot.size = 0;
        slot.next = self.vacant;
        self.vacant = Some(id);
    }

    /// The segment containing `addr`, if any.
    pub fn segment_containing(&self, addr: u64) -> Option<SegmentId> {
        let (_, &id) = self.by_addr.range(..=addr).next_back()?;
        let seg = self.segment(id);
        (addr < seg.addr + seg.size).then_some(id)
    }

    /// The block that starts exactly at `addr`, if any.
    pub fn block_at(&self, addr: u64) -> Option<BlockId> {
        let seg = self.segment_containing(addr)?;
        self.segment_blocks(seg)
            .find(|&id| self.block(id).addr == addr)
    }

    /// Adds a segment made of one free block; returns the segment and the block.
    pub(crate) fn add_segment(
        &mut self,
        addr: u64,
        size: u64,
        pool: Pool,
        key: CacheKey,
    ) -> (SegmentId, BlockId) {
        let seg_id = SegmentId(self.segments.vacant_key() as u32);
        let block_id = self.alloc_slot(Block {
            addr,
            size,
            requested: 0,
            segment: seg_id,
            prev: None,
            next: None,
            state: BlockState::Free,
            stream: key.stream,
            private_pool: key.private_pool,
            pool,
            bin: 0,
            freed_at: self.clock[pool.index()],
            handed_out: false,
        });
        let inserted = self.segments.insert(Segment {
            addr,
            size,
            stream: key.stream,
            private_pool: key.private_pool,
            pool,
            first: block_id,
            last: block_id,
            expandable: false,
            unmapped: 0,
            blocks: 1,
            busy: 0,
            idle_since: self.clock[pool.index()],
        });
        debug_assert_eq!(inserted, seg_id.index());
        self.by_addr.insert(addr, seg_id);
        self.ledger.segment_added(pool, size);
        (seg_id, block_id)
    }

    /// Changes the size from which blocks and segments count as oversize
    /// (`max_split_size_mb` changed at run time): the current oversize
    /// counts are recounted under the new threshold, so that later frees
    /// and releases undo exactly what they count.
    pub(crate) fn set_oversize_threshold(&mut self, threshold: u64) {
        let slots = &self.segments;
        let segments = self.by_addr.values().map(|id| slots[id.index()].size);
        // Slot 0 is the placeholder, retired slots have size 0.
        let allocated = self
            .blocks
            .iter()
            .skip(1)
            .filter(|b| b.size != 0 && b.state == BlockState::Allocated)
            .map(|b| (b.pool, b.size));
        self.ledger
            .set_oversize_threshold(threshold, segments, allocated);
    }

    /// Removes an idle segment and all its blocks; returns its address and size.
    ///
    /// The caller must have taken its blocks out of the policy's index first.
    pub(crate) fn remove_segment(&mut self, seg_id: SegmentId) -> (u64, u64) {
        debug_assert!(self.segment(seg_id).is_idle());
        let ids: smallvec::SmallVec<[BlockId; 4]> = self.segment_blocks(seg_id).collect();
        for id in ids {
            self.account(id, -1);
            self.retire_slot(id);
        }
        let seg = self.segments.remove(seg_id.index());
        self.by_addr.remove(&seg.addr);
        self.ledger
            .segment_removed(seg.pool, seg.size, seg.unmapped);
        (seg.addr, seg.size)
    }

    /// Splits a free block: it keeps its first `first_size` bytes and a new free
    /// block takes the rest; returns the new block.
    // A retired slot is reused without a call, and a new one is pushed out
    // of line: with no call on its common path, split saves fewer
    // registers. Out of line, as it was before this shrank it: inlined
    // into the engine's malloc it cost more.
    #[inline(never)]
    pub fn split(&mut self, id: BlockId, first_size: u64) -> BlockId {
        match self.reuse_slot() {
            Some(rest_id) => self.split_into(id, first_size, rest_id),
            None => self.split_pushing(id, first_size),
        }
    }

    /// [`Heap::split`] when no retired slot is left: the rest goes into a
    /// new slot.
    #[cold]
    #[inline(never)]
    fn split_pushing(&mut self, id: BlockId, first_size: u64) -> BlockId {
        let rest_id = self.push_slot(VACANT);
        self.split_into(id, first_size, rest_id)
    }

    /// [`Heap::split`] into the slot `rest_id`, taken for it.
    #[inline(always)]
    fn split_into(&mut self, id: BlockId, first_size: u64, rest_id: BlockId) -> BlockId {
        // One slice for every access: through `self.blocks` the vector's
        // pointer and length were loaded again after each store.
        let blocks = &mut self.blocks[..];
        // Field by field: a block copied whole right after some of its
        // fields were written stalls on store forwarding.
        let b = &blocks[id.index()];
        debug_assert!(b.state == BlockState::Free && first_size > 0 && first_size < b.size);
        let (addr, whole, segment, next) = (b.addr, b.size, b.segment, b.next);
        let (stream, private_pool, pool, freed_at) = (b.stream, b.private_pool, b.pool, b.freed_at);
        let rest = &mut blocks[rest_id.index()];
        rest.addr = addr + first_size;
        rest.size = whole - first_size;
        rest.requested = 0;
        rest.segment = segment;
        rest.prev = Some(id);
        rest.next = next;
        rest.state = BlockState::Free;
        rest.stream = stream;
        rest.private_pool = private_pool;
        rest.pool = pool;
        rest.bin = 0;
        rest.freed_at = freed_at;
        rest.handed_out = false;
        let b = &mut blocks[id.index()];
        b.size = first_size;
        b.next = Some(rest_id);
        // Without branches (where in its segment a block lies, and whether
        // the segment was split, are random in a mixed workload): a
        // missing successor's link goes to the placeholder slot 0.
        blocks[next.map_or(0, BlockId::index)].prev = Some(rest_id);
        let segment = &mut self.segments[segment.index()];
        segment.last = if next.is_none() {
            rest_id
        } else {
            segment.last
        };
        let was_alone = segment.blocks == 1;
        segment.blocks += 1;
        // Both pieces are free blocks of a split segment now; before, the
        // block counted as inactive split only if its segment was split.
        self.ledger.block_split(pool, whole, was_alone);
        rest_id
    }

    /// Merges the free block `id` with its free successor; the successor's id
    /// is retired and `id` grows to cover both.
    #[inline]
    pub fn merge_next(&mut self, id: BlockId) {
        let next = self.blocks[id.index()]
            .next
            .expect("merge_next without successor");
        self.merge_with(id, next);
    }

    /// [`Heap::merge_next`] with the successor `next` known.
    // Always inline, for `coalesce`, which knows the successor: called, it
    // set up a frame and loaded the block arena and the successor again.
    #[inline(always)]
    fn merge_with(&mut self, id: BlockId, next: BlockId) {
        // One slice, as in `split`.
        let blocks = &mut self.blocks[..];
        debug_assert_eq!(blocks[id.index()].next, Some(next));
        debug_assert!(blocks[id.index()].state == BlockState::Free);
        debug_assert!(blocks[next.index()].state == BlockState::Free);
        let absorbed = &blocks[next.index()];
        let (size, after, freed_at) = (absorbed.size, absorbed.next, absorbed.freed_at);
        let b = &mut blocks[id.index()];
        b.size += size;
        b.next = after;
        b.freed_at = b.freed_at.max(freed_at);
        let (merged, seg, pool) = (b.size, b.segment, b.pool);
        // Without branches, as in `split`.
        blocks[after.map_or(0, BlockId::index)].prev = Some(id);
        self.retire_slot(next);
        let segment = &mut self.segments[seg.index()];
        segment.last = if after.is_none() { id } else { segment.last };
        segment.blocks -= 1;
        // Two inactive split blocks become one, which no longer counts if
        // it is now its segment's only block.
        let now_alone = segment.blocks == 1;
        self.ledger.blocks_merged(pool, merged, now_alone);
    }

    /// Marks a segment as growable (expandable segments).
    pub(crate) fn set_expandable(&mut self, seg: SegmentId) {
        self.segments[seg.index()].expandable = true;
    }

    /// Extends a segment by `extra` bytes at its end: a free last block grows
    /// (the caller must have taken it out of the policy's index), otherwise a
    /// new free block is appended. Returns the free block ending the segment.
    pub(crate) fn grow_segment(&mut self, seg_id: SegmentId, extra: u64) -> BlockId {
        let seg = &self.segments[seg_id.index()];
        let last = seg.last;
        let (pool, end) = (seg.pool, seg.addr + seg.size);
        let grown = if self.blocks[last.index()].state == BlockState::Free {
            self.account(last, -1);
            self.blocks[last.index()].size += extra;
            self.account(last, 1);
            last
        } else {
            let tail = Block {
                addr: end,
                size: extra,
                requested: 0,
                prev: Some(last),
                next: None,
                state: BlockState::Free,
                bin: 0,
                freed_at: self.clock[pool.index()],
                handed_out: false,
                ..self.blocks[last.index()]
            };
            let id = self.alloc_slot(tail);
            self.blocks[last.index()].next = Some(id);
            let segment = &mut self.segments[seg_id.index()];
            segment.last = id;
            segment.blocks += 1;
            self.account(id, 1);
            id
        };
        let size = self.segments[seg_id.index()].size;
        self.segments[seg_id.index()].size += extra;
        self.ledger.segment_grown(pool, size, size + extra);
        grown
    }

    /// Cuts `by` bytes off the end of a segment whose last block is free and
    /// at least `by` bytes long; a last block cut entirely is retired. The
    /// caller must have taken that block out of the policy's index (and
    /// re-indexes what is left of it). The segment keeps at least one block.
    pub(crate) fn shrink_segment(&mut self, seg_id: SegmentId, by: u64, unmapped: u64) {
        let last = self.segments[seg_id.index()].last;
        let b = self.block(last);
        debug_assert!(b.state == BlockState::Free && b.size >= by);
        if b.size == by {
            let prev = b.prev.expect("shrink would empty the segment");
            self.account(last, -1);
            self.account(prev, -1);
            self.retire_slot(last);
            self.blocks[prev.index()].next = None;
            let seg = &mut self.segments[seg_id.index()];
            seg.last = prev;
            seg.blocks -= 1;
            self.account(prev, 1);
        } else {
            self.account(last, -1);
            self.blocks[last.index()].size -= by;
            self.account(last, 1);
        }
        let seg = &mut self.segments[seg_id.index()];
        debug_assert!(unmapped <= by.min(seg.unmapped));
        let size = seg.size;
        seg.size -= by;
        seg.unmapped -= unmapped;
        let pool = seg.pool;
        self.ledger.segment_shrunk(pool, size, size - by, unmapped);
    }

    /// `bytes` of pages inside a growable segment were unmapped: they no
    /// longer count as reserved (the free blocks over them stay).
    pub(crate) fn pages_unmapped(&mut self, seg_id: SegmentId, bytes: u64) {
        let seg = &mut self.segments[seg_id.index()];
        seg.unmapped += bytes;
        debug_assert!(seg.unmapped <= seg.size);
        let pool = seg.pool;
        self.ledger.pages_unmapped(pool, bytes);
    }

    /// `bytes` of unmapped pages inside a growable segment were mapped again.
    pub(crate) fn pages_mapped(&mut self, seg_id: SegmentId, bytes: u64) {
        let seg = &mut self.segments[seg_id.index()];
        debug_assert!(bytes <= seg.unmapped);
        seg.unmapped -= bytes;
        let pool = seg.pool;
        self.ledger.pages_mapped(pool, bytes);
    }

    /// Moves a block to a new state, recording `requested` bytes when it
    /// becomes allocated; its statistics change is tallied until the
    /// settle.
    #[inline]
    pub(crate) fn set_state(&mut self, id: BlockId, state: BlockState, requested: u64) {
        self.transition::<false>(id, state, requested);
    }

    /// [`Heap::set_state`] for the block a `malloc` hands out or a `free`
    /// gives back: its statistics change is counted now, not at the
    /// settle. The caller's operation changes no other block's state the
    /// other way (only the inactive split counts, which are tallied), so
    /// the totals and peaks are those of the operation's net change; if
    /// block-state changes are already tallied, this one is tallied too
    /// ([`Ledger::state_changed`]).
    #[inline]
    pub(crate) fn set_state_counted_now(&mut self, id: BlockId, state: BlockState, requested: u64) {
        self.transition::<true>(id, state, requested);
    }

    /// [`Heap::set_state`] (`NOW` false) or
    /// [`Heap::set_state_counted_now`] (`NOW` true).
    #[inline(always)]
    fn transition<const NOW: bool>(&mut self, id: BlockId, state: BlockState, requested: u64) {
        let b = &mut self.blocks[id.index()];
        let seg = &mut self.segments[b.segment.index()];
        let pool = b.pool;
        let p = pool.index();
        let size = b.size;
        // The two transitions of every malloc and free.
        let (sign, requested) = match (b.state, state) {
            (BlockState::Free, BlockState::Allocated) => {
                b.requested = requested;
                b.handed_out = true;
                seg.busy += 1;
                (1, requested)
            }
            (BlockState::Allocated, BlockState::Free) => {
                seg.busy -= 1;
                if seg.busy == 0 {
                    seg.idle_since = self.clock[p];
                }
                b.freed_at = self.clock[p];
                (-1, std::mem::replace(&mut b.requested, 0))
            }
            _ => return self.set_state_slow(id, state, requested),
        };
        b.state = state;
        let split = seg.blocks > 1;
        self.ledger
            .state_changed::<NOW>(pool, sign, size, requested, split);
    }

    /// [`Heap::set_state`] for transitions other than free <-> allocated.
    #[inline(never)]
    fn set_state_slow(&mut self, id: BlockId, state: BlockState, requested: u64) {
        let clock = self.clock;
        let b = &mut self.blocks[id.index()];
        let old = (b.state, b.requested);
        let seg = &mut self.segments[b.segment.index()];
        let split = seg.blocks > 1;
        let p = b.pool.index();
        b.state = state;
        if state == BlockState::Allocated {
            b.requested = requested;
            b.handed_out = true;
        }
        let was_free = old.0 == BlockState::Free;
        let now_free = state == BlockState::Free;
        if was_free && !now_free {
            seg.busy += 1;
        } else if !was_free && now_free {
            b.requested = 0;
            b.freed_at = clock[p];
            seg.busy -= 1;
            if seg.busy == 0 {
                seg.idle_since = clock[p];
            }
        }
        let (pool, size, new) = (b.pool, b.size, (state, b.requested));
        self.ledger.state_changed_other(pool, size, split, old, new);
    }

    /// Adds (`sign = 1`) or removes (`sign = -1`) one block's contribution
    /// to the statistics into the ledger's pending tally
    /// ([`Ledger::account`]).
    #[inline]
    fn account(&mut self, id: BlockId, sign: i64) {
        let b = &self.blocks[id.index()];
        let split = self.segments[b.segment.index()].blocks > 1;
        self.ledger
            .account(b.pool, sign, b.state, split, b.size, b.requested);
    }

    /// Advances the clock of one pool (one cache lookup).
    #[inline]
    pub(crate) fn tick(&mut self, pool: Pool) {
        self.clock[pool.index()] += 1;
    }
}

/// Iterator over a segment's blocks in address order.
pub struct SegmentBlocks<'a> {
    heap: &'a Heap,
    next: Option<BlockId>,
}

impl Iterator for SegmentBlocks<'_> {
    type Item = BlockId;

    fn next(&mut self) -> Option<BlockId> {
        let id = self.next?;
        self.next = self.heap.block(id).next;
        Some(id)
    }
}

/// Merges a free block with its free address neighbours in the same segment,
/// calling `unindex` for each neighbour before it is absorbed; returns the
/// surviving block. This is the coalescing step of best-fit-with-coalescing
/// policies.
pub fn coalesce(heap: &mut Heap, id: BlockId, mut unindex: impl FnMut(&Heap, BlockId)) -> BlockId {
    let mut id = id;
    if let Some(next) = heap.block(id).next {
        if heap.block(next).state == BlockState::Free {
            unindex(heap, next);
            heap.merge_with(id, next);
        }
    }
    if let Some(prev) = heap.block(id).prev {
        if heap.block(prev).state == BlockState::Free {
            unindex(heap, prev);
            heap.merge_with(prev, id);
            id = prev;
        }
    }
    id
}

#[cfg(test)]
impl Heap {
    /// For the parts' tests: a segment of `key` at `addr` cut into blocks of
    /// `sizes` in address order, the `true` ones allocated (their request
    /// their size); returns the segment and its blocks.
    pub(crate) fn add_cut_segment(
        &mut self,
        addr: u64,
        key: CacheKey,
        sizes: &[(u64, bool)],
    ) -> (SegmentId, Vec<BlockId>) {
        let total = sizes.iter().map(|s| s.0).sum();
        let (seg, first) = self.add_segment(addr, total, Pool::Large, key);
        let (mut rest, mut blocks) = (Some(first), Vec::new());
        for &(size, allocated) in sizes {
            let Some(id) = rest else { break };
            rest = (self.block(id).size > size).then(|| self.split(id, size));
            if allocated {
                self.set_state(id, BlockState::Allocated, size);
            }
            blocks.push(id);
        }
        (seg, blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heap_with_segment(size: u64) -> (Heap, SegmentId, BlockId) {
        let mut heap = Heap::new(u64::MAX);
        let (s, b) = heap.add_segment(0x1000, size, Pool::Large, CacheKey::default());
        (heap, s, b)
    }

    #[test]
    fn a_block_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Block>(), 64);
        assert_eq!(std::mem::align_of::<Block>(), 64);
    }

    #[test]
    fn split_tiles_segment_and_counts_inactive_split() {
        let (mut heap, seg, b) = heap_with_segment(1000);
        let rest = heap.split(b, 300);
        heap.ledger.settle();
        assert_eq!(heap.block(b).size, 300);
        assert_eq!(heap.block(rest).addr, 0x1000 + 300);
        assert_eq!(heap.segment(seg).blocks, 2);
        assert_eq!(heap.ledger.snapshot().inactive_split.all.current, 2);
        assert_eq!(
            heap.ledger.snapshot().inactive_split_bytes.all.current,
            1000
        );
        heap.set_state(b, BlockState::Allocated, 250);
        heap.ledger.settle();
        assert_eq!(heap.ledger.snapshot().inactive_split.all.current, 1);
        assert_eq!(heap.ledger.snapshot().inactive_split_bytes.all.current, 700);
        assert_eq!(heap.ledger.snapshot().allocated_bytes.all.current, 300);
        assert_eq!(heap.ledger.snapshot().requested_bytes.all.current, 250);
        assert_eq!(heap.segment(seg).busy, 1);
    }

    #[test]
    fn changes_applied_at_once_equal_settled_ones() {
        let run = |now: bool| {
            let (mut heap, _, a) = heap_with_segment(1000);
            let b = heap.split(a, 300);
            heap.ledger.settle();
            for (id, state, requested) in [
                (a, BlockState::Allocated, 250),
                (b, BlockState::Allocated, 700),
                (a, BlockState::Free, 0),
                (a, BlockState::Allocated, 10),
                (b, BlockState::Free, 0),
            ] {
                if now {
                    heap.set_state_counted_now(id, state, requested);
                } else {
                    heap.set_state(id, state, requested);
                }
                heap.ledger.settle();
            }
            heap.ledger.snapshot()
        };
        assert_eq!(run(true), run(false));
        assert_eq!(run(true).allocation.all.allocated, 3);
    }

    proptest::proptest! {
        /// Random block-state changes (blocks awaiting events among them,
        /// several in one operation, resets between operations) give the
        /// same statistics whether the active counts follow the allocated
        /// ones while no block awaits events or are always updated.
        #[test]
        fn following_active_counts_equal_updating_them(
            steps in proptest::collection::vec((0u8..8, 0usize..4, 1u64..100), 0..200)
        ) {
            let run = |never_follow: bool| {
                let mut heap = Heap::new(300);
                if never_follow {
                    heap.ledger.never_follow();
                }
                let key = CacheKey::default();
                let (_, a) = heap.add_segment(0x1000, 1000, Pool::Large, key);
                let (_, c) = heap.add_segment(0x9000, 1000, Pool::Small, key);
                let b = heap.split(a, 400);
                let d = heap.split(c, 200);
                heap.ledger.settle();
                let ids = [a, b, c, d];
                let mut seen = vec![];
                for &(kind, i, requested) in &steps {
                    let id = ids[i];
                    let state = heap.block(id).state;
                    let to = match state {
                        BlockState::Free => BlockState::Allocated,
                        BlockState::Allocated if kind % 2 == 0 => BlockState::AwaitingEvents,
                        _ => BlockState::Free,
                    };
                    match kind {
                        0..=2 => heap.set_state_counted_now(id, to, requested),
                        3..=4 => heap.set_state(id, to, requested),
                        // A change of an operation that goes on.
                        5 => {
                            heap.set_state(id, to, requested);
                            continue;
                        }
                        6 => {
                            heap.ledger.settle();
                            heap.ledger.stats.reset_peaks();
                        }
                        _ => {
                            heap.ledger.settle();
                            heap.ledger.stats.reset_accumulated();
                        }
                    }
                    heap.ledger.settle();
                    seen.push(heap.ledger.snapshot());
                }
                seen
            };
            proptest::prop_assert_eq!(run(false), run(true));
        }
    }

    #[test]
    fn a_change_after_tallied_ones_is_tallied_with_them() {
        // One operation releases a block awaiting events and hands another
        // out: the active count does not move, so neither does its total.
        let (mut heap, _, a) = heap_with_segment(1000);
        let b = heap.split(a, 500);
        heap.set_state(a, BlockState::Allocated, 500);
        heap.ledger.settle();
        heap.set_state(a, BlockState::AwaitingEvents, 0);
        heap.ledger.settle();
        let before = heap.ledger.snapshot().active;
        heap.set_state(a, BlockState::Free, 0);
        heap.set_state_counted_now(b, BlockState::Allocated, 500);
        heap.ledger.settle();
        assert_eq!(heap.ledger.snapshot().active, before);
        assert_eq!(heap.ledger.snapshot().allocation.all.allocated, 2);
    }

    #[test]
    fn coalesce_merges_both_neighbours() {
        let (mut heap, seg, a) = heap_with_segment(900);
        let b = heap.split(a, 300);
        let c = heap.split(b, 300);
        heap.set_state(b, BlockState::Allocated, 300);
        heap.set_state(b, BlockState::Free, 0);
        let mut unindexed = vec![];
        let survivor = coalesce(&mut heap, b, |_, id| unindexed.push(id));
        assert_eq!(survivor, a);
        assert_eq!(unindexed, vec![c, a]);
        heap.ledger.settle();
        assert_eq!(heap.block(a).size, 900);
        assert_eq!(heap.segment(seg).blocks, 1);
        assert_eq!(heap.ledger.snapshot().inactive_split.all.current, 0);
        assert!(heap.segment(seg).is_idle());
    }

    #[test]
    fn remove_segment_restores_stats() {
        let (mut heap, seg, a) = heap_with_segment(900);
        heap.split(a, 100);
        assert_eq!(heap.remove_segment(seg), (0x1000, 900));
        heap.ledger.settle();
        assert_eq!(heap.ledger.snapshot().reserved_bytes.all.current, 0);
        assert_eq!(heap.ledger.snapshot().inactive_split.all.current, 0);
        assert_eq!(heap.block_count(), 0);
        assert_eq!(heap.ledger.snapshot().segment.all.peak, 1);
    }

    #[test]
    fn retired_slots_are_reused_last_in_first_out() {
        let (mut heap, seg, a) = heap_with_segment(900);
        let b = heap.split(a, 300);
        let c = heap.split(b, 300);
        heap.merge_next(b);
        heap.merge_next(a);
        heap.ledger.settle();
        assert_eq!(heap.block_count(), 1);
        assert_eq!(heap.blocks().map(|(id, _)| id).collect::<Vec<_>>(), vec![a]);
        // b was retired last, so it comes back first.
        assert_eq!(heap.split(a, 100), b);
        assert_eq!(heap.split(b, 100), c);
        heap.ledger.settle();
        assert_eq!(heap.segment(seg).blocks, 3);
        assert_eq!(heap.ledger.snapshot().inactive_split.all.current, 3);
        assert_eq!(heap.ledger.snapshot().inactive_split_bytes.all.current, 900);
        assert_eq!(heap.ledger.snapshot().inactive_split.all.peak, 3);
    }

    #[test]
    fn address_lookup() {
        let (mut heap, seg, a) = heap_with_segment(900);
        let b = heap.split(a, 100);
        assert_eq!(heap.segment_containing(0x1000 + 899), Some(seg));
        assert_eq!(heap.segment_containing(0x1000 + 900), None);
        assert_eq!(heap.segment_containing(0x10), None);
        assert_eq!(heap.block_at(0x1000 + 100), Some(b));
        assert_eq!(heap.block_at(0x1000 + 101), None);
    }
}
