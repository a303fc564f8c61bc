//! Adds two vectors with a kernel on buffers owned by the caching allocator.
//! The PTX is in this file and loaded with `cuModuleLoadData` (no NVRTC).
//!
//! `cargo run --release -p alloc-cuda --example vector_add` (needs a GPU).

use alloc_cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use alloc_cuda::cudarc::nvrtc::Ptx;
use alloc_cuda::CudaAllocator;

#[path = "../../../examples/failure.rs"]
mod failure;
use failure::Failure;

/// `out[i] = a[i] + b[i]` for `i < n`.
const VECTOR_ADD_PTX: &str = r#"
.version 8.0
.target sm_75
.address_size 64

.visible .entry vector_add(
    .param .u64 a,
    .param .u64 b,
    .param .u64 out,
    .param .u32 n
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [a];
    ld.param.u64 %rd2, [b];
    ld.param.u64 %rd3, [out];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd4, %rd1;
    cvta.to.global.u64 %rd5, %rd2;
    cvta.to.global.u64 %rd6, %rd3;
    mul.wide.u32 %rd7, %r5, 4;
    add.s64 %rd8, %rd4, %rd7;
    add.s64 %rd9, %rd5, %rd7;
    add.s64 %rd10, %rd6, %rd7;
    ld.global.f32 %f1, [%rd8];
    ld.global.f32 %f2, [%rd9];
    add.f32 %f3, %f1, %f2;
    st.global.f32 [%rd10], %f3;
DONE:
    ret;
}
"#;

fn main() -> Result<(), Failure> {
    let alloc = CudaAllocator::global(0)?;
    let ctx = alloc.context().clone();
    println!("device 0: {}", ctx.name()?);
    let stream = ctx.new_stream()?;
    let module = ctx.load_module(Ptx::from_src(VECTOR_ADD_PTX))?;
    let vector_add = module.load_function("vector_add")?;

    let n: usize = 3_000_017; // not a multiple of the block size
    let a: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.5).collect();
    let b: Vec<f32> = (0..n).map(|i| (i % 777) as f32 - 100.0).collect();

    let da = alloc.alloc_from_host(&a, &stream)?;
    let mut db = alloc.alloc::<f32>(n, &stream)?;
    stream.memcpy_htod(&b, &mut db)?; // cudarc copy into an allocator-owned buffer
    let mut out = alloc.alloc_zeros::<f32>(n, &stream)?;

    let n32 = u32::try_from(n)?;
    let mut launch = stream.launch_builder(&vector_add);
    launch.arg(&da).arg(&db).arg(&mut out).arg(&n32);
    // SAFETY: the arguments match the kernel's (u64, u64, u64, u32)
    // parameters, and the three buffers hold `n` f32 each.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n32)) }?;

    let mut host = vec![0f32; n];
    stream.memcpy_dtoh(&out, &mut host)?;
    stream.synchronize()?;
    let wrong = (0..n).filter(|&i| host[i] != a[i] + b[i]).count();
    let stats = alloc.stats()?;
    println!(
        "vector_add of {n} floats: {} wrong; buffers at {:#x}, {:#x}, {:#x}; \
         allocated {} B in {} segment(s)",
        wrong,
        da.device_address(),
        db.device_address(),
        out.device_address(),
        stats.allocated_bytes.all.current,
        stats.segment.all.current
    );
    drop((da, db, out));
    alloc.empty_cache()?;
    if wrong != 0 {
        return Err(format!("vector_add: {wrong} of {n} results are wrong").into());
    }
    println!("vector_add: OK");
    Ok(())
}
