//! Host cost of the CUDA caching allocator next to the driver's
//! `cuMemAllocAsync` / `cuMemFreeAsync` (pool kept, as `alloc_bench.cpp`
//! does) and `cuMemAlloc` / `cuMemFree`, in the same run and the same loops
//! as `shared/device/alloc_bench.cpp`: steady-state alloc+free pairs of one
//! size, and a random mixed workload (log-uniform sizes, bounded live set,
//! second pass of the same sequence timed). Prints a markdown table of ns.
//! Then the same engine through its Rust API and through the C library
//! (`liballoc_ffi.so`, found as [`paths::find_library`] says), interleaved
//! (see `paths.rs`): the cost each path adds to the engine.
//!
//! `gpu_bench [--quick] [--paths] [--only cudarc|raw|c] [--so PATH] [--c-config CONF]` (needs a
//! GPU, or the null driver of `null-driver/` for `--paths`). `--paths`: only
//! the comparison of the Rust and C paths; `--only`: of those, one path and
//! no table (for a profiler's counts); `--so`: the C library to load.
//!
//! `gpu_bench --threads LIST ...` or `--devices LIST ...`: many threads on
//! one device, or one thread per device (see `threads.rs`; driven by
//! `benchmarks/host_cost/host_threads.py`).

mod paths;
mod shared_totals;
mod threads;

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use alloc_core::{human_bytes, KIB, MIB};
use alloc_cuda::cudarc::driver::{result, sys, CudaContext, CudaStream};
use alloc_cuda::{AsStream, CudaAllocator, CudaError, StreamEngines};

type BoxResult<T> = Result<T, Box<dyn Error>>;

/// One allocator under test.
trait Backend {
    fn alloc(&mut self, size: usize) -> BoxResult<u64>;
    fn release(&mut self, ptr: u64, size: usize) -> BoxResult<()>;
}

/// An allocator of the library, as `Ours` times it.
trait Library {
    fn malloc<S: AsStream + ?Sized>(&self, size: u64, stream: &S) -> Result<u64, CudaError>;
    fn free(&self, ptr: u64) -> Result<(), CudaError>;
}

impl Library for CudaAllocator {
    #[inline]
    fn malloc<S: AsStream + ?Sized>(&self, size: u64, stream: &S) -> Result<u64, CudaError> {
        CudaAllocator::malloc(self, size, stream)
    }
    #[inline]
    fn free(&self, ptr: u64) -> Result<(), CudaError> {
        CudaAllocator::free(self, ptr)
    }
}

impl Library for StreamEngines {
    #[inline]
    fn malloc<S: AsStream + ?Sized>(&self, size: u64, stream: &S) -> Result<u64, CudaError> {
        StreamEngines::malloc(self, size, stream)
    }
    #[inline]
    fn free(&self, ptr: u64) -> Result<(), CudaError> {
        StreamEngines::free(self, ptr)
    }
}

/// Our allocator on one stream (a cudarc stream unless said otherwise;
/// `CudaAllocator` unless said otherwise).
struct Ours<S: AsStream = Arc<CudaStream>, A: Library = CudaAllocator> {
    alloc: A,
    stream: S,
}

impl<S: AsStream, A: Library> Backend for Ours<S, A> {
    #[inline]
    fn alloc(&mut self, size: usize) -> BoxResult<u64> {
        Ok(self.alloc.malloc(size as u64, &self.stream)?)
    }
    #[inline]
    fn release(&mut self, ptr: u64, _size: usize) -> BoxResult<()> {
        Ok(self.alloc.free(ptr)?)
    }
}

/// Our allocator with a `record_stream` on a second stream before each free
/// (event record at free, event query at the next malloc).
struct OursCrossStream {
    alloc: CudaAllocator,
    stream: Arc<CudaStream>,
    other: Arc<CudaStream>,
}

impl Backend for OursCrossStream {
    #[inline]
    fn alloc(&mut self, size: usize) -> BoxResult<u64> {
        let p = self.alloc.malloc(size as u64, &self.stream)?;
        self.alloc.record_stream(p, &self.other)?;
        Ok(p)
    }
    #[inline]
    fn release(&mut self, ptr: u64, _size: usize) -> BoxResult<()> {
        Ok(self.alloc.free(ptr)?)
    }
}

/// `cuMemAllocAsync` / `cuMemFreeAsync` on the device's default pool.
struct DriverAsync {
    stream: Arc<CudaStream>,
}

impl Backend for DriverAsync {
    #[inline]
    fn alloc(&mut self, size: usize) -> BoxResult<u64> {
        // SAFETY: live stream of the current context; the memory is only
        // freed again, never read.
        Ok(unsafe { result::malloc_async(self.stream.cu_stream(), size) }?)
    }
    #[inline]
    fn release(&mut self, ptr: u64, _size: usize) -> BoxResult<()> {
        // SAFETY: `ptr` came from `malloc_async` on this stream, freed once.
        Ok(unsafe { result::free_async(ptr, self.stream.cu_stream()) }?)
    }
}

/// `cuMemAlloc` / `cuMemFree`.
struct DriverSync;

impl Backend for DriverSync {
    fn alloc(&mut self, size: usize) -> BoxResult<u64> {
        // SAFETY: fresh memory, only freed again, never read.
        Ok(unsafe { result::malloc_sync(size) }?)
    }
    fn release(&mut self, ptr: u64, _size: usize) -> BoxResult<()> {
        // SAFETY: `ptr` came from `malloc_sync`, freed once.
        Ok(unsafe { result::free_sync(ptr) }?)
    }
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// ns per alloc+free pair of one size, after a warm pair. (Never inlined:
/// a profiler's `--toggle-collect=gpu_bench::pair_ns` counts the pairs alone.)
#[inline(never)]
fn pair_ns(b: &mut dyn Backend, size: usize, iters: u64) -> BoxResult<f64> {
    let w = b.alloc(size)?;
    b.release(w, size)?;
    let t0 = Instant::now();
    for _ in 0..iters {
        let p = b.alloc(size)?;
        b.release(p, size)?;
    }
    Ok(t0.elapsed().as_nanos() as f64 / iters as f64)
}

/// ns per operation of the random workload: log-uniform sizes in [lo, hi],
/// at most `max_live` live blocks; second pass of the same sequence timed.
/// (Never inlined, as `pair_ns`.)
#[inline(never)]
fn mixed_ns(
    b: &mut dyn Backend,
    seed: u64,
    n_ops: u64,
    max_live: usize,
    lo: f64,
    hi: f64,
) -> BoxResult<f64> {
    let mut result = 0.0;
    for _pass in 0..2 {
        let mut rng = Rng(seed);
        let mut live: Vec<(u64, usize)> = Vec::with_capacity(max_live);
        let t0 = Instant::now();
        for _ in 0..n_ops {
            let do_alloc = live.is_empty() || (live.len() < max_live && rng.uniform() < 0.5);
            if do_alloc {
                let n = (lo.ln() + rng.uniform() * (hi.ln() - lo.ln())).exp() as usize;
                live.push((b.alloc(n)?, n));
            } else {
                let j = (rng.uniform() * live.len() as f64) as usize;
                let last = live.len() - 1;
                live.swap(j, last);
                let (p, n) = live.pop().unwrap_or_default();
                b.release(p, n)?;
            }
        }
        result = t0.elapsed().as_nanos() as f64 / n_ops as f64;
        for (p, n) in live {
            b.release(p, n)?;
        }
    }
    Ok(result)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[derive(Clone, Copy)]
enum Workload {
    Pair(usize),
    Mixed { max_live: usize, lo: f64, hi: f64 },
}

impl Workload {
    /// How many pairs or operations to time: pairs and mixed runs have
    /// their own counts.
    fn pick(&self, pairs: u64, mixed_ops: u64) -> u64 {
        match self {
            Workload::Pair(_) => pairs,
            Workload::Mixed { .. } => mixed_ops,
        }
    }

    fn label(&self) -> String {
        match *self {
            Workload::Pair(size) => format!("{} pair", human_bytes(size as u64)),
            Workload::Mixed { max_live, lo, hi } => format!(
                "mixed {}..{}, {max_live} live",
                human_bytes(lo as u64),
                human_bytes(hi as u64)
            ),
        }
    }

    /// ns per pair or operation of run number `run` with `scale`
    /// (iterations for pairs, ops for the mixed workload, whose sequence
    /// depends on `run`).
    fn run(&self, b: &mut dyn Backend, scale: u64, run: usize) -> BoxResult<f64> {
        match *self {
            Workload::Pair(size) => pair_ns(b, size, scale),
            Workload::Mixed { max_live, lo, hi } => {
                mixed_ns(b, 1234 + run as u64, scale, max_live, lo, hi)
            }
        }
    }

    /// Median ns over `reps` runs with `scale`.
    fn measure(
        &self,
        b: &mut dyn Backend,
        scale: u64,
        reps: usize,
        ctx: &CudaContext,
    ) -> BoxResult<f64> {
        let mut v = Vec::with_capacity(reps);
        for r in 0..reps {
            v.push(self.run(b, scale, r)?);
            ctx.synchronize()?;
        }
        Ok(median(v))
    }
}

fn keep_default_pool(ctx: &CudaContext, release_threshold: u64) -> BoxResult<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = release_threshold;
    // SAFETY: writes the device's default pool handle into a local; then sets
    // its release threshold from a local u64, the attribute's type.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )?;
    }
    Ok(pool)
}

/// The configuration of both paths in the comparison of `paths.rs`.
const PATHS_CONFIG: &str = "policy:pytorch-bfc";

/// The command line.
struct Args {
    quick: bool,
    /// Only the comparison of the Rust and C paths.
    paths_only: bool,
    /// The C library to load.
    so: Option<String>,
    /// The one path to run (an index into `paths::PATH_NAMES`).
    only: Option<usize>,
    /// `--c-config`: the C library alone under this configuration, after
    /// a second stream has allocated once (so that a layout with an engine
    /// per stream runs as it does once several streams are in use).
    c_config: Option<String>,
}

impl Args {
    fn parse() -> BoxResult<Self> {
        let mut args = Args {
            quick: false,
            paths_only: false,
            so: None,
            only: None,
            c_config: None,
        };
        let mut it = std::env::args().skip(1);
        while let Some(a) = it.next() {
            match a.as_str() {
                "--quick" => args.quick = true,
                "--paths" => args.paths_only = true,
                "--so" => args.so = Some(it.next().ok_or("--so needs a path")?),
                "--only" => {
                    let name = it.next().unwrap_or_default();
                    let i = paths::PATH_NAMES.iter().position(|&n| n == name);
                    args.only = Some(i.ok_or("--only takes cudarc, raw or c")?);
                    args.paths_only = true;
                }
                "--c-config" => {
                    args.c_config = Some(it.next().ok_or("--c-config needs a configuration")?);
                    args.only = Some(paths::C_PATH);
                    args.paths_only = true;
                }
                other => {
                    return Err(format!(
                        "unknown argument {other}: \
                         gpu_bench [--quick] [--paths] [--only cudarc|raw|c] [--so PATH] \
                         [--c-config CONF]"
                    )
                    .into())
                }
            }
        }
        Ok(args)
    }
}

/// The comparison of the Rust and C paths, or why it was left out.
fn compare_paths(
    args: &Args,
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    workloads: &[Workload],
    scale: (u64, u64),
    rounds: usize,
) -> BoxResult<()> {
    let Some(path) = paths::find_library(args.so.as_deref()) else {
        let why = "no liballoc_ffi.so beside this program or in ../lib (--so PATH names one)";
        if args.paths_only {
            return Err(why.into());
        }
        println!("\nRust path / C library path: left out ({why})");
        return Ok(());
    };
    let config = args.c_config.as_deref().unwrap_or(PATHS_CONFIG);
    let lib = paths::CLibrary::load(&path, config)
        .map_err(|e| format!("loading {}: {e}", path.display()))?;
    println!("\nC library: {}", path.display());
    if args.c_config.is_some() {
        lib.use_stream_once(&ctx.new_stream()?)?;
    }
    paths::compare(
        args.only, &lib, config, ctx, stream, workloads, scale, rounds,
    )
}

fn main() -> BoxResult<()> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "--threads" || a == "--devices") {
        return threads::run(&argv);
    }
    let args = Args::parse()?;
    let quick = args.quick;
    let (pair_iters, mixed_ops, sync_pair_iters, sync_mixed_ops, reps) = if quick {
        (20_000, 20_000, 50, 2_000, 3)
    } else {
        (200_000, 200_000, 200, 10_000, 5)
    };

    let probe = CudaAllocator::global(0)?;
    let ctx = probe.context().clone();
    let mut driver_version = 0;
    // SAFETY: writes an int into a local.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result()?;
    let (free, total) = probe.diagnostics().mem_get_info()?;
    println!(
        "device 0: {}, driver API {}.{}, {} total, {} free",
        ctx.name()?,
        driver_version / 1000,
        driver_version % 1000 / 10,
        human_bytes(total),
        human_bytes(free)
    );
    drop(probe);

    let workloads = [
        Workload::Pair(512),
        Workload::Pair(64 * KIB as usize),
        Workload::Pair(MIB as usize),
        Workload::Pair(8 * MIB as usize),
        Workload::Pair(64 * MIB as usize),
        Workload::Mixed {
            max_live: 1000,
            lo: 512.0,
            hi: MIB as f64,
        },
        Workload::Mixed {
            max_live: 200,
            lo: 512.0,
            hi: 64.0 * MIB as f64,
        },
    ];
    let stream = ctx.new_stream()?;
    if args.paths_only {
        return compare_paths(
            &args,
            &ctx,
            &stream,
            &workloads,
            (pair_iters, mixed_ops),
            reps,
        );
    }
    let other = ctx.new_stream()?;

    // Columns: each compiled-in policy, then the driver's allocators.
    let policies = alloc_policy::policy_names();
    let mut columns: Vec<(String, Vec<f64>)> = Vec::new();
    for name in &policies {
        let alloc = CudaAllocator::with_config_str(0, &format!("policy:{name}"))?;
        let mut b = Ours {
            alloc: alloc.clone(),
            stream: stream.clone(),
        };
        let mut col = Vec::new();
        for w in &workloads {
            let scale = w.pick(pair_iters, mixed_ops);
            col.push(w.measure(&mut b, scale, reps, &ctx)?);
        }
        alloc.empty_cache()?;
        columns.push((format!("ours: {name}"), col));
    }

    let pool = keep_default_pool(&ctx, u64::MAX)?;
    let mut col = Vec::new();
    for w in &workloads {
        let scale = w.pick(pair_iters, mixed_ops);
        col.push(w.measure(
            &mut DriverAsync {
                stream: stream.clone(),
            },
            scale,
            reps,
            &ctx,
        )?);
    }
    ctx.synchronize()?;
    // SAFETY: the default pool of this device; nothing of it is in use now.
    unsafe { result::mem_pool::trim_to(pool, 0) }?;
    columns.push(("cuMemAllocAsync".into(), col));

    let mut col = Vec::new();
    for w in &workloads {
        let scale = w.pick(sync_pair_iters, sync_mixed_ops);
        col.push(w.measure(&mut DriverSync, scale, 1, &ctx)?);
    }
    columns.push(("cuMemAlloc".into(), col));

    println!();
    println!(
        "Host cost in ns per alloc+free pair (mixed: per operation), median of {reps} runs; \
         {pair_iters} pairs / {mixed_ops} ops per run ({sync_pair_iters} / {sync_mixed_ops} for cuMemAlloc)."
    );
    println!();
    let async_col = policies.len();
    let mut header = String::from("| workload |");
    let mut rule = String::from("|---|");
    for (name, _) in &columns {
        header += &format!(" {name} |");
        rule += "---:|";
    }
    header += " ours (default) / cuMemAllocAsync |";
    rule += "---:|";
    println!("{header}\n{rule}");
    for (i, w) in workloads.iter().enumerate() {
        let mut row = format!("| {} |", w.label());
        for (_, col) in &columns {
            row += &format!(" {:.0} |", col[i]);
        }
        row += &format!(" {:.2} |", columns[0].1[i] / columns[async_col].1[i]);
        println!("{row}");
    }

    // The cross-stream path: record_stream on a second stream before each
    // free (one cuEventRecord at free, one cuEventQuery at the next malloc).
    let alloc = CudaAllocator::with_config_str(0, "")?;
    let mut cross = OursCrossStream {
        alloc: alloc.clone(),
        stream: stream.clone(),
        other: other.clone(),
    };
    let mut plain = Ours {
        alloc: alloc.clone(),
        stream: stream.clone(),
    };
    let plain_ns = Workload::Pair(64 * KIB as usize).measure(&mut plain, pair_iters, reps, &ctx)?;
    let cross_ns = Workload::Pair(64 * KIB as usize).measure(&mut cross, pair_iters, reps, &ctx)?;
    alloc.process_events()?;
    let events = alloc.diagnostics().event_stats()?;
    println!();
    println!(
        "| 64 KiB pair, ours (default) | same stream: {plain_ns:.0} ns | with record_stream on a second stream: {cross_ns:.0} ns | CUDA events created: {} for {} cross-stream frees |",
        events.created,
        events.created + events.reused
    );
    alloc.empty_cache()?;
    compare_paths(
        &args,
        &ctx,
        &stream,
        &workloads,
        (pair_iters, mixed_ops),
        reps,
    )
}
