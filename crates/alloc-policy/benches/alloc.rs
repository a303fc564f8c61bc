//! Host cost of every compiled-in policy, beside the fastest allocator cores
//! (`offset-allocator`, `rlsf`) and an empty loop, in loops of the same shape
//! as the GPU harness (`shared/device/alloc_bench.cpp`):
//!
//! - `pair/<size>`: one malloc + free of the same size on stream 0, steady
//!   state (a warm pair runs first, untimed). One criterion iteration = one
//!   pair.
//! - `mixed_small` / `mixed_wide`: the harness's random workload (log-uniform
//!   sizes in 512 B..1 MiB with at most 1000 live, and 512 B..64 MiB with at
//!   most 200 live; 400 000 ops, seed 42). The op sequence is generated once,
//!   outside the timed loop, by the same rule as the C++ (alloc when nothing
//!   is live, or when below the cap and a coin says so; else free a random
//!   live block by swap-and-pop). One criterion iteration = one op. The
//!   sequence is replayed in passes; between passes the live blocks are freed
//!   untimed, and a first pass runs untimed before measuring (the C++ times
//!   the second pass).
//!
//! Run: `cargo bench -p alloc-policy --bench alloc` (add `-- mixed` etc. to
//! filter). Results and their reading are in `docs/benchmarks.md`.

use std::alloc::Layout;
use std::hint::black_box;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use alloc_core::{AllocatorConfig, Engine, SimMemory, SimStreams, StreamId, KIB, MIB};
use alloc_policy::{policy_names, AnyPolicy};
use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};

/// Simulated device size: bookkeeping only, so it can be far larger than the
/// live set of any workload here.
const DEVICE: u64 = 1 << 40;
/// Seed and length of the mixed workloads (as `baseline.py` calls `mixed_ns`).
const SEED: u64 = 42;
const MIXED_OPS: usize = 400_000;
/// `offset-allocator` counts in `u32` units; 256-byte units let it address
/// 1 TiB (the wide workload's live set can exceed 4 GiB).
const OA_UNIT: u64 = 256;
/// rlsf alignment: its natural granularity (the cheapest case for it).
const RLSF_ALIGN: usize = 16;

// ---------------------------------------------------------------- allocators

/// The two calls every contender offers to the loops.
trait Contender {
    type Handle: Copy;
    fn alloc(&mut self, size: u64) -> Self::Handle;
    fn free(&mut self, handle: Self::Handle);
}

type SimEngine = Engine<AnyPolicy, SimMemory, SimStreams>;

fn engine(policy: &str) -> SimEngine {
    let mut cfg = AllocatorConfig::default();
    cfg.policy = Some(policy.to_string());
    AnyPolicy::engine(&cfg, SimMemory::new(DEVICE), SimStreams::new()).expect("policy builds")
}

impl Contender for SimEngine {
    type Handle = u64;
    #[inline]
    fn alloc(&mut self, size: u64) -> u64 {
        self.malloc(size, StreamId(0)).expect("engine malloc").addr
    }
    #[inline]
    fn free(&mut self, addr: u64) {
        Engine::free(self, addr).expect("engine free")
    }
}

/// `offset_allocator` 0.2: two-level bins, metadata outside the memory.
struct OffsetAlloc(offset_allocator::Allocator);

impl OffsetAlloc {
    fn new() -> Self {
        OffsetAlloc(offset_allocator::Allocator::new(u32::MAX))
    }
}

impl Contender for OffsetAlloc {
    type Handle = offset_allocator::Allocation;
    #[inline]
    fn alloc(&mut self, size: u64) -> Self::Handle {
        let units = size.div_ceil(OA_UNIT) as u32;
        self.0.allocate(units).expect("offset-allocator allocate")
    }
    #[inline]
    fn free(&mut self, a: Self::Handle) {
        self.0.free(a)
    }
}

/// `rlsf` 0.2 TLSF: blocks of up to 8 GiB (32 B << 28), headers inside the
/// pool, so it needs real (here lazily committed) memory.
struct Rlsf<'p>(rlsf::Tlsf<'p, u32, u32, 28, 32>);

impl<'p> Rlsf<'p> {
    fn new(pool: &'p mut [MaybeUninit<u8>]) -> Self {
        let mut t = rlsf::Tlsf::new();
        t.insert_free_block(pool);
        Rlsf(t)
    }
}

impl Contender for Rlsf<'_> {
    type Handle = NonNull<u8>;
    #[inline]
    fn alloc(&mut self, size: u64) -> NonNull<u8> {
        let layout = Layout::from_size_align(size as usize, RLSF_ALIGN).unwrap();
        self.0.allocate(layout).expect("rlsf pool too small")
    }
    #[inline]
    fn free(&mut self, p: NonNull<u8>) {
        // Safety: `p` came from `allocate` of this Tlsf with this alignment
        // and is freed once (the loops free each live handle exactly once).
        unsafe { self.0.deallocate(p, RLSF_ALIGN) }
    }
}

/// A pool for rlsf: reserved address space only; pages are committed when
/// rlsf first writes a block header into them.
fn rlsf_pool(bytes: u64) -> Vec<u8> {
    Vec::with_capacity(bytes as usize)
}

/// The loop alone: the size goes through `black_box` and nothing is allocated.
struct Empty;

impl Contender for Empty {
    type Handle = u64;
    #[inline]
    fn alloc(&mut self, size: u64) -> u64 {
        black_box(size)
    }
    #[inline]
    fn free(&mut self, h: u64) {
        black_box(h);
    }
}

// ---------------------------------------------------------------- workloads

/// xorshift64* (Vigna), a small deterministic RNG.
struct XorShift(u64);

impl XorShift {
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[derive(Clone, Copy)]
enum Op {
    Alloc(u64),
    /// Swap-remove this index of the live list and free it.
    Free(u32),
}

/// A pre-generated mixed workload.
struct Mixed {
    ops: Vec<Op>,
    max_live: usize,
    /// Largest sum of live requested bytes during the sequence.
    peak_bytes: u64,
}

/// The op sequence of `mixed_ns` in `alloc_bench.cpp`: alloc when nothing is
/// live or (below `max_live` and a coin < 0.5), with a log-uniform size in
/// [lo, hi]; else free the live block at a uniform random index.
fn mixed(seed: u64, n_ops: usize, max_live: usize, lo: u64, hi: u64) -> Mixed {
    let mut rng = XorShift(seed);
    let (llo, lhi) = ((lo as f64).ln(), (hi as f64).ln());
    let mut ops = Vec::with_capacity(n_ops);
    let mut live: Vec<u64> = Vec::with_capacity(max_live);
    let (mut bytes, mut peak_bytes) = (0u64, 0u64);
    for _ in 0..n_ops {
        let do_alloc = live.is_empty() || (live.len() < max_live && rng.unit() < 0.5);
        if do_alloc {
            let n = (llo + rng.unit() * (lhi - llo)).exp() as u64;
            ops.push(Op::Alloc(n));
            live.push(n);
            bytes += n;
            peak_bytes = peak_bytes.max(bytes);
        } else {
            let j = (rng.unit() * live.len() as f64) as usize;
            ops.push(Op::Free(j as u32));
            bytes -= live.swap_remove(j);
        }
    }
    Mixed {
        ops,
        max_live,
        peak_bytes,
    }
}

/// Replays a mixed sequence; `pos` and `live` carry over between calls.
struct Replay<'w, H> {
    w: &'w Mixed,
    pos: usize,
    live: Vec<H>,
    warmed: bool,
}

impl<'w, H: Copy> Replay<'w, H> {
    fn new(w: &'w Mixed) -> Self {
        Replay {
            w,
            pos: 0,
            live: Vec::with_capacity(w.max_live),
            warmed: false,
        }
    }

    /// Frees what is live and rewinds to the start of the sequence.
    fn rewind<C: Contender<Handle = H>>(&mut self, a: &mut C) {
        for h in self.live.drain(..) {
            a.free(h);
        }
        self.pos = 0;
    }

    /// One untimed pass, leaving the contender warm and the replay rewound.
    fn warm<C: Contender<Handle = H>>(&mut self, a: &mut C) {
        self.run(a, self.w.ops.len() as u64);
        self.rewind(a);
        self.warmed = true;
    }

    /// Runs `iters` ops, rewinding (untimed) at the end of the sequence;
    /// returns the time spent in ops.
    #[inline(never)]
    fn run<C: Contender<Handle = H>>(&mut self, a: &mut C, iters: u64) -> Duration {
        let ops = &self.w.ops;
        let mut left = iters as usize;
        let mut spent = Duration::ZERO;
        while left > 0 {
            if self.pos == ops.len() {
                self.rewind(a);
            }
            let end = ops.len().min(self.pos + left);
            let t0 = Instant::now();
            for op in &ops[self.pos..end] {
                match *op {
                    Op::Alloc(n) => self.live.push(a.alloc(n)),
                    Op::Free(j) => {
                        let h = self.live.swap_remove(j as usize);
                        a.free(h);
                    }
                }
            }
            spent += t0.elapsed();
            left -= end - self.pos;
            self.pos = end;
        }
        spent
    }
}

// ---------------------------------------------------------------- benches

fn bench_pair<C: Contender>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    a: &mut C,
    size: u64,
) {
    // Warm pair: the segment (or free block) is cached before timing.
    let h = a.alloc(size);
    a.free(h);
    g.bench_function(name, |b| {
        b.iter(|| {
            let h = a.alloc(black_box(size));
            a.free(h);
        })
    });
}

fn bench_mixed<C: Contender>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    a: &mut C,
    w: &Mixed,
) {
    // Criterion calls the routine many times (warm-up, each sample), and not
    // at all when filtered out: warm on the first call only.
    let mut replay: Option<Replay<'_, C::Handle>> = None;
    g.bench_function(name, |b| {
        let r = replay.get_or_insert_with(|| Replay::new(w));
        if !r.warmed {
            r.warm(a);
        }
        b.iter_custom(|iters| r.run(a, iters))
    });
}

fn pairs(c: &mut Criterion) {
    let sizes: [(u64, &str); 5] = [
        (512, "512B"),
        (64 * KIB, "64KiB"),
        (MIB, "1MiB"),
        (8 * MIB, "8MiB"),
        (64 * MIB, "64MiB"),
    ];
    let mut pool = rlsf_pool(256 * MIB);
    let mut tlsf = Rlsf::new(pool.spare_capacity_mut());
    for (size, label) in sizes {
        let mut g = configure_group(c, &format!("pair/{label}"));
        for p in policy_names() {
            bench_pair(&mut g, &p, &mut engine(&p), size);
        }
        bench_pair(&mut g, "offset-allocator", &mut OffsetAlloc::new(), size);
        bench_pair(&mut g, "rlsf", &mut tlsf, size);
        bench_pair(&mut g, "empty_loop", &mut Empty, size);
        g.finish();
    }
}

fn mixed_workloads(c: &mut Criterion) {
    let workloads = [
        ("mixed_small", mixed(SEED, MIXED_OPS, 1000, 512, MIB)),
        ("mixed_wide", mixed(SEED, MIXED_OPS, 200, 512, 64 * MIB)),
    ];
    for (label, w) in &workloads {
        let mut g = configure_group(c, label);
        for p in policy_names() {
            bench_mixed(&mut g, &p, &mut engine(p.as_str()), w);
        }
        bench_mixed(&mut g, "offset-allocator", &mut OffsetAlloc::new(), w);
        // Twice the peak live bytes plus slack: TLSF's good fit stays well
        // within that; only the pages that hold block headers get committed.
        let mut pool = rlsf_pool(2 * w.peak_bytes + 256 * MIB);
        bench_mixed(&mut g, "rlsf", &mut Rlsf::new(pool.spare_capacity_mut()), w);
        bench_mixed(&mut g, "empty_loop", &mut Empty, w);
        g.finish();
    }
}

/// Measurement time per benchmark: 2 s while the policies are few; with
/// many compiled-in policies it shrinks (not below 1 s) so that the whole run
/// stays near 3 minutes (about 7 groups x contenders x (0.5 s warm-up +
/// measurement + analysis)).
fn measurement_time() -> Duration {
    let contenders = policy_names().len() as u32 + 3;
    let budget_ms = 2000 * 7 / contenders;
    Duration::from_millis(budget_ms.clamp(1000, 2000) as u64)
}

fn configure_group<'c>(c: &'c mut Criterion, name: &str) -> BenchmarkGroup<'c, WallTime> {
    let mut g = c.benchmark_group(name);
    g.measurement_time(measurement_time());
    // One iteration is one pair or one op: the reported time reads per pair /
    // per op, and the throughput line as pairs (ops) per second.
    g.throughput(Throughput::Elements(1));
    g
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    targets = pairs, mixed_workloads
}
criterion_main!(benches);
