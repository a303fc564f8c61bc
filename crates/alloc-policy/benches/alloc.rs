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
//! Times are the benchmark thread's CPU time by default
//! (`ALLOC_BENCH_CLOCK=wall` for criterion's wall clock): on a box shared
//! with other work, wall time also counts the waits for a core.
//!
//! Run: `cargo bench -p alloc-policy --bench alloc` (add `-- mixed` etc. to
//! filter). Results and their reading are in `docs/benchmarks.md`.

mod common;

use std::hint::black_box;
use std::time::Duration;

use alloc_core::{KIB, MIB};
use alloc_policy::policy_names;
use common::{
    engine, mixed, rlsf_pool, Contender, Empty, Mixed, OffsetAlloc, Replay, Rlsf, ThreadCpuTime,
    MIXED_OPS, SEED,
};
use criterion::measurement::{Measurement, WallTime};
use criterion::{BenchmarkGroup, Criterion, Throughput};

// ---------------------------------------------------------------- benches

fn bench_pair<C: Contender, M: Measurement>(
    g: &mut BenchmarkGroup<'_, M>,
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

fn bench_mixed<C: Contender, M: Measurement<Value = Duration>>(
    g: &mut BenchmarkGroup<'_, M>,
    clock: &M,
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
        b.iter_custom(|iters| r.run(a, iters, clock))
    });
}

fn pairs<M: Measurement>(c: &mut Criterion<M>) {
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

fn mixed_workloads<M: Measurement<Value = Duration>>(c: &mut Criterion<M>, clock: &M) {
    let workloads = [
        ("mixed_small", mixed(SEED, MIXED_OPS, 1000, 512, MIB)),
        ("mixed_wide", mixed(SEED, MIXED_OPS, 200, 512, 64 * MIB)),
    ];
    for (label, w) in &workloads {
        let mut g = configure_group(c, label);
        for p in policy_names() {
            bench_mixed(&mut g, clock, &p, &mut engine(p.as_str()), w);
        }
        bench_mixed(
            &mut g,
            clock,
            "offset-allocator",
            &mut OffsetAlloc::new(),
            w,
        );
        // Twice the peak live bytes plus slack: TLSF's good fit stays well
        // within that; only the pages that hold block headers get committed.
        let mut pool = rlsf_pool(2 * w.peak_bytes + 256 * MIB);
        let mut tlsf = Rlsf::new(pool.spare_capacity_mut());
        bench_mixed(&mut g, clock, "rlsf", &mut tlsf, w);
        bench_mixed(&mut g, clock, "empty_loop", &mut Empty, w);
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

fn configure_group<'c, M: Measurement>(
    c: &'c mut Criterion<M>,
    name: &str,
) -> BenchmarkGroup<'c, M> {
    let mut g = c.benchmark_group(name);
    g.measurement_time(measurement_time());
    // One iteration is one pair or one op: the reported time reads per pair /
    // per op, and the throughput line as pairs (ops) per second.
    g.throughput(Throughput::Elements(1));
    g
}

/// Every group under `clock`, with the settings of this benchmark (the
/// command line's criterion options override them).
fn run<M: Measurement<Value = Duration> + 'static>(clock: M, again: M) {
    let mut c = Criterion::default()
        .with_measurement(clock)
        .sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .configure_from_args();
    pairs(&mut c);
    mixed_workloads(&mut c, &again);
    c.final_summary();
}

/// Thread CPU time unless `ALLOC_BENCH_CLOCK=wall` asks for criterion's
/// wall clock.
fn main() {
    match std::env::var("ALLOC_BENCH_CLOCK").as_deref() {
        Ok("wall") => run(WallTime, WallTime),
        Ok("cpu") | Err(_) => run(ThreadCpuTime, ThreadCpuTime),
        Ok(other) => panic!("ALLOC_BENCH_CLOCK={other}: expected `cpu` or `wall`"),
    }
}
