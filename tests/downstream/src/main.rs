//! An application of `alloc-cuda` that also uses `cudarc` directly, with
//! features of its own (see `Cargo.toml`). Without a GPU it checks what it
//! can and says so; with one it copies a buffer through the allocator.

use std::process::ExitCode;
use std::sync::Arc;

use alloc_cuda::{CudaAllocator, CudaError};
use cudarc::driver::CudaStream;

/// Copies `host` to a buffer of `alloc` and back on `stream`: the cudarc
/// calls' errors convert with `?`.
fn round_trip(
    alloc: &CudaAllocator,
    stream: &Arc<CudaStream>,
    host: &[u32],
) -> Result<Vec<u32>, CudaError> {
    let buf = alloc.alloc_from_host(host, stream)?;
    let mut back = vec![0u32; host.len()];
    stream.memcpy_dtoh(&buf, &mut back)?;
    stream.synchronize()?;
    Ok(back)
}

/// Runs the device part on device 0.
fn on_device() -> Result<(), CudaError> {
    let alloc = CudaAllocator::with_config_str(0, "policy:size-class+gc-age")?;
    let stream = alloc.context().new_stream()?;
    let host: Vec<u32> = (0..1 << 16).collect();
    let back = round_trip(&alloc, &stream, &host)?;
    assert_eq!(back, host);
    println!(
        "{}: {} bytes reserved after the round trip",
        alloc.diagnostics().policy_name()?,
        alloc.reserved_bytes()?
    );
    Ok(())
}

fn main() -> ExitCode {
    // A policy this build leaves out is refused before any driver call.
    let refused = CudaAllocator::with_config_str(0, "policy:buddy").unwrap_err();
    assert!(
        refused.to_string().contains("enable cargo feature `buddy`"),
        "{refused}"
    );
    if !alloc_cuda::driver_available() {
        println!("no NVIDIA driver here: the device part is skipped");
        return ExitCode::SUCCESS;
    }
    match on_device() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("downstream: {e}");
            ExitCode::FAILURE
        }
    }
}
