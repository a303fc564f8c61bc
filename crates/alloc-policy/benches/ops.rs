//! One contender in one loop of the host-cost benchmarks, for profilers:
//! the loop runs `N` pairs or ops in `timed_*` functions (callgrind's
//! `--toggle-collect='*timed_*'` counts them alone) and prints the thread's
//! CPU nanoseconds per pair or op.
//!
//! ```sh
//! cargo bench -p alloc-policy --bench ops --no-run   # prints the binary's path
//! target/release/deps/ops-HASH pytorch-bfc pair:512 20000000
//! valgrind --tool=callgrind --toggle-collect='*timed_*' target/release/deps/ops-HASH size-class mixed_wide 400000
//! ```
//!
//! Contenders: a policy name (`policy_names()`), `offset-allocator`,
//! `rlsf`, `empty_loop`, or else a setting's name or a configuration string
//! (`budget`, `expandable_segments:True`): the engine the C library builds.
//! Workloads: `pair:<bytes>`, `mixed_small`, `mixed_wide`. Run without
//! arguments under `cargo bench` (which passes `--bench`), it runs a short
//! smoke loop of every contender.

mod common;

use std::hint::black_box;

use alloc_core::MIB;
use alloc_policy::policy_names;
use common::{
    configured_engine, engine, mixed, rlsf_pool, thread_cpu_time, Contender, Empty, OffsetAlloc,
    Replay, Rlsf, ThreadCpuTime, MIXED_OPS, SEED,
};

#[inline(never)]
fn timed_pairs<C: Contender>(a: &mut C, size: u64, n: u64) {
    for _ in 0..n {
        let h = a.alloc(black_box(size));
        a.free(h);
    }
}

#[inline(never)]
fn timed_ops<C: Contender>(r: &mut Replay<'_, C::Handle>, a: &mut C, n: u64) {
    r.run(a, n, &ThreadCpuTime);
}

/// Runs `work` `n` times on `a`; returns CPU nanoseconds per pair or op.
fn measure<C: Contender>(a: &mut C, work: &str, n: u64) -> Result<f64, String> {
    if let Some(bytes) = work.strip_prefix("pair:") {
        let size: u64 = bytes.parse().map_err(|e| format!("{work}: {e}"))?;
        timed_pairs(a, size, 1000); // warm
        let t0 = thread_cpu_time();
        timed_pairs(a, size, n);
        return Ok((thread_cpu_time() - t0).as_nanos() as f64 / n as f64);
    }
    let w = match work {
        "mixed_small" => mixed(SEED, MIXED_OPS, 1000, 512, MIB),
        "mixed_wide" => mixed(SEED, MIXED_OPS, 200, 512, 64 * MIB),
        _ => return Err(format!("unknown workload {work}")),
    };
    let mut r = Replay::new(&w);
    r.warm(a);
    let t0 = thread_cpu_time();
    timed_ops(&mut r, a, n);
    Ok((thread_cpu_time() - t0).as_nanos() as f64 / n as f64)
}

fn run(who: &str, work: &str, n: u64) -> Result<f64, String> {
    match who {
        "offset-allocator" => measure(&mut OffsetAlloc::new(), work, n),
        "rlsf" => {
            let mut pool = rlsf_pool(4 << 30);
            measure(&mut Rlsf::new(pool.spare_capacity_mut()), work, n)
        }
        "empty_loop" => measure(&mut Empty, work, n),
        p if policy_names().iter().any(|name| name == p) => measure(&mut engine(p), work, n),
        // A setting or configuration string: the engine as the C library builds it.
        config => measure(&mut configured_engine(config)?, work, n),
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.is_empty() {
        let mut who: Vec<String> = policy_names();
        who.extend(["offset-allocator", "rlsf", "empty_loop"].map(String::from));
        for c in &who {
            for w in ["pair:512", "mixed_wide"] {
                match run(c, w, 10_000) {
                    Ok(ns) => println!("{c} {w} {ns:.1} ns"),
                    Err(e) => panic!("{e}"),
                }
            }
        }
        return;
    }
    let [who, work, n] = &args[..] else {
        eprintln!("usage: ops CONTENDER WORKLOAD N (see the source's first lines)");
        std::process::exit(2);
    };
    let n: u64 = n.parse().unwrap_or_else(|e| panic!("N: {e}"));
    match run(who, work, n) {
        Ok(ns) => println!("{ns:.2}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    }
}
