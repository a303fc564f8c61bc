//! The one forwarding of the [`Policy`](crate::Policy) trait: every method's
//! signature and call, written once, for policies that hand calls to another
//! policy (`Box<P>` here; in `alloc-policy` the enum of compiled-in policies
//! and the garbage-collecting adaptor).

/// Implements [`Policy`](crate::Policy) methods inside an `impl Policy for
/// ...` block by handing each call to an inner policy.
///
/// `forward_policy!(reach; all)` writes every method;
/// `forward_policy!(reach; plan, take_free, ...)` only those named, for an
/// adaptor that writes the others itself. `reach` names a macro that the
/// forwarding invokes as `reach!(ref self, p => call)` in `&self` methods
/// and `reach!(mut self, p => call)` in `&mut self` methods: it evaluates
/// `call` with `p` bound to the inner policy (by shared or mutable
/// reference), so an enum of policies can match on its variants and a
/// wrapper can reach its field. Every forwarded method is `#[inline]`.
///
/// An adaptor that counts the cached blocks its policy hands out, and
/// forwards the rest:
///
/// ```
/// use alloc_core::{
///     forward_policy, AllocatorConfig, BlockId, Engine, EngineOptions, Heap, Policy, Request,
///     SimMemory, SimStreams, StreamId, GIB, MIB,
/// };
/// use alloc_policy::AnyPolicy;
///
/// struct Counting<P> {
///     inner: P,
///     hits: u64,
/// }
///
/// macro_rules! to_inner {
///     (ref $s:expr, $p:ident => $call:expr) => {{ let $p = &$s.inner; $call }};
///     (mut $s:expr, $p:ident => $call:expr) => {{ let $p = &mut $s.inner; $call }};
/// }
///
/// impl<P: Policy> Policy for Counting<P> {
///     fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId> {
///         let found = self.inner.take_free(heap, req);
///         self.hits += u64::from(found.is_some());
///         found
///     }
///     forward_policy!(to_inner; name, reconfigure, plan, segment_size, carve, insert_free,
///         remove_free, release_for_oom, collect_garbage, coalesces, rebuilds_layouts,
///         oversize_threshold, supports_growth, indexed_blocks, check);
/// }
///
/// let cfg = AllocatorConfig::default();
/// let policy = Counting { inner: AnyPolicy::from_config(&cfg)?, hits: 0 };
/// let mut e = Engine::new(policy, SimMemory::new(GIB), SimStreams::new(), EngineOptions::default());
/// let a = e.malloc(MIB, StreamId(0))?;
/// e.free(a.addr)?;
/// e.malloc(MIB, StreamId(0))?; // served from the cache
/// assert_eq!(e.policy().hits, 1);
/// assert_eq!(e.policy().name(), "pytorch-bfc");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[macro_export]
macro_rules! forward_policy {
    ($reach:ident; all) => {
        $crate::forward_policy!($reach; name, reconfigure, plan, segment_size, take_free, carve,
            insert_free, remove_free, release_for_oom, collect_garbage, coalesces,
            rebuilds_layouts, oversize_threshold, supports_growth, indexed_blocks, check);
    };
    ($reach:ident; $($method:ident),+ $(,)?) => {
        $($crate::forward_policy!(@method $reach $method);)+
    };
    (@method $reach:ident name) => {
        #[inline]
        fn name(&self) -> &str {
            $reach!(ref self, p => p.name())
        }
    };
    (@method $reach:ident reconfigure) => {
        #[inline]
        fn reconfigure(
            &mut self,
            cfg: &$crate::AllocatorConfig,
        ) -> ::core::result::Result<(), $crate::ConfigError> {
            $reach!(mut self, p => p.reconfigure(cfg))
        }
    };
    (@method $reach:ident plan) => {
        #[inline]
        fn plan(&self, requested: u64, key: $crate::CacheKey) -> $crate::Request {
            $reach!(ref self, p => p.plan(requested, key))
        }
    };
    (@method $reach:ident segment_size) => {
        #[inline]
        fn segment_size(&self, req: &$crate::Request) -> u64 {
            $reach!(ref self, p => p.segment_size(req))
        }
    };
    (@method $reach:ident take_free) => {
        #[inline]
        fn take_free(
            &mut self,
            heap: &$crate::Heap,
            req: &$crate::Request,
        ) -> ::core::option::Option<$crate::BlockId> {
            $reach!(mut self, p => p.take_free(heap, req))
        }
    };
    (@method $reach:ident carve) => {
        #[inline]
        fn carve(
            &mut self,
            heap: &mut $crate::Heap,
            block: $crate::BlockId,
            req: &$crate::Request,
        ) -> $crate::BlockId {
            $reach!(mut self, p => p.carve(heap, block, req))
        }
    };
    (@method $reach:ident insert_free) => {
        #[inline]
        fn insert_free(&mut self, heap: &mut $crate::Heap, block: $crate::BlockId) {
            $reach!(mut self, p => p.insert_free(heap, block))
        }
    };
    (@method $reach:ident remove_free) => {
        #[inline]
        fn remove_free(&mut self, heap: &$crate::Heap, block: $crate::BlockId) {
            $reach!(mut self, p => p.remove_free(heap, block))
        }
    };
    (@method $reach:ident release_for_oom) => {
        #[inline]
        fn release_for_oom(
            &mut self,
            heap: &$crate::Heap,
            req: &$crate::Request,
        ) -> $crate::OomRelease {
            $reach!(mut self, p => p.release_for_oom(heap, req))
        }
    };
    (@method $reach:ident collect_garbage) => {
        #[inline]
        fn collect_garbage(
            &mut self,
            heap: &$crate::Heap,
            pressure: &$crate::Pressure,
        ) -> ::std::vec::Vec<$crate::SegmentId> {
            $reach!(mut self, p => p.collect_garbage(heap, pressure))
        }
    };
    (@method $reach:ident coalesces) => {
        #[inline]
        fn coalesces(&self) -> bool {
            $reach!(ref self, p => p.coalesces())
        }
    };
    (@method $reach:ident rebuilds_layouts) => {
        #[inline]
        fn rebuilds_layouts(&self) -> bool {
            $reach!(ref self, p => p.rebuilds_layouts())
        }
    };
    (@method $reach:ident oversize_threshold) => {
        #[inline]
        fn oversize_threshold(&self) -> u64 {
            $reach!(ref self, p => p.oversize_threshold())
        }
    };
    (@method $reach:ident supports_growth) => {
        #[inline]
        fn supports_growth(&self) -> bool {
            $reach!(ref self, p => p.supports_growth())
        }
    };
    (@method $reach:ident kept_mapped) => {
        #[inline]
        fn kept_mapped(&self, key: $crate::CacheKey) -> ::std::option::Option<(u64, u64)> {
            $reach!(ref self, p => p.kept_mapped(key))
        }
    };
    (@method $reach:ident indexed_blocks) => {
        #[inline]
        fn indexed_blocks(&self) -> ::std::vec::Vec<$crate::BlockId> {
            $reach!(ref self, p => p.indexed_blocks())
        }
    };
    (@method $reach:ident check) => {
        #[inline]
        fn check(&self, heap: &$crate::Heap) -> ::core::result::Result<(), ::std::string::String> {
            $reach!(ref self, p => p.check(heap))
        }
    };
}
