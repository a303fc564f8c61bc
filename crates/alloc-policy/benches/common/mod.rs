//! The contenders and workloads of the host-cost benchmarks, shared by
//! `alloc.rs` (criterion) and `ops.rs` (one loop, for profilers): every
//! compiled-in policy on the simulated device, `offset-allocator`, `rlsf` and
//! an empty loop, in loops of the shape of the GPU harness
//! (`shared/device/alloc_bench.cpp`). `docs/benchmarks.md` describes them.

#![allow(dead_code)] // each benchmark uses a part

use std::alloc::Layout;
use std::hint::black_box;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::time::Duration;

use alloc_core::{AllocatorConfig, Engine, SimMemory, SimStreams, StreamId};
use alloc_policy::AnyPolicy;
use criterion::measurement::{Measurement, ValueFormatter, WallTime};

/// Simulated device size: bookkeeping only, so it can be far larger than the
/// live set of any workload here.
pub const DEVICE: u64 = 1 << 40;
/// Seed and length of the mixed workloads (as `baseline.py` calls `mixed_ns`).
pub const SEED: u64 = 42;
pub const MIXED_OPS: usize = 400_000;
/// `offset-allocator` counts in `u32` units; 256-byte units let it address
/// 1 TiB (the wide workload's live set can exceed 4 GiB).
pub const OA_UNIT: u64 = 256;
/// rlsf alignment: its natural granularity (the cheapest case for it).
pub const RLSF_ALIGN: usize = 16;

// ---------------------------------------------------------------- allocators

/// The two calls every contender offers to the loops.
pub trait Contender {
    type Handle: Copy;
    fn alloc(&mut self, size: u64) -> Self::Handle;
    fn free(&mut self, handle: Self::Handle);
}

pub type SimEngine = Engine<AnyPolicy, SimMemory, SimStreams>;

pub fn engine(policy: &str) -> SimEngine {
    let mut cfg = AllocatorConfig::default();
    cfg.policy = Some(policy.to_string());
    engine_of(&cfg).expect("policy builds")
}

/// The engine of a setting's name or a configuration string (`budget`,
/// `expandable_segments:True`), as the C library would build it.
pub fn configured_engine(config: &str) -> Result<SimEngine, String> {
    let cfg = AllocatorConfig::parse(config).map_err(|e| format!("{config}: {e}"))?;
    engine_of(&cfg).map_err(|e| format!("{config}: {e}"))
}

/// The engine `cfg` builds on the simulated device.
fn engine_of(cfg: &AllocatorConfig) -> Result<SimEngine, alloc_core::ConfigError> {
    AnyPolicy::engine(cfg, SimMemory::new(DEVICE), SimStreams::new())
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
pub struct OffsetAlloc(offset_allocator::Allocator);

impl OffsetAlloc {
    pub fn new() -> Self {
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
pub struct Rlsf<'p>(rlsf::Tlsf<'p, u32, u32, 28, 32>);

impl<'p> Rlsf<'p> {
    pub fn new(pool: &'p mut [MaybeUninit<u8>]) -> Self {
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
pub fn rlsf_pool(bytes: u64) -> Vec<u8> {
    Vec::with_capacity(bytes as usize)
}

/// The loop alone: the size goes through `black_box` and nothing is allocated.
pub struct Empty;

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
pub enum Op {
    Alloc(u64),
    /// Swap-remove this index of the live list and free it.
    Free(u32),
}

/// A pre-generated mixed workload.
pub struct Mixed {
    pub ops: Vec<Op>,
    pub max_live: usize,
    /// Largest sum of live requested bytes during the sequence.
    pub peak_bytes: u64,
}

/// The op sequence of `mixed_ns` in `alloc_bench.cpp`: alloc when nothing is
/// live or (below `max_live` and a coin < 0.5), with a log-uniform size in
/// [lo, hi]; else free the live block at a uniform random index.
pub fn mixed(seed: u64, n_ops: usize, max_live: usize, lo: u64, hi: u64) -> Mixed {
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
pub struct Replay<'w, H> {
    w: &'w Mixed,
    pos: usize,
    live: Vec<H>,
    pub warmed: bool,
}

impl<'w, H: Copy> Replay<'w, H> {
    pub fn new(w: &'w Mixed) -> Self {
        Replay {
            w,
            pos: 0,
            live: Vec::with_capacity(w.max_live),
            warmed: false,
        }
    }

    /// Frees what is live and rewinds to the start of the sequence.
    pub fn rewind<C: Contender<Handle = H>>(&mut self, a: &mut C) {
        for h in self.live.drain(..) {
            a.free(h);
        }
        self.pos = 0;
    }

    /// One untimed pass, leaving the contender warm and the replay rewound.
    pub fn warm<C: Contender<Handle = H>>(&mut self, a: &mut C) {
        self.run(a, self.w.ops.len() as u64, &ThreadCpuTime);
        self.rewind(a);
        self.warmed = true;
    }

    /// Runs `iters` ops, rewinding (untimed) at the end of the sequence;
    /// returns the time spent in ops on `clock`.
    #[inline(never)]
    pub fn run<C: Contender<Handle = H>, M: Measurement<Value = Duration>>(
        &mut self,
        a: &mut C,
        iters: u64,
        clock: &M,
    ) -> Duration {
        let ops = &self.w.ops;
        let mut left = iters as usize;
        let mut spent = Duration::ZERO;
        while left > 0 {
            if self.pos == ops.len() {
                self.rewind(a);
            }
            let end = ops.len().min(self.pos + left);
            let t0 = clock.start();
            for op in &ops[self.pos..end] {
                match *op {
                    Op::Alloc(n) => self.live.push(a.alloc(n)),
                    Op::Free(j) => {
                        let h = self.live.swap_remove(j as usize);
                        a.free(h);
                    }
                }
            }
            spent += clock.end(t0);
            left -= end - self.pos;
            self.pos = end;
        }
        spent
    }
}

// ---------------------------------------------------------------- clocks

/// Time the calling thread spent on a CPU (`CLOCK_THREAD_CPUTIME_ID`). On a
/// box shared with other work, wall time also counts the time the thread
/// waited for a core, which moves figures by 2x between runs; CPU time
/// still counts what the other work does to the caches.
pub struct ThreadCpuTime;

/// The calling thread's CPU time.
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer to
    // a local; CLOCK_THREAD_CPUTIME_ID exists on every Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Criterion's formatting of durations, borrowed from its wall clock.
static WALL: WallTime = WallTime;

impl Measurement for ThreadCpuTime {
    type Intermediate = Duration;
    type Value = Duration;
    fn start(&self) -> Duration {
        thread_cpu_time()
    }
    fn end(&self, start: Duration) -> Duration {
        thread_cpu_time().saturating_sub(start)
    }
    fn add(&self, v1: &Duration, v2: &Duration) -> Duration {
        *v1 + *v2
    }
    fn zero(&self) -> Duration {
        Duration::ZERO
    }
    fn to_f64(&self, value: &Duration) -> f64 {
        value.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        WALL.formatter()
    }
}
