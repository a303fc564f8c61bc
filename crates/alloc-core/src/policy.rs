//! The policy seam: how sizes are rounded, which cached block serves a
//! request, how blocks are split and merged, and which cached segments go back
//! to the device under pressure. The engine owns everything else (streams,
//! events, statistics, the out-of-memory path).

use crate::config::{AllocatorConfig, ConfigError};
use crate::heap::Heap;
use crate::types::{BlockId, CacheKey, PoolKind, SegmentId};

/// The cache keys for which a policy keeps pages mapped
/// ([`Policy::kept_mapped_keys`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeptKeys {
    /// Any key may have a kept range: ask about each.
    Any,
    /// No key has one.
    None,
    /// This key alone may have one.
    One(CacheKey),
}

/// What a policy can do: read by the engine once when it is built, and
/// again after [`Policy::reconfigure`], and kept (never asked per request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Whether free address neighbours are always merged (checked by
    /// validation: no two adjacent free blocks).
    pub coalesces: bool,
    /// Whether a private pool's layout can be rebuilt by carving its blocks
    /// from the front of merged free space in address order (checkpoint and
    /// restore for CUDA graph trees, and no-split pools).
    pub rebuilds_layouts: bool,
    /// Whether the policy works with growable segments (expandable
    /// segments), whose last block grows and shrinks at the end.
    pub supports_growth: bool,
    /// Blocks at or above this size count as oversize in the statistics.
    pub oversize_threshold: u64,
}

impl Default for Capabilities {
    /// No merging, layouts rebuilt, no growable segments, nothing oversize.
    fn default() -> Self {
        Capabilities {
            coalesces: false,
            rebuilds_layouts: true,
            supports_growth: false,
            oversize_threshold: u64::MAX,
        }
    }
}

/// A request after the policy has rounded it and chosen its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Bytes the caller asked for.
    pub requested: u64,
    /// Bytes the block will have (rounded).
    pub size: u64,
    /// Pool to serve it from.
    pub pool: PoolKind,
    /// The cached blocks it may take: the allocating stream's, in its
    /// private pool if it names one.
    pub key: CacheKey,
}

impl Request {
    /// A request for `requested` bytes rounded to `size`, that may reuse the
    /// cached blocks of `key`: in the small pool when `size` is at most
    /// `small_max`, else in the large pool. The one small/large choice, so
    /// that a policy states its limit rather than write the choice again.
    #[inline]
    pub const fn new(requested: u64, size: u64, key: CacheKey, small_max: u64) -> Request {
        let pool = if size <= small_max {
            PoolKind::Small
        } else {
            PoolKind::Large
        };
        Request {
            requested,
            size,
            pool,
            key,
        }
    }
}

/// Memory pressure, as the engine sees it when a new segment is needed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pressure {
    /// Bytes reserved from the device now.
    pub reserved: u64,
    /// The reserved-bytes limit: the memory fraction's, or the device capacity.
    pub limit: u64,
    /// True when the limit comes from `set_memory_fraction`.
    pub fraction_set: bool,
    /// The configured `garbage_collection_threshold`, if any.
    pub threshold: Option<f64>,
}

/// Segments a policy chose to give back when a device allocation failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OomRelease {
    /// Idle segments to free, in order.
    pub segments: Vec<SegmentId>,
    /// Whether freeing them is expected to make room for the request (if
    /// false the engine frees them anyway and moves to the next step, as
    /// PyTorch does).
    pub sufficient: bool,
}

/// An allocation strategy over the shared [`Heap`].
///
/// The engine calls these in a fixed protocol: [`Policy::plan`] for every
/// request; [`Policy::take_free`] to find a cached block; when none fits, a
/// new segment of [`Policy::segment_size`] bytes is made and handed to
/// [`Policy::carve`] as one free block; [`Policy::carve`] also receives the
/// blocks found by `take_free` ([`Policy::take_carved`] makes both calls in
/// one). A block that becomes free again goes to
/// [`Policy::insert_free`]. Before a segment is freed, its free blocks go to
/// [`Policy::remove_free`].
pub trait Policy {
    /// Short name shown in reports.
    fn name(&self) -> &str;

    /// Takes the settings of `cfg` changed at run time
    /// (`torch.cuda.memory._set_allocator_settings`): later decisions follow
    /// them, blocks already handed out or cached stay as they are (as in
    /// PyTorch). A policy that cannot change what changed refuses with the
    /// option to keep. The default keeps the policy as it is, for policies
    /// that take nothing from the configuration.
    fn reconfigure(&mut self, _cfg: &AllocatorConfig) -> Result<(), ConfigError> {
        Ok(())
    }

    /// Rounds `requested` (1 ..= the engine's maximum) and chooses a pool,
    /// for a request that may reuse the cached blocks of `key`. The same
    /// arguments give the same request: the engine plans a request again
    /// rather than keep it on its slow paths.
    fn plan(&self, requested: u64, key: CacheKey) -> Request;

    /// Size of the device allocation to make when no cached block fits.
    fn segment_size(&self, req: &Request) -> u64;

    /// Finds a cached free block for `req` of its key and pool, removes it
    /// from the index and returns it. It may be larger than `req.size`.
    fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId>;

    /// Cuts the block to hand out from the unindexed free `block` (at least
    /// `req.size` bytes), indexing any remainder; returns the block to hand out.
    fn carve(&mut self, heap: &mut Heap, block: BlockId, req: &Request) -> BlockId;

    /// [`Policy::take_free`] and then, for the block found,
    /// [`Policy::carve`]: the cached block to hand out for `req`, or `None`
    /// (nothing changed) when no cached block fits. The default makes
    /// exactly those two calls; a policy that forwards to another forwards
    /// this too, so that the engine's common path reaches the inner policy
    /// through one dispatch. A wrapper that writes its own `take_free` or
    /// `carve` leaves this one to the default, which calls them.
    fn take_carved(&mut self, heap: &mut Heap, req: &Request) -> Option<BlockId> {
        let block = self.take_free(heap, req)?;
        Some(self.carve(heap, block, req))
    }

    /// Takes back a block that just became free: merges it as the policy
    /// wants and indexes the result.
    fn insert_free(&mut self, heap: &mut Heap, block: BlockId);

    /// Removes an indexed free block from the index (its segment is about to
    /// be released).
    fn remove_free(&mut self, heap: &Heap, block: BlockId);

    /// Device allocation failed: idle segments to release before the engine
    /// falls back to releasing every idle segment. Default: none.
    fn release_for_oom(&mut self, _heap: &Heap, _req: &Request) -> OomRelease {
        OomRelease::default()
    }

    /// A new segment is about to be allocated under `pressure`: idle segments
    /// to release first (garbage collection). Default: none.
    fn collect_garbage(&mut self, _heap: &Heap, _pressure: &Pressure) -> Vec<SegmentId> {
        Vec::new()
    }

    /// What the policy can do (see [`Capabilities`]), under its current
    /// settings.
    fn capabilities(&self) -> Capabilities;

    /// The addresses `[start, end)` of `key`'s large-pool growable segment
    /// whose free pages should stay mapped when `unmap_free_pages` makes room
    /// for a mapping (a planned layout, whose pages every step uses again:
    /// unmapping them only moves them back later). Default: none.
    fn kept_mapped(&self, _key: CacheKey) -> Option<(u64, u64)> {
        None
    }

    /// The cache keys for which [`Policy::kept_mapped`] may answer, so that
    /// the engine asks about those alone rather than about every growable
    /// segment (one per stream ever seen). Default: any key.
    fn kept_mapped_keys(&self) -> KeptKeys {
        KeptKeys::Any
    }

    /// Drops per-key state of keys with no free block (streams that hold
    /// nothing any more), after `empty_cache` gave their segments back.
    /// Answers do not change. Default: nothing to drop.
    fn forget_empty_keys(&mut self) {}

    /// Every indexed block, for validation.
    fn indexed_blocks(&self) -> Vec<BlockId>;

    /// Policy-specific invariants over the heap, for validation.
    fn check(&self, _heap: &Heap) -> Result<(), String> {
        Ok(())
    }
}

/// Reaches the boxed policy, for [`forward_policy!`](crate::forward_policy).
macro_rules! boxed {
    (ref $s:expr, $p:ident => $call:expr) => {{
        let $p = &**$s;
        $call
    }};
    (mut $s:expr, $p:ident => $call:expr) => {{
        let $p = &mut **$s;
        $call
    }};
}

/// Forwards every call to the boxed policy, so `Box<dyn Policy>` works
/// wherever a policy does.
impl<P: Policy + ?Sized> Policy for Box<P> {
    crate::forward_policy!(boxed; all);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_small_up_to_the_limit() {
        let key = CacheKey::default();
        let at = Request::new(100, 1024, key, 1024);
        assert_eq!(
            (at.requested, at.size, at.pool),
            (100, 1024, PoolKind::Small)
        );
        assert_eq!(Request::new(1025, 1536, key, 1024).pool, PoolKind::Large);
        assert_eq!(Request::new(1, 1, key, 0).pool, PoolKind::Large);
        assert_eq!(
            Request::new(1, u64::MAX, key, u64::MAX).pool,
            PoolKind::Small
        );
    }
}
