//! Settings changed while the allocator runs, as PyTorch's
//! `torch.cuda.memory._set_allocator_settings` changes them: rounding,
//! `max_split_size_mb`, garbage collection, expandable segments and stream
//! reuse apply from the next decision on; what is already allocated or
//! cached stays as it is. The options that shape the segments already made
//! (`unmap_free_pages`, its page size) and the policy itself stay fixed.

use super::{Engine, EngineOptions};
use crate::backend::{MemoryBackend, StreamBackend};
use crate::config::AllocatorConfig;
use crate::error::AllocError;
use crate::policy::Policy;

impl<P: Policy, M: MemoryBackend, S: StreamBackend> Engine<P, M, S> {
    /// Takes the settings of `cfg` (a configuration changed with
    /// [`AllocatorConfig::with_settings`]) from now on. Refused, with nothing
    /// changed, when it changes an option fixed at creation or one the
    /// policy cannot change; `cfg.per_process_memory_fraction` and
    /// `cfg.policy` are the caller's to apply
    /// ([`Engine::set_memory_fraction`]; the policy is chosen once).
    ///
    /// ```
    /// use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, GIB, MIB};
    /// use alloc_policy::AnyPolicy;
    ///
    /// let cfg = AllocatorConfig::default();
    /// let mut engine = AnyPolicy::engine(&cfg, SimMemory::new(GIB), SimStreams::new())?;
    /// let before = engine.malloc(84 * MIB, StreamId(1))?;
    /// assert_eq!(before.size, 84 * MIB);
    /// engine.reconfigure(&cfg.with_settings("roundup_power2_divisions:4")?)?;
    /// let after = engine.malloc(84 * MIB, StreamId(1))?;
    /// assert_eq!(after.size, 96 * MIB); // the next quarter step above 64 MiB
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reconfigure(&mut self, cfg: &AllocatorConfig) -> Result<(), AllocError> {
        let wanted = EngineOptions::from(cfg);
        let fixed = |key: &str| {
            AllocError::InvalidArgument(format!(
                "`{key}` cannot change while the allocator runs: it shapes the segments \
                 already made (set it in the configuration before the first allocation)"
            ))
        };
        if wanted.unmap_free_pages != self.options.unmap_free_pages {
            return Err(fixed("unmap_free_pages"));
        }
        if wanted.unmap_free_pages && wanted.unmap_pages != self.options.unmap_pages {
            return Err(fixed("unmap_page_mb"));
        }
        if wanted.unmap_free_pages && wanted.unmap_worker != self.options.unmap_worker {
            return Err(fixed("unmap_worker"));
        }
        self.policy.reconfigure(cfg)?;
        self.caps = self.policy.capabilities();
        // Without virtual memory, segments stay ordinary ones, as at
        // construction ([`Engine::expandable_fallback`]).
        self.segments
            .set_expandable(wanted.expandable_segments && self.caps.supports_growth);
        self.order.set_options(
            wanted.stream_wait_reuse,
            wanted.graph_capture_record_stream_reuse,
        );
        self.options = wanted;
        self.heap
            .set_oversize_threshold(self.caps.oversize_threshold);
        Ok(())
    }
}
