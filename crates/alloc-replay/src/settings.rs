//! The settings worth choosing between, as the advice weighs them.
//!
//! PyTorch's two settings (its default rules and its expandable segments),
//! which the replay reproduces byte for byte, against ours that reserve
//! less: `unmap_free_pages` with 16 MiB pages (its default) and 8 MiB pages,
//! memory at the bound (8 MiB pages with a planned layout and first fit for
//! large requests), size classes (the lowest host cost), and, on traces with
//! several streams, stream-wait reuse for FSDP-style training.

use std::borrow::Cow;

use alloc_core::config::named::{self, NamedSetting};
use serde::Serialize;

use crate::trace::Trace;

/// One setting: a configuration string and what it is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Setting {
    /// Short name, for table columns (`unmap16`).
    pub name: &'static str,
    /// What it is, in words.
    pub label: &'static str,
    /// The configuration string (`GPUALLOC_CONF`, `gpu_alloc.enable(...)`);
    /// empty for the default.
    pub config: &'static str,
    /// PyTorch's own allocator has this setting (and the replay reproduces
    /// it): `PYTORCH_CUDA_ALLOC_CONF` takes the same string.
    pub pytorch: bool,
    /// The page size it moves, in MiB (`unmap_free_pages`), if it moves any.
    pub page_mb: Option<u64>,
    /// It only differs from the others where several streams share memory.
    pub multi_stream: bool,
}

/// PyTorch's default rules (ours reproduce them: `policy:pytorch-bfc`).
pub const PYTORCH_DEFAULT: Setting = Setting {
    name: named::DEFAULT.name,
    label: "PyTorch's default",
    config: named::DEFAULT.config,
    pytorch: true,
    page_mb: None,
    multi_stream: false,
};

/// PyTorch's expandable segments (reproduced byte for byte).
pub const PYTORCH_EXPANDABLE: Setting = Setting {
    name: named::EXPANDABLE.name,
    label: "PyTorch's expandable segments",
    config: named::EXPANDABLE.config,
    pytorch: true,
    page_mb: None,
    multi_stream: false,
};

/// Memory at the bound: 8 MiB pages moved under a planned layout, with
/// requests of 8 MiB and more placed first fit (lowest address), which keeps
/// a growing key/value cache from stranding holes that pages must then
/// leave (docs/policies.md, "Memory at the bound").
pub const BOUND: Setting = Setting {
    name: named::BOUND.name,
    label: "at the bound: 8 MiB pages, plan, first fit",
    config: named::BOUND.config,
    pytorch: false,
    page_mb: Some(8),
    multi_stream: false,
};

/// The configuration of [`BUDGET`] ends with this budget: the device's
/// memory, so that pages move only when the device runs short.
const DEVICE_BUDGET: &str = "memory_budget_fraction:1";

/// Reclaim at a memory budget: 16 MiB pages, unmapped and reused only once
/// reserved memory reaches the budget (by default the device's memory, so
/// only under real pressure), never below it (docs/policies.md, "A memory
/// budget").
pub const BUDGET: Setting = Setting {
    name: named::BUDGET.name,
    label: "at a budget: 16 MiB pages moved at it only",
    config: named::BUDGET.config,
    pytorch: false,
    page_mb: Some(16),
    multi_stream: false,
};

/// Every setting the advice replays, in the order of the tables; the first
/// two are PyTorch's.
pub const SETTINGS: &[Setting] = &[
    PYTORCH_DEFAULT,
    PYTORCH_EXPANDABLE,
    Setting {
        name: named::UNMAP16.name,
        label: "unmap_free_pages, 16 MiB pages",
        config: named::UNMAP16.config,
        pytorch: false,
        page_mb: Some(16),
        multi_stream: false,
    },
    Setting {
        name: named::UNMAP8.name,
        label: "unmap_free_pages, 8 MiB pages",
        config: named::UNMAP8.config,
        pytorch: false,
        page_mb: Some(8),
        multi_stream: false,
    },
    BOUND,
    Setting {
        name: named::SIZE_CLASS.name,
        label: "size classes",
        config: named::SIZE_CLASS.config,
        pytorch: false,
        page_mb: None,
        multi_stream: false,
    },
    Setting {
        name: named::STREAM_WAIT.name,
        label: "stream-wait reuse + unmap_free_pages (FSDP)",
        config: named::STREAM_WAIT.config,
        pytorch: false,
        page_mb: Some(16),
        multi_stream: true,
    },
    Setting {
        name: named::MULTI_STREAM.name,
        label: "stream-wait, pages moved past 1.03x alloc.",
        config: named::MULTI_STREAM.config,
        pytorch: false,
        page_mb: Some(16),
        multi_stream: true,
    },
    BUDGET,
];

impl Setting {
    /// The configuration string the engine takes (`policy:pytorch-bfc` for
    /// the default's empty one).
    pub fn engine_config(&self) -> &'static str {
        if self.config.is_empty() {
            "policy:pytorch-bfc"
        } else {
            self.config
        }
    }

    /// Its configuration string under a memory budget of `budget` bytes
    /// (whole MiB, at least one), for a setting with a budget ([`BUDGET`]);
    /// `None`, or a setting without one: its own string.
    pub fn config_at(&self, budget: Option<u64>) -> Cow<'static, str> {
        match (self.config.strip_suffix(DEVICE_BUDGET), budget) {
            (Some(base), Some(bytes)) => {
                format!("{base}memory_budget_mb:{}", (bytes >> 20).max(1)).into()
            }
            _ => self.config.into(),
        }
    }

    /// The Python call that selects it, by name.
    pub fn enable_call(&self) -> String {
        if self.config.is_empty() {
            "gpu_alloc.enable()".to_string()
        } else {
            format!("gpu_alloc.enable(\"{}\")", self.name)
        }
    }

    /// The named setting of the configuration parser that it is: the name
    /// and string that every configuration entry point takes.
    pub fn named(&self) -> Option<&'static NamedSetting> {
        named::named_setting(self.name)
    }
}

/// The Python call that selects the configuration `config` (a setting's
/// string at a budget of the caller's, which no name stands for).
pub fn enable_call_of(config: &str) -> String {
    if config.is_empty() {
        "gpu_alloc.enable()".to_string()
    } else {
        format!("gpu_alloc.enable(\"{config}\")")
    }
}

/// The settings that apply to `trace`: stream-wait reuse only where the
/// trace uses more than one stream, by allocating on several or by frees
/// that waited for other streams' use (otherwise it is `unmap16`).
pub fn settings_for(trace: &Trace) -> Vec<&'static Setting> {
    let several = trace.stream_count() > 1 || trace.late_completions() > 0;
    SETTINGS
        .iter()
        .filter(|s| !s.multi_stream || several)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceEvent;

    #[test]
    fn every_setting_parses_and_the_first_two_are_pytorchs() {
        for s in SETTINGS {
            alloc_core::Config::parse(s.engine_config())
                .unwrap_or_else(|e| panic!("{}: {e}", s.name));
        }
        assert_eq!(SETTINGS[0], PYTORCH_DEFAULT);
        assert_eq!(SETTINGS[1], PYTORCH_EXPANDABLE);
        assert!(SETTINGS[2..].iter().all(|s| !s.pytorch));
        assert_eq!(PYTORCH_DEFAULT.enable_call(), "gpu_alloc.enable()");
        assert_eq!(
            PYTORCH_EXPANDABLE.enable_call(),
            "gpu_alloc.enable(\"expandable\")"
        );
    }

    #[test]
    fn every_setting_is_a_named_setting_of_the_parser() {
        for s in SETTINGS {
            let named = s
                .named()
                .unwrap_or_else(|| panic!("{} has no name", s.name));
            assert_eq!(named.config, s.config, "{}", s.name);
            assert_eq!(
                alloc_core::AllocatorConfig::parse(s.name).unwrap(),
                alloc_core::AllocatorConfig::parse(s.config).unwrap(),
                "{}",
                s.name
            );
        }
    }

    #[test]
    fn the_budget_setting_takes_a_budget_and_the_others_keep_their_string() {
        assert_eq!(BUDGET.config_at(None), BUDGET.config);
        let at = BUDGET.config_at(Some(24 << 30));
        assert_eq!(
            at,
            "expandable_segments:True,unmap_free_pages:True,unmap_page_mb:16,\
             idle_mark_mb:512,lend_idle_blocks:True,memory_budget_mb:24576"
        );
        let cfg = alloc_core::AllocatorConfig::parse(&at).unwrap();
        assert_eq!(
            cfg.memory_budget,
            Some(alloc_core::MemoryBudget::Bytes(24 << 30))
        );
        assert_eq!(BUDGET.config_at(Some(1)), BUDGET.config_at(Some(1 << 20)));
        assert_eq!(BOUND.config_at(Some(1 << 30)), BOUND.config);
    }

    #[test]
    fn stream_wait_reuse_applies_to_traces_with_several_streams_or_late_frees() {
        let alloc = |id, stream| TraceEvent::Alloc {
            id,
            size: 1 << 20,
            stream,
        };
        let one = Trace {
            events: vec![alloc(1, 0), alloc(2, 0)],
            ..Trace::default()
        };
        let two = Trace {
            events: vec![alloc(1, 0), alloc(2, 1)],
            ..Trace::default()
        };
        // One stream allocates, but a free waited for another stream's use.
        let used_elsewhere = Trace {
            events: vec![
                alloc(1, 0),
                TraceEvent::Free { id: 1, stream: 0 },
                alloc(2, 0),
                TraceEvent::FreeCompleted { id: 1 },
            ],
            ..Trace::default()
        };
        let names = |t: &Trace| settings_for(t).iter().map(|s| s.name).collect::<Vec<_>>();
        assert!(!names(&one).contains(&"stream-wait"));
        assert!(!names(&one).contains(&"multi-stream"));
        assert!(names(&two).contains(&"stream-wait"));
        assert!(names(&two).contains(&"multi-stream"));
        assert_eq!(names(&two).len(), SETTINGS.len());
        assert_eq!(used_elsewhere.late_completions(), 1);
        assert!(names(&used_elsewhere).contains(&"stream-wait"));
    }
}
