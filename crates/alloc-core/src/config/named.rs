//! Settings by name: a word that stands for a whole configuration string,
//! accepted wherever a configuration is (`bound`, or `bound,max_split_size_mb:64`
//! with later options overriding the named ones). The replay's advice names
//! its settings with the same words.

/// A named configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamedSetting {
    /// The name (`bound`).
    pub name: &'static str,
    /// The configuration string it stands for; empty for the defaults.
    pub config: &'static str,
    /// What it costs, in one line (docs/policies.md, "Settings by name").
    pub cost: &'static str,
}

/// PyTorch's default rules.
pub const DEFAULT: NamedSetting = NamedSetting {
    name: "default",
    config: "",
    cost: "PyTorch's own behaviour: the most memory on growing workloads, no page moves",
};

/// PyTorch's expandable segments.
pub const EXPANDABLE: NamedSetting = NamedSetting {
    name: "expandable",
    config: "expandable_segments:True",
    cost: "PyTorch's expandable segments: maps memory as segments grow, never unmaps",
};

/// Free pages unmapped before the heap grows, 16 MiB pages.
pub const UNMAP16: NamedSetting = NamedSetting {
    name: "unmap16",
    config: "expandable_segments:True,unmap_free_pages:True",
    cost: "driver calls to move free 16 MiB pages where the heap would grow",
};

/// Free pages unmapped before the heap grows, 8 MiB pages.
pub const UNMAP8: NamedSetting = NamedSetting {
    name: "unmap8",
    config: "expandable_segments:True,unmap_free_pages:True,unmap_page_mb:8",
    cost: "less memory than unmap16 for more page moves (smaller pages)",
};

/// Memory at the bound: 8 MiB pages moved under a planned layout, large
/// requests placed first fit (docs/policies.md, "Memory at the bound").
pub const BOUND: NamedSetting = NamedSetting {
    name: "bound",
    config: "expandable_segments:True,unmap_free_pages:True,unmap_page_mb:8,plan_layout:True,\
             first_fit_mb:8",
    cost: "the least memory; page moves and a layout plan learnt over the first steps",
};

/// Size classes.
pub const SIZE_CLASS: NamedSetting = NamedSetting {
    name: "size-class",
    config: "policy:size-class",
    cost: "the lowest host time per call; more memory held in slabs",
};

/// Stream-wait reuse with unmapped free pages, for FSDP-style training.
pub const STREAM_WAIT: NamedSetting = NamedSetting {
    name: "stream-wait",
    config: "stream_wait_reuse:True,expandable_segments:True,unmap_free_pages:True",
    cost:
        "as unmap16, and out of room a stream waits on another's events to reuse its freed blocks",
};

/// Stream-wait reuse with free pages moved only past 1.03x the allocated
/// peak: the multi-stream setting for FSDP-style training, at most 3% over
/// the bytes the program holds with fewer page moves than `stream-wait`
/// (docs/policies.md, "A budget over the allocated peak"). Pages move
/// rarely, so a mark every 512 MiB freed keeps the knowledge of which free
/// pages the GPU is done with fresh (`idle_mark_mb`), and a large block
/// whose growth would pass the level takes another stream's free block the
/// GPU is done with where it lies instead of moving pages
/// (`lend_idle_blocks`).
pub const MULTI_STREAM: NamedSetting = NamedSetting {
    name: "multi-stream",
    config: "stream_wait_reuse:True,expandable_segments:True,unmap_free_pages:True,\
             memory_budget_over_allocated:1.03,idle_mark_mb:512,lend_idle_blocks:True",
    cost: "as stream-wait, but pages move only once reserved memory passes 1.03x the allocated \
           peak, and other streams' idle free blocks serve first",
};

/// Expandable segments whose free pages are unmapped and reused only once
/// reserved memory reaches a budget: by default the device's memory (or
/// PyTorch's per-process memory fraction, where set), so pages move only
/// under pressure (docs/policies.md, "A memory budget"); there, another
/// stream's free block the GPU is done with serves a large request before
/// pages move (`lend_idle_blocks`).
pub const BUDGET: NamedSetting = NamedSetting {
    name: "budget",
    config: "expandable_segments:True,unmap_free_pages:True,unmap_page_mb:16,\
             idle_mark_mb:512,lend_idle_blocks:True,memory_budget_fraction:1",
    cost: "as expandable below the budget; at it, driver calls to move free 16 MiB pages",
};

/// Every named setting. A new one is one entry here.
pub const NAMED_SETTINGS: &[NamedSetting] = &[
    DEFAULT,
    EXPANDABLE,
    UNMAP16,
    UNMAP8,
    BOUND,
    SIZE_CLASS,
    STREAM_WAIT,
    MULTI_STREAM,
    BUDGET,
];

/// The setting called `name`, if there is one.
pub fn named_setting(name: &str) -> Option<&'static NamedSetting> {
    NAMED_SETTINGS.iter().find(|s| s.name == name)
}

/// The names, comma separated, for error messages.
pub fn names() -> String {
    NAMED_SETTINGS
        .iter()
        .map(|s| s.name)
        .collect::<Vec<_>>()
        .join(", ")
}
