#![doc = include_str!("../README.md")]
//!
//! ## Items
//!
//! Segments obtained from a [`MemoryBackend`] are tiled by blocks kept in an
//! arena ([`Heap`]); a [`Policy`] decides rounding, best fit, splitting and
//! merging; the [`Engine`] adds streams and events (`record_stream`), the
//! out-of-memory path, [`Stats`] in PyTorch's model and [`Snapshot`]s, with
//! settings from an [`AllocatorConfig`]. The simulated device ([`SimMemory`],
//! [`SimStreams`]) backs tests and trace replay.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod backend;
pub mod budget;
pub mod capture;
pub mod checkpoint;
pub mod config;
pub mod device_totals;
pub mod engine;
pub mod error;
mod forward;
pub mod heap;
mod ledger;
mod live_stats;
pub mod page_layout;
mod page_set;
pub mod policy;
pub mod private_pool;
pub mod pytorch;
pub mod sim;
pub mod snapshot;
pub mod stats;
pub mod tags;
pub mod types;
mod validate;

pub use backend::{DetachPages, MemoryBackend, SegmentSource, StreamBackend, VirtualMemory};
pub use budget::MemoryBudget;
pub use capture::{CaptureFrontier, CaptureGraph, GraphNode};
pub use checkpoint::{BlockCheckpoint, PoolCheckpoint, RestoreOutcome, SegmentCheckpoint};
pub use config::{AllocatorConfig, Config, ConfigError, PolicyConfig, SCALED_UNMAP_PAGES};
pub use device_totals::{DeviceTotals, Levels};
pub use engine::{fraction_limit, Engine, EngineOptions, MAX_REQUEST};
pub use error::{AllocError, BackendError, OomReport};
pub use heap::{coalesce, Block, Heap, Segment};
pub use page_layout::{PageLayout, RangePages, DEFAULT_UNMAP_PAGE};
pub use policy::{
    check_growth, Audit, Capabilities, KeptKeys, OomRelease, Policy, Pressure, Reclaim, Request,
};
pub use sim::data::SimDataMemory;
pub use sim::{SimCapture, SimEvent, SimMemory, SimStreams};
pub use snapshot::{BlockSnapshot, SegmentSnapshot, Snapshot, SnapshotState};
pub use stats::{human_bytes, scale_bytes, PageMoves, Stat, StatArray, Stats};
pub use tags::{Backup, CopyBlocks, PauseReport, ResumeReport, TagInfo};
pub use types::{
    Allocation, BlockId, BlockState, CacheKey, Pool, PoolId, PrivatePool, SegmentId, StreamId, GIB,
    KIB, MIB,
};
// The former name stays reachable, warning those who use it.
#[allow(deprecated)]
pub use types::PoolKind;
