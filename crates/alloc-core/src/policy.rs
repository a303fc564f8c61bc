//! The policy seam, three traits: [`Policy`], placement (how sizes are
//! rounded, which cached block serves a request, how blocks are split and
//! merged); [`Reclaim`], which cached segments go back to the device under
//! pressure; [`Audit`], what validation asks of the policy. The engine owns
//! everything else (streams, events, statistics, the out-of-memory path).

use crate::config::{AllocatorConfig, ConfigError};
use crate::heap::Heap;
use crate::types::{BlockId, CacheKey, Pool, SegmentId};

/// The cache keys for which a policy keeps pages mapped
/// ([`Reclaim::kept_mapped_keys`]).
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

/// Refuses `expandable_segments` in `cfg` when `policy` cannot grow
/// segments ([`Capabilities::supports_growth`]): the one check of every
/// place that pairs a policy with a configuration.
pub fn check_growth<P: Policy + ?Sized>(
    policy: &P,
    cfg: &AllocatorConfig,
) -> Result<(), ConfigError> {
    if cfg.expandable_segments && !policy.capabilities().supports_growth {
        return Err(ConfigError::InvalidValue {
            key: "expandable_segments".into(),
            value: "true".into(),
            reason: format!(
                "policy `{}` does not support growable segments",
                policy.name()
            ),
        });
    }
    Ok(())
}

/// A request after the policy has rounded it and chosen its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Bytes the caller asked for.
    pub requested: u64,
    /// Bytes the block will have (rounded).
    pub size: u64,
    /// Pool to serve it from.
    pub pool: Pool,
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
            Pool::Small
        } else {
            Pool::Large
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

/// Where a request goes: an allocation strategy over the shared [`Heap`],
/// placement only. Giving memory back is [`Reclaim`]'s, checking the
/// policy's index is [`Audit`]'s; a policy implements all three.
///
/// The engine calls these in a fixed protocol: [`Policy::round_request`] once for
/// every request; [`Policy::take_free`] to find a cached block; when none
/// fits, a new segment of [`Policy::segment_size`] bytes is made and handed
/// to [`Policy::carve`] as one free block; [`Policy::carve`] also receives
/// the blocks found by `take_free`. A block that becomes free again goes to
/// [`Policy::insert_free`]. Before a segment is freed, its free blocks go to
/// [`Policy::remove_free`]. [`Policy::capabilities`] is read when the engine
/// is built and after [`Policy::reconfigure`], never per request.
pub trait Policy: Reclaim + Audit {
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

    /// What the policy can do (see [`Capabilities`]), under its current
    /// settings.
    fn capabilities(&self) -> Capabilities;

    /// Rounds `requested` (1 ..= the engine's maximum) and chooses a pool
    /// (with [`Request::new`]), for a request that may reuse the cached
    /// blocks of `key`. Called once per request: the engine keeps the answer
    /// for the request's every later step.
    fn round_request(&self, requested: u64, key: CacheKey) -> Request;

    /// Size of the device allocation to make when no cached block fits.
    fn segment_size(&self, req: &Request) -> u64;

    /// Finds a cached free block for `req` of its key and pool, removes it
    /// from the index and returns it. It may be larger than `req.size`.
    fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId>;

    /// Cuts the block to hand out from the unindexed free `block` (at least
    /// `req.size` bytes), indexing any remainder; returns the block to hand out.
    fn carve(&mut self, heap: &mut Heap, block: BlockId, req: &Request) -> BlockId;

    /// Takes back a block that just became free: merges it as the policy
    /// wants and indexes the result.
    fn insert_free(&mut self, heap: &mut Heap, block: BlockId);

    /// Removes an indexed free block from the index (its segment is about to
    /// be released).
    fn remove_free(&mut self, heap: &Heap, block: BlockId);
}

/// What a policy gives back, and keeps, under memory pressure: idle
/// segments when a device allocation failed or before a new segment is
/// made (garbage collection), the free pages to keep mapped, and per-key
/// state once its segments went back. Every method has a default that gives
/// nothing back, so a policy without a collector of its own writes
/// `impl Reclaim for MyPolicy {}`; a collector such as `alloc_policy`'s
/// `GcAge` is a `Reclaim` of its own that a policy's implementation calls.
pub trait Reclaim {
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

    /// The addresses `[start, end)` of `key`'s large-pool growable segment
    /// whose free pages should stay mapped when `unmap_free_pages` makes room
    /// for a mapping (a planned layout, whose pages every step uses again:
    /// unmapping them only moves them back later). Default: none.
    fn kept_mapped(&self, _key: CacheKey) -> Option<(u64, u64)> {
        None
    }

    /// The cache keys for which [`Reclaim::kept_mapped`] may answer, so that
    /// the engine asks about those alone rather than about every growable
    /// segment (one per stream ever seen). Default: any key.
    fn kept_mapped_keys(&self) -> KeptKeys {
        KeptKeys::Any
    }

    /// Drops per-key state of keys with no free block (streams that hold
    /// nothing any more), after `empty_cache` gave their segments back.
    /// Answers do not change. Default: nothing to drop.
    fn forget_empty_keys(&mut self) {}
}

/// What [`Engine::validate`](crate::Engine::validate) asks of a policy: the
/// blocks in its index and its own invariants. Not called by allocation:
/// tests check the engine after every step with it, and a thread-safe
/// allocator checks an engine whose lock a panic poisoned before using it
/// again.
pub trait Audit {
    /// Every indexed block.
    fn indexed_blocks(&self) -> Vec<BlockId>;

    /// Policy-specific invariants over the heap. Default: none.
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

/// Forwards to the boxed policy's reclaim.
impl<P: Reclaim + ?Sized> Reclaim for Box<P> {
    crate::forward_policy!(boxed; all_reclaim);
}

/// Forwards to the boxed policy's audit.
impl<P: Audit + ?Sized> Audit for Box<P> {
    crate::forward_policy!(boxed; all_audit);
}

/// For the parts' tests: a policy of one free list, in the order blocks were
/// freed, that takes the first block that fits and carves requests from the
/// front of a block. It neither merges nor grows by itself.
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct FreeList(pub(crate) Vec<BlockId>);

#[cfg(test)]
impl Policy for FreeList {
    fn name(&self) -> &str {
        "free-list"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            supports_growth: true,
            ..Capabilities::default()
        }
    }

    fn round_request(&self, requested: u64, key: CacheKey) -> Request {
        Request::new(requested, requested, key, 0)
    }

    fn segment_size(&self, req: &Request) -> u64 {
        req.size
    }

    fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId> {
        let at = self
            .0
            .iter()
            .position(|&b| heap.block(b).size >= req.size)?;
        Some(self.0.remove(at))
    }

    fn carve(&mut self, heap: &mut Heap, block: BlockId, req: &Request) -> BlockId {
        if heap.block(block).size > req.size {
            let rest = heap.split(block, req.size);
            self.0.push(rest);
        }
        block
    }

    fn insert_free(&mut self, _heap: &mut Heap, block: BlockId) {
        self.0.push(block);
    }

    fn remove_free(&mut self, _heap: &Heap, block: BlockId) {
        self.0.retain(|&b| b != block);
    }
}

#[cfg(test)]
impl Reclaim for FreeList {}

#[cfg(test)]
impl Audit for FreeList {
    fn indexed_blocks(&self) -> Vec<BlockId> {
        self.0.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_small_up_to_the_limit() {
        let key = CacheKey::default();
        let at = Request::new(100, 1024, key, 1024);
        assert_eq!((at.requested, at.size, at.pool), (100, 1024, Pool::Small));
        assert_eq!(Request::new(1025, 1536, key, 1024).pool, Pool::Large);
        assert_eq!(Request::new(1, 1, key, 0).pool, Pool::Large);
        assert_eq!(Request::new(1, u64::MAX, key, u64::MAX).pool, Pool::Small);
    }
}
