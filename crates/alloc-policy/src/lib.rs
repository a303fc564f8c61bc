//! # alloc-policy
//!
//! Allocation policies for the `alloc-core` engine, each behind a cargo
//! feature (all on by default):
//!
//! - `pytorch-bfc` ([`PytorchBfc`]): PyTorch 2.x's best fit with coalescing.
//! - `buddy` ([`Buddy`]): a binary buddy system.
//! - `size-class` ([`SizeClass`]): per-class free lists carved from slabs.
//! - `gc-age` ([`GcAge`]): garbage collection by age, over any policy.
//!
//! [`AnyPolicy`] chooses among the compiled-in policies at run time from the
//! `policy:` key of the configuration string.

#![warn(missing_docs)]

#[cfg(feature = "buddy")]
pub mod buddy;
pub mod free_index;
#[cfg(feature = "gc-age")]
pub mod gc_age;
#[cfg(feature = "pytorch-bfc")]
pub mod pytorch_bfc;
#[cfg(feature = "size-class")]
pub mod size_class;

#[cfg(feature = "buddy")]
pub use buddy::{Buddy, BuddySettings};
#[cfg(feature = "gc-age")]
pub use gc_age::{GcAge, GcAgeSettings};
#[cfg(feature = "pytorch-bfc")]
pub use pytorch_bfc::{BfcSettings, PytorchBfc};
#[cfg(feature = "size-class")]
pub use size_class::{SizeClass, SizeClassSettings};

use alloc_core::{
    AllocatorConfig, BlockId, ConfigError, Heap, OomRelease, Policy, Pressure, Request, SegmentId,
    StreamId,
};

/// Base policy names compiled into this build, the default first.
pub const BASE_POLICIES: &[&str] = &[
    #[cfg(feature = "pytorch-bfc")]
    "pytorch-bfc",
    #[cfg(feature = "buddy")]
    "buddy",
    #[cfg(feature = "size-class")]
    "size-class",
];

/// Every policy name accepted by [`AnyPolicy::from_config`] in this build:
/// each base policy, and with `gc-age` each base policy with `+gc-age`.
pub fn policy_names() -> Vec<String> {
    let mut names: Vec<String> = BASE_POLICIES.iter().map(|s| s.to_string()).collect();
    if cfg!(feature = "gc-age") {
        names.extend(BASE_POLICIES.iter().map(|s| format!("{s}+gc-age")));
    }
    names
}

/// One of the compiled-in policies, chosen at run time.
#[derive(Debug)]
pub enum AnyPolicy {
    /// PyTorch's best fit with coalescing.
    #[cfg(feature = "pytorch-bfc")]
    PytorchBfc(PytorchBfc),
    /// Binary buddy.
    #[cfg(feature = "buddy")]
    Buddy(Buddy),
    /// Size-class free lists.
    #[cfg(feature = "size-class")]
    SizeClass(SizeClass),
    /// Garbage collection by age over another policy.
    #[cfg(feature = "gc-age")]
    GcAge(Box<GcAge<AnyPolicy>>),
}

impl AnyPolicy {
    /// Builds the policy named by `cfg.policy` (`<base>` or `<base>+gc-age`),
    /// or the default policy when unnamed.
    pub fn from_config(cfg: &AllocatorConfig) -> Result<Self, ConfigError> {
        let name = cfg
            .policy
            .as_deref()
            .unwrap_or_else(|| BASE_POLICIES.first().copied().unwrap_or(""));
        let unknown = || ConfigError::InvalidValue {
            key: "policy".into(),
            value: name.into(),
            reason: format!("compiled-in policies are: {}", policy_names().join(", ")),
        };
        let (base, adaptor) = match name.split_once('+') {
            Some((base, adaptor)) => (base, Some(adaptor)),
            None => (name, None),
        };
        let base = match base {
            #[cfg(feature = "pytorch-bfc")]
            "pytorch-bfc" => AnyPolicy::PytorchBfc(PytorchBfc::new(BfcSettings::from(cfg))),
            #[cfg(feature = "buddy")]
            "buddy" => AnyPolicy::Buddy(Buddy::new(BuddySettings::from(cfg))),
            #[cfg(feature = "size-class")]
            "size-class" => AnyPolicy::SizeClass(SizeClass::new(SizeClassSettings::from(cfg))),
            _ => return Err(unknown()),
        };
        if cfg.expandable_segments && !base.supports_growth() {
            return Err(ConfigError::InvalidValue {
                key: "expandable_segments".into(),
                value: "true".into(),
                reason: format!(
                    "policy `{}` does not support growable segments",
                    base.name()
                ),
            });
        }
        #[cfg(feature = "size-class")]
        let slabs = matches!(base, AnyPolicy::SizeClass(_));
        #[cfg(not(feature = "size-class"))]
        let slabs = false;
        if let (Some(limit), false) = (cfg.idle_slab_limit, slabs) {
            return Err(ConfigError::InvalidValue {
                key: "idle_slab_limit_mb".into(),
                value: (limit / alloc_core::MIB).to_string(),
                reason: format!("applies to policy `size-class` only, not `{}`", base.name()),
            });
        }
        match adaptor {
            None => Ok(base),
            #[cfg(feature = "gc-age")]
            Some("gc-age") => Ok(AnyPolicy::GcAge(Box::new(GcAge::new(
                base,
                GcAgeSettings::from(cfg),
            )))),
            Some(_) => Err(unknown()),
        }
    }
}

/// Forwards a call to whichever policy is inside.
macro_rules! dispatch {
    ($self:expr, $p:ident => $call:expr) => {
        match $self {
            #[cfg(feature = "pytorch-bfc")]
            AnyPolicy::PytorchBfc($p) => $call,
            #[cfg(feature = "buddy")]
            AnyPolicy::Buddy($p) => $call,
            #[cfg(feature = "size-class")]
            AnyPolicy::SizeClass($p) => $call,
            #[cfg(feature = "gc-age")]
            AnyPolicy::GcAge($p) => $call,
        }
    };
}

impl Policy for AnyPolicy {
    fn name(&self) -> &str {
        dispatch!(self, p => p.name())
    }
    #[inline]
    fn plan(&self, requested: u64, stream: StreamId) -> Request {
        dispatch!(self, p => p.plan(requested, stream))
    }
    fn segment_size(&self, req: &Request) -> u64 {
        dispatch!(self, p => p.segment_size(req))
    }
    #[inline]
    fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId> {
        dispatch!(self, p => p.take_free(heap, req))
    }
    #[inline]
    fn carve(&mut self, heap: &mut Heap, block: BlockId, req: &Request) -> BlockId {
        dispatch!(self, p => p.carve(heap, block, req))
    }
    #[inline]
    fn insert_free(&mut self, heap: &mut Heap, block: BlockId) {
        dispatch!(self, p => p.insert_free(heap, block))
    }
    fn remove_free(&mut self, heap: &Heap, block: BlockId) {
        dispatch!(self, p => p.remove_free(heap, block))
    }
    fn release_for_oom(&mut self, heap: &Heap, req: &Request) -> OomRelease {
        dispatch!(self, p => p.release_for_oom(heap, req))
    }
    fn collect_garbage(&mut self, heap: &Heap, pressure: &Pressure) -> Vec<SegmentId> {
        dispatch!(self, p => p.collect_garbage(heap, pressure))
    }
    fn coalesces(&self) -> bool {
        dispatch!(self, p => p.coalesces())
    }
    fn oversize_threshold(&self) -> u64 {
        dispatch!(self, p => p.oversize_threshold())
    }
    fn supports_growth(&self) -> bool {
        dispatch!(self, p => p.supports_growth())
    }
    fn indexed_blocks(&self) -> Vec<BlockId> {
        dispatch!(self, p => p.indexed_blocks())
    }
    fn check(&self, heap: &Heap) -> Result<(), String> {
        dispatch!(self, p => p.check(heap))
    }
}
