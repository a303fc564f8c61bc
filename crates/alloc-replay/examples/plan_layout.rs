//! Replays a trace under a configuration (with `plan_layout` or without)
//! and prints, once a step, the host time the step's mallocs and frees
//! took, the pages moved so far, the peak reserved and what the plan did
//! (plans made and dropped, requests placed as planned, conflicts,
//! mismatches). The bundled traces hold a few steps only; to see
//! the steady state, the trace's last whole step is repeated `EXTRA` more
//! times (the i-th block of a repetition frees what the i-th block of the
//! step before freed). Frees that completed later (other streams used the
//! block) complete at once here: the layout, not the streams, is studied.
//!
//! ```sh
//! cargo run --release -p alloc-replay --example plan_layout -- traces/gpt2_train.trace.gz \
//!     expandable_segments:True,unmap_free_pages:True,unmap_page_mb:2,plan_layout:True 20
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

use alloc_core::{AllocError, AllocatorConfig, SimStreams, StreamId};
use alloc_policy::AnyPolicy;
use alloc_replay::replay::DEFAULT_CAPACITY;
use alloc_replay::{device_for, estimate_steps, load_trace, Trace, TraceEvent};
use rustc_hash::FxHashMap;

#[path = "../../../examples/failure.rs"]
mod failure;
use failure::Failure;

fn main() -> Result<(), Failure> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (path, config, extra) = match &args[..] {
        [path, config] => (path, config, 0),
        [path, config, extra] => (path, config, extra.parse()?),
        _ => return Err("usage: plan_layout TRACE CONFIG [EXTRA]".into()),
    };
    let trace = load_trace(Path::new(path))?;
    let every = estimate_steps(&trace)
        .ok_or("the trace has no steps")?
        .allocations_per_step;
    let events = with_repeated_step(&trace, every, extra);
    let device = device_for(&trace, DEFAULT_CAPACITY);
    let mut engine =
        AnyPolicy::engine(&AllocatorConfig::parse(config)?, device, SimStreams::new())?;
    let mut live: FxHashMap<u64, u64> = FxHashMap::default();
    let mut allocs = 0u64;
    // The engine's time since the last report.
    let mut busy = Duration::ZERO;
    let report = |engine: &alloc_core::Engine<AnyPolicy, _, _>, allocs: u64, busy: Duration| {
        let moves = engine.stats().page_moves.pages_unmapped;
        let reserved = engine.stats().reserved_bytes.all.peak;
        println!(
            "{allocs:>8} allocs  {:>8.3} ms  pages unmapped {moves:>6}  peak reserved {reserved:>14}  {:?}",
            busy.as_secs_f64() * 1e3,
            engine.policy().plan_stats()
        );
    };
    for event in &events {
        let started = Instant::now();
        match *event {
            TraceEvent::Alloc { id, size, stream } => {
                match engine.malloc(size.max(1), StreamId(stream)) {
                    Ok(a) => {
                        live.insert(id, a.addr);
                    }
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(e) => return Err(e.into()),
                }
                busy += started.elapsed();
                allocs += 1;
                if allocs.is_multiple_of(every) {
                    report(&engine, allocs, std::mem::take(&mut busy));
                }
            }
            TraceEvent::Free { id, .. } => {
                if let Some(addr) = live.remove(&id) {
                    engine.free(addr)?;
                }
                busy += started.elapsed();
            }
            TraceEvent::FreeCompleted { .. } => {} // left out by with_repeated_step
        }
    }
    report(&engine, allocs, busy);
    engine.validate()?;
    Ok(())
}

/// The trace's events with the allocations numbered in order (each its own
/// id), cut after its last whole step of `per_step` allocations, and that
/// step repeated `extra` more times.
fn with_repeated_step(trace: &Trace, per_step: u64, extra: u64) -> Vec<TraceEvent> {
    // Serial numbers instead of ids, which the trace may reuse.
    let mut live: FxHashMap<u64, u64> = FxHashMap::default();
    let mut serial = 0u64;
    let mut numbered = Vec::new();
    for event in &trace.events {
        match *event {
            TraceEvent::Alloc { id, size, stream } => {
                live.insert(id, serial);
                numbered.push(TraceEvent::Alloc {
                    id: serial,
                    size,
                    stream,
                });
                serial += 1;
            }
            TraceEvent::Free { id, stream } => {
                if let Some(s) = live.remove(&id) {
                    numbered.push(TraceEvent::Free { id: s, stream });
                }
            }
            TraceEvent::FreeCompleted { .. } => {} // every free completes at once
        }
    }
    let steps = serial / per_step;
    if steps < 2 {
        return numbered;
    }
    // The last whole step: allocations [last, last + per_step).
    let last = (steps - 1) * per_step;
    let is_alloc = |e: &TraceEvent, n: u64| matches!(*e, TraceEvent::Alloc { id, .. } if id == n);
    let begin = numbered
        .iter()
        .position(|e| is_alloc(e, last))
        .expect("step start");
    let end = numbered
        .iter()
        .position(|e| is_alloc(e, last + per_step))
        .unwrap_or(numbered.len());
    let step: Vec<TraceEvent> = numbered[begin..end].to_vec();
    numbered.truncate(end);
    for r in 0..extra {
        // Repetition r's j-th allocation is `base + j`; the step before's
        // is `prev + j`.
        let base = serial + r * per_step;
        let prev = if r == 0 { last } else { base - per_step };
        for e in &step {
            match *e {
                TraceEvent::Alloc { id, size, stream } => numbered.push(TraceEvent::Alloc {
                    id: base + (id - last),
                    size,
                    stream,
                }),
                TraceEvent::Free { id, stream } if id >= last => numbered.push(TraceEvent::Free {
                    id: base + (id - last),
                    stream,
                }),
                TraceEvent::Free { id, stream } if id + per_step >= last => {
                    numbered.push(TraceEvent::Free {
                        id: prev + (id + per_step - last),
                        stream,
                    })
                }
                TraceEvent::Free { .. } | TraceEvent::FreeCompleted { .. } => {} // freed once, long before
            }
        }
    }
    numbered
}
