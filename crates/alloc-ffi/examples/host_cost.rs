//! Where the host cost of an allocation goes, layer by layer, in the loops
//! of `shared/device/alloc_bench.cpp` (steady-state alloc+free pairs; the
//! random mixed workload, second pass timed). Needs a GPU for the CUDA rows:
//!
//!     cargo run --release -p alloc-ffi --example host_cost [policy]
//!
//! Rows: the engine on the simulated device (no lock), the same behind a
//! `Mutex` (one lock per call), the engine of a real `CudaAllocator` driven
//! inside one `with_engine` lock (real addresses and CUDA backends, no
//! per-call lock), `CudaAllocator::malloc` / `free` (one lock
//! per call), and the C entry points `gpualloc_malloc` / `gpualloc_free`.

use std::hint::black_box;
use std::ptr::null_mut;
use std::sync::Mutex;
use std::time::Instant;

use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId};
use alloc_cuda::CudaAllocator;
use alloc_ffi::{gpualloc_free, gpualloc_malloc};
use alloc_policy::AnyPolicy;

/// One op of the mixed workload: allocate `size` or free live block `index`.
#[derive(Clone, Copy)]
enum Op {
    Alloc(u64),
    Free(usize),
}

fn xorshift(state: &mut u64) -> f64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
}

fn mixed_ops(n: usize, max_live: usize, lo: u64, hi: u64) -> Vec<Op> {
    let mut s = 42u64;
    let mut live = 0usize;
    let (llo, lhi) = ((lo as f64).ln(), (hi as f64).ln());
    (0..n)
        .map(|_| {
            if live == 0 || (live < max_live && xorshift(&mut s) < 0.5) {
                live += 1;
                Op::Alloc((llo + xorshift(&mut s) * (lhi - llo)).exp() as u64)
            } else {
                let i = (xorshift(&mut s) * live as f64) as usize;
                live -= 1;
                Op::Free(i)
            }
        })
        .collect()
}

/// ns per pair and ns per mixed op (small, wide) for an alloc/free pair of closures.
fn measure(alloc: &mut dyn FnMut(u64) -> u64, free: &mut dyn FnMut(u64)) -> Vec<f64> {
    let mut out = Vec::new();
    for size in [512u64, 65536, 1 << 20, 8 << 20, 64 << 20] {
        let w = alloc(size);
        free(w);
        let iters = 200_000;
        let t = Instant::now();
        for _ in 0..iters {
            let p = alloc(black_box(size));
            free(p);
        }
        out.push(t.elapsed().as_nanos() as f64 / iters as f64);
    }
    for (max_live, lo, hi) in [(1000usize, 512u64, 1u64 << 20), (200, 512, 64 << 20)] {
        let ops = mixed_ops(400_000, max_live, lo, hi);
        let mut ns = 0.0;
        for pass in 0..2 {
            let mut live: Vec<u64> = Vec::with_capacity(max_live);
            let t = Instant::now();
            for op in &ops {
                match *op {
                    Op::Alloc(s) => live.push(alloc(s)),
                    Op::Free(i) => free(live.swap_remove(i)),
                }
            }
            ns = t.elapsed().as_nanos() as f64 / ops.len() as f64;
            for p in live {
                free(p);
            }
            let _ = pass;
        }
        out.push(ns);
    }
    out
}

fn print(name: &str, v: &[f64]) {
    let cells: Vec<String> = v.iter().map(|x| format!("{x:>8.0}")).collect();
    println!("{name:<34} {}", cells.join(" "));
}

fn main() {
    let policy = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "pytorch-bfc".into());
    let conf = format!("policy:{policy}");
    let cfg = AllocatorConfig::parse(&conf).unwrap();
    println!(
        "policy {policy}; ns per pair (512B 64KiB 1MiB 8MiB 64MiB), ns per mixed op (small wide)"
    );
    println!(
        "{:<34} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "layer", "512B", "64KiB", "1MiB", "8MiB", "64MiB", "m.small", "m.wide"
    );
    let sim = || AnyPolicy::engine(&cfg, SimMemory::new(1 << 40), SimStreams::new()).unwrap();
    let mut e = sim();
    let e2 = std::cell::RefCell::new(&mut e);
    print(
        "sim engine",
        &measure(
            &mut |s| e2.borrow_mut().malloc(s, StreamId(0)).unwrap().addr,
            &mut |p| e2.borrow_mut().free(p).unwrap(),
        ),
    );
    let m = Mutex::new(sim());
    print(
        "sim engine + Mutex per call",
        &measure(
            &mut |s| m.lock().unwrap().malloc(s, StreamId(0)).unwrap().addr,
            &mut |p| m.lock().unwrap().free(p).unwrap(),
        ),
    );
    if !alloc_cuda::driver_available() {
        println!("no CUDA driver: CUDA rows skipped");
        return;
    }
    CudaAllocator::configure_global(&conf).unwrap();
    let a = CudaAllocator::global(0).unwrap();
    let stream = a.context().default_stream(); // the legacy default stream, id 0
                                               // SAFETY: `f` frees only blocks it allocated itself (no DeviceBuffer's).
    let row = unsafe {
        a.diagnostics().with_engine(|eng| {
            let id = eng.streams_mut().register(&stream).unwrap();
            let eng = std::cell::RefCell::new(eng);
            measure(
                &mut |s| eng.borrow_mut().malloc(s, id).unwrap().addr,
                &mut |p| eng.borrow_mut().free(p).unwrap(),
            )
        })
    }
    .unwrap();
    print("CUDA engine, one lock around all", &row);
    print(
        "CudaAllocator (lock per call)",
        &measure(&mut |s| a.malloc(s, &stream).unwrap(), &mut |p| {
            a.free(p).unwrap()
        }),
    );
    print(
        "C entry points gpualloc_malloc/free",
        &measure(
            &mut |s| gpualloc_malloc(s as isize, 0, null_mut()) as u64,
            &mut |p| gpualloc_free(p as *mut _, 0, 0, null_mut()),
        ),
    );
    let st = a.stats().unwrap();
    println!(
        "device allocs {} frees {} reserved peak {} MiB",
        st.num_device_alloc,
        st.num_device_free,
        st.reserved_bytes.all.peak >> 20
    );
}
