//! A model of what callers do to an engine ([`Op`]) and a driver ([`Run`])
//! that applies operations one at a time and checks after each one every
//! invariant of the engine (`validate()`), the [`Shadow`] of what was handed
//! out, and the outcome the operation must have (errors of the right kind for
//! bad arguments, out of memory only where plausible, nothing given back
//! during a capture, held pools kept across `empty_cache`).

use std::collections::HashMap;

use alloc_core::{AllocError, PoolId, SimStreams, SnapshotState, StreamId, MAX_REQUEST};

use super::shadow::Shadow;
use super::{engine_with, SimEngine};

/// The streams the generated operations use: the default stream, another,
/// and one with the top bit set (every value is a stream; private pools are
/// keyed apart).
pub const STREAMS: [StreamId; 3] = [StreamId(0), StreamId(1), StreamId(1 << 63)];

/// Private pools the generated operations use: `(1, 0)` up to `(POOLS, 0)`.
pub const POOLS: u64 = 2;

/// One thing a caller does to the engine. Picks select a live allocation by
/// index (modulo their count) and are ignored when none is live.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Allocates `size` bytes on `stream`; the default stream's allocations
    /// go to the capture's private pool while one is underway. A size of 0
    /// or above [`MAX_REQUEST`] must be refused.
    Alloc {
        /// Bytes requested.
        size: u64,
        /// The allocating stream.
        stream: StreamId,
    },
    /// Frees a live allocation, then frees it again (which must be refused).
    Free {
        /// Which live allocation.
        pick: usize,
    },
    /// Frees, and records a stream on, an address inside a live block past
    /// its start: both must be refused as unknown pointers, changing nothing.
    FreeInterior {
        /// Which live allocation.
        pick: usize,
        /// Offset past the block's start (modulo its size less one).
        offset: u64,
    },
    /// Marks a live allocation as used on `stream` too (`record_stream`).
    RecordStream {
        /// Which live allocation.
        pick: usize,
        /// The other stream.
        stream: StreamId,
    },
    /// The simulated GPU finishes all work queued on `stream`.
    CompleteStream {
        /// The stream that runs dry.
        stream: StreamId,
    },
    /// One host operation passes: with a GPU lag, older events complete.
    Tick,
    /// The engine polls its outstanding events.
    ProcessEvents,
    /// Returns idle cached memory to the device (refused during a capture).
    EmptyCache,
    /// Starts routing the default stream's allocations to private pool
    /// `(pool, 0)` and capturing the default stream (a CUDA graph capture),
    /// holding the pool once more; ignored during a capture.
    BeginCapture {
        /// First half of the pool id.
        pool: u64,
    },
    /// A kernel on `stream` (a node of the graph when it is capturing).
    Launch {
        /// The stream it runs on.
        stream: StreamId,
    },
    /// `waiter.wait_stream(on)`: in a capture, a fork or a join; ignored
    /// when both are the same stream.
    WaitStream {
        /// The stream that waits.
        waiter: StreamId,
        /// The stream waited for.
        on: StreamId,
    },
    /// Ends the open capture (refused when none is open).
    EndCapture,
    /// Drops one holder of private pool `(pool, 0)` (refused when it has
    /// none); ignored during a capture.
    ReleasePool {
        /// First half of the pool id.
        pool: u64,
    },
    /// Limits reserved memory to `fraction` of the device (refused outside
    /// `[0, 1]`, NaN included).
    SetFraction {
        /// Fraction of the device's capacity.
        fraction: f64,
    },
    /// Takes a snapshot, which must agree with the statistics (allocated
    /// bytes; segments at least as large as reserved memory) and list every
    /// live allocation as allocated, and serialises it.
    Snapshot,
}

/// An engine under test with everything the checks need to know about what
/// was done to it.
pub struct Run {
    config: String,
    capacity: u64,
    engine: SimEngine,
    /// Addresses handed out and not freed, in no particular order.
    live: Vec<u64>,
    /// The pool of the open capture.
    capture: Option<PoolId>,
    /// Holders of each private pool (captures begun, not released).
    holders: HashMap<PoolId, u32>,
    shadow: Shadow,
    /// A memory fraction below 1 was set.
    limited: bool,
}

/// Runs `ops` on an engine for `config` on a simulated device of `capacity`
/// bytes whose events complete only when an operation completes them, then
/// frees everything and checks that all memory went back.
pub fn run(config: &str, capacity: u64, ops: &[Op]) -> Result<(), String> {
    let mut run = Run::new(config, capacity, SimStreams::new())?;
    for op in ops {
        run.step(op)?;
    }
    run.finish()
}

impl Run {
    /// An engine for `config` on a simulated device of `capacity` bytes with
    /// `streams` (e.g. [`SimStreams::with_gpu_lag`]).
    pub fn new(config: &str, capacity: u64, streams: SimStreams) -> Result<Run, String> {
        Ok(Run {
            config: config.to_string(),
            capacity,
            engine: engine_with(config, capacity, streams)?,
            live: Vec::new(),
            capture: None,
            holders: HashMap::new(),
            shadow: Shadow::default(),
            limited: false,
        })
    }

    /// The engine.
    pub fn engine(&self) -> &SimEngine {
        &self.engine
    }

    /// The engine, for what the operations do not call (taking its levels,
    /// say); what changes blocks goes through [`Run::step`], which the
    /// shadow watches.
    pub fn engine_mut(&mut self) -> &mut SimEngine {
        &mut self.engine
    }

    /// Applies `op` and checks its outcome and every invariant; the error
    /// names the configuration, the operation and what went wrong.
    pub fn step(&mut self, op: &Op) -> Result<(), String> {
        let events_before = self.engine.streams().pending();
        self.apply(op)
            .and_then(|()| self.check(events_before))
            .map_err(|msg| format!("{}: after {op:?}: {msg}", self.config))
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        let e = &mut self.engine;
        match *op {
            Op::Alloc { size, stream } => self.alloc(size, stream)?,
            Op::Free { pick } if !self.live.is_empty() => {
                let addr = self.live.swap_remove(pick % self.live.len());
                self.shadow.freeing(e, addr, self.capture.is_some())?;
                e.free(addr).map_err(|err| format!("free: {err}"))?;
                let again = e.free(addr);
                if !matches!(
                    again,
                    Err(AllocError::DoubleFree { .. } | AllocError::UnknownPointer { .. })
                ) {
                    return Err(format!("second free gave {again:?}"));
                }
            }
            Op::FreeInterior { pick, offset } if !self.live.is_empty() => {
                let addr = self.live[pick % self.live.len()];
                let before = e.allocation(addr);
                let size = before.map_or(0, |a| a.size);
                if size > 1 {
                    let inside = addr + 1 + offset % (size - 1);
                    let freed = e.free(inside);
                    if !matches!(freed, Err(AllocError::UnknownPointer { .. })) {
                        return Err(format!("free of {inside:#x} inside a block gave {freed:?}"));
                    }
                    let recorded = e.record_stream(inside, StreamId(1));
                    if !matches!(recorded, Err(AllocError::UnknownPointer { .. })) {
                        return Err(format!(
                            "record_stream of {inside:#x} inside a block gave {recorded:?}"
                        ));
                    }
                    if e.allocation(addr) != before {
                        return Err("a refused free changed the block".into());
                    }
                }
            }
            Op::RecordStream { pick, stream } if !self.live.is_empty() => {
                let addr = self.live[pick % self.live.len()];
                e.record_stream(addr, stream)
                    .map_err(|err| format!("record_stream: {err}"))?;
                self.shadow.recorded(e, addr, stream);
            }
            Op::CompleteStream { stream } => e.streams_mut().complete_stream(stream),
            Op::Tick => e.streams_mut().tick(),
            Op::ProcessEvents => e
                .process_events()
                .map_err(|err| format!("process_events: {err}"))?,
            Op::SetFraction { fraction } => {
                let set = e.set_memory_fraction(fraction);
                if (0.0..=1.0).contains(&fraction) {
                    set.map_err(|err| format!("set_memory_fraction: {err}"))?;
                    self.limited = fraction < 1.0;
                } else if !matches!(set, Err(AllocError::InvalidArgument(_))) {
                    return Err(format!("set_memory_fraction({fraction}) gave {set:?}"));
                }
            }
            Op::EmptyCache if self.capture.is_some() => {
                refused(e.empty_cache(), "empty_cache during a capture")?;
            }
            Op::EmptyCache => {
                let held = pool_bytes(e, &self.holders);
                e.empty_cache()
                    .map_err(|err| format!("empty_cache: {err}"))?;
                if e.awaiting_events() != 0 {
                    return Err("blocks still await events after empty_cache".into());
                }
                if pool_bytes(e, &self.holders) != held {
                    return Err("a held pool lost memory".into());
                }
            }
            Op::BeginCapture { pool } if self.capture.is_none() => {
                let pool = (pool, 0);
                e.begin_allocate_to_pool(pool);
                e.streams_mut().capture().begin(StreamId::DEFAULT);
                *self.holders.entry(pool).or_default() += 1;
                self.capture = Some(pool);
            }
            Op::Launch { stream } => {
                e.streams_mut().capture().launch(stream);
            }
            Op::WaitStream { waiter, on } if waiter != on => {
                e.streams_mut().capture().wait_stream(waiter, on);
            }
            Op::EndCapture => match self.capture.take() {
                Some(pool) => {
                    self.shadow.capture_ending(e);
                    e.streams_mut().capture().end(StreamId::DEFAULT);
                    e.end_allocate_to_pool(pool)
                        .map_err(|err| format!("end_allocate_to_pool: {err}"))?;
                }
                None => refused(
                    e.end_allocate_to_pool((1, 0)),
                    "the end of a capture that never began",
                )?,
            },
            Op::ReleasePool { pool } if self.capture.is_none() => {
                let pool = (pool, 0);
                match self.holders.get_mut(&pool) {
                    Some(n) if *n > 0 => {
                        *n -= 1;
                        e.release_pool(pool)
                            .map_err(|err| format!("release_pool: {err}"))?;
                    }
                    _ => refused(e.release_pool(pool), "a release of a pool without holders")?,
                }
                let held = self.holders.get(&pool).copied().unwrap_or(0);
                if e.pool_use_count(pool) != held {
                    return Err(format!(
                        "pool {pool:?} has {} holders, expected {held}",
                        e.pool_use_count(pool)
                    ));
                }
            }
            Op::Snapshot => self.check_snapshot()?,
            _ => {}
        }
        Ok(())
    }

    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<(), String> {
        let pool = self.capture.filter(|_| stream == StreamId::DEFAULT);
        let e = &mut self.engine;
        let reserved_before = e.stats().reserved_bytes.all.current;
        match e.malloc_in(size, stream, pool) {
            Ok(a) => {
                if size == 0 || size > MAX_REQUEST {
                    return Err(format!("malloc({size}, {stream:#x}) accepted"));
                }
                if a.size < size {
                    return Err(format!("block of {} for a request of {size}", a.size));
                }
                self.shadow.allocated(e, a)?;
                let owner = owning_pool(e, a.addr)?;
                if owner != pool {
                    return Err(format!("served from pool {owner:?}, expected {pool:?}"));
                }
                self.live.push(a.addr);
            }
            Err(AllocError::InvalidSize { .. }) if size == 0 || size > MAX_REQUEST => {}
            Err(AllocError::OutOfMemory(report)) => {
                if report.requested != size {
                    return Err(format!(
                        "out of memory reported for {} bytes, {size} requested",
                        report.requested
                    ));
                }
                if self.roomy(size, reserved_before) {
                    return Err(format!(
                        "out of memory for {size} bytes with {reserved_before} reserved of \
                         {} (no memory fraction)",
                        self.capacity
                    ));
                }
            }
            Err(other) => return Err(format!("malloc({size}, {stream:#x}): {other}")),
        }
        Ok(())
    }

    /// Whether a request of `size` bytes had to succeed: no memory fraction
    /// limits the device, and what was reserved plus four times the request
    /// and 1 GiB of slack for segment rounding and fragmentation fit in a
    /// quarter of it.
    fn roomy(&self, size: u64, reserved: i64) -> bool {
        let need = (reserved as u64)
            .saturating_add(size.saturating_mul(4))
            .saturating_add(1 << 30);
        !self.limited && need <= self.capacity / 4
    }

    /// Checks that a snapshot agrees with the statistics and lists every
    /// live allocation as allocated, and that it serialises.
    fn check_snapshot(&self) -> Result<(), String> {
        let e = &self.engine;
        let snap = e.snapshot();
        let reserved: u64 = snap.segments.iter().map(|s| s.total_size).sum();
        let allocated: u64 = snap.segments.iter().map(|s| s.allocated_size).sum();
        let stats = e.stats();
        // Segments span their unmapped pages too (`unmap_free_pages`).
        if (reserved as i64) < stats.reserved_bytes.all.current
            || allocated as i64 != stats.allocated_bytes.all.current
        {
            return Err(format!(
                "snapshot: {reserved} reserved, {allocated} allocated; statistics: {}, {}",
                stats.reserved_bytes.all.current, stats.allocated_bytes.all.current
            ));
        }
        for &addr in &self.live {
            let listed = snap
                .segments
                .iter()
                .flat_map(|s| &s.blocks)
                .any(|b| b.address == addr && b.state == SnapshotState::ActiveAllocated);
            if !listed {
                return Err(format!("snapshot does not list the live block {addr:#x}"));
            }
        }
        if snap.to_json().is_empty() {
            return Err("snapshot serialised to nothing".into());
        }
        Ok(())
    }

    /// The checks after every operation.
    fn check(&mut self, events_before: usize) -> Result<(), String> {
        let e = &self.engine;
        if self.capture.is_some() && e.streams().pending() > events_before {
            return Err("an event was recorded during a capture".into());
        }
        self.shadow.check_mapped(e)?;
        e.validate()?;
        let reserved = e.stats().reserved_bytes.all.current;
        if e.memory().used() as i64 != reserved {
            return Err(format!(
                "device holds {} bytes, statistics say {reserved} reserved",
                e.memory().used()
            ));
        }
        Ok(())
    }

    /// Frees everything, ends the capture, releases the pools and empties
    /// the cache, then checks that all memory went back to the device.
    pub fn finish(mut self) -> Result<(), String> {
        let e = &mut self.engine;
        let capturing = self.capture.is_some();
        for addr in self.live.drain(..) {
            self.shadow
                .freeing(e, addr, capturing)
                .map_err(|msg| format!("final free: {msg}"))?;
            e.free(addr).map_err(|err| format!("final free: {err}"))?;
        }
        if let Some(pool) = self.capture.take() {
            e.end_allocate_to_pool(pool)
                .map_err(|err| format!("final end_allocate_to_pool: {err}"))?;
        }
        for (pool, n) in std::mem::take(&mut self.holders) {
            for _ in 0..n {
                e.release_pool(pool)
                    .map_err(|err| format!("final release_pool: {err}"))?;
            }
        }
        e.empty_cache()
            .map_err(|err| format!("final empty_cache: {err}"))?;
        let config = &self.config;
        if e.memory().used() != 0 || e.stats().reserved_bytes.all.current != 0 {
            return Err(format!(
                "{config}: {} bytes left on the device ({} reserved) after freeing everything",
                e.memory().used(),
                e.stats().reserved_bytes.all.current
            ));
        }
        // Growable segments map in several steps but go back in one unmap.
        if !e.expandable() && e.stats().num_device_alloc != e.stats().num_device_free {
            return Err(format!(
                "{config}: {} device allocations, {} frees",
                e.stats().num_device_alloc,
                e.stats().num_device_free
            ));
        }
        e.validate()
            .map_err(|msg| format!("{config}: at the end: {msg}"))
    }
}

/// Fails when `result`, the outcome of `what`, is not an error.
fn refused(result: Result<(), AllocError>, what: &str) -> Result<(), String> {
    match result {
        Ok(()) => Err(format!("{what} was accepted")),
        Err(_) => Ok(()),
    }
}

/// The private pool whose segment holds `addr` (`None`: the device's).
fn owning_pool(e: &SimEngine, addr: u64) -> Result<Option<PoolId>, String> {
    e.snapshot()
        .segments
        .iter()
        .find(|s| (s.address..s.address + s.total_size).contains(&addr))
        .map(|s| s.private_pool)
        .ok_or_else(|| format!("allocated address {addr:#x} lies in no segment"))
}

/// Bytes reserved by segments of the pools that still have holders.
fn pool_bytes(e: &SimEngine, holders: &HashMap<PoolId, u32>) -> u64 {
    e.snapshot()
        .segments
        .iter()
        .filter(|s| {
            s.private_pool
                .is_some_and(|p| holders.get(&p).copied().unwrap_or(0) > 0)
        })
        .map(|s| s.total_size)
        .sum()
}

/// Bytes of a request of 2^`log2_size` bytes (at least 1): requests spread
/// evenly over orders of magnitude.
pub fn log_size(log2_size: f64) -> u64 {
    (2f64.powf(log2_size) as u64).max(1)
}
