//! Replays a trace through the engine on the simulated device and measures
//! peaks, device calls and host cost per operation.

use std::time::Instant;

use alloc_core::{
    AllocError, AllocatorConfig, Engine, Policy, SimMemory, SimStreams, StreamId, GIB,
};
use alloc_policy::AnyPolicy;
use rustc_hash::FxHashMap;
use serde::Serialize;
use thiserror::Error;

use crate::peak_resets::{PeakResets, Peaks};
use crate::trace::{Trace, TraceEvent};

/// Capacity of the simulated device: an H100 80GB as PyTorch sees it.
pub const DEFAULT_CAPACITY: u64 = 80 * GIB;

/// Why a replay stopped.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The configuration (policy name, keys) was rejected.
    #[error(transparent)]
    Config(#[from] alloc_core::ConfigError),
    /// The trace has nothing to replay.
    #[error("{trace}: the trace has no allocations to replay")]
    NoAllocations {
        /// Trace name.
        trace: String,
    },
    /// The engine failed on an event that should have succeeded.
    #[error("{trace} under {policy}: event {index}: {source}")]
    Engine {
        /// Trace name.
        trace: String,
        /// Policy name.
        policy: String,
        /// Index of the event in the trace.
        index: usize,
        /// The engine's error.
        source: Box<AllocError>,
    },
    /// The engine refused the memory fraction of [`ReplayOptions::memory_fraction`].
    #[error("{trace} under {policy}: memory fraction {fraction}: {source}")]
    MemoryFraction {
        /// Trace name.
        trace: String,
        /// Policy name.
        policy: String,
        /// The fraction asked for.
        fraction: f64,
        /// The engine's error.
        source: Box<AllocError>,
    },
}

/// Figures of one replay of one trace under one policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// Trace name.
    pub trace: String,
    /// Policy name (with configuration, when one was given).
    pub policy: String,
    /// Allocation and free events replayed.
    pub ops: u64,
    /// Highest sum of requested bytes of live blocks.
    pub peak_requested_bytes: u64,
    /// Highest sum of (rounded) bytes of live blocks.
    pub peak_allocated_bytes: u64,
    /// Highest bytes reserved from the device.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes / peak_requested_bytes`.
    pub reserved_over_requested: f64,
    /// Device allocations (cudaMalloc calls).
    pub device_allocs: u64,
    /// Device frees (cudaFree calls).
    pub device_frees: u64,
    /// Pages `unmap_free_pages` unmapped under free blocks to make room
    /// (each is mapped again later: a move).
    pub pages_moved: u64,
    /// Times `unmap_free_pages` waited on the host for a stream (with a
    /// GPU lag, [`ReplayOptions::gpu_lag`], the pages it needed were still
    /// in use).
    pub stream_waits: u64,
    /// Queries of the device's free memory (`cuMemGetInfo` on a GPU, a
    /// driver call of microseconds): a budget asks before each mapping.
    pub free_queries: u64,
    /// Allocations that needed the flush-everything retry.
    pub retries: u64,
    /// Allocations that failed for lack of memory.
    pub ooms: u64,
    /// Host nanoseconds per replayed operation (best of the timed runs).
    pub ns_per_op: f64,
}

/// A replay with its memory timeline.
#[derive(Debug, Clone)]
pub struct ReplayRun {
    /// The figures.
    pub report: ReplayReport,
    /// `(event index, allocated bytes, reserved bytes)` after each event that
    /// changed either.
    pub timeline: Vec<(u64, u64, u64)>,
}

/// How to replay.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ReplayOptions {
    /// Simulated device capacity.
    pub capacity: u64,
    /// Timed repetitions; the fastest counts.
    pub timed_runs: usize,
    /// How many trace events the simulated GPU runs behind the host (see
    /// [`SimStreams::with_gpu_lag`]); `None`: events complete only when the
    /// engine waits for them.
    pub gpu_lag: Option<u64>,
    /// PyTorch's per-process memory fraction (`set_per_process_memory_fraction`),
    /// in `[0, 1]`: reserved memory is limited to this share of the device,
    /// and a budget (the `budget` setting) reclaims at it.
    pub memory_fraction: Option<f64>,
    /// Resets the statistics' peaks (`reset_peak_memory_stats`) after every
    /// this many allocations, as a loop that logs each step's peak does
    /// ([`PeakResets`]); `None` or 0: never. The report's peaks stay the
    /// trace's.
    pub reset_peaks_every: Option<u64>,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            capacity: DEFAULT_CAPACITY,
            timed_runs: 3,
            gpu_lag: None,
            memory_fraction: None,
            reset_peaks_every: None,
        }
    }
}

type SimEngine = Engine<AnyPolicy, SimMemory, SimStreams>;

/// Builds an engine for a configuration string on a simulated device.
pub fn sim_engine(config: &str, capacity: u64) -> Result<SimEngine, alloc_core::ConfigError> {
    engine_on(config, SimMemory::new(capacity), SimStreams::new())
}

fn engine_on(
    config: &str,
    memory: SimMemory,
    streams: SimStreams,
) -> Result<SimEngine, alloc_core::ConfigError> {
    AnyPolicy::engine(&AllocatorConfig::parse(config)?, memory, streams)
}

/// The simulated device for replaying `trace`: it hands out the recording's
/// segment addresses where the trace has them (see
/// [`SimMemory::with_recorded_addresses`]), so that replaying PyTorch's policy
/// reproduces PyTorch's choices exactly.
pub fn device_for(trace: &Trace, capacity: u64) -> SimMemory {
    let recorded: Vec<(u64, u64)> = trace
        .segment_allocs
        .iter()
        .zip(&trace.segment_addrs)
        .map_while(|(&size, addr)| addr.map(|a| (size, a)))
        .collect();
    if recorded.is_empty() {
        SimMemory::new(capacity)
    } else {
        SimMemory::with_recorded_addresses(capacity, recorded)
    }
}

/// Replays `trace` under `config` (a configuration string such as
/// `policy:buddy`): one pass recording the timeline, then timed passes.
pub fn replay(trace: &Trace, config: &str, opts: &ReplayOptions) -> Result<ReplayRun, ReplayError> {
    let mut timeline = Vec::new();
    // Found once, outside the timed passes.
    let completions = late_completions(trace);
    let (engine, resets) = run_events(trace, &completions, config, opts, Some(&mut timeline))?;
    let mut best = f64::INFINITY;
    for _ in 0..opts.timed_runs {
        let start = Instant::now();
        let timed = run_events(trace, &completions, config, opts, None)?;
        let ns = start.elapsed().as_nanos() as f64;
        drop(timed);
        best = best.min(ns);
    }
    let s = engine.stats();
    let ops = trace.events.len() as u64;
    let peaks = resets.map_or_else(|| Peaks::of(&s), |r| r.peaks(&s));
    let peak_requested = peaks.requested;
    let peak_reserved = peaks.reserved;
    let policy = if config.is_empty() || config == format!("policy:{}", engine.policy().name()) {
        engine.policy().name().to_string()
    } else {
        config.to_string()
    };
    Ok(ReplayRun {
        report: ReplayReport {
            trace: trace.name.clone(),
            policy,
            ops,
            peak_requested_bytes: peak_requested,
            peak_allocated_bytes: peaks.allocated,
            peak_reserved_bytes: peak_reserved,
            reserved_over_requested: peak_reserved as f64 / peak_requested.max(1) as f64,
            device_allocs: s.num_device_alloc,
            device_frees: s.num_device_free,
            pages_moved: s.page_moves.pages_unmapped,
            stream_waits: s.page_moves.stream_waits,
            free_queries: engine.memory().free_queries(),
            retries: s.num_alloc_retries,
            ooms: s.num_ooms,
            ns_per_op: if opts.timed_runs == 0 {
                f64::NAN
            } else {
                best / ops.max(1) as f64
            },
        },
        timeline,
    })
}

/// The frees of `trace` that completed later ([`TraceEvent::FreeCompleted`]):
/// index of the free -> index of its completion (each completion belongs to
/// the last free of its id before it). Empty, without a look at the frees,
/// for a trace with no late completion.
fn late_completions(trace: &Trace) -> FxHashMap<usize, usize> {
    let mut completion_of = FxHashMap::default();
    if trace.late_completions() == 0 {
        return completion_of;
    }
    let mut last_free: FxHashMap<u64, usize> = FxHashMap::default();
    for (index, event) in trace.events.iter().enumerate() {
        match *event {
            TraceEvent::Free { id, .. } => {
                last_free.insert(id, index);
            }
            TraceEvent::FreeCompleted { id } => {
                if let Some(free) = last_free.remove(&id) {
                    completion_of.insert(free, index);
                }
            }
            TraceEvent::Alloc { .. } => {}
        }
    }
    completion_of
}

/// The frees of a trace that completed later, during one replay: each such
/// block is used, as far as the engine knows, by a stream of its own
/// (`record_stream`) whose work completes at the completion, so that it
/// awaits events as the recording allocator's block did, and a setting that
/// reuses blocks with a stream wait (`stream_wait_reuse`) may do so.
struct AwaitingFrees<'a> {
    /// Index of an awaiting free -> index of its completion
    /// ([`late_completions`]).
    completion_of: &'a FxHashMap<usize, usize>,
    /// Index of a completion -> the stream its free's use was recorded on.
    stream_at: FxHashMap<usize, StreamId>,
    /// Streams whose use completed, for the next awaiting free.
    spare: Vec<StreamId>,
    /// Streams made so far.
    made: u64,
}

impl<'a> AwaitingFrees<'a> {
    /// The first stream number of the frees' own streams: above any a
    /// trace numbers (small integers from 0).
    const FIRST_STREAM: u64 = 1 << 48;

    /// None used yet; `completion_of` from [`late_completions`].
    fn new(completion_of: &'a FxHashMap<usize, usize>) -> Self {
        AwaitingFrees {
            completion_of,
            stream_at: FxHashMap::default(),
            spare: Vec::new(),
            made: 0,
        }
    }

    /// Before the free at `index` of the block at `addr`: when that free
    /// completes later, a use of the block by a stream of its own.
    fn record_use<P: Policy>(
        &mut self,
        index: usize,
        addr: u64,
        engine: &mut Engine<P, SimMemory, SimStreams>,
    ) -> Result<(), AllocError> {
        let Some(&completion) = self.completion_of.get(&index) else {
            return Ok(());
        };
        let stream = self.spare.pop().unwrap_or_else(|| {
            self.made += 1;
            StreamId(Self::FIRST_STREAM + self.made)
        });
        self.stream_at.insert(completion, stream);
        engine.record_stream(addr, stream)
    }

    /// At the completion at `index`: the use's stream ran its work.
    fn complete(&mut self, index: usize, streams: &mut SimStreams) {
        if let Some(stream) = self.stream_at.remove(&index) {
            streams.complete_stream(stream);
            self.spare.push(stream);
        }
    }
}

/// Runs every event through a fresh engine. Frees of ids never allocated
/// (made before recording began) are skipped; an allocation that runs out of
/// memory is counted and its later free skipped. With
/// [`ReplayOptions::reset_peaks_every`], also the resets, returned with the
/// peaks they hid.
fn run_events(
    trace: &Trace,
    completions: &FxHashMap<usize, usize>,
    config: &str,
    opts: &ReplayOptions,
    mut timeline: Option<&mut Vec<(u64, u64, u64)>>,
) -> Result<(SimEngine, Option<PeakResets>), ReplayError> {
    let streams = opts
        .gpu_lag
        .map_or_else(SimStreams::new, SimStreams::with_gpu_lag);
    let mut engine = engine_on(config, device_for(trace, opts.capacity), streams)?;
    if let Some(fraction) = opts.memory_fraction {
        engine
            .set_memory_fraction(fraction)
            .map_err(|source| ReplayError::MemoryFraction {
                trace: trace.name.clone(),
                policy: config.to_string(),
                fraction,
                source: Box::new(source),
            })?;
    }
    let mut live: FxHashMap<u64, u64> = FxHashMap::default();
    live.reserve(1024);
    let mut awaiting = AwaitingFrees::new(completions);
    let mut last = (0, 0);
    let mut resets = opts.reset_peaks_every.and_then(PeakResets::every);
    for (index, event) in trace.events.iter().enumerate() {
        let result = match *event {
            TraceEvent::Alloc { id, size, stream } => {
                let result = match engine.malloc(size.max(1), StreamId(stream)) {
                    Ok(a) => {
                        live.insert(id, a.addr);
                        Ok(())
                    }
                    Err(AllocError::OutOfMemory(_)) => Ok(()),
                    Err(e) => Err(e),
                };
                if let Some(r) = resets.as_mut() {
                    if r.after_allocation(|| engine.stats()) {
                        engine.reset_peak_stats();
                    }
                }
                result
            }
            TraceEvent::Free { id, .. } => match live.remove(&id) {
                Some(addr) => awaiting
                    .record_use(index, addr, &mut engine)
                    .and_then(|()| engine.free(addr)),
                None => Ok(()),
            },
            TraceEvent::FreeCompleted { .. } => {
                awaiting.complete(index, engine.streams_mut());
                Ok(())
            }
        };
        if opts.gpu_lag.is_some() {
            engine.streams_mut().tick();
        }
        result.map_err(|source| ReplayError::Engine {
            trace: trace.name.clone(),
            policy: config.to_string(),
            index,
            source: Box::new(source),
        })?;
        if let Some(points) = timeline.as_deref_mut() {
            let now = (engine.allocated_bytes(), engine.reserved_bytes());
            if now != last {
                points.push((index as u64, now.0, now.1));
                last = now;
            }
        }
    }
    Ok((engine, resets))
}
