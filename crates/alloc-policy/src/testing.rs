//! Test support (cargo feature `testing`): the engine on the simulated
//! device, a model of random operations ([`ops::Op`]) with a driver that
//! checks every invariant after each step ([`ops::Run`]), and a shadow of what
//! was handed out ([`shadow::Shadow`]). The property tests of this crate and
//! the fuzz targets of the repository (`fuzz/`) drive the same model; with
//! the `arbitrary` feature, operations decode from fuzz input.
//!
//! ```
//! use alloc_core::StreamId;
//! use alloc_policy::testing::configs;
//! use alloc_policy::testing::ops::{run, Op};
//!
//! let (compute, copy) = (StreamId(1), StreamId(2));
//! let ops = [
//!     Op::Alloc { size: 3 << 20, stream: compute },
//!     Op::RecordStream { pick: 0, stream: copy },
//!     Op::Free { pick: 0 },
//!     Op::Alloc { size: 3 << 20, stream: compute }, // not the block `copy` may still use
//!     Op::CompleteStream { stream: copy },
//!     Op::Snapshot,
//! ];
//! for config in configs() {
//!     run(&config, 8 << 30, &ops)?;
//! }
//! # Ok::<(), String>(())
//! ```

#[cfg(feature = "arbitrary")]
mod arbitrary;
pub mod ops;
pub mod shadow;

use alloc_core::{AllocatorConfig, Engine, SimDataMemory, SimStreams};

use crate::{policy_names, AnyPolicy};

/// Reproducible random numbers without a dependency: xorshift64 from
/// `seed` (nonzero), one `u64` a call.
pub fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

/// The engine the tests drive: every policy, on the simulated device that
/// keeps what is written into it (which the [`shadow::Shadow`] checks).
pub type SimEngine = Engine<AnyPolicy, SimDataMemory, SimStreams>;

/// An engine for `config` on a simulated device of `capacity` bytes.
pub fn engine_with(config: &str, capacity: u64, streams: SimStreams) -> Result<SimEngine, String> {
    let cfg = AllocatorConfig::parse(config).map_err(|e| e.to_string())?;
    AnyPolicy::engine(&cfg, SimDataMemory::new(capacity), streams).map_err(|e| e.to_string())
}

/// Every compiled-in policy, plus PyTorch's with each engine setting worth
/// testing: expandable segments (with and without unmapped free pages and
/// their page size, uniform or growing with the heap), stream-wait reuse with a split limit, the setting the
/// README recommends for FSDP, growth with a split limit, reuse during
/// captures once the graph joins the streams, garbage collection by age under
/// a threshold, and size classes' bounded mode.
pub fn configs() -> Vec<String> {
    let mut all: Vec<String> = policy_names()
        .iter()
        .map(|p| format!("policy:{p}"))
        .collect();
    if cfg!(feature = "pytorch-bfc") {
        all.push("policy:pytorch-bfc,expandable_segments:true".into());
        all.push("policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true".into());
        all.push(
            "policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true,unmap_page_mb:2"
                .into(),
        );
        all.push(
            "policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true,unmap_page_mb:auto"
                .into(),
        );
        all.push("policy:pytorch-bfc,stream_wait_reuse:true,max_split_size_mb:64".into());
        all.push(
            "policy:pytorch-bfc,stream_wait_reuse:true,expandable_segments:true,\
             unmap_free_pages:true"
                .into(),
        );
        all.push("policy:pytorch-bfc,expandable_segments:true,max_split_size_mb:64".into());
        all.push(
            "policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true,plan_layout:true"
                .into(),
        );
        // A memory budget: pages move only once reserved memory reaches it.
        all.push(
            "policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true,unmap_page_mb:2,\
             memory_budget_mb:64"
                .into(),
        );
        // Pages moved only past 1.03x the allocated peak, marks after every
        // MiB freed, and other streams' idle free blocks lent before pages
        // move (the `multi-stream` setting, with small pages and marks).
        all.push(
            "policy:pytorch-bfc,stream_wait_reuse:true,expandable_segments:true,\
             unmap_free_pages:true,unmap_page_mb:2,memory_budget_over_allocated:1.03,\
             idle_mark_mb:1,lend_idle_blocks:true"
                .into(),
        );
        // The same lending at a memory budget.
        all.push(
            "policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true,unmap_page_mb:2,\
             idle_mark_mb:1,lend_idle_blocks:true,memory_budget_mb:64"
                .into(),
        );
        // Reuse during captures once the graph joins the other streams.
        all.push("policy:pytorch-bfc,graph_capture_record_stream_reuse:true".into());
    }
    if cfg!(all(feature = "pytorch-bfc", feature = "gc-age")) {
        all.push("policy:pytorch-bfc+gc-age,garbage_collection_threshold:0.6".into());
    }
    if cfg!(feature = "size-class") {
        all.push("policy:size-class,idle_slab_limit_mb:0".into());
    }
    all
}
