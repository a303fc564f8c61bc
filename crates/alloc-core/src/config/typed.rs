//! The checked form of a configuration: engine options, one policy's own
//! settings and optional garbage collection, each a type of its own, so
//! that a combination the allocator cannot run cannot be written down.
//!
//! The text parser fills the flat [`AllocatorConfig`] key by key (keys come
//! in any order, the policy's name may come last); [`Config::parse`] and
//! [`AllocatorConfig::typed`] then check it as a whole and give this form.
//!
//! What the types rule out (these do not compile):
//!
//! ```compile_fail,E0559
//! use alloc_core::config::Segments;
//! // Unmapping free pages exists only inside expandable segments.
//! let s = Segments::Fixed { unmap: None };
//! ```
//!
//! ```compile_fail,E0559
//! use alloc_core::config::PolicyConfig;
//! // `buddy` has no split limit: `max_split_size_mb` is pytorch-bfc's.
//! let p = PolicyConfig::Buddy { max_split_size: 64 << 20 };
//! ```
//!
//! ```compile_fail,E0560
//! use alloc_core::config::{PolicyConfig, SizeClassConfig};
//! // A layout plan is pytorch-bfc's placement, not size-class's.
//! let p = PolicyConfig::SizeClass(SizeClassConfig { idle_slab_limit: None, plan_layout: true });
//! ```
//!
//! What the types cannot say, the parser refuses with the key and the
//! policy:
//!
//! ```
//! use alloc_core::config::Config;
//!
//! let e = Config::parse("policy:buddy,plan_layout:true").unwrap_err();
//! assert!(e.to_string().contains("`plan_layout`"), "{e}");
//! assert!(e.to_string().contains("applies to policy `pytorch-bfc` only, not `buddy`"), "{e}");
//! let e = Config::parse("policy:size_class").unwrap_err();
//! assert!(e.to_string().contains("did you mean `size-class`?"), "{e}");
//! ```

use super::{
    closest, invalid, AllocatorConfig, ConfigError, DEFAULT_UNMAP_PAGE, ROUNDUP_INTERVALS,
};
use crate::budget::MemoryBudget;
use crate::page_layout::PageLayout;

/// A whole configuration, checked.
///
/// ```
/// use alloc_core::config::{Config, GarbageCollection, PolicyConfig, Segments};
///
/// let cfg = Config::parse("policy:size-class+gc-age,idle_slab_limit_mb:512,stream_wait_reuse:True")?;
/// assert!(matches!(cfg.policy, PolicyConfig::SizeClass(ref s) if s.idle_slab_limit == Some(512 << 20)));
/// assert_eq!(cfg.gc, Some(GarbageCollection::ByAge { threshold: None }));
/// assert_eq!(cfg.engine.segments, Segments::Fixed);
/// assert!(cfg.engine.stream_wait_reuse);
/// assert_eq!(cfg.policy_name(), "size-class+gc-age");
/// # Ok::<(), alloc_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Config {
    /// What the engine does whatever the policy.
    pub engine: EngineConfig,
    /// The policy and its own settings.
    pub policy: PolicyConfig,
    /// Garbage collection of cached segments; `None`: segments stay cached
    /// until memory runs short or the cache is emptied.
    pub gc: Option<GarbageCollection>,
}

/// Engine behaviour that is not policy.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineConfig {
    /// Ordinary or growable segments.
    pub segments: Segments,
    /// Out of room, reuse blocks still awaiting other streams' events by
    /// making the allocating stream wait on those events instead of the
    /// host waiting for every stream (`stream_wait_reuse`).
    pub stream_wait_reuse: bool,
    /// During a CUDA graph capture, reuse a block other streams used once
    /// the capture shows they joined the allocating one
    /// (`graph_capture_record_stream_reuse`).
    pub graph_capture_record_stream_reuse: bool,
    /// Limit on reserved memory as a fraction of the device's capacity
    /// (`per_process_memory_fraction`), applied by whoever creates the
    /// allocator; `None`: no limit.
    pub per_process_memory_fraction: Option<f64>,
}

/// How segments are made.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Segments {
    /// One device allocation per segment (PyTorch's default).
    #[default]
    Fixed,
    /// Segments grown on the virtual-memory API (`expandable_segments`);
    /// only `pytorch-bfc` places blocks in them.
    Expandable {
        /// Free pages unmapped and reused before more is mapped
        /// (`unmap_free_pages`); `None`: mapped pages stay mapped.
        unmap: Option<UnmapFreePages>,
    },
}

impl Segments {
    /// Whether segments grow.
    pub fn expandable(&self) -> bool {
        matches!(self, Segments::Expandable { .. })
    }

    /// The page-unmapping settings, when free pages are unmapped.
    pub fn unmap(&self) -> Option<&UnmapFreePages> {
        match self {
            Segments::Expandable { unmap } => unmap.as_ref(),
            Segments::Fixed => None,
        }
    }
}

/// Free pages of growable segments unmapped before more memory is mapped.
#[derive(Debug, Clone, PartialEq)]
pub struct UnmapFreePages {
    /// The large pool's pages (`unmap_page_mb`, default
    /// [`DEFAULT_UNMAP_PAGE`]).
    pub pages: PageLayout,
    /// Unmap moved pages' old addresses on a worker thread
    /// (`unmap_worker`).
    pub worker: bool,
    /// Bytes freed in a growable segment after which a free records a mark
    /// on its stream (`idle_mark_mb`; 0: marks only where pages move).
    pub idle_mark: u64,
    /// Serve a large allocation that would pass the level with another
    /// stream's free block over idle pages (`lend_idle_blocks`).
    pub lend_idle: bool,
    /// Below this budget the heap grows without unmapping
    /// (`memory_budget_mb`, `memory_budget_fraction`).
    pub budget: Option<MemoryBudget>,
}

impl Default for UnmapFreePages {
    fn default() -> Self {
        UnmapFreePages {
            pages: PageLayout::uniform(DEFAULT_UNMAP_PAGE),
            worker: false,
            idle_mark: 0,
            lend_idle: false,
            budget: None,
        }
    }
}

/// The base policy and the settings that are its alone.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyConfig {
    /// PyTorch's best fit with coalescing (the default).
    PytorchBfc(BfcConfig),
    /// Binary buddy: no settings of its own.
    Buddy,
    /// Size-class free lists.
    SizeClass(SizeClassConfig),
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::PytorchBfc(BfcConfig::default())
    }
}

impl PolicyConfig {
    /// Which policy this is.
    pub fn kind(&self) -> PolicyKind {
        match self {
            PolicyConfig::PytorchBfc(_) => PolicyKind::PytorchBfc,
            PolicyConfig::Buddy => PolicyKind::Buddy,
            PolicyConfig::SizeClass(_) => PolicyKind::SizeClass,
        }
    }
}

/// The settings of `pytorch-bfc`: PyTorch's rounding and splitting, and
/// our placements inside growable segments.
#[derive(Debug, Clone, PartialEq)]
pub struct BfcConfig {
    /// Blocks at or above this size are never split (`max_split_size_mb`;
    /// `u64::MAX`: no limit).
    pub max_split_size: u64,
    /// How far above its size an oversize block may serve a request
    /// (`max_non_split_rounding_mb`).
    pub max_non_split_rounding: u64,
    /// Divisions per power-of-two interval (`roundup_power2_divisions`).
    pub roundup_power2_divisions: [u32; ROUNDUP_INTERVALS],
    /// Follow a layout learnt from the repeating steps (`plan_layout`;
    /// needs expandable segments).
    pub plan_layout: bool,
    /// Requests of at least this many bytes take the lowest free block
    /// that fits (`first_fit_mb`; needs expandable segments).
    pub first_fit: Option<u64>,
}

impl Default for BfcConfig {
    fn default() -> Self {
        AllocatorConfig::default().bfc()
    }
}

/// The settings of `size-class`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SizeClassConfig {
    /// Bytes of wholly idle slabs kept cached (`idle_slab_limit_mb`);
    /// `None`: idle slabs are reset and kept until memory runs short.
    pub idle_slab_limit: Option<u64>,
}

/// Garbage collection of cached segments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GarbageCollection {
    /// The policy's own collector, once reserved memory passes this
    /// fraction of the limit (`garbage_collection_threshold`, as PyTorch).
    Threshold(f64),
    /// The `gc-age` adaptor over the policy (`policy:<base>+gc-age`):
    /// idle segments oldest first, past `threshold` when given
    /// (`garbage_collection_threshold`), else past the adaptor's default.
    ByAge {
        /// `garbage_collection_threshold`, when set.
        threshold: Option<f64>,
    },
}

impl GarbageCollection {
    /// `garbage_collection_threshold`, when set.
    pub fn threshold(&self) -> Option<f64> {
        match *self {
            GarbageCollection::Threshold(t) => Some(t),
            GarbageCollection::ByAge { threshold } => threshold,
        }
    }
}

/// A base policy, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// `pytorch-bfc`.
    PytorchBfc,
    /// `buddy`.
    Buddy,
    /// `size-class`.
    SizeClass,
}

/// The adaptor suffix that adds garbage collection by age (`+gc-age`).
pub const GC_AGE_SUFFIX: &str = "+gc-age";

impl PolicyKind {
    /// Every base policy, PyTorch's (the default) first.
    pub const ALL: [PolicyKind; 3] = [
        PolicyKind::PytorchBfc,
        PolicyKind::Buddy,
        PolicyKind::SizeClass,
    ];

    /// The name in `policy:` (and of the cargo feature that compiles it in).
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::PytorchBfc => "pytorch-bfc",
            PolicyKind::Buddy => "buddy",
            PolicyKind::SizeClass => "size-class",
        }
    }

    /// The base policy called `name`, if any.
    pub fn from_name(name: &str) -> Option<PolicyKind> {
        PolicyKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// A `policy:` value read: the base and whether `gc-age` wraps it.
fn read_policy(name: &str) -> Result<(PolicyKind, bool), ConfigError> {
    let (base, by_age) = match name.strip_suffix(GC_AGE_SUFFIX) {
        Some(base) => (base, true),
        None => (name, false),
    };
    match PolicyKind::from_name(base) {
        Some(kind) => Ok((kind, by_age)),
        None => {
            let names = PolicyKind::ALL
                .iter()
                .flat_map(|k| [k.name().to_string(), format!("{}{GC_AGE_SUFFIX}", k.name())]);
            let names: Vec<String> = names.collect();
            let suggestion = closest(name, names.iter().map(String::as_str))
                .map_or_else(String::new, |s| format!("; did you mean `{s}`?"));
            let bases: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.name()).collect();
            Err(invalid(
                "policy",
                name,
                &format!(
                    "policies are {}, each alone or as `<policy>{GC_AGE_SUFFIX}`{suggestion}",
                    bases.join(", ")
                ),
            ))
        }
    }
}

/// A policy-specific option given to another policy.
fn wrong_policy(key: &str, value: &str, owner: PolicyKind, given: PolicyKind) -> ConfigError {
    invalid(
        key,
        value,
        &format!(
            "applies to policy `{}` only, not `{}`",
            owner.name(),
            given.name()
        ),
    )
}

impl Config {
    /// Parses a configuration string (PyTorch's syntax, setting names
    /// included) into its checked form; a string that names no policy gets
    /// PyTorch's (`pytorch-bfc`).
    ///
    /// ```
    /// use alloc_core::config::{Config, PolicyConfig, Segments};
    ///
    /// let cfg = Config::parse("bound")?;
    /// let PolicyConfig::PytorchBfc(bfc) = &cfg.policy else { panic!() };
    /// assert!(bfc.plan_layout && bfc.first_fit == Some(8 << 20));
    /// assert_eq!(cfg.engine.segments.unmap().map(|u| u.pages.smallest()), Some(8 << 20));
    ///
    /// let e = Config::parse("policy:buddy,expandable_segments:True").unwrap_err();
    /// assert!(e.to_string().contains("policy `buddy` does not support growable segments"));
    /// # Ok::<(), alloc_core::ConfigError>(())
    /// ```
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        AllocatorConfig::parse(text)?.typed()
    }

    /// Checks a configuration written in code as the parser checks a
    /// string: what the types leave open across their parts (expandable
    /// segments with a policy that cannot grow them, `plan_layout` or
    /// `first_fit` without expandable segments, `plan_layout` over pages of
    /// several sizes). [`Config::parse`] gives only configurations that
    /// pass.
    ///
    /// ```
    /// use alloc_core::config::{Config, PolicyConfig, Segments};
    ///
    /// let cfg = Config {
    ///     policy: PolicyConfig::Buddy,
    ///     ..Config::parse("expandable")?
    /// };
    /// let e = cfg.check().unwrap_err();
    /// assert!(e.to_string().contains("policy `buddy` does not support growable segments"));
    /// # Ok::<(), alloc_core::ConfigError>(())
    /// ```
    pub fn check(&self) -> Result<(), ConfigError> {
        self.flat().typed().map(|_| ())
    }

    /// The `policy:` value: the base policy, with `+gc-age` when that
    /// adaptor wraps it.
    pub fn policy_name(&self) -> String {
        let base = self.policy.kind().name();
        match self.gc {
            Some(GarbageCollection::ByAge { .. }) => format!("{base}{GC_AGE_SUFFIX}"),
            _ => base.to_string(),
        }
    }

    /// The flat view of this configuration ([`AllocatorConfig`]), the one
    /// the C interface, run-time settings and policies of one's own read.
    pub fn flat(&self) -> AllocatorConfig {
        let mut cfg = AllocatorConfig {
            policy: Some(self.policy_name()),
            garbage_collection_threshold: self.gc.and_then(|g| g.threshold()),
            stream_wait_reuse: self.engine.stream_wait_reuse,
            graph_capture_record_stream_reuse: self.engine.graph_capture_record_stream_reuse,
            per_process_memory_fraction: self.engine.per_process_memory_fraction,
            expandable_segments: self.engine.segments.expandable(),
            ..AllocatorConfig::default()
        };
        if let Some(unmap) = self.engine.segments.unmap() {
            cfg.unmap_free_pages = true;
            cfg.unmap_pages = unmap.pages;
            cfg.unmap_worker = unmap.worker;
            cfg.idle_mark = unmap.idle_mark;
            cfg.lend_idle_blocks = unmap.lend_idle;
            cfg.memory_budget = unmap.budget;
        }
        match &self.policy {
            PolicyConfig::PytorchBfc(bfc) => {
                cfg.max_split_size = bfc.max_split_size;
                cfg.max_non_split_rounding = bfc.max_non_split_rounding;
                cfg.roundup_power2_divisions = bfc.roundup_power2_divisions;
                cfg.plan_layout = bfc.plan_layout;
                cfg.first_fit = bfc.first_fit;
            }
            PolicyConfig::Buddy => {}
            PolicyConfig::SizeClass(sc) => cfg.idle_slab_limit = sc.idle_slab_limit,
        }
        cfg
    }
}

impl AllocatorConfig {
    /// The checked form of this configuration; one that names no policy
    /// gets PyTorch's (`pytorch-bfc`).
    ///
    /// ```
    /// use alloc_core::AllocatorConfig;
    ///
    /// let mut flat = AllocatorConfig::default();
    /// flat.policy = Some("buddy".into());
    /// flat.idle_slab_limit = Some(0);
    /// let e = flat.typed().unwrap_err();
    /// assert!(e.to_string().contains("`idle_slab_limit_mb`"), "{e}");
    /// ```
    pub fn typed(&self) -> Result<Config, ConfigError> {
        self.typed_or(PolicyKind::PytorchBfc)
    }

    /// The checked form, a configuration that names no policy getting
    /// `default` (a build's first compiled-in policy, say). The options
    /// are checked together as the parser checks them, then against the
    /// policy: an option of one policy given to another is refused, naming
    /// both. PyTorch's own options (`max_split_size_mb`,
    /// `max_non_split_rounding_mb`, `roundup_power2_divisions`) are
    /// accepted with any policy, as a `PYTORCH_CUDA_ALLOC_CONF` shared with
    /// PyTorch may hold them, and apply to `pytorch-bfc` only.
    pub fn typed_or(&self, default: PolicyKind) -> Result<Config, ConfigError> {
        let (kind, by_age) = match &self.policy {
            Some(name) => read_policy(name)?,
            None => (default, false),
        };
        if kind != PolicyKind::PytorchBfc {
            if self.plan_layout {
                return Err(wrong_policy(
                    "plan_layout",
                    "true",
                    PolicyKind::PytorchBfc,
                    kind,
                ));
            }
            if let Some(bytes) = self.first_fit {
                let mb = (bytes >> 20).to_string();
                return Err(wrong_policy(
                    "first_fit_mb",
                    &mb,
                    PolicyKind::PytorchBfc,
                    kind,
                ));
            }
            if self.expandable_segments {
                return Err(invalid(
                    "expandable_segments",
                    "true",
                    &format!(
                        "policy `{}` does not support growable segments",
                        kind.name()
                    ),
                ));
            }
        }
        if let (Some(limit), false) = (self.idle_slab_limit, kind == PolicyKind::SizeClass) {
            let mb = (limit >> 20).to_string();
            return Err(wrong_policy(
                "idle_slab_limit_mb",
                &mb,
                PolicyKind::SizeClass,
                kind,
            ));
        }
        // After the policy's own options: `plan_layout` given to `buddy`
        // is refused as `buddy`'s, not as lacking expandable segments.
        self.check(self.explicit())?;
        let policy = match kind {
            PolicyKind::PytorchBfc => PolicyConfig::PytorchBfc(self.bfc()),
            PolicyKind::Buddy => PolicyConfig::Buddy,
            PolicyKind::SizeClass => PolicyConfig::SizeClass(SizeClassConfig {
                idle_slab_limit: self.idle_slab_limit,
            }),
        };
        let gc = match (by_age, self.garbage_collection_threshold) {
            (true, threshold) => Some(GarbageCollection::ByAge { threshold }),
            (false, Some(t)) => Some(GarbageCollection::Threshold(t)),
            (false, None) => None,
        };
        let segments = match (self.expandable_segments, self.unmap_free_pages) {
            (false, _) => Segments::Fixed,
            (true, unmap) => Segments::Expandable {
                unmap: unmap.then_some(UnmapFreePages {
                    pages: self.unmap_pages,
                    worker: self.unmap_worker,
                    idle_mark: self.idle_mark,
                    lend_idle: self.lend_idle_blocks,
                    budget: self.memory_budget,
                }),
            },
        };
        Ok(Config {
            engine: EngineConfig {
                segments,
                stream_wait_reuse: self.stream_wait_reuse,
                graph_capture_record_stream_reuse: self.graph_capture_record_stream_reuse,
                per_process_memory_fraction: self.per_process_memory_fraction,
            },
            policy,
            gc,
        })
    }

    /// `pytorch-bfc`'s settings as this configuration gives them, whatever
    /// policy it names (for the flat view's readers, such as
    /// `Policy::reconfigure`).
    pub fn bfc(&self) -> BfcConfig {
        BfcConfig {
            max_split_size: self.max_split_size,
            max_non_split_rounding: self.max_non_split_rounding,
            roundup_power2_divisions: self.roundup_power2_divisions,
            plan_layout: self.plan_layout,
            first_fit: self.first_fit,
        }
    }

    /// `size-class`'s settings as this configuration gives them, whatever
    /// policy it names.
    pub fn size_class(&self) -> SizeClassConfig {
        SizeClassConfig {
            idle_slab_limit: self.idle_slab_limit,
        }
    }

    /// Checks a named policy's own options against it (an unknown name is
    /// left to whoever builds the policy, who knows the names compiled in).
    pub(super) fn check_policy_options(&self) -> Result<(), ConfigError> {
        match &self.policy {
            Some(name) if read_policy(name).is_ok() => self.typed().map(|_| ()),
            _ => Ok(()),
        }
    }
}
