//! [`AnyPolicy`]: one of the compiled-in policies, chosen at run time from
//! the `policy:` key of the configuration string.

use alloc_core::config::{Config, GarbageCollection, PolicyConfig, PolicyKind};
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
            PolicyConfig::PytorchBfc(bfc) => AnyPolicy::PytorchBfc(PytorchBfc::new(
                BfcSettings::new(bfc, cfg.engine.segments.expandable()),
            )),
            #[cfg(feature = "buddy")]
            PolicyConfig::Buddy => AnyPolicy::Buddy(Buddy::new(BuddySettings::default())),
            #[cfg(feature = "size-class")]
            PolicyConfig::SizeClass(slabs) => {
                AnyPolicy::SizeClass(SizeClass::new(SizeClassSettings::from(slabs)))
            }
            #[allow(unreachable_patterns)]
            other => return Err(not_compiled_in(other.kind().name(), &cfg.policy_name())),
        };
        match cfg.gc {
            #[cfg(feature = "gc-age")]
            Some(GarbageCollection::ByAge { threshold }) => Ok(AnyPolicy::GcAge(Box::new(
                GcAge::new(base, GcAgeSettings::with_threshold(threshold)),
            ))),
            #[cfg(not(feature = "gc-age"))]
            Some(GarbageCollection::ByAge { .. }) => {
                Err(not_compiled_in(GC_AGE, &cfg.policy_name()))
            }
            _ => Ok(base),
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
        return Err(refuse(base, &ALL_BASE_POLICIES));
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
}
