//! A stream made per use, many times over: stream 0 holds a block while
//! each of N fresh streams allocates a buffer and frees it (the pattern of a
//! job that makes a stream per weight sync). Replays that trace under every
//! setting, with and without a simulated GPU lag, and prints the host time
//! of the allocations and frees, of the `empty_cache` after them, the
//! segments the page walks visited, and the growable segments and streams
//! still held. Per-stream state should cost nothing per stream: the times
//! grow with N, not with N squared.
//!
//! ```sh
//! cargo run --release -p alloc-replay --example many_streams -- 5000 20000 100000
//! # the same trace for `cargo xtask replay --runs 0 FILE`:
//! cargo run --release -p alloc-replay --example many_streams -- --write streams_5000.trace 5000
//! ```
//!
//! Options: `--lag N` (only that GPU lag; `none` for no lag; default both
//! `none` and 4), `--setting NAME` (only those settings, by name), `--size
//! MIB` (each stream's buffer, default 4), `--write FILE` (writes the
//! trace of the one stream count given, as text, and replays nothing).

use std::process::ExitCode;
use std::time::Instant;

use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, MIB};
use alloc_policy::AnyPolicy;
use alloc_replay::replay::DEFAULT_CAPACITY;
use alloc_replay::{settings_for, Trace, TraceEvent};

/// Prints an error's message and exits with status 1.
fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The command line.
struct Args {
    counts: Vec<u64>,
    lags: Vec<Option<u64>>,
    settings: Vec<String>,
    size: u64,
    write: Option<String>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        counts: Vec::new(),
        lags: Vec::new(),
        settings: Vec::new(),
        size: 4 * MIB,
        write: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--lag" => {
                let v = value()?;
                args.lags.push(if v == "none" {
                    None
                } else {
                    Some(v.parse().map_err(|e| format!("--lag {v}: {e}"))?)
                });
            }
            "--setting" => args.settings.push(value()?),
            "--size" => {
                let v = value()?;
                args.size = v.parse::<u64>().map_err(|e| format!("--size {v}: {e}"))? * MIB;
            }
            "--write" => args.write = Some(value()?),
            n => args
                .counts
                .push(n.parse().map_err(|e| format!("stream count {n}: {e}"))?),
        }
    }
    if args.counts.is_empty() {
        args.counts = vec![5_000, 20_000, 100_000];
    }
    if args.lags.is_empty() {
        args.lags = vec![None, Some(4)];
    }
    Ok(args)
}

/// Stream 0 allocates 8 MiB and keeps it; then each of `streams` fresh
/// streams allocates `size` bytes and frees them.
fn trace(streams: u64, size: u64) -> Trace {
    let mut events = vec![TraceEvent::Alloc {
        id: 0,
        size: 8 * MIB,
        stream: 0,
    }];
    for s in 1..=streams {
        events.push(TraceEvent::Alloc {
            id: s,
            size,
            stream: s,
        });
        events.push(TraceEvent::Free { id: s, stream: s });
    }
    Trace {
        name: format!("streams_{streams}"),
        events,
        segment_allocs: Vec::new(),
        segment_addrs: Vec::new(),
        header: vec![format!(
            "workload streams_{streams}: a fresh stream per allocation"
        )],
    }
}

/// The trace as text (`cargo xtask replay` reads it).
fn text(trace: &Trace) -> String {
    let mut out = format!("# {}\n", trace.header[0]);
    for e in &trace.events {
        out += &match *e {
            TraceEvent::Alloc { id, size, stream } => format!("a {id} {size} {stream}\n"),
            TraceEvent::Free { id, stream } => format!("f {id} {stream}\n"),
            TraceEvent::FreeCompleted { id } => format!("c {id}\n"),
        };
    }
    out
}

/// What one replay measured.
struct Measured {
    run_s: f64,
    empty_s: f64,
    visited: u64,
    held_segments: usize,
    held_streams: usize,
}

/// Replays `trace` under `config` (as `cargo xtask replay` does: a tick of
/// the simulated GPU per event with a lag), then empties the cache.
fn measure(trace: &Trace, config: &str, lag: Option<u64>) -> Result<Measured, String> {
    let streams = lag.map_or_else(SimStreams::new, SimStreams::with_gpu_lag);
    let cfg = AllocatorConfig::parse(config).map_err(|e| e.to_string())?;
    let mut engine = AnyPolicy::engine(&cfg, SimMemory::new(DEFAULT_CAPACITY), streams)
        .map_err(|e| e.to_string())?;
    let mut live = Vec::new();
    let started = Instant::now();
    for e in &trace.events {
        match *e {
            TraceEvent::Alloc { id, size, stream } => {
                let a = engine
                    .malloc(size, StreamId(stream))
                    .map_err(|e| format!("{config}: malloc: {e}"))?;
                live.push((id, a.addr));
            }
            TraceEvent::Free { id, .. } => {
                let i = live.iter().rposition(|&(i, _)| i == id).expect("live id");
                let (_, addr) = live.swap_remove(i);
                engine
                    .free(addr)
                    .map_err(|e| format!("{config}: free: {e}"))?;
            }
            // The traces made here complete every free at once.
            TraceEvent::FreeCompleted { .. } => {}
        }
        if lag.is_some() {
            engine.streams_mut().tick();
        }
    }
    let run_s = started.elapsed().as_secs_f64();
    let held_segments = engine.heap().segments().count();
    let held_streams = engine.streams_in_use().len();
    let started = Instant::now();
    engine
        .empty_cache()
        .map_err(|e| format!("{config}: empty_cache: {e}"))?;
    let empty_s = started.elapsed().as_secs_f64();
    engine.assert_valid();
    Ok(Measured {
        run_s,
        empty_s,
        visited: engine.free_page_segments_visited(),
        held_segments,
        held_streams,
    })
}

fn run() -> Result<(), String> {
    let args = parse()?;
    if let Some(path) = &args.write {
        let [n] = args.counts[..] else {
            return Err("--write takes one stream count".into());
        };
        return std::fs::write(path, text(&trace(n, args.size)))
            .map_err(|e| format!("{path}: {e}"));
    }
    println!("| streams | setting | GPU lag | allocations and frees s | empty_cache s | segments visited | segments held | streams held |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    for &n in &args.counts {
        let t = trace(n, args.size);
        for setting in settings_for(&t) {
            if !args.settings.is_empty() && !args.settings.iter().any(|s| s == setting.name) {
                continue;
            }
            for &lag in &args.lags {
                let m = measure(&t, setting.engine_config(), lag)?;
                let lag = lag.map_or("none".to_string(), |l| l.to_string());
                println!(
                    "| {n} | {} | {lag} | {:.3} | {:.3} | {} | {} | {} |",
                    setting.name, m.run_s, m.empty_s, m.visited, m.held_segments, m.held_streams
                );
            }
        }
    }
    Ok(())
}
