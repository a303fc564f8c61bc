//! Do the driver's virtual-memory calls wait for kernels that are running on
//! another stream? `unmap_free_pages` maps and unmaps 2 MiB granules in the
//! middle of training; if `cuMemCreate` / `cuMemMap` / `cuMemSetAccess` /
//! `cuMemUnmap` / `cuMemRelease` synchronized with the device, each round
//! would drain the GPU's queue whatever the engine does to avoid waiting.
//!
//! The example times the same allocator calls twice, with the GPU idle and
//! while a kernel spins for 300 ms on an unrelated stream: a growth of an
//! expandable segment (maps only) and an unmap round (free pages of the
//! segment unmapped, then the growth mapped). A call that waits for the
//! kernel takes about 300 ms and finds it finished.
//!
//! `cargo run --release -p alloc-cuda --example vmm_while_busy` (needs a GPU).

use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use alloc_cuda::cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use alloc_cuda::cudarc::nvrtc::Ptx;
use alloc_cuda::CudaAllocator;

#[path = "../../../examples/failure.rs"]
mod failure;
use failure::Failure;

/// Spins until `ns` nanoseconds of `%globaltimer` have passed.
const SPIN_PTX: &str = r#"
.version 8.0
.target sm_75
.address_size 64

.visible .entry spin(.param .u64 ns)
{
    .reg .pred %p1;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
SPIN:
    mov.u64 %rd3, %globaltimer;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra SPIN;
    ret;
}
"#;

const MIB: u64 = 1 << 20;
const SPIN_FOR: Duration = Duration::from_millis(300);

type BoxResult<T> = Result<T, Box<dyn Error>>;

/// One timed allocator step: host milliseconds, map and unmap calls of the
/// engine (a call covers a run of granules), and whether the spinning kernel was still running afterwards.
struct Timed {
    ms: f64,
    maps: u64,
    unmaps: u64,
    still_running: bool,
}

fn main() -> Result<(), Failure> {
    let alloc =
        CudaAllocator::with_config_str(0, "expandable_segments:true,unmap_free_pages:true")?;
    let ctx = alloc.context().clone();
    let a = ctx.new_stream()?;
    let busy = ctx.new_stream()?;
    let module = ctx.load_module(Ptx::from_src(SPIN_PTX))?;
    let spin = module.load_function("spin")?;
    let spin_ns = SPIN_FOR.as_nanos() as u64;
    let launch_spin = |stream: &CudaStream| -> BoxResult<()> {
        let mut launch = stream.launch_builder(&spin);
        launch.arg(&spin_ns);
        // SAFETY: one u64 argument, as the PTX declares.
        unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }?;
        Ok(())
    };
    launch_spin(&busy)?; // loads the module: lazy loading synchronizes once
    busy.synchronize()?;

    println!("granule-by-granule mapping, 2 MiB granules; the spin kernel runs {SPIN_FOR:?} on its own stream");
    for gpu_busy in [false, true] {
        // A fresh pair of growable segments each time: stream A's large pool.
        let (grow, round) = scenario(
            &alloc,
            &a,
            || {
                if gpu_busy {
                    launch_spin(&busy)
                } else {
                    Ok(())
                }
            },
            &busy,
        )?;
        for (what, t) in [("growth of 20 MiB", grow), ("unmap round + growth", round)] {
            println!(
                "GPU {:>4}: {what:<22} {:>9.3} ms host, {:>3} map calls, {:>3} unmap calls, spin kernel still running after: {}",
                if gpu_busy { "busy" } else { "idle" },
                t.ms,
                t.maps,
                t.unmaps,
                t.still_running
            );
        }
        busy.synchronize()?;
        alloc.empty_cache()?;
    }
    Ok(())
}

/// Times a growth, then an unmap round, each right after `start_kernel`.
fn scenario(
    alloc: &CudaAllocator,
    a: &Arc<CudaStream>,
    start_kernel: impl Fn() -> BoxResult<()>,
    busy: &CudaStream,
) -> BoxResult<(Timed, Timed)> {
    let timed = |f: &mut dyn FnMut() -> BoxResult<u64>| -> BoxResult<(Timed, u64)> {
        let before = alloc.stats()?;
        start_kernel()?;
        let t0 = Instant::now();
        let addr = f()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let still_running = !busy.record_event(None)?.is_complete();
        let after = alloc.stats()?;
        busy.synchronize()?;
        Ok((
            Timed {
                ms,
                maps: after.num_device_alloc - before.num_device_alloc,
                unmaps: after.num_device_free - before.num_device_free,
                still_running,
            },
            addr,
        ))
    };
    // Growth: the first 20 MiB of a new segment would reserve its range too;
    // take that first, untimed.
    let first = alloc.malloc(20 * MIB, a)?;
    let (grow, second) = timed(&mut || Ok(alloc.malloc(20 * MIB, a)?))?;
    // Unmap round: `first` freed, then a larger request that would raise
    // reserved memory above its peak: first's pages are unmapped (stream A
    // is idle, so no wait is needed) and the growth is mapped.
    alloc.free(first)?;
    a.synchronize()?;
    let (round, third) = timed(&mut || Ok(alloc.malloc(30 * MIB, a)?))?;
    alloc.free(second)?;
    alloc.free(third)?;
    Ok((grow, round))
}
