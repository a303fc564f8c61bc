//! [`AnyPolicy`]: one of the compiled-in policies, chosen at run time from
//! the `policy:` key of the configuration string.

use alloc_core::{
    forward_policy, AllocatorConfig, BlockId, CacheKey, ConfigError, Engine, EngineOptions, Heap,
    MemoryBackend, Policy, Request, StreamBackend,
};

use crate::{policy_names, ALL_BASE_POLICIES, BASE_POLICIES, GC_AGE};
#[cfg(feature = "pytorch-bfc")]
use crate::{BfcSettings, PytorchBfc};
#[cfg(feature = "buddy")]
use crate::{Buddy, BuddySettings};
#[cfg(feature = "gc-age")]
use crate::{GcAge, GcAgeSettings};
#[cfg(feature = "size-class")]
use crate::{SizeClass, SizeClassSettings};

/// One of the compiled-in policies, chosen at run time.
#[derive(Debug)]
// An explicit tag byte: read with one load. Without it the variant is
// decoded from a niche in the first policy's fields, a few instructions on
// every forwarded call.
#[repr(u8)]
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
    ///
    /// A name this crate knows whose cargo feature is off is refused with
    /// the feature to enable; any other name with the compiled-in ones.
    ///
    /// ```
    /// use alloc_core::{AllocatorConfig, Policy};
    /// use alloc_policy::{policy_names, AnyPolicy};
    ///
    /// for name in policy_names() {
    ///     let cfg = AllocatorConfig::parse(&format!("policy:{name}"))?;
    ///     assert_eq!(AnyPolicy::from_config(&cfg)?.name(), name);
    /// }
    /// let cfg = AllocatorConfig::parse("policy:first-fit")?;
    /// let err = AnyPolicy::from_config(&cfg).unwrap_err();
    /// assert!(err.to_string().contains("compiled-in policies are"));
    /// # Ok::<(), alloc_core::ConfigError>(())
    /// ```
    pub fn from_config(cfg: &AllocatorConfig) -> Result<Self, ConfigError> {
        let name = cfg.policy.as_deref().unwrap_or(BASE_POLICIES[0]);
        // `part` of `name` is refused: either its feature is off or no
        // policy of this crate has that name (at that place).
        let refuse = |part: &str, known: &[&str]| {
            let reason = if known.contains(&part) {
                format!("policy `{part}` is not compiled in; enable cargo feature `{part}`")
            } else {
                format!("compiled-in policies are: {}", policy_names().join(", "))
            };
            ConfigError::InvalidValue {
                key: "policy".into(),
                value: alloc_core::config::excerpt(name),
                reason,
            }
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
            other => return Err(refuse(other, &ALL_BASE_POLICIES)),
        };
        #[cfg(feature = "pytorch-bfc")]
        let planner = matches!(base, AnyPolicy::PytorchBfc(_));
        #[cfg(not(feature = "pytorch-bfc"))]
        let planner = false;
        // Options of pytorch-bfc's placement: refused by the other policies.
        let placements = [
            (cfg.plan_layout, "plan_layout", "true".to_string()),
            (
                cfg.first_fit.is_some(),
                "first_fit_mb",
                (cfg.first_fit.unwrap_or(0) / alloc_core::MIB).to_string(),
            ),
        ];
        for (set, key, value) in placements {
            if set && !planner {
                return Err(ConfigError::InvalidValue {
                    key: key.into(),
                    value,
                    reason: format!(
                        "applies to policy `pytorch-bfc` only, not `{}`",
                        base.name()
                    ),
                });
            }
        }
        base.check_growth(cfg)?;
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
            Some(other) => Err(refuse(other, &[GC_AGE])),
        }
    }

    /// What `plan_layout` did so far: `None` unless the policy is
    /// `pytorch-bfc` (alone or inside `gc-age`) with `plan_layout` on.
    pub fn plan_stats(&self) -> Option<crate::layout_plan::PlanStats> {
        match self {
            #[cfg(feature = "pytorch-bfc")]
            AnyPolicy::PytorchBfc(p) => p.plan_stats(),
            #[cfg(feature = "gc-age")]
            AnyPolicy::GcAge(g) => g.inner().plan_stats(),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// An engine over `memory` and `streams` with the policy and engine
    /// options of `cfg`, as tests, examples and trace replay build one on the
    /// simulated device.
    ///
    /// ```
    /// use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, GIB};
    /// use alloc_policy::AnyPolicy;
    ///
    /// let cfg = AllocatorConfig::default(); // the first compiled-in policy
    /// let mut engine = AnyPolicy::engine(&cfg, SimMemory::new(GIB), SimStreams::new())?;
    /// let a = engine.malloc(1000, StreamId(0))?;
    /// assert!(a.size >= 1000);
    /// engine.free(a.addr)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn engine<M: MemoryBackend, S: StreamBackend>(
        cfg: &AllocatorConfig,
        memory: M,
        streams: S,
    ) -> Result<Engine<AnyPolicy, M, S>, ConfigError> {
        let policy = AnyPolicy::from_config(cfg)?;
        Ok(Engine::new(
            policy,
            memory,
            streams,
            EngineOptions::from(cfg),
        ))
    }
}

impl AnyPolicy {
    /// Refuses `expandable_segments` for a policy without growable segments.
    fn check_growth(&self, cfg: &AllocatorConfig) -> Result<(), ConfigError> {
        if cfg.expandable_segments && !self.capabilities().supports_growth {
            return Err(ConfigError::InvalidValue {
                key: "expandable_segments".into(),
                value: "true".into(),
                reason: format!(
                    "policy `{}` does not support growable segments",
                    self.name()
                ),
            });
        }
        Ok(())
    }
}

/// Reaches whichever policy is inside, for [`forward_policy!`] (`ref` and
/// `mut` calls alike: the match borrows as `self` is borrowed).
macro_rules! dispatch {
    ($mode:ident $self:expr, $p:ident => $call:expr) => {
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
    /// Refuses growable segments for a policy without them, then hands the
    /// settings to the policy inside.
    fn reconfigure(&mut self, cfg: &AllocatorConfig) -> Result<(), ConfigError> {
        self.check_growth(cfg)?;
        dispatch!(mut self, p => p.reconfigure(cfg))
    }
    // The three calls of a malloc's cached path: those of the policies
    // that are called, not inlined (buddy and gc-age), out of line with a
    // copy of the request and the plan returned field by field (see
    // `by_copy`), so that pytorch-bfc's and size-class's request stays in
    // registers (buddy pays for it with one call more).
    #[inline]
    fn plan(&self, requested: u64, key: CacheKey) -> Request {
        match self {
            #[cfg(feature = "gc-age")]
            AnyPolicy::GcAge(p) => {
                let (requested, size, pool, key) = by_copy::plan(p, requested, key);
                Request {
                    requested,
                    size,
                    pool,
                    key,
                }
            }
            #[allow(unreachable_patterns)]
            other => dispatch!(ref other, p => p.plan(requested, key)),
        }
    }
    #[inline]
    fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId> {
        match self {
            #[cfg(feature = "buddy")]
            AnyPolicy::Buddy(p) => by_copy::take_free(p, heap, *req),
            #[cfg(feature = "gc-age")]
            AnyPolicy::GcAge(p) => by_copy::take_free(p, heap, *req),
            #[allow(unreachable_patterns)]
            other => dispatch!(mut other, p => p.take_free(heap, req)),
        }
    }
    #[inline]
    fn take_carved(&mut self, heap: &mut Heap, req: &Request) -> Option<BlockId> {
        match self {
            #[cfg(feature = "buddy")]
            AnyPolicy::Buddy(p) => by_copy::take_carved(p, heap, *req),
            #[cfg(feature = "gc-age")]
            AnyPolicy::GcAge(p) => by_copy::take_carved(p, heap, *req),
            #[allow(unreachable_patterns)]
            other => dispatch!(mut other, p => p.take_carved(heap, req)),
        }
    }
    forward_policy!(dispatch; name, segment_size, carve,
        insert_free,
        remove_free, release_for_oom, collect_garbage, capabilities, kept_mapped, kept_mapped_keys,
        forget_empty_keys, indexed_blocks, check);
}

/// The calls of [`AnyPolicy`]'s cached path for the policies that take
/// the request's address in a call: out of line, each with a copy of the
/// request, so that the request of a malloc of the other policies stays in
/// registers. Passed the caller's request, such a call made every malloc
/// store it to the stack (and an inlined copy was forwarded to the call).
#[cfg(any(feature = "buddy", feature = "gc-age"))]
mod by_copy {
    use super::*;

    /// [`Policy::plan`], field by field: returned whole, the caller's
    /// request was its return slot.
    #[cfg(feature = "gc-age")]
    #[inline(never)]
    pub(super) fn plan<P: Policy>(
        p: &P,
        requested: u64,
        key: CacheKey,
    ) -> (u64, u64, alloc_core::PoolKind, CacheKey) {
        let req = p.plan(requested, key);
        (req.requested, req.size, req.pool, req.key)
    }

    /// [`Policy::take_free`] with its own request.
    #[inline(never)]
    pub(super) fn take_free<P: Policy>(p: &mut P, heap: &Heap, req: Request) -> Option<BlockId> {
        p.take_free(heap, &req)
    }

    /// [`Policy::take_carved`] with its own request.
    #[inline(never)]
    pub(super) fn take_carved<P: Policy>(
        p: &mut P,
        heap: &mut Heap,
        req: Request,
    ) -> Option<BlockId> {
        p.take_carved(heap, &req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error building the policy of `config` gives, as text.
    fn error_of(config: &str) -> String {
        let cfg = AllocatorConfig::parse(config).unwrap();
        AnyPolicy::from_config(&cfg).unwrap_err().to_string()
    }

    #[test]
    fn every_compiled_in_name_builds() {
        for name in policy_names() {
            let cfg = AllocatorConfig::parse(&format!("policy:{name}")).unwrap();
            assert_eq!(AnyPolicy::from_config(&cfg).unwrap().name(), name);
        }
    }

    #[test]
    fn a_policy_whose_feature_is_off_names_the_feature() {
        let off = ALL_BASE_POLICIES
            .iter()
            .filter(|base| !BASE_POLICIES.contains(base));
        for base in off {
            let err = error_of(&format!("policy:{base}"));
            let expected =
                format!("policy `{base}` is not compiled in; enable cargo feature `{base}`");
            assert!(err.contains(&expected), "{err}");
        }
        if !cfg!(feature = "gc-age") {
            let err = error_of(&format!("policy:{}+gc-age", BASE_POLICIES[0]));
            assert!(err.contains("enable cargo feature `gc-age`"), "{err}");
        }
    }

    #[test]
    fn unknown_names_list_the_compiled_in_policies() {
        let default = BASE_POLICIES[0];
        for name in ["first-fit", "gc-age", &format!("{default}+buddy")] {
            let err = error_of(&format!("policy:{name}"));
            assert!(
                err.contains("compiled-in policies are") && err.contains(default),
                "{err}"
            );
        }
    }
}
