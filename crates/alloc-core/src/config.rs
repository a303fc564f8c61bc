//! Allocator configuration in the syntax of `PYTORCH_CUDA_ALLOC_CONF`:
//! `key:value` pairs separated by commas, with the list form
//! `roundup_power2_divisions:[256:1,512:2,>:4]`.

use thiserror::Error;

pub mod keys;
pub mod named;
mod suggest;
mod text;
mod typed;

pub use keys::{all_keys, known_keys, PyTorchKey, Treatment, OUR_KEYS, PYTORCH_KEYS};
pub use named::{named_setting, NamedSetting, NAMED_SETTINGS};
pub use suggest::{closest, edit_distance};
pub use text::{excerpt, EXCERPT_CHARS};
pub use typed::{
    BfcConfig, Config, EngineConfig, GarbageCollection, PolicyConfig, PolicyKind, Segments,
    SizeClassConfig, UnmapFreePages, GC_AGE_SUFFIX,
};

use crate::budget::MemoryBudget;
use crate::page_layout::PageLayout;
use crate::pytorch::LARGE_BUFFER;
use crate::types::MIB;

/// Number of power-of-two size intervals (1 MiB .. 64 GiB) that
/// `roundup_power2_divisions` configures.
pub const ROUNDUP_INTERVALS: usize = 16;

/// A configuration string that could not be accepted. Messages quote at
/// most an [`excerpt`] of the input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The key is not an option of this allocator.
    #[error(
        "unknown allocator option `{key}`{} (known: {})",
        did_you_mean(.suggestion),
        keys::known_keys()
    )]
    UnknownKey {
        /// The offending key (an excerpt).
        key: String,
        /// The known option or setting name closest to it.
        suggestion: Option<&'static str>,
    },
    /// A word without `:value` that names no setting.
    #[error(
        "unknown setting name `{name}`{} (names: {}; an option takes a value, `key:value`)",
        did_you_mean(.suggestion),
        named::names()
    )]
    UnknownName {
        /// The offending word (an excerpt).
        name: String,
        /// The setting name or option closest to it.
        suggestion: Option<&'static str>,
    },
    /// The value is malformed or out of range.
    #[error("invalid value `{value}` for allocator option `{key}`: {reason}")]
    InvalidValue {
        /// The option.
        key: String,
        /// The offending value.
        value: String,
        /// What is expected instead.
        reason: String,
    },
    /// The string does not follow the `key:value,...` syntax.
    #[error("malformed allocator configuration near token {position} (`{token}`): {reason}")]
    Syntax {
        /// Token index where parsing stopped.
        position: usize,
        /// The token found there (an excerpt).
        token: String,
        /// What was expected.
        reason: &'static str,
    },
    /// The string holds a character no configuration may contain.
    #[error("the allocator configuration contains {reason}")]
    Unusable {
        /// The character and where it is.
        reason: String,
    },
}

/// `; did you mean `x`?` when there is a suggestion.
fn did_you_mean(suggestion: &Option<&'static str>) -> String {
    suggestion.map_or_else(String::new, |s| format!("; did you mean `{s}`?"))
}

/// Allocator settings as the configuration string gives them, one field per
/// option: the flat view of a configuration.
///
/// The parser fills it key by key; [`AllocatorConfig::typed`] gives the
/// checked form, [`Config`], which policies and engines are built from.
/// This view stays for what reads options by name: the C interface's
/// snapshot, settings changed at run time ([`AllocatorConfig::with_settings`])
/// and `alloc-cuda`'s allocator over a policy of one's own, which takes
/// engine options without naming a policy. A string that names a policy is
/// checked against it here too (an option of another policy is refused);
/// one that names none is checked against the default policy when it is
/// built.
///
/// ```
/// use alloc_core::{AllocatorConfig, MIB};
///
/// let cfg = AllocatorConfig::parse("policy:buddy,max_split_size_mb:128,stream_wait_reuse:True")?;
/// assert_eq!(cfg.policy.as_deref(), Some("buddy"));
/// assert_eq!(cfg.max_split_size, 128 * MIB);
/// assert!(cfg.stream_wait_reuse);
///
/// // A bad value is an error naming its key.
/// let err = AllocatorConfig::parse("max_split_size_mb:lots").unwrap_err();
/// assert!(err.to_string().contains("max_split_size_mb"));
///
/// // So is an option of another policy.
/// let err = AllocatorConfig::parse("policy:buddy,expandable_segments:True").unwrap_err();
/// assert!(err.to_string().contains("policy `buddy` does not support growable segments"));
///
/// // Or field by field, from the defaults.
/// let mut cfg = AllocatorConfig::default();
/// cfg.stream_wait_reuse = true;
/// assert!(cfg.typed()?.engine.stream_wait_reuse);
/// # Ok::<(), alloc_core::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct AllocatorConfig {
    /// Blocks at or above this size are never split (`max_split_size_mb`);
    /// `u64::MAX` when unset.
    pub max_split_size: u64,
    /// How far above its size an oversize block may serve a request
    /// (`max_non_split_rounding_mb`, default 20 MiB).
    pub max_non_split_rounding: u64,
    /// Divisions per power-of-two interval (`roundup_power2_divisions`);
    /// index 0 covers sizes below 2 MiB, index 15 sizes from 32 GiB. 0 or 1 =
    /// plain 512-byte rounding.
    pub roundup_power2_divisions: [u32; ROUNDUP_INTERVALS],
    /// Reclaim cached segments once reserved memory passes this fraction of
    /// the limit (`garbage_collection_threshold`); `None` when off.
    pub garbage_collection_threshold: Option<f64>,
    /// Grow segments on the virtual-memory API (`expandable_segments`).
    pub expandable_segments: bool,
    /// Out of room (at the memory limit or budget, or the device full),
    /// reuse blocks still awaiting other streams' events by making the
    /// allocating stream wait on those events instead of the host waiting
    /// for every stream (`stream_wait_reuse`, ours). With room to grow it
    /// makes no wait PyTorch's allocator would not make.
    pub stream_wait_reuse: bool,
    /// With expandable segments: before mapping more memory, unmap the free
    /// pages inside growable segments, and map pages again when a block over
    /// them is handed out (`unmap_free_pages`, ours).
    pub unmap_free_pages: bool,
    /// With `unmap_free_pages`: the physical pages of the large pool's
    /// growable segments (`unmap_page_mb`, ours: a power of two of MiB for
    /// pages of one size, rounded up to the driver's granularity, default
    /// [`DEFAULT_UNMAP_PAGE`]; or `auto` for [`SCALED_UNMAP_PAGES`], pages
    /// that grow with the heap beneath them). Larger pages make each moved
    /// byte cheaper and leave free holes smaller than a page mapped.
    pub unmap_pages: PageLayout,
    /// With `unmap_free_pages`: unmap the old addresses of moved pages on a
    /// worker thread instead of the allocating thread (`unmap_worker`, ours,
    /// default false). Alone, a move then costs its caller only the new
    /// mapping; beside a host-bound PyTorch step, on the H100, the worker's
    /// unmaps made the allocating thread's maps slower and the mean step
    /// longer (GPT-2 generation: 9.9-10.5 ms against 8.3-9.8 ms, three
    /// rounds; docs/benchmarks.md). Read by backends that map pages on a
    /// device (`alloc-cuda`); the simulated device ignores it.
    pub unmap_worker: bool,
    /// With `unmap_free_pages`: after this many bytes freed in a growable
    /// segment since its last mark, the free that passes it records a mark
    /// (an event on the segment's stream), so that the pages freed before
    /// it are known idle once the GPU passes it (`idle_mark_mb`, ours; 0,
    /// the default: marks only where pages are unmapped or mapped). Where
    /// pages move rarely (under a memory budget) the last mark may be a
    /// step old, and a growth then finds most free pages of other streams
    /// busy and maps new memory instead of reusing them.
    pub idle_mark: u64,
    /// With `unmap_free_pages`: when a large allocation would take reserved
    /// memory past its level (the reserved peak, a memory budget), a free
    /// block of another stream's growable segment whose pages the GPU is
    /// known to be done with serves it instead of pages moved to the
    /// allocating stream's segment (`lend_idle_blocks`, ours; default
    /// false). The block goes back to its own stream's cache once an event
    /// recorded at its free on the borrowing stream has completed.
    pub lend_idle_blocks: bool,
    /// With expandable segments and `policy:pytorch-bfc`: learn the layout
    /// of a repeating step and place later steps' blocks as planned, so that
    /// the same addresses serve the same requests every step and, with
    /// `unmap_free_pages`, no page moves once the plan is followed
    /// (`plan_layout`, ours; `alloc_policy::layout_plan`).
    pub plan_layout: bool,
    /// With expandable segments and `policy:pytorch-bfc`: requests of at
    /// least this many bytes take the free block of lowest address that
    /// fits instead of the best fit (`first_fit_mb`, ours; `None`, the
    /// default, keeps PyTorch's best fit for every size). Tensors that grow
    /// a little at each step (a key/value cache extended by `torch.cat`)
    /// leave best fit a trail of holes just too small for the next one;
    /// taken lowest first, the holes a step frees merge into the one the
    /// next request takes.
    pub first_fit: Option<u64>,
    /// With `policy:size-class`: bytes of wholly idle slabs kept cached
    /// (`idle_slab_limit_mb`, ours). Set, the policy runs bounded: idle slabs
    /// keep their classes and the oldest go back to the device whenever a new
    /// slab is needed while more is idle. `None` (the default): idle slabs
    /// are reset for any class and stay cached until memory runs short, the
    /// `garbage_collection_threshold` is passed or the cache is emptied.
    pub idle_slab_limit: Option<u64>,
    /// Policy name (`policy`), e.g. `pytorch-bfc`, `buddy`, `size-class`,
    /// optionally with `+gc-age`.
    pub policy: Option<String>,
    /// During a CUDA graph capture, reuse a freed block that other streams
    /// used once the capture shows those streams joined the allocating one
    /// (PyTorch's `graph_capture_record_stream_reuse`; needs a stream
    /// backend that reads the capture's graph, as `alloc-cuda`'s does); off:
    /// such frees wait for the end of the capture.
    pub graph_capture_record_stream_reuse: bool,
    /// Limit on reserved memory as a fraction of the device's capacity,
    /// applied when the allocator is created (PyTorch's
    /// `per_process_memory_fraction`, like `set_memory_fraction`); `None`:
    /// no limit.
    pub per_process_memory_fraction: Option<f64>,
    /// With `unmap_free_pages`: the memory budget (`memory_budget_mb`, or
    /// `memory_budget_fraction` of the device; ours). Below it the heap
    /// grows by mapping new pages, with no unmaps and no page moves; at it
    /// free pages are unmapped and reused before the heap passes it; the
    /// memory-fraction limit and the device's free memory count as budgets
    /// too. Or `memory_budget_over_allocated`, a multiple of the allocated
    /// peak counting the allocation being served (never below the reserved
    /// peak, no host waits). `None` (the
    /// default): pages move whenever reserved memory would pass its earlier
    /// peak ([`crate::budget`]).
    pub memory_budget: Option<MemoryBudget>,
    /// An engine for each stream instead of one for the device
    /// (`engine_per_stream`, ours; read by the C library, which then serves
    /// each device through `alloc_cuda::StreamEngines`): threads allocating
    /// on their own streams do not queue on one lock. The settings whose
    /// decisions span streams ([`AllocatorConfig::spanning_streams`]) are
    /// refused with it; the memory fraction is one limit the engines share.
    pub engine_per_stream: bool,
    /// With `engine_per_stream`: an engine for each stream and thread
    /// (`engine_per_thread`, ours), so that threads allocating on one
    /// stream do not queue on one lock either. A block is still reused on
    /// its own stream only, now by the thread that allocated it: a free on
    /// another thread goes back to the allocating thread's engine, and what
    /// one thread's engine caches serves another only after an
    /// out-of-memory error emptied it (or the thread ended: the next thread
    /// to start takes its engines over). That costs memory where one thread
    /// frees what another then allocates (PyTorch's backward runs on an
    /// autograd thread of its own); it pays where each thread runs work of
    /// its own.
    pub engine_per_thread: bool,
}

/// Why a setting is refused beside `engine_per_stream`.
pub const SPANS_STREAMS: &str =
    "its decisions span streams: not with an engine per stream (engine_per_stream) yet";

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: u64::MAX,
            max_non_split_rounding: LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: None,
            expandable_segments: false,
            stream_wait_reuse: false,
            unmap_free_pages: false,
            unmap_pages: PageLayout::uniform(DEFAULT_UNMAP_PAGE),
            unmap_worker: false,
            idle_mark: 0,
            lend_idle_blocks: false,
            plan_layout: false,
            first_fit: None,
            idle_slab_limit: None,
            policy: None,
            graph_capture_record_stream_reuse: false,
            per_process_memory_fraction: None,
            memory_budget: None,
            engine_per_stream: false,
            engine_per_thread: false,
        }
    }
}

pub use crate::page_layout::DEFAULT_UNMAP_PAGE;

/// The pages of `unmap_page_mb:auto`: 2 MiB pages up to 2 GiB into a
/// growable segment, then pages of at most 1/512 of the offset below them
/// (4 MiB from 2 GiB, 8 MiB from 4 GiB), at most 16 MiB (from 8 GiB). Memory
/// held under free holes stays about the same share of a small heap as of a
/// large one, while a large heap moves few, large pages (docs/policies.md,
/// "Pages that grow with the heap").
pub const SCALED_UNMAP_PAGES: PageLayout = PageLayout::scaled_const(2 * MIB, 16 * MIB, 512);

/// The `unmap_page_mb` value that gives `pages`: `auto` or MiB.
fn unmap_page_value(pages: &PageLayout) -> String {
    if *pages == SCALED_UNMAP_PAGES {
        "auto".to_string()
    } else {
        (pages.smallest() >> 20).to_string()
    }
}

impl AllocatorConfig {
    /// Parses a configuration string. An empty string gives the defaults.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        AllocatorConfig::default().with_settings(text)
    }

    /// This configuration with the options that `text` names set as it says
    /// and every other option kept: how settings change at run time
    /// (`torch.cuda.memory._set_allocator_settings`). The result is checked
    /// as a whole, as [`AllocatorConfig::parse`] checks.
    ///
    /// ```
    /// use alloc_core::{AllocatorConfig, MIB};
    ///
    /// let base = AllocatorConfig::parse("expandable_segments:true")?;
    /// let changed = base.with_settings("max_split_size_mb:40")?;
    /// assert!(changed.expandable_segments);
    /// assert_eq!(changed.max_split_size, 40 * MIB);
    /// # Ok::<(), alloc_core::ConfigError>(())
    /// ```
    pub fn with_settings(&self, text: &str) -> Result<Self, ConfigError> {
        if let Some(reason) = text::unusable_character(text) {
            return Err(ConfigError::Unusable { reason });
        }
        let mut cfg = self.clone();
        let mut set = Explicit::default();
        cfg.apply(text, &mut set, true)?;
        cfg.check_policy_options()?;
        cfg.check(set)?;
        Ok(cfg)
    }

    /// Sets the options `text` names, in order; a setting name (when
    /// `names` allows one) stands for its configuration string.
    fn apply(&mut self, text: &str, set: &mut Explicit, names: bool) -> Result<(), ConfigError> {
        let mut p = Parser {
            tokens: lex(text),
            pos: 0,
        };
        while let Some(key) = p.next_token() {
            if key == "," {
                continue;
            }
            if names && p.at_item_end() && !is_punctuation(&key) {
                self.apply_name(&key, p.pos - 1, set)?;
            } else {
                p.expect(":")?;
                self.apply_option(key, &mut p, set)?;
            }
            match p.next_token() {
                None => break,
                Some(t) if t == "," => {}
                Some(t) => {
                    return Err(ConfigError::Syntax {
                        position: p.pos - 1,
                        token: excerpt(&t),
                        reason: "expected `,` between options",
                    })
                }
            }
        }
        Ok(())
    }

    /// Applies the setting called `name`.
    fn apply_name(
        &mut self,
        name: &str,
        position: usize,
        set: &mut Explicit,
    ) -> Result<(), ConfigError> {
        if keys::all_keys().any(|k| k == name) {
            // An option without its value: the old message, which says so.
            return Err(ConfigError::Syntax {
                position,
                token: name.to_string(),
                reason: "expected `:` after an option name",
            });
        }
        match named::named_setting(name) {
            // Named settings' strings hold options only: no name expands
            // into another.
            Some(setting) => self.apply(setting.config, set, false),
            None => Err(ConfigError::UnknownName {
                name: excerpt(name),
                suggestion: closest(
                    name,
                    NAMED_SETTINGS
                        .iter()
                        .map(|s| s.name)
                        .chain(keys::all_keys()),
                ),
            }),
        }
    }

    /// Sets the option `key` from the value that `p` is at.
    fn apply_option(
        &mut self,
        key: String,
        p: &mut Parser,
        set: &mut Explicit,
    ) -> Result<(), ConfigError> {
        let cfg = self;
        match key.as_str() {
            "max_split_size_mb" => cfg.max_split_size = p.megabytes(&key)?,
            "max_non_split_rounding_mb" => cfg.max_non_split_rounding = p.megabytes(&key)?,
            "garbage_collection_threshold" => {
                let v = p.value(&key)?;
                let f: f64 = v
                    .parse()
                    .map_err(|_| invalid(&key, &v, "expected a number"))?;
                if !(f > 0.0 && f < 1.0) {
                    return Err(invalid(&key, &v, "must be strictly between 0.0 and 1.0"));
                }
                cfg.garbage_collection_threshold = Some(f);
            }
            "roundup_power2_divisions" => p.divisions(&mut cfg.roundup_power2_divisions)?,
            "expandable_segments" => cfg.expandable_segments = p.boolean(&key)?,
            "stream_wait_reuse" => cfg.stream_wait_reuse = p.boolean(&key)?,
            "engine_per_stream" => cfg.engine_per_stream = p.boolean(&key)?,
            "engine_per_thread" => cfg.engine_per_thread = p.boolean(&key)?,
            "unmap_free_pages" => cfg.unmap_free_pages = p.boolean(&key)?,
            "unmap_page_mb" => {
                set.page = true;
                let v = p.value(&key)?;
                cfg.unmap_pages = if v.eq_ignore_ascii_case("auto") {
                    SCALED_UNMAP_PAGES
                } else {
                    let mb = whole_number(&v)
                        .filter(|mb| mb.is_power_of_two() && *mb <= 1 << 20)
                        .ok_or_else(|| {
                            invalid(
                                &key,
                                &v,
                                "expected auto or a power of two from 1 to 1048576 (MiB)",
                            )
                        })?;
                    PageLayout::uniform(mb << 20)
                };
            }
            "idle_mark_mb" => {
                set.mark = true;
                cfg.idle_mark = p.mebibytes(&key)?;
            }
            "lend_idle_blocks" => cfg.lend_idle_blocks = p.boolean(&key)?,
            "unmap_worker" => {
                set.worker = true;
                cfg.unmap_worker = p.boolean(&key)?;
            }
            "plan_layout" => cfg.plan_layout = p.boolean(&key)?,
            "first_fit_mb" => {
                let bytes = p.mebibytes(&key)?;
                cfg.first_fit = (bytes > 0).then_some(bytes);
            }
            "idle_slab_limit_mb" => cfg.idle_slab_limit = Some(p.mebibytes(&key)?),
            "policy" => cfg.policy = Some(p.value(&key)?),
            "backend" => {
                let v = p.value(&key)?;
                if v != "native" {
                    return Err(invalid(&key, &v, keys::BACKEND_REASON));
                }
            }
            "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
                p.boolean(&key)?;
            }
            "throw_on_cudamalloc_oom" => {
                if p.boolean(&key)? {
                    return Err(invalid(&key, "True", keys::THROW_ON_OOM_REASON));
                }
            }
            // PyTorch's pinned host allocator stays PyTorch's and reads
            // these itself: checked as PyTorch checks them, so that a
            // string PyTorch refuses is refused here too.
            "pinned_use_cuda_host_register"
            | "pinned_use_hip_host_register"
            | "pinned_use_background_threads"
            | "pinned_free_catch_all" => {
                p.boolean(&key)?;
            }
            "pinned_num_register_threads" => {
                let v = p.value(&key)?;
                whole_number(&v)
                    .filter(|n| n.is_power_of_two() && *n <= keys::MAX_REGISTER_THREADS)
                    .ok_or_else(|| invalid(&key, &v, "expected a power of two from 1 to 128"))?;
            }
            "pinned_reserve_segment_size_mb" => {
                let v = p.value(&key)?;
                whole_number(&v)
                    .filter(|&mb| mb > 0)
                    .ok_or_else(|| invalid(&key, &v, "expected a whole number of MiB above 0"))?;
            }
            "graph_capture_record_stream_reuse" => {
                cfg.graph_capture_record_stream_reuse = p.boolean(&key)?
            }
            "per_process_memory_fraction" => {
                let f = p.number(&key, |f| (0.0..=1.0).contains(&f), "from 0.0 to 1.0")?;
                cfg.per_process_memory_fraction = Some(f);
            }
            "memory_budget_mb" => {
                cfg.memory_budget = Some(MemoryBudget::Bytes(p.mebibytes(&key)?));
            }
            "memory_budget_fraction" => {
                let f = p.number(&key, |f| f > 0.0 && f <= 1.0, "above 0.0, up to 1.0")?;
                cfg.memory_budget = Some(MemoryBudget::Fraction(f));
            }
            "memory_budget_over_allocated" => {
                let f = p.number(&key, |f| (1.0..=16.0).contains(&f), "from 1.0 to 16.0")?;
                cfg.memory_budget = Some(MemoryBudget::OverAllocated(f));
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    suggestion: closest(
                        &key,
                        keys::all_keys().chain(NAMED_SETTINGS.iter().map(|s| s.name)),
                    ),
                    key: excerpt(&key),
                })
            }
        }
        Ok(())
    }

    /// The first setting whose decisions span streams, as `(key, value)`:
    /// an engine for each stream cannot make them (yet), so
    /// `engine_per_stream` and `alloc_cuda::StreamEngines` refuse them.
    /// `None` when there is none.
    ///
    /// ```
    /// use alloc_core::AllocatorConfig;
    ///
    /// let plain = AllocatorConfig::parse("max_split_size_mb:128")?;
    /// assert_eq!(plain.spanning_streams(), None);
    /// let gc = AllocatorConfig::parse("garbage_collection_threshold:0.8")?;
    /// assert_eq!(gc.spanning_streams().map(|(key, _)| key), Some("garbage_collection_threshold"));
    /// # Ok::<(), alloc_core::ConfigError>(())
    /// ```
    pub fn spanning_streams(&self) -> Option<(&'static str, String)> {
        if self.stream_wait_reuse {
            return Some(("stream_wait_reuse", "True".into()));
        }
        if self.unmap_free_pages {
            return Some(("unmap_free_pages", "True".into()));
        }
        if let Some(t) = self.garbage_collection_threshold {
            return Some(("garbage_collection_threshold", t.to_string()));
        }
        self.memory_budget.map(|b| b.key_value())
    }

    /// Checks the options together: those that need another.
    fn check(&self, set: Explicit) -> Result<(), ConfigError> {
        let cfg = self;
        if let (true, Some((key, value))) = (cfg.engine_per_stream, cfg.spanning_streams()) {
            return Err(invalid(key, &value, SPANS_STREAMS));
        }
        if cfg.engine_per_thread && !cfg.engine_per_stream {
            return Err(invalid(
                "engine_per_thread",
                "true",
                "needs engine_per_stream:True (it splits the engines per stream by thread too)",
            ));
        }
        if cfg.unmap_free_pages && !cfg.expandable_segments {
            return Err(invalid(
                "unmap_free_pages",
                "true",
                "needs expandable_segments:True (only growable segments map pages)",
            ));
        }
        if cfg.plan_layout && !cfg.expandable_segments {
            return Err(invalid(
                "plan_layout",
                "true",
                "needs expandable_segments:True (the plan lays blocks out in a growable segment)",
            ));
        }
        if let (Some(bytes), false) = (cfg.first_fit, cfg.expandable_segments) {
            return Err(invalid(
                "first_fit_mb",
                &(bytes >> 20).to_string(),
                "needs expandable_segments:True (it places blocks in a growable segment)",
            ));
        }
        if cfg.plan_layout && cfg.lend_idle_blocks {
            // The plan places every block of a step at its own address; a
            // block of another stream's segment would leave the plan.
            return Err(invalid(
                "lend_idle_blocks",
                "true",
                "plan_layout places every block itself: lend_idle_blocks does not go with it",
            ));
        }
        if cfg.plan_layout && cfg.unmap_free_pages && !cfg.unmap_pages.is_uniform() {
            // Busy pages move only to mappings of their own size: pages of
            // several sizes leave the plan's switch short of movable memory
            // (GPT-2 training: 1.20x its peak in replay, against 1.01x).
            return Err(invalid(
                "unmap_page_mb",
                "auto",
                "plan_layout needs pages of one size (unmap_page_mb:4 or 8, say)",
            ));
        }
        if !cfg.unmap_free_pages {
            // The options that mean something only in that mode, in the
            // order they are reported: key, value as set, what it does there.
            let set_without_it = [
                set.page.then(|| {
                    let pages = unmap_page_value(&cfg.unmap_pages);
                    ("unmap_page_mb", pages, "it sizes the pages that mode moves")
                }),
                cfg.memory_budget.map(|budget| {
                    let (key, value) = budget.key_value();
                    (key, value, "the budget decides when that mode unmaps pages")
                }),
                set.mark.then(|| {
                    let mb = (cfg.idle_mark >> 20).to_string();
                    ("idle_mark_mb", mb, "it dates the pages that mode unmaps")
                }),
                set.worker.then(|| {
                    let on = cfg.unmap_worker.to_string();
                    ("unmap_worker", on, "it places the unmaps that mode makes")
                }),
                cfg.lend_idle_blocks.then(|| {
                    let on = true.to_string();
                    (
                        "lend_idle_blocks",
                        on,
                        "it lends the pages that mode knows idle",
                    )
                }),
            ];
            if let Some((key, value, why)) = set_without_it.into_iter().flatten().next() {
                let reason = format!("needs unmap_free_pages:True ({why})");
                return Err(invalid(key, &value, &reason));
            }
        }
        Ok(())
    }

    /// The options set away from their defaults that [`Self::check`] needs
    /// to know were set, for a configuration not read from text.
    fn explicit(&self) -> Explicit {
        let default = AllocatorConfig::default();
        Explicit {
            page: self.unmap_pages != default.unmap_pages,
            worker: self.unmap_worker != default.unmap_worker,
            mark: self.idle_mark != default.idle_mark,
        }
    }

    /// Divisions that apply to a (non-zero) size, per PyTorch's interval rule.
    pub fn divisions_for(&self, size: u64) -> u32 {
        let log = 63 - size.max(1).leading_zeros() as usize;
        let index = log.saturating_sub(20).min(ROUNDUP_INTERVALS - 1);
        self.roundup_power2_divisions[index]
    }
}

/// The options a string set explicitly, which some checks need.
#[derive(Debug, Default, Clone, Copy)]
struct Explicit {
    /// `unmap_page_mb`.
    page: bool,
    /// `unmap_worker`.
    worker: bool,
    /// `idle_mark_mb`.
    mark: bool,
}

/// `v` as a whole number written in decimal digits only: no sign, space,
/// fraction or trailing text (Rust's own parse takes a leading `+`).
fn whole_number(v: &str) -> Option<u64> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

/// `v` whole MiB in bytes.
fn parse_mebibytes(key: &str, v: &str) -> Result<u64, ConfigError> {
    let mb = whole_number(v).ok_or_else(|| invalid(key, v, "expected a whole number of MiB"))?;
    Ok(mb.saturating_mul(MIB))
}

/// A value error; the value quoted as an excerpt.
fn invalid(key: &str, value: &str, reason: &str) -> ConfigError {
    ConfigError::InvalidValue {
        key: excerpt(key),
        value: excerpt(value),
        reason: reason.to_string(),
    }
}

/// `,`, `:`, `[` or `]`.
fn is_punctuation(token: &str) -> bool {
    matches!(token, "," | ":" | "[" | "]")
}

/// Splits like PyTorch's lexer: `,`, `:`, `[` and `]` are tokens of their
/// own; spaces are dropped.
fn lex(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = String::new();
    for c in text.chars() {
        match c {
            ',' | ':' | '[' | ']' => {
                if !buf.is_empty() {
                    out.push(std::mem::take(&mut buf));
                }
                out.push(c.to_string());
            }
            c if c.is_whitespace() => {}
            c => buf.push(c),
        }
    }
    if !buf.is_empty() {
        out.push(buf);
    }
    out
}

struct Parser {
    tokens: Vec<String>,
    pos: usize,
}

impl Parser {
    /// Whether the token just read ends an item: the next is `,` or none.
    fn at_item_end(&self) -> bool {
        matches!(
            self.tokens.get(self.pos).map(String::as_str),
            None | Some(",")
        )
    }

    fn next_token(&mut self) -> Option<String> {
        let t = self.tokens.get(self.pos).cloned();
        if t.is_some() {
            self.pos += 1;
        }
        t
    }

    fn expect(&mut self, want: &'static str) -> Result<(), ConfigError> {
        match self.next_token() {
            Some(t) if t == want => Ok(()),
            other => Err(ConfigError::Syntax {
                position: self.pos.saturating_sub(1),
                token: excerpt(&other.unwrap_or_default()),
                reason: match want {
                    ":" => "expected `:` after an option name",
                    "," => "expected `,`",
                    _ => "unexpected token",
                },
            }),
        }
    }

    fn value(&mut self, key: &str) -> Result<String, ConfigError> {
        match self.next_token() {
            Some(t) if !matches!(t.as_str(), "," | ":" | "[" | "]") => Ok(t),
            other => Err(invalid(key, &other.unwrap_or_default(), "missing value")),
        }
    }

    fn boolean(&mut self, key: &str) -> Result<bool, ConfigError> {
        let v = self.value(key)?;
        match v.to_ascii_lowercase().as_str() {
            "true" | "1" => Ok(true),
            "false" | "0" => Ok(false),
            _ => Err(invalid(key, &v, "expected True or False")),
        }
    }

    /// A size in whole MiB of at least PyTorch's 20 MiB large buffer.
    fn megabytes(&mut self, key: &str) -> Result<u64, ConfigError> {
        let v = self.value(key)?;
        let mb = parse_mebibytes(key, &v)?;
        if mb < LARGE_BUFFER {
            return Err(invalid(key, &v, "must be at least 20 (MiB)"));
        }
        Ok(mb)
    }

    /// A number for which `ok` holds; `range` says which in the error
    /// ("expected a number {range}").
    fn number(
        &mut self,
        key: &str,
        ok: impl Fn(f64) -> bool,
        range: &str,
    ) -> Result<f64, ConfigError> {
        let v = self.value(key)?;
        v.parse::<f64>()
            .ok()
            .filter(|&f| ok(f))
            .ok_or_else(|| invalid(key, &v, &format!("expected a number {range}")))
    }

    /// A size in whole MiB, zero included.
    fn mebibytes(&mut self, key: &str) -> Result<u64, ConfigError> {
        let v = self.value(key)?;
        parse_mebibytes(key, &v)
    }

    fn power_of_two(&self, key: &str, v: &str, allow_zero: bool) -> Result<u32, ConfigError> {
        let n = whole_number(v)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| invalid(key, v, "expected a whole number"))?;
        if n.is_power_of_two() || (allow_zero && n == 0) {
            Ok(n)
        } else {
            Err(invalid(key, v, "must be a power of two"))
        }
    }

    fn divisions(&mut self, out: &mut [u32; ROUNDUP_INTERVALS]) -> Result<(), ConfigError> {
        const KEY: &str = "roundup_power2_divisions";
        let first = self
            .next_token()
            .ok_or_else(|| invalid(KEY, "", "missing value"))?;
        if first != "[" {
            let n = self.power_of_two(KEY, &first, false)?;
            out.fill(n);
            return Ok(());
        }
        // List form: `[<size_mb>:<divisions>, ..., >:<divisions>]`.
        let mut last_index = 0;
        let mut first_entry = true;
        loop {
            let interval = self
                .next_token()
                .ok_or_else(|| invalid(KEY, "", "unterminated list"))?;
            if interval == "]" {
                break;
            }
            self.expect(":")?;
            let v = self.value(KEY)?;
            let divisions = self.power_of_two(KEY, &v, true)?;
            if interval == ">" {
                out[last_index..].fill(divisions);
            } else {
                let mb = whole_number(&interval).ok_or_else(|| {
                    invalid(KEY, &interval, "interval must be a size in MiB or `>`")
                })?;
                if !mb.is_power_of_two() {
                    return Err(invalid(KEY, &interval, "interval must be a power of two"));
                }
                let index = (mb.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
                if first_entry {
                    out[..index].fill(divisions);
                    first_entry = false;
                }
                out[index] = divisions;
                last_index = index;
            }
            match self.next_token().as_deref() {
                Some(",") => {}
                Some("]") => break,
                other => {
                    return Err(invalid(
                        KEY,
                        other.unwrap_or(""),
                        "expected `,` or `]` in list",
                    ))
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_is_default() {
        assert_eq!(
            AllocatorConfig::parse("").unwrap(),
            AllocatorConfig::default()
        );
        assert_eq!(
            AllocatorConfig::parse("  ").unwrap(),
            AllocatorConfig::default()
        );
    }

    #[test]
    fn parses_every_key() {
        let c = AllocatorConfig::parse(
            "max_split_size_mb:128, garbage_collection_threshold:0.6,expandable_segments:True,\
             policy:pytorch-bfc,stream_wait_reuse:true,backend:native,max_non_split_rounding_mb:64,\
             unmap_free_pages:true",
        )
        .unwrap();
        assert!(c.unmap_free_pages);
        let e = AllocatorConfig::parse("unmap_free_pages:true").unwrap_err();
        assert!(e.to_string().contains("expandable_segments"), "{e}");
        assert_eq!(c.max_split_size, 128 * MIB);
        assert_eq!(c.max_non_split_rounding, 64 * MIB);
        assert_eq!(c.garbage_collection_threshold, Some(0.6));
        assert!(c.expandable_segments && c.stream_wait_reuse);
        assert_eq!(c.policy.as_deref(), Some("pytorch-bfc"));
    }

    #[test]
    fn an_engine_per_stream_refuses_the_settings_that_span_streams() {
        let c = AllocatorConfig::parse("engine_per_stream:True,max_split_size_mb:64").unwrap();
        assert!(c.engine_per_stream && c.spanning_streams().is_none());
        for (conf, key) in [
            ("stream_wait_reuse:True", "stream_wait_reuse"),
            (
                "garbage_collection_threshold:0.7",
                "garbage_collection_threshold",
            ),
            (
                "expandable_segments:True,unmap_free_pages:True",
                "unmap_free_pages",
            ),
        ] {
            assert_eq!(
                AllocatorConfig::parse(conf)
                    .unwrap()
                    .spanning_streams()
                    .unwrap()
                    .0,
                key
            );
            let e = AllocatorConfig::parse(&format!("engine_per_stream:True,{conf}")).unwrap_err();
            assert!(
                e.to_string().contains(key) && e.to_string().contains("span streams"),
                "{e}"
            );
        }
        // Expandable segments alone decide nothing across streams; the memory
        // fraction is one limit the engines share.
        AllocatorConfig::parse("engine_per_stream:True,expandable_segments:True").unwrap();
        AllocatorConfig::parse("engine_per_stream:True,per_process_memory_fraction:0.5").unwrap();
        let c = AllocatorConfig::parse("engine_per_stream:True,engine_per_thread:True").unwrap();
        assert!(c.engine_per_stream && c.engine_per_thread);
        assert!(!AllocatorConfig::default().engine_per_thread);
        let e = AllocatorConfig::parse("engine_per_thread:True").unwrap_err();
        assert!(e.to_string().contains("needs engine_per_stream"), "{e}");
    }

    #[test]
    fn parses_the_memory_budget() {
        let base = "expandable_segments:True,unmap_free_pages:True";
        let c = AllocatorConfig::parse(&format!("{base},memory_budget_mb:24576")).unwrap();
        assert_eq!(c.memory_budget, Some(MemoryBudget::Bytes(24 * 1024 * MIB)));
        let c = AllocatorConfig::parse(&format!("{base},memory_budget_fraction:0.5")).unwrap();
        assert_eq!(c.memory_budget, Some(MemoryBudget::Fraction(0.5)));
        assert_eq!(AllocatorConfig::default().memory_budget, None);
        let c =
            AllocatorConfig::parse(&format!("{base},memory_budget_over_allocated:1.02")).unwrap();
        assert_eq!(c.memory_budget, Some(MemoryBudget::OverAllocated(1.02)));
        // After the `budget` setting, it takes the budget's place.
        let c = AllocatorConfig::parse("budget,memory_budget_over_allocated:1.05").unwrap();
        assert_eq!(c.memory_budget, Some(MemoryBudget::OverAllocated(1.05)));
        for bad in ["0.99", "17", "x", "nan"] {
            let e = AllocatorConfig::parse(&format!("{base},memory_budget_over_allocated:{bad}"))
                .unwrap_err();
            assert!(e.to_string().contains("from 1.0 to 16.0"), "{e}");
        }
        let e = AllocatorConfig::parse("expandable_segments:True,memory_budget_over_allocated:1.1")
            .unwrap_err();
        assert!(e.to_string().contains("needs unmap_free_pages"), "{e}");
        for bad in ["0", "1.5", "-1", "half", "NaN"] {
            let e = AllocatorConfig::parse(&format!("{base},memory_budget_fraction:{bad}"))
                .unwrap_err();
            assert!(e.to_string().contains("memory_budget_fraction"), "{e}");
        }
        let e = AllocatorConfig::parse("memory_budget_mb:1024").unwrap_err();
        assert!(e.to_string().contains("needs unmap_free_pages"), "{e}");
        let e = AllocatorConfig::parse("expandable_segments:True,memory_budget_fraction:0.5")
            .unwrap_err();
        assert!(e.to_string().contains("memory_budget_fraction"), "{e}");
    }

    #[test]
    fn settings_change_only_the_options_they_name() {
        let base = AllocatorConfig::parse(
            "expandable_segments:true,unmap_free_pages:true,roundup_power2_divisions:4",
        )
        .unwrap();
        let c = base
            .with_settings("max_split_size_mb:40,graph_capture_record_stream_reuse:True")
            .unwrap();
        assert_eq!(c.max_split_size, 40 * MIB);
        assert!(c.graph_capture_record_stream_reuse);
        assert!(c.expandable_segments && c.unmap_free_pages);
        assert_eq!(c.roundup_power2_divisions, base.roundup_power2_divisions);
        // Checked as a whole: the base's unmap_free_pages needs expandable segments.
        let e = base.with_settings("expandable_segments:false").unwrap_err();
        assert!(e.to_string().contains("unmap_free_pages"), "{e}");
        assert_eq!(base.with_settings("").unwrap(), base);
    }

    #[test]
    fn per_process_memory_fraction_is_a_fraction() {
        let c = AllocatorConfig::parse("per_process_memory_fraction:0.5").unwrap();
        assert_eq!(c.per_process_memory_fraction, Some(0.5));
        assert_eq!(AllocatorConfig::default().per_process_memory_fraction, None);
        for bad in ["-0.1", "1.5", "half", "NaN"] {
            let e = AllocatorConfig::parse(&format!("per_process_memory_fraction:{bad}"));
            assert!(e.is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn idle_mark_mb_is_off_by_default_and_needs_unmap_free_pages() {
        let on = "expandable_segments:true,unmap_free_pages:true";
        assert_eq!(AllocatorConfig::parse(on).unwrap().idle_mark, 0);
        let c = AllocatorConfig::parse(&format!("{on},idle_mark_mb:512")).unwrap();
        assert_eq!(c.idle_mark, 512 * MIB);
        assert_eq!(c.with_settings("idle_mark_mb:0").unwrap().idle_mark, 0);
        let e = AllocatorConfig::parse("expandable_segments:true,idle_mark_mb:64").unwrap_err();
        assert!(e.to_string().contains("unmap_free_pages"), "{e}");
        for bad in ["-1", "half", "1.5"] {
            let e = AllocatorConfig::parse(&format!("{on},idle_mark_mb:{bad}"));
            assert!(e.is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn unmap_page_mb_sizes_the_moved_pages() {
        let c = AllocatorConfig::parse(
            "expandable_segments:true,unmap_free_pages:true,unmap_page_mb:64",
        )
        .unwrap();
        assert_eq!(c.unmap_pages, PageLayout::uniform(64 * MIB));
        let c = AllocatorConfig::parse("expandable_segments:true,unmap_free_pages:true").unwrap();
        assert_eq!(c.unmap_pages, PageLayout::uniform(DEFAULT_UNMAP_PAGE));
        let c = AllocatorConfig::parse(
            "expandable_segments:true,unmap_free_pages:true,unmap_page_mb:auto",
        )
        .unwrap();
        assert_eq!(c.unmap_pages, SCALED_UNMAP_PAGES);
        assert_eq!(unmap_page_value(&c.unmap_pages), "auto");
        let e = AllocatorConfig::parse(
            "expandable_segments:true,unmap_free_pages:true,unmap_page_mb:auto,plan_layout:true",
        )
        .unwrap_err();
        assert!(e.to_string().contains("pages of one size"), "{e}");
        assert_eq!(SCALED_UNMAP_PAGES.size_at(8 << 30), 16 * MIB);
        let e = AllocatorConfig::parse("expandable_segments:true,unmap_page_mb:8").unwrap_err();
        assert!(e.to_string().contains("unmap_free_pages"), "{e}");
    }

    #[test]
    fn unmap_worker_is_off_by_default_and_needs_unmap_free_pages() {
        let on = "expandable_segments:true,unmap_free_pages:true";
        assert!(!AllocatorConfig::parse(on).unwrap().unmap_worker);
        let worker = AllocatorConfig::parse(&format!("{on},unmap_worker:true")).unwrap();
        assert!(worker.unmap_worker);
        assert!(
            !worker
                .with_settings("unmap_worker:false")
                .unwrap()
                .unmap_worker
        );
        let e = AllocatorConfig::parse("expandable_segments:true,unmap_worker:true").unwrap_err();
        assert!(e.to_string().contains("unmap_free_pages"), "{e}");
        assert!(AllocatorConfig::parse(&format!("{on},unmap_worker:sometimes")).is_err());
    }

    #[test]
    fn divisions_single_value_and_list() {
        let c = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        assert!(c.roundup_power2_divisions.iter().all(|&d| d == 4));
        let c = AllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,>:4]").unwrap();
        // Entries below 256 MiB take the first value; 512 MiB gets 2; `>` fills
        // from the last interval named (inclusive), as PyTorch does.
        assert_eq!(&c.roundup_power2_divisions[..8], &[1; 8]);
        assert_eq!(c.roundup_power2_divisions[8], 1);
        assert_eq!(&c.roundup_power2_divisions[9..], &[4; 7]);
        assert_eq!(c.divisions_for(300 * MIB), 1);
        assert_eq!(c.divisions_for(5 << 30), 4);
        assert_eq!(c.divisions_for(100), 1);
    }

    #[test]
    fn idle_slab_limit_takes_whole_mebibytes_from_zero() {
        assert_eq!(AllocatorConfig::default().idle_slab_limit, None);
        let c = AllocatorConfig::parse("idle_slab_limit_mb:0").unwrap();
        assert_eq!(c.idle_slab_limit, Some(0));
        let c = AllocatorConfig::parse("policy:size-class,idle_slab_limit_mb:512").unwrap();
        assert_eq!(c.idle_slab_limit, Some(512 * MIB));
        for bad in [
            "idle_slab_limit_mb:-1",
            "idle_slab_limit_mb:1.5",
            "idle_slab_limit_mb:,",
        ] {
            let e = AllocatorConfig::parse(bad).unwrap_err();
            assert!(e.to_string().contains("idle_slab_limit_mb"), "{bad}: {e}");
        }
    }

    #[test]
    fn errors_name_the_problem() {
        let e = AllocatorConfig::parse("max_split_size_mb:10").unwrap_err();
        assert!(e.to_string().contains("max_split_size_mb"), "{e}");
        let e = AllocatorConfig::parse("bogus:1").unwrap_err();
        assert!(matches!(e, ConfigError::UnknownKey { ref key, .. } if key == "bogus"));
        assert!(e.to_string().contains("bogus"));
        for bad in [
            "garbage_collection_threshold:1.5",
            "garbage_collection_threshold:x",
            "expandable_segments:maybe",
            "roundup_power2_divisions:3",
            "roundup_power2_divisions:[100:2]",
            "roundup_power2_divisions:[256:3]",
            "roundup_power2_divisions:[256:2",
            "backend:cudaMallocAsync",
            "policy",
            "policy:",
            "max_split_size_mb:64 max_split_size_mb:32",
            "expandable_segments:true,unmap_free_pages:true,unmap_page_mb:6",
            "expandable_segments:true,unmap_free_pages:true,unmap_page_mb:0",
            "expandable_segments:true,unmap_page_mb:8",
        ] {
            assert!(AllocatorConfig::parse(bad).is_err(), "{bad} accepted");
        }
        assert!(AllocatorConfig::parse("max_split_size_mb:64 policy:buddy").is_err());
    }
}
