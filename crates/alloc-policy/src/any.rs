//! [`AnyPolicy`]: one of the compiled-in policies, chosen at run time from
//! the `policy:` key of the configuration string, with the age-based
//! collector when the name ends in `+gc-age`.

use alloc_core::config::{Config, GarbageCollection, PolicyConfig, PolicyKind};
use alloc_core::{
    forward_policy, AllocatorConfig, Audit, ConfigError, Engine, EngineOptions, Heap,
    MemoryBackend, Policy, Pressure, Reclaim, SegmentId, StreamBackend,
};

use crate::{policy_names, BasePolicy, ALL_BASE_POLICIES, BASE_POLICIES, GC_AGE};
#[cfg(feature = "pytorch-bfc")]
use crate::{BfcSettings, PytorchBfc};
#[cfg(feature = "buddy")]
use crate::{Buddy, BuddySettings};
#[cfg(feature = "size-class")]
use crate::{SizeClass, SizeClassSettings};
#[cfg(feature = "gc-age")]
use crate::{GcAge, GcAgeSettings};

/// One of the compiled-in policies, chosen at run time: a base policy's
/// placement, and its collector or the age-based one before it.
#[derive(Debug)]
pub struct AnyPolicy {
    /// The base policy: placement, and its own reclaim.
    base: BasePolicy,
    /// The age-based collector, for `<base>+gc-age`.
    #[cfg(feature = "gc-age")]
    gc: Option<GcAge>,
}

impl AnyPolicy {
    /// Builds the policy named by `cfg.policy` (`<base>` or `<base>+gc-age`),
    /// or the default policy (the first compiled in) when unnamed, from the
    /// checked form of `cfg` ([`AllocatorConfig::typed_or`]).
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
        AnyPolicy::from_typed(&AnyPolicy::typed(cfg)?)
    }

    /// The checked form of `cfg` for this build
    /// ([`AllocatorConfig::typed_or`]): a policy name this build runs, the
    /// first compiled-in policy when it names none.
    ///
    /// ```
    /// use alloc_core::AllocatorConfig;
    /// use alloc_policy::AnyPolicy;
    ///
    /// let cfg = AllocatorConfig::parse("max_split_size_mb:64")?;
    /// assert_eq!(AnyPolicy::typed(&cfg)?.policy_name(), alloc_policy::BASE_POLICIES[0]);
    /// # Ok::<(), alloc_core::ConfigError>(())
    /// ```
    pub fn typed(cfg: &AllocatorConfig) -> Result<Config, ConfigError> {
        if let Some(name) = &cfg.policy {
            check_name(name)?;
        }
        cfg.typed_or(DEFAULT_POLICY)
    }

    /// Builds the policy of a typed configuration, with its own settings
    /// and, for [`GarbageCollection::ByAge`], inside `gc-age`. Refused when
    /// that policy's cargo feature is off, or when the configuration, written
    /// in code, fails the parser's checks ([`Config::check`]).
    ///
    /// ```
    /// use alloc_core::config::{Config, GarbageCollection, PolicyConfig, SizeClassConfig};
    /// use alloc_core::Policy;
    /// use alloc_policy::AnyPolicy;
    ///
    /// let cfg = Config {
    ///     policy: PolicyConfig::SizeClass(SizeClassConfig { idle_slab_limit: Some(0) }),
    ///     gc: Some(GarbageCollection::ByAge { threshold: Some(0.5) }),
    ///     ..Config::default()
    /// };
    /// match AnyPolicy::from_typed(&cfg) {
    ///     Ok(policy) => assert_eq!(policy.name(), "size-class+gc-age"),
    ///     // A build without `size-class` or `gc-age` names the feature.
    ///     Err(e) => assert!(e.to_string().contains("enable cargo feature"), "{e}"),
    /// }
    /// ```
    pub fn from_typed(cfg: &Config) -> Result<Self, ConfigError> {
        cfg.check()?;
        let base = match &cfg.policy {
            #[cfg(feature = "pytorch-bfc")]
            PolicyConfig::PytorchBfc(bfc) => BasePolicy::PytorchBfc(PytorchBfc::new(
                BfcSettings::new(bfc, cfg.engine.segments.expandable()),
            )),
            #[cfg(feature = "buddy")]
            PolicyConfig::Buddy => BasePolicy::Buddy(Buddy::new(BuddySettings::default())),
            #[cfg(feature = "size-class")]
            PolicyConfig::SizeClass(slabs) => {
                BasePolicy::SizeClass(SizeClass::new(SizeClassSettings::from(slabs)))
            }
            #[allow(unreachable_patterns)]
            other => return Err(not_compiled_in(other.kind().name(), &cfg.policy_name())),
        };
        #[cfg(feature = "gc-age")]
        let gc = match cfg.gc {
            Some(GarbageCollection::ByAge { threshold }) => {
                Some(GcAge::new(GcAgeSettings::with_threshold(threshold)))
            }
            _ => None,
        };
        #[cfg(not(feature = "gc-age"))]
        if let Some(GarbageCollection::ByAge { .. }) = cfg.gc {
            return Err(not_compiled_in(GC_AGE, &cfg.policy_name()));
        }
        Ok(AnyPolicy {
            base,
            #[cfg(feature = "gc-age")]
            gc,
        })
    }

    /// The base policy (placement, and its own reclaim).
    pub fn base(&self) -> &BasePolicy {
        &self.base
    }

    /// The age-based collector, for a `<base>+gc-age` policy.
    #[cfg(feature = "gc-age")]
    pub fn gc_age(&self) -> Option<&GcAge> {
        self.gc.as_ref()
    }

    /// What `plan_layout` did so far: `None` unless the policy is
    /// `pytorch-bfc` (alone or with `gc-age`) with `plan_layout` on.
    pub fn plan_stats(&self) -> Option<crate::layout_plan::PlanStats> {
        match &self.base {
            #[cfg(feature = "pytorch-bfc")]
            BasePolicy::PytorchBfc(p) => p.plan_stats(),
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
        AnyPolicy::typed_engine(&AnyPolicy::typed(cfg)?, memory, streams)
    }

    /// An engine over `memory` and `streams` with the policy and engine
    /// options of a checked configuration.
    pub fn typed_engine<M: MemoryBackend, S: StreamBackend>(
        cfg: &Config,
        memory: M,
        streams: S,
    ) -> Result<Engine<AnyPolicy, M, S>, ConfigError> {
        let policy = AnyPolicy::from_typed(cfg)?;
        Ok(Engine::new(
            policy,
            memory,
            streams,
            EngineOptions::from(cfg),
        ))
    }
}

/// The policy of a configuration that names none: the first compiled in
/// (the first of [`BASE_POLICIES`]).
const DEFAULT_POLICY: PolicyKind = if cfg!(feature = "pytorch-bfc") {
    PolicyKind::PytorchBfc
} else if cfg!(feature = "buddy") {
    PolicyKind::Buddy
} else {
    PolicyKind::SizeClass
};

/// Refuses a policy name this build cannot run: one this crate knows
/// whose cargo feature is off with the feature to enable, any other with
/// the compiled-in names.
fn check_name(name: &str) -> Result<(), ConfigError> {
    let (base, adaptor) = match name.split_once('+') {
        Some((base, adaptor)) => (base, Some(adaptor)),
        None => (name, None),
    };
    let refuse = |part: &str, known: &[&str]| {
        if known.contains(&part) {
            not_compiled_in(part, name)
        } else {
            let names = policy_names();
            let suggestion = alloc_core::config::closest(name, names.iter().map(String::as_str))
                .map_or_else(String::new, |s| format!("; did you mean `{s}`?"));
            ConfigError::InvalidValue {
                key: "policy".into(),
                value: alloc_core::config::excerpt(name),
                reason: format!("compiled-in policies are: {}{suggestion}", names.join(", ")),
            }
        }
    };
    if !BASE_POLICIES.contains(&base) {
        return Err(refuse(base, ALL_BASE_POLICIES));
    }
    match adaptor {
        None => Ok(()),
        Some(GC_AGE) if cfg!(feature = "gc-age") => Ok(()),
        Some(other) => Err(refuse(other, &[GC_AGE])),
    }
}

/// `part` of the policy `name` is a policy of this crate whose cargo
/// feature is off.
fn not_compiled_in(part: &str, name: &str) -> ConfigError {
    ConfigError::InvalidValue {
        key: "policy".into(),
        value: alloc_core::config::excerpt(name),
        reason: format!("policy `{part}` is not compiled in; enable cargo feature `{part}`"),
    }
}


impl Policy for BasePolicy {
    // buddy's `take_free` and `carve`, called rather than inlined, take a
    // copy of the request (see `by_copy`), so that pytorch-bfc's and
    // size-class's request stays in registers (buddy pays for it with a
    // copy).
    #[inline]
    fn take_free(&mut self, heap: &Heap, req: &alloc_core::Request) -> Option<alloc_core::BlockId> {
        match self {
            #[cfg(feature = "buddy")]
            BasePolicy::Buddy(p) => by_copy::take_free(p, heap, *req),
            #[allow(unreachable_patterns)]
            other => dispatch!(mut other, p => p.take_free(heap, req)),
        }
    }
    // Always inlined: with `#[inline]` alone the carve of a cached block
    // became a call of its own on every malloc (docs/benchmarks.md).
    #[inline(always)]
    fn carve(
        &mut self,
        heap: &mut Heap,
        block: alloc_core::BlockId,
        req: &alloc_core::Request,
    ) -> alloc_core::BlockId {
        match self {
            #[cfg(feature = "buddy")]
            BasePolicy::Buddy(p) => by_copy::carve(p, heap, block, *req),
            #[allow(unreachable_patterns)]
            other => dispatch!(mut other, p => p.carve(heap, block, req)),
        }
    }
    forward_policy!(dispatch; name, reconfigure, capabilities, round_request, segment_size, insert_free,
        remove_free);
}

impl Reclaim for BasePolicy {
    forward_policy!(dispatch; all_reclaim);
}

impl Audit for BasePolicy {
    forward_policy!(dispatch; all_audit);
}

/// Reaches the base policy of an [`AnyPolicy`], for [`forward_policy!`].
macro_rules! base {
    (ref $any:expr, $p:ident => $call:expr) => {
        dispatch!(ref &$any.base, $p => $call)
    };
    (mut $any:expr, $p:ident => $call:expr) => {
        dispatch!(mut &mut $any.base, $p => $call)
    };
}

impl Policy for AnyPolicy {
    /// `<base>`, or `<base>+gc-age`.
    fn name(&self) -> &str {
        #[cfg(feature = "gc-age")]
        if self.gc.is_some() {
            return self.base.name_with_gc_age();
        }
        self.base.name()
    }
    /// Refuses growable segments for a policy without them, then hands the
    /// settings to the base policy and the collector.
    fn reconfigure(&mut self, cfg: &AllocatorConfig) -> Result<(), ConfigError> {
        alloc_core::check_growth(self, cfg)?;
        self.base.reconfigure(cfg)?;
        #[cfg(feature = "gc-age")]
        if let Some(gc) = &mut self.gc {
            gc.reconfigure(cfg);
        }
        Ok(())
    }
    // The calls of a malloc through `BasePolicy`'s, which copy buddy's
    // request.
    #[inline]
    fn take_free(&mut self, heap: &Heap, req: &alloc_core::Request) -> Option<alloc_core::BlockId> {
        self.base.take_free(heap, req)
    }
    #[inline(always)]
    fn carve(
        &mut self,
        heap: &mut Heap,
        block: alloc_core::BlockId,
        req: &alloc_core::Request,
    ) -> alloc_core::BlockId {
        self.base.carve(heap, block, req)
    }
    forward_policy!(base; capabilities, round_request, segment_size, insert_free, remove_free);
}

impl Reclaim for AnyPolicy {
    /// The age-based collector first, if any, then the base policy's own on
    /// the pressure left.
    fn collect_garbage(&mut self, heap: &Heap, pressure: &Pressure) -> Vec<SegmentId> {
        #[cfg(feature = "gc-age")]
        if let Some(gc) = &mut self.gc {
            return gc.collect_then(heap, pressure, &mut self.base);
        }
        self.base.collect_garbage(heap, pressure)
    }
    forward_policy!(base; release_for_oom, kept_mapped, kept_mapped_keys, forget_empty_keys);
}

impl Audit for AnyPolicy {
    forward_policy!(base; all_audit);
}

/// The calls of [`BasePolicy`]'s cached path for the policies that take
/// the request's address in a call: out of line, each with a copy of the
/// request, so that the request of a malloc of the other policies stays in
/// registers. Passed the caller's request, such a call made every malloc
/// store it to the stack (and an inlined copy was forwarded to the call).
#[cfg(feature = "buddy")]
mod by_copy {
    use alloc_core::{BlockId, Heap, Policy, Request};

    /// [`Policy::take_free`] with its own request.
    #[inline(never)]
    pub(super) fn take_free<P: Policy>(p: &mut P, heap: &Heap, req: Request) -> Option<BlockId> {
        p.take_free(heap, &req)
    }

    /// [`Policy::carve`] with its own request.
    #[inline(never)]
    pub(super) fn carve<P: Policy>(
        p: &mut P,
        heap: &mut Heap,
        block: BlockId,
        req: Request,
    ) -> BlockId {
        p.carve(heap, block, &req)
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
    fn a_misspelt_policy_gets_a_suggestion() {
        let default = BASE_POLICIES[0];
        let name = &default[..default.len() - 1];
        let err = error_of(&format!("policy:{name}"));
        let meant = format!("did you mean `{default}`?");
        assert!(err.contains(&meant), "{err}");
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

    #[cfg(all(feature = "pytorch-bfc", feature = "gc-age"))]
    #[test]
    fn composes_with_pytorch_bfc_in_any_policy() {
        use alloc_core::{Engine, EngineOptions, SimMemory, SimStreams, StreamId, GIB, MIB};
        let cfg =
            AllocatorConfig::parse("policy:pytorch-bfc+gc-age,garbage_collection_threshold:0.5")
                .unwrap();
        let policy = AnyPolicy::from_config(&cfg).unwrap();
        assert_eq!(policy.name(), "pytorch-bfc+gc-age");
        let mut e = Engine::new(
            policy,
            SimMemory::new(GIB),
            SimStreams::new(),
            EngineOptions::from(&cfg),
        );
        e.set_memory_fraction(0.5).unwrap();
        // A 20 MiB segment whose 2 MiB blocks tick the large pool's clock.
        let y = e.malloc(2 * MIB, StreamId(0)).unwrap();
        let a = e.malloc(140 * MIB, StreamId(0)).unwrap();
        let b = e.malloc(150 * MIB, StreamId(0)).unwrap();
        e.free(a.addr).unwrap();
        e.malloc(2 * MIB, StreamId(0)).unwrap();
        e.free(b.addr).unwrap();
        // 310 MiB reserved > 256 MiB: the next new segment (a small one)
        // releases `a`, the older, which is enough.
        e.malloc(1000, StreamId(0)).unwrap();
        let now: Vec<u64> = e.snapshot().segments.iter().map(|s| s.address).collect();
        assert_eq!(e.stats().num_device_free, 1);
        assert!(now.contains(&b.addr));
        assert!(!now.contains(&a.addr), "the oldest idle segment went back");
        assert!(now.contains(&y.addr));
        if let Err(msg) = e.validate() {
            panic!("{msg}");
        }
    }
}
