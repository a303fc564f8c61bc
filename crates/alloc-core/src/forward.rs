//! The one forwarding of the policy traits ([`Policy`](crate::Policy),
//! [`Reclaim`](crate::Reclaim), [`Audit`](crate::Audit)): every method's
//! signature and call, written once, for policies that hand calls to another
//! policy (`Box<P>` here; in `alloc-policy` the enum of compiled-in
//! policies).

/// Implements methods of [`Policy`](crate::Policy), [`Reclaim`](crate::Reclaim)
/// or [`Audit`](crate::Audit) inside an `impl` block of that trait by handing
/// each call to an inner policy.
///
/// `forward_policy!(reach; all)` writes every method of `Policy`,
/// `all_reclaim` every method of `Reclaim`, `all_audit` every method of
/// `Audit`; `forward_policy!(reach; round_request, take_free, ...)` only those named,
/// for an adaptor that writes the others itself. A wrapper that holds its
/// policy in a field names it: `forward_policy!(field inner; ...)`.
/// Otherwise `reach` names a macro that the forwarding invokes as
/// `reach!(ref self, p => call)` in `&self` methods and `reach!(mut self, p
/// => call)` in `&mut self` methods: it evaluates `call` with `p` bound to
/// the inner policy (by shared or mutable reference), so an enum of policies
/// can match on its variants. Every forwarded method is `#[inline]`.
///
/// An adaptor that counts the cached blocks its policy hands out, and
/// forwards the rest:
///
/// ```
/// use alloc_core::{
///     forward_policy, Audit, BlockId, Engine, EngineOptions, Heap, Policy, Reclaim, Request,
///     SimMemory, SimStreams, StreamId, GIB, MIB,
/// };
/// use alloc_core::AllocatorConfig;
/// use alloc_policy::AnyPolicy;
///
/// struct Counting<P> {
///     inner: P,
///     hits: u64,
/// }
///
/// impl<P: Policy> Policy for Counting<P> {
///     fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId> {
///         let found = self.inner.take_free(heap, req);
///         self.hits += u64::from(found.is_some());
///         found
///     }
///     forward_policy!(field inner; name, reconfigure, capabilities, round_request, segment_size,
///         carve, insert_free, remove_free);
/// }
/// impl<P: Policy> Reclaim for Counting<P> {
///     forward_policy!(field inner; all_reclaim);
/// }
/// impl<P: Policy> Audit for Counting<P> {
///     forward_policy!(field inner; all_audit);
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
/// e.assert_valid();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[macro_export]
macro_rules! forward_policy {
    // How a call reaches the inner policy: a field of the wrapper, or the
    // caller's own reach macro.
    (@reach [field $f:ident], ref $s:expr, $p:ident => $call:expr) => {{
        let $p = &$s.$f;
        $call
    }};
    (@reach [field $f:ident], mut $s:expr, $p:ident => $call:expr) => {{
        let $p = &mut $s.$f;
        $call
    }};
    (@reach $reach:ident, $($call:tt)*) => {
        $reach!($($call)*)
    };
    (field $f:ident; $($methods:tt)*) => {
        $crate::forward_policy!([field $f]; $($methods)*);
    };
    ($reach:tt; all) => {
        $crate::forward_policy!($reach; name, reconfigure, capabilities, round_request, segment_size,
            take_free, carve, insert_free, remove_free);
    };
    ($reach:tt; all_reclaim) => {
        $crate::forward_policy!($reach; release_for_oom, collect_garbage, kept_mapped,
            kept_mapped_keys, forget_empty_keys);
    };
    ($reach:tt; all_audit) => {
        $crate::forward_policy!($reach; indexed_blocks, check);
    };
    ($reach:tt; $($method:ident),+ $(,)?) => {
        $($crate::forward_policy!(@method $reach $method);)+
    };
    (@method $reach:tt name) => {
        #[inline]
        fn name(&self) -> &str {
            $crate::forward_policy!(@reach $reach, ref self, p => p.name())
        }
    };
    (@method $reach:tt reconfigure) => {
        #[inline]
        fn reconfigure(
            &mut self,
            cfg: &$crate::AllocatorConfig,
        ) -> ::core::result::Result<(), $crate::ConfigError> {
            $crate::forward_policy!(@reach $reach, mut self, p => p.reconfigure(cfg))
        }
    };
    (@method $reach:tt round_request) => {
        #[inline]
        fn round_request(&self, requested: u64, key: $crate::CacheKey) -> $crate::Request {
            $crate::forward_policy!(@reach $reach, ref self, p => p.round_request(requested, key))
        }
    };
    (@method $reach:tt segment_size) => {
        #[inline]
        fn segment_size(&self, req: &$crate::Request) -> u64 {
            $crate::forward_policy!(@reach $reach, ref self, p => p.segment_size(req))
        }
    };
    (@method $reach:tt take_free) => {
        #[inline]
        fn take_free(
            &mut self,
            heap: &$crate::Heap,
            req: &$crate::Request,
        ) -> ::core::option::Option<$crate::BlockId> {
            $crate::forward_policy!(@reach $reach, mut self, p => p.take_free(heap, req))
        }
    };
    (@method $reach:tt carve) => {
        #[inline]
        fn carve(
            &mut self,
            heap: &mut $crate::Heap,
            block: $crate::BlockId,
            req: &$crate::Request,
        ) -> $crate::BlockId {
            $crate::forward_policy!(@reach $reach, mut self, p => p.carve(heap, block, req))
        }
    };
    (@method $reach:tt insert_free) => {
        #[inline]
        fn insert_free(&mut self, heap: &mut $crate::Heap, block: $crate::BlockId) {
            $crate::forward_policy!(@reach $reach, mut self, p => p.insert_free(heap, block))
        }
    };
    (@method $reach:tt remove_free) => {
        #[inline]
        fn remove_free(&mut self, heap: &$crate::Heap, block: $crate::BlockId) {
            $crate::forward_policy!(@reach $reach, mut self, p => p.remove_free(heap, block))
        }
    };
    (@method $reach:tt release_for_oom) => {
        #[inline]
        fn release_for_oom(
            &mut self,
            heap: &$crate::Heap,
            req: &$crate::Request,
        ) -> $crate::OomRelease {
            $crate::forward_policy!(@reach $reach, mut self, p => p.release_for_oom(heap, req))
        }
    };
    (@method $reach:tt collect_garbage) => {
        #[inline]
        fn collect_garbage(
            &mut self,
            heap: &$crate::Heap,
            pressure: &$crate::Pressure,
        ) -> ::std::vec::Vec<$crate::SegmentId> {
            $crate::forward_policy!(@reach $reach, mut self, p => p.collect_garbage(heap, pressure))
        }
    };
    (@method $reach:tt capabilities) => {
        #[inline]
        fn capabilities(&self) -> $crate::Capabilities {
            $crate::forward_policy!(@reach $reach, ref self, p => p.capabilities())
        }
    };
    (@method $reach:tt forget_empty_keys) => {
        #[inline]
        fn forget_empty_keys(&mut self) {
            $crate::forward_policy!(@reach $reach, mut self, p => p.forget_empty_keys())
        }
    };
    (@method $reach:tt kept_mapped) => {
        #[inline]
        fn kept_mapped(&self, key: $crate::CacheKey) -> ::std::option::Option<(u64, u64)> {
            $crate::forward_policy!(@reach $reach, ref self, p => p.kept_mapped(key))
        }
    };
    (@method $reach:tt kept_mapped_keys) => {
        #[inline]
        fn kept_mapped_keys(&self) -> $crate::KeptKeys {
            $crate::forward_policy!(@reach $reach, ref self, p => p.kept_mapped_keys())
        }
    };
    (@method $reach:tt indexed_blocks) => {
        #[inline]
        fn indexed_blocks(&self) -> ::std::vec::Vec<$crate::BlockId> {
            $crate::forward_policy!(@reach $reach, ref self, p => p.indexed_blocks())
        }
    };
    (@method $reach:tt check) => {
        #[inline]
        fn check(&self, heap: &$crate::Heap) -> ::core::result::Result<(), ::std::string::String> {
            $crate::forward_policy!(@reach $reach, ref self, p => p.check(heap))
        }
    };
}
