//! `gpu_bench --threads` / `--devices`: many threads on one device, or one
//! thread per device, through `CudaAllocator` (one allocator per device,
//! shared by its threads) and through `cuMemAllocAsync` (the default pool
//! kept), in the loops of `benchmarks/host_cost/mt_loops.h`: each thread
//! warms up, meets the others at a start line, and runs its workload until
//! the main thread says stop after the window, in rounds of N calls whose
//! last call is timed.
//! One `CELL {json}` line per cell on stdout, read by
//! `benchmarks/host_cost/host_threads.py`.
//!
//! `gpu_bench --threads 1,2,4 [--streams own,shared] | --devices 1,2
//!  --workload pair:BYTES|mixed:LO:HI:LIVE [--warm CALLS] ...
//!  [--window SECONDS] [--repeats N] [--sample-every N] [--config CONF]
//!  [--engines device|thread|stream] [--shared-totals atomic|locked]`
//!
//! `--engines thread` gives each thread an allocator (an engine and a lock)
//! of its own on its device instead of one a device: the most that engines
//! per stream could carry. `--shared-totals` adds what they would have to
//! share, the device-wide statistics' counters ([`SharedTotals`]).
//! `--engines stream` runs the library's engines per stream
//! ([`StreamEngines`]: one allocator a device, an engine for each stream,
//! the device's totals and the table of owners shared).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use alloc_cuda::cudarc::driver::{CudaContext, CudaStream};
use alloc_cuda::{CudaAllocator, StreamEngines};

use crate::shared_totals::{SharedTotals, Sharing, WithTotals};
use crate::{keep_default_pool, Backend, BoxResult, DriverAsync, Ours, Rng};

/// One thread's workload.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Load {
    /// Alloc+free pairs of one size.
    Pair(usize),
    /// Log-uniform sizes in [lo, hi], at most `live` blocks live.
    Mixed { lo: usize, hi: usize, live: usize },
}

impl Load {
    /// `pair:BYTES` or `mixed:LO:HI:LIVE`.
    fn parse(spec: &str) -> BoxResult<Self> {
        let parts: Vec<&str> = spec.split(':').collect();
        match parts.as_slice() {
            ["pair", size] => Ok(Load::Pair(size.parse()?)),
            ["mixed", lo, hi, live] => {
                let (lo, hi, live) = (lo.parse()?, hi.parse()?, live.parse()?);
                if lo == 0 || lo > hi || live == 0 {
                    return Err(format!("bad mixed workload {spec}").into());
                }
                Ok(Load::Mixed { lo, hi, live })
            }
            _ => Err(format!("a workload is pair:BYTES or mixed:LO:HI:LIVE, not {spec}").into()),
        }
    }

    /// The spec it was parsed from (the cells' key).
    fn spec(&self) -> String {
        match *self {
            Load::Pair(size) => format!("pair:{size}"),
            Load::Mixed { lo, hi, live } => format!("mixed:{lo}:{hi}:{live}"),
        }
    }
}

/// The command line of the threads mode.
struct Plan {
    /// Workloads with the calls each thread makes before the start line.
    loads: Vec<(Load, u64)>,
    threads: Vec<usize>,
    /// Stream modes: false = each thread its own stream, true = one shared.
    shared: Vec<bool>,
    /// One thread per device, on this many devices (instead of `threads`).
    devices: Option<Vec<usize>>,
    window: Duration,
    repeats: usize,
    sample_every: u64,
    config: String,
    /// How a device's threads share engines.
    engines: Engines,
    /// Every call of ours also changes device-wide totals kept this way
    /// ([`SharedTotals`]).
    shared_totals: Option<Sharing>,
}

/// How a device's threads share engines (`--engines`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engines {
    /// One `CudaAllocator` a device, as the library has it.
    Device,
    /// Each thread a `CudaAllocator` of its own.
    Thread,
    /// One `StreamEngines` a device: an engine for each stream.
    Stream,
}

impl Engines {
    fn parse(text: &str) -> BoxResult<Self> {
        match text {
            "device" => Ok(Engines::Device),
            "thread" => Ok(Engines::Thread),
            "stream" => Ok(Engines::Stream),
            other => Err(format!("--engines takes device, thread or stream, not {other}").into()),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Engines::Device => "device",
            Engines::Thread => "thread",
            Engines::Stream => "stream",
        }
    }
}

fn list(text: &str) -> BoxResult<Vec<usize>> {
    text.split(',')
        .map(|t| t.parse::<usize>().map_err(|e| format!("{t}: {e}").into()))
        .collect()
}

impl Plan {
    fn parse(argv: &[String]) -> BoxResult<Self> {
        let mut p = Plan {
            loads: Vec::new(),
            threads: vec![1],
            shared: vec![false],
            devices: None,
            window: Duration::from_millis(100),
            repeats: 3,
            sample_every: 31,
            config: std::env::var("GPUALLOC_CONF").unwrap_or_default(),
            engines: Engines::Device,
            shared_totals: None,
        };
        let mut it = argv.iter();
        while let Some(a) = it.next() {
            let mut value = || it.next().ok_or_else(|| format!("{a} needs a value"));
            match a.as_str() {
                "--threads" => p.threads = list(value()?)?,
                "--devices" => p.devices = Some(list(value()?)?),
                "--streams" => {
                    p.shared = value()?
                        .split(',')
                        .map(|s| match s {
                            "own" => Ok(false),
                            "shared" => Ok(true),
                            _ => Err(format!("--streams takes own and/or shared, not {s}")),
                        })
                        .collect::<Result<_, _>>()?
                }
                "--workload" => p.loads.push((Load::parse(value()?)?, 2000)),
                "--warm" => {
                    let warm = value()?.parse()?;
                    p.loads.last_mut().ok_or("--warm follows a --workload")?.1 = warm;
                }
                "--window" => p.window = Duration::from_secs_f64(value()?.parse()?),
                "--repeats" => p.repeats = value()?.parse()?,
                "--sample-every" => p.sample_every = value()?.parse::<u64>()?.max(1),
                "--config" => p.config = value()?.clone(),
                "--engines" => p.engines = Engines::parse(value()?)?,
                "--shared-totals" => p.shared_totals = Some(Sharing::parse(value()?)?),
                other => return Err(format!("unknown argument {other} (see threads.rs)").into()),
            }
        }
        if p.loads.is_empty() {
            p.loads.push((Load::Pair(512), 2000));
        }
        if p.threads.contains(&0) || p.devices.as_ref().is_some_and(|d| d.contains(&0)) {
            return Err("thread and device counts start at 1".into());
        }
        if p.engines == Engines::Stream && p.shared_totals.is_some() {
            return Err("--engines stream keeps the library's own device totals: \
                        no --shared-totals"
                .into());
        }
        Ok(p)
    }

    /// Runs one cell of `threads` threads in this plan's window.
    fn cell<B: Backend>(
        &self,
        threads: usize,
        load: Load,
        warm: u64,
        make: &(dyn Fn(usize) -> BoxResult<B> + Sync),
    ) -> CellOut {
        run_cell(threads, load, warm, self.window, self.sample_every, make)
    }

    /// The cells of one repeat: (load, warm calls, shared stream, device of each thread).
    fn cells(&self) -> Vec<(Load, u64, bool, Vec<usize>)> {
        let mut out = Vec::new();
        for &(load, warm) in &self.loads {
            match &self.devices {
                Some(devices) => {
                    for &n in devices {
                        out.push((load, warm, false, (0..n).collect()));
                    }
                }
                None => {
                    for &shared in &self.shared {
                        for &t in &self.threads {
                            out.push((load, warm, shared, vec![0; t]));
                        }
                    }
                }
            }
        }
        out
    }
}

/// One thread's figures.
#[derive(Default)]
struct ThreadOut {
    calls: u64,
    end: Option<Instant>,
    lat: Vec<u32>,
    error: Option<String>,
}

/// One cell's figures, as `mt_loops.h` reports them.
#[derive(Debug, Default, PartialEq)]
struct CellOut {
    calls: u64,
    wall_ns: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    max: f64,
    samples: usize,
    failed: usize,
    error: String,
}

/// The start line and the stop flag of one cell.
struct Gate {
    ready: AtomicUsize,
    go: AtomicBool,
    stop: AtomicBool,
}

/// The workload's state on one thread.
struct Driver {
    load: Load,
    rng: Rng,
    held: Option<u64>,
    live: Vec<(u64, usize)>,
}

impl Driver {
    fn new(load: Load, seed: u64) -> Self {
        let cap = match load {
            Load::Mixed { live, .. } => live,
            Load::Pair(_) => 0,
        };
        Driver {
            load,
            rng: Rng(seed),
            held: None,
            live: Vec::with_capacity(cap),
        }
    }

    /// One alloc or free.
    #[inline]
    fn call(&mut self, b: &mut dyn Backend) -> BoxResult<()> {
        match self.load {
            Load::Pair(size) => match self.held.take() {
                Some(p) => b.release(p, size),
                None => {
                    self.held = Some(b.alloc(size)?);
                    Ok(())
                }
            },
            Load::Mixed { lo, hi, live } => {
                let grow =
                    self.live.is_empty() || (self.live.len() < live && self.rng.uniform() < 0.5);
                if grow {
                    let (lo, hi) = (lo as f64, hi as f64);
                    let n = (lo.ln() + self.rng.uniform() * (hi.ln() - lo.ln())).exp() as usize;
                    self.live.push((b.alloc(n)?, n));
                } else {
                    let j = (self.rng.uniform() * self.live.len() as f64) as usize;
                    let last = self.live.len() - 1;
                    self.live.swap(j, last);
                    let (p, n) = self.live.pop().unwrap_or_default();
                    b.release(p, n)?;
                }
                Ok(())
            }
        }
    }

    /// Frees what is still held.
    fn drain(&mut self, b: &mut dyn Backend) -> BoxResult<()> {
        if let (Some(p), Load::Pair(size)) = (self.held.take(), self.load) {
            b.release(p, size)?;
        }
        for (p, n) in self.live.drain(..) {
            b.release(p, n)?;
        }
        Ok(())
    }
}

/// Thread `t` of a cell: warm, start line, timed window, drain.
fn worker(
    b: &mut dyn Backend,
    load: Load,
    warm: u64,
    t: usize,
    sample_every: u64,
    gate: &Gate,
) -> ThreadOut {
    let mut out = ThreadOut::default();
    let mut d = Driver::new(load, 42 + t as u64);
    let mut counted = false;
    let mut run = || -> BoxResult<()> {
        for _ in 0..warm {
            d.call(b)?;
        }
        out.lat.reserve(1 << 17);
        gate.ready.fetch_add(1, Ordering::SeqCst);
        counted = true;
        while !gate.go.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        // Rounds of `sample_every` calls, the last one timed; the stop flag
        // is read between rounds, so every thread makes at least one round.
        loop {
            for _ in 1..sample_every {
                d.call(b)?;
            }
            let a = Instant::now();
            d.call(b)?;
            let ns = a.elapsed().as_nanos();
            if out.lat.len() < 1 << 17 {
                out.lat.push(ns.min(u32::MAX as u128) as u32);
            }
            out.calls += sample_every;
            if gate.stop.load(Ordering::Relaxed) {
                break;
            }
        }
        out.end = Some(Instant::now());
        d.drain(b)
    };
    if let Err(e) = run() {
        out.error = Some(e.to_string());
        let _ = d.drain(b);
    }
    if !counted {
        gate.ready.fetch_add(1, Ordering::SeqCst);
    }
    out
}

/// Nearest-rank quantile of sorted values, as `mt_loops.h` computes it.
fn quantile(v: &[u32], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let i = ((q * v.len() as f64).ceil() as usize).saturating_sub(1);
    v[i.min(v.len() - 1)] as f64
}

/// Runs one cell: `make(t)` builds thread t's backend inside thread t.
fn run_cell<B: Backend>(
    threads: usize,
    load: Load,
    warm: u64,
    window: Duration,
    sample_every: u64,
    make: &(dyn Fn(usize) -> BoxResult<B> + Sync),
) -> CellOut {
    let gate = Gate {
        ready: AtomicUsize::new(0),
        go: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    };
    let mut t0 = Instant::now();
    let outs: Vec<ThreadOut> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let gate = &gate;
                s.spawn(move || match make(t) {
                    Ok(mut b) => worker(&mut b, load, warm, t, sample_every, gate),
                    Err(e) => {
                        gate.ready.fetch_add(1, Ordering::SeqCst);
                        ThreadOut {
                            error: Some(e.to_string()),
                            ..ThreadOut::default()
                        }
                    }
                })
            })
            .collect();
        while gate.ready.load(Ordering::SeqCst) < threads {
            std::thread::sleep(Duration::from_micros(200));
        }
        t0 = Instant::now();
        gate.go.store(true, Ordering::Release);
        std::thread::sleep(window);
        gate.stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| ThreadOut {
                    error: Some("thread panicked".into()),
                    ..ThreadOut::default()
                })
            })
            .collect()
    });
    summarize(t0, outs)
}

/// The cell's figures from its threads'.
fn summarize(t0: Instant, outs: Vec<ThreadOut>) -> CellOut {
    let mut c = CellOut::default();
    let mut last = t0;
    let mut all = Vec::new();
    for o in outs {
        if let Some(e) = o.error {
            if c.failed == 0 {
                c.error = e;
            }
            c.failed += 1;
            continue;
        }
        c.calls += o.calls;
        last = last.max(o.end.unwrap_or(t0));
        all.extend(o.lat);
    }
    all.sort_unstable();
    c.wall_ns = (last - t0).as_nanos() as f64;
    c.samples = all.len();
    c.p50 = quantile(&all, 0.5);
    c.p99 = quantile(&all, 0.99);
    c.p999 = quantile(&all, 0.999);
    c.max = all.last().copied().unwrap_or(0) as f64;
    c
}

/// A JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// What each device's threads share: its context, allocators (one, or one
/// a thread with `--engines thread`), streams and device-wide totals.
struct Device {
    ctx: Arc<CudaContext>,
    allocs: Vec<CudaAllocator>,
    /// With `--engines stream`.
    stream_engines: Option<StreamEngines>,
    streams: Vec<Arc<CudaStream>>,
    totals: &'static SharedTotals,
}

/// The threads mode: every cell of the plan, `repeats` times, the two
/// backends' order alternating from cell to cell.
pub fn run(argv: &[String]) -> BoxResult<()> {
    let plan = Plan::parse(argv)?;
    let ndev = plan
        .devices
        .as_ref()
        .map_or(1, |d| d.iter().copied().max().unwrap_or(1));
    let per_device = if plan.devices.is_some() {
        1
    } else {
        plan.threads.iter().copied().max().unwrap_or(1)
    };
    let mut devices = Vec::new();
    for d in 0..ndev {
        // Under an engine per stream the device's allocator is its StreamEngines alone:
        // a configuration may ask for that layout (engine_per_stream), which
        // CudaAllocator refuses.
        let engines = match plan.engines {
            Engines::Thread => per_device,
            Engines::Device => 1,
            Engines::Stream => 0,
        };
        let allocs = (0..engines)
            .map(|_| CudaAllocator::with_config_str(d, &plan.config))
            .collect::<Result<Vec<_>, _>>()?;
        let stream_engines = match plan.engines {
            Engines::Stream => Some(StreamEngines::with_config_str(d, &plan.config)?),
            _ => None,
        };
        let ctx = match (&stream_engines, allocs.first()) {
            (Some(engines), _) => engines.context().clone(),
            (None, Some(alloc)) => alloc.context().clone(),
            (None, None) => return Err("no allocator for the device".into()),
        };
        keep_default_pool(&ctx, u64::MAX)?;
        let streams = (0..per_device)
            .map(|_| ctx.new_stream())
            .collect::<Result<Vec<_>, _>>()?;
        devices.push(Device {
            ctx,
            allocs,
            stream_engines,
            streams,
            totals: Box::leak(Box::new(SharedTotals::new(
                plan.shared_totals.unwrap_or_default(),
            ))),
        });
    }
    for repeat in 0..plan.repeats {
        for (i, (load, warm, shared, devs)) in plan.cells().into_iter().enumerate() {
            // Thread t's place among its device's threads.
            let slot = |t: usize| devs[..t].iter().filter(|&&d| d == devs[t]).count();
            let stream_of =
                |t: usize| devices[devs[t]].streams[if shared { 0 } else { slot(t) }].clone();
            let ours = |t: usize| -> BoxResult<Ours> {
                let dev = &devices[devs[t]];
                dev.ctx.bind_to_thread()?;
                let engine = if plan.engines == Engines::Thread {
                    slot(t)
                } else {
                    0
                };
                Ok(Ours {
                    alloc: dev.allocs[engine].clone(),
                    stream: stream_of(t),
                })
            };
            for k in 0..2 {
                let (kind, out) = if (repeat + i + k) % 2 == 0 {
                    let o = if plan.engines == Engines::Stream {
                        let make = |t: usize| -> BoxResult<Ours<Arc<CudaStream>, StreamEngines>> {
                            let dev = &devices[devs[t]];
                            dev.ctx.bind_to_thread()?;
                            Ok(Ours {
                                alloc: dev.stream_engines.clone().ok_or("no StreamEngines")?,
                                stream: stream_of(t),
                            })
                        };
                        plan.cell(devs.len(), load, warm, &make)
                    } else if plan.shared_totals.is_some() {
                        let make = |t: usize| -> BoxResult<WithTotals<Ours>> {
                            Ok(WithTotals {
                                inner: ours(t)?,
                                totals: devices[devs[t]].totals,
                            })
                        };
                        plan.cell(devs.len(), load, warm, &make)
                    } else {
                        plan.cell(devs.len(), load, warm, &ours)
                    };
                    ("ours", o)
                } else {
                    let make = |t: usize| -> BoxResult<DriverAsync> {
                        devices[devs[t]].ctx.bind_to_thread()?;
                        Ok(DriverAsync {
                            stream: stream_of(t),
                        })
                    };
                    ("driver-async", plan.cell(devs.len(), load, warm, &make))
                };
                for dev in &devices {
                    dev.ctx.synchronize()?;
                }
                println!(
                    "CELL {{\"kind\": \"{kind}\", \"repeat\": {repeat}, \"spec\": \"{}\", \
                     \"streams\": \"{}\", \"threads\": {}, \"devices\": {}, \"calls\": {}, \
                     \"wall_ns\": {}, \"p50_ns\": {}, \"p99_ns\": {}, \"p999_ns\": {}, \
                     \"max_ns\": {}, \"samples\": {}, \"failed_threads\": {}, \"error\": {}, \
                     \"engines\": \"{}\", \"shared_totals\": \"{}\"}}",
                    load.spec(),
                    if shared { "shared" } else { "own" },
                    devs.len(),
                    devs.iter().max().map_or(1, |m| m + 1),
                    out.calls,
                    out.wall_ns,
                    out.p50,
                    out.p99,
                    out.p999,
                    out.max,
                    out.samples,
                    out.failed,
                    json_str(&out.error),
                    plan.engines.name(),
                    match plan.shared_totals {
                        Some(Sharing::Atomic) if kind == "ours" => "atomic",
                        Some(Sharing::Locked) if kind == "ours" => "locked",
                        _ => "none",
                    }
                );
            }
        }
    }
    for alloc in devices.iter().flat_map(|d| &d.allocs) {
        alloc.empty_cache()?;
    }
    for alloc in devices.iter().filter_map(|d| d.stream_engines.as_ref()) {
        alloc.empty_cache()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads_parse_and_print_back() {
        let p = Load::parse("mixed:512:1048576:1000").unwrap();
        assert_eq!(
            p,
            Load::Mixed {
                lo: 512,
                hi: 1 << 20,
                live: 1000
            }
        );
        assert_eq!(p.spec(), "mixed:512:1048576:1000");
        assert_eq!(Load::parse("pair:512").unwrap().spec(), "pair:512");
        assert!(Load::parse("mixed:0:1:1").is_err());
        assert!(Load::parse("pairs:1").is_err());
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<u32> = (1..=100).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    /// A backend of host memory only: every thread counts calls and the
    /// cell adds them up; one failing thread is reported, not summed.
    struct Counter(u64);

    impl Backend for Counter {
        fn alloc(&mut self, _size: usize) -> BoxResult<u64> {
            self.0 += 1;
            Ok(self.0)
        }
        fn release(&mut self, _ptr: u64, _size: usize) -> BoxResult<()> {
            Ok(())
        }
    }

    #[test]
    fn a_cell_counts_every_thread_and_reports_failures() {
        let make = |t: usize| -> BoxResult<Counter> {
            if t == 2 {
                Err("no backend".into())
            } else {
                Ok(Counter(0))
            }
        };
        let load = Load::Mixed {
            lo: 512,
            hi: 4096,
            live: 10,
        };
        let c = run_cell(3, load, 100, Duration::from_millis(20), 7, &make);
        assert_eq!(c.failed, 1);
        assert_eq!(c.error, "no backend");
        assert!(c.calls > 0 && c.wall_ns > 0.0);
        // Whole rounds of 7 calls, one timed (up to each thread's cap of samples).
        assert_eq!(c.calls % 7, 0);
        assert!(c.samples > 0 && c.samples as u64 <= c.calls / 7);
        assert!(c.p50 <= c.p99 && c.p99 <= c.max);
    }

    #[test]
    fn plans_name_every_cell() {
        let argv: Vec<String> = "--threads 1,4 --streams own,shared --workload pair:512 --warm 5"
            .split(' ')
            .map(String::from)
            .collect();
        let p = Plan::parse(&argv).unwrap();
        let cells = p.cells();
        assert_eq!(cells.len(), 4);
        assert_eq!(cells[3], (Load::Pair(512), 5, true, vec![0; 4]));
        let argv: Vec<String> = ["--devices", "1,2", "--workload", "pair:64"]
            .map(String::from)
            .to_vec();
        assert_eq!(Plan::parse(&argv).unwrap().cells()[1].3, vec![0, 1]);
        assert!(Plan::parse(&["--threads".into(), "0".into()]).is_err());
        let argv: Vec<String> = ["--engines", "thread", "--shared-totals", "locked"]
            .map(String::from)
            .to_vec();
        let p = Plan::parse(&argv).unwrap();
        assert!(p.engines == Engines::Thread && p.shared_totals == Some(Sharing::Locked));
        let streams = Plan::parse(&["--engines".into(), "stream".into()]).unwrap();
        assert_eq!(streams.engines, Engines::Stream);
        assert!(Plan::parse(&["--engines".into(), "process".into()]).is_err());
        let both = ["--engines", "stream", "--shared-totals", "atomic"].map(String::from);
        assert!(
            Plan::parse(&both).is_err(),
            "stream engines keep their own totals"
        );
    }
}
