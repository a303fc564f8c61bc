//! Settings changed while the allocator runs, as PyTorch's
//! `torch.cuda.memory._set_allocator_settings` changes them: rounding,
//! `max_split_size_mb`, garbage collection, expandable segments and stream
//! reuse apply from the next decision on; what is already allocated or
//! cached stays as it is. The options that shape the segments already made
//! (`unmap_free_pages`, its page size) and the policy itself stay fixed.
//!
//! [`EngineOptions`] holds the engine's settings and says which of them
//! may change while it runs ([`EngineOptions::check_change`]); the engine
//! hands the others to its parts.

use crate::budget::MemoryBudget;
use crate::config::{AllocatorConfig, Config, UnmapFreePages};
use crate::error::AllocError;
use crate::page_layout::PageLayout;

/// Engine behaviour that is not policy: taken from an [`AllocatorConfig`]
/// (the default is that of the default configuration).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineOptions {
    /// `garbage_collection_threshold`, handed to the policy's collector.
    pub garbage_collection_threshold: Option<f64>,
    /// Reuse blocks awaiting events by making the allocating stream wait on
    /// them instead of reserving new memory.
    pub stream_wait_reuse: bool,
    /// Grow one segment per stream and pool instead of making new ones
    /// (needs a backend with growable ranges and a policy that supports them).
    pub expandable_segments: bool,
    /// With expandable segments, unmap free pages before mapping more.
    pub unmap_free_pages: bool,
    /// With `unmap_free_pages`, the large pool's pages (rounded up to the
    /// backend's granularity).
    pub unmap_pages: PageLayout,
    /// With `unmap_free_pages`, whether the backend unmaps moved pages on a
    /// worker thread: the backend reads it at creation, the engine keeps it
    /// to refuse a change at run time.
    pub unmap_worker: bool,
    /// With `unmap_free_pages`, the bytes freed in a growable segment after
    /// which a free records a mark (`idle_mark_mb`; 0: off).
    pub idle_mark: u64,
    /// With `unmap_free_pages`, serve a large allocation that would pass
    /// the level with another stream's free block over idle pages
    /// (`lend_idle_blocks`).
    pub lend_idle_blocks: bool,
    /// During a capture, reuse a block freed while other streams used it
    /// once the capture's graph orders the allocating stream after those
    /// uses (needs a stream backend that reads the graph).
    pub graph_capture_record_stream_reuse: bool,
    /// With `unmap_free_pages`, the memory budget below which the heap grows
    /// without unmapping or moving pages ([`crate::budget`]); `None`: the
    /// reserved peak is that level.
    pub memory_budget: Option<MemoryBudget>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions::from(&AllocatorConfig::default())
    }
}

/// The flat view's options as they stand (a policy of one's own, settings
/// changed at run time); for a configuration the parser accepts, the same
/// as from its checked form.
impl From<&AllocatorConfig> for EngineOptions {
    fn from(cfg: &AllocatorConfig) -> Self {
        EngineOptions {
            garbage_collection_threshold: cfg.garbage_collection_threshold,
            stream_wait_reuse: cfg.stream_wait_reuse,
            expandable_segments: cfg.expandable_segments,
            unmap_free_pages: cfg.unmap_free_pages,
            unmap_pages: cfg.unmap_pages,
            unmap_worker: cfg.unmap_worker,
            idle_mark: cfg.idle_mark,
            lend_idle_blocks: cfg.lend_idle_blocks,
            graph_capture_record_stream_reuse: cfg.graph_capture_record_stream_reuse,
            memory_budget: cfg.memory_budget,
        }
    }
}

/// The engine's part of a checked configuration, and its garbage
/// collection threshold.
impl From<&Config> for EngineOptions {
    fn from(cfg: &Config) -> Self {
        let unmap = cfg.engine.segments.unmap();
        EngineOptions {
            garbage_collection_threshold: cfg.gc.and_then(|g| g.threshold()),
            stream_wait_reuse: cfg.engine.stream_wait_reuse,
            expandable_segments: cfg.engine.segments.expandable(),
            unmap_free_pages: unmap.is_some(),
            unmap_pages: unmap.map_or_else(|| UnmapFreePages::default().pages, |u| u.pages),
            unmap_worker: unmap.is_some_and(|u| u.worker),
            idle_mark: unmap.map_or(0, |u| u.idle_mark),
            lend_idle_blocks: unmap.is_some_and(|u| u.lend_idle),
            graph_capture_record_stream_reuse: cfg.engine.graph_capture_record_stream_reuse,
            memory_budget: unmap.and_then(|u| u.budget),
        }
    }
}

impl EngineOptions {
    /// Errors, naming the key, when `wanted` changes an option fixed at
    /// creation: `unmap_free_pages`, and with it its page size and worker,
    /// shape the segments already made.
    pub(crate) fn check_change(&self, wanted: &EngineOptions) -> Result<(), AllocError> {
        let fixed = |key: &str| {
            AllocError::InvalidArgument(format!(
                "`{key}` cannot change while the allocator runs: it shapes the segments \
                 already made (set it in the configuration before the first allocation)"
            ))
        };
        if wanted.unmap_free_pages != self.unmap_free_pages {
            return Err(fixed("unmap_free_pages"));
        }
        if wanted.unmap_free_pages && wanted.unmap_pages != self.unmap_pages {
            return Err(fixed("unmap_page_mb"));
        }
        if wanted.unmap_free_pages && wanted.unmap_worker != self.unmap_worker {
            return Err(fixed("unmap_worker"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The options of the configuration `settings` (`key:value,...`).
    fn options(settings: &str) -> EngineOptions {
        EngineOptions::from(&AllocatorConfig::default().with_settings(settings).unwrap())
    }

    #[test]
    fn settings_that_shape_segments_cannot_change() {
        let plain = options("expandable_segments:True");
        let unmapping = options("expandable_segments:True,unmap_free_pages:True");
        assert!(plain.check_change(&plain).is_ok());
        let err = plain.check_change(&unmapping).unwrap_err().to_string();
        assert!(err.contains("`unmap_free_pages`"), "{err}");
        let err = unmapping.check_change(&plain).unwrap_err().to_string();
        assert!(err.contains("`unmap_free_pages`"), "{err}");
        let mut other_pages = unmapping;
        other_pages.unmap_pages = PageLayout::uniform(64 << 20);
        assert_ne!(other_pages.unmap_pages, unmapping.unmap_pages);
        let err = unmapping
            .check_change(&other_pages)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`unmap_page_mb`"), "{err}");
        let mut worker = unmapping;
        worker.unmap_worker = !unmapping.unmap_worker;
        let err = unmapping.check_change(&worker).unwrap_err().to_string();
        assert!(err.contains("`unmap_worker`"), "{err}");
        // Without page recycling, its page size and worker do not matter.
        let mut plain_pages = plain;
        plain_pages.unmap_pages = PageLayout::uniform(64 << 20);
        plain_pages.unmap_worker = !plain.unmap_worker;
        assert!(plain.check_change(&plain_pages).is_ok());
    }

    #[test]
    fn settings_that_apply_from_the_next_decision_may_change() {
        let before = options("expandable_segments:True");
        let after = options("expandable_segments:False,garbage_collection_threshold:0.5");
        assert!(before.check_change(&after).is_ok());
        assert_eq!(after.garbage_collection_threshold, Some(0.5));
        assert!(!after.expandable_segments);
    }

    #[test]
    fn the_idle_mark_reaches_the_engine_from_both_views_and_may_change() {
        let text = "expandable_segments:True,unmap_free_pages:True,idle_mark_mb:512";
        let flat = options(text);
        assert_eq!(flat.idle_mark, 512 << 20);
        let checked = EngineOptions::from(&Config::parse(text).unwrap());
        assert_eq!(checked.idle_mark, 512 << 20);
        assert_eq!(options("expandable_segments:True").idle_mark, 0);
        // Marks change when pages are known idle, not how segments are made.
        let off = options("expandable_segments:True,unmap_free_pages:True");
        assert!(flat.check_change(&off).is_ok());
    }
}
