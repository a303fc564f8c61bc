//! Helpers shared by the GPU test binaries: a spinning copy kernel (PTX,
//! loaded with cuModuleLoadData), patterns, allocators and streams.
#![allow(dead_code)]

use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use alloc_cuda::cudarc::driver::{result, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use alloc_cuda::cudarc::nvrtc::Ptx;
use alloc_cuda::{CudaAllocator, DeviceBuffer};

/// Spins for `spin_ns` nanoseconds of `%globaltimer`, then copies `n` words
/// from `src` to `dst` (grid-stride). The loads are volatile so that they
/// cannot be hoisted above the spin.
pub const SPIN_COPY_PTX: &str = r#"
.version 8.0
.target sm_75
.address_size 64

.visible .entry spin_copy(
    .param .u64 src,
    .param .u64 dst,
    .param .u32 n,
    .param .u64 spin_ns
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [src];
    ld.param.u64 %rd2, [dst];
    ld.param.u32 %r1, [n];
    ld.param.u64 %rd3, [spin_ns];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u64 %rd4, %globaltimer;
SPIN:
    mov.u64 %rd5, %globaltimer;
    sub.s64 %rd6, %rd5, %rd4;
    setp.lt.u64 %p1, %rd6, %rd3;
    @%p1 bra SPIN;

    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    mov.u32 %r6, %nctaid.x;
    mul.lo.s32 %r7, %r6, %r3;
COPY:
    setp.ge.u32 %p2, %r5, %r1;
    @%p2 bra DONE;
    mul.wide.u32 %rd7, %r5, 4;
    add.s64 %rd8, %rd1, %rd7;
    add.s64 %rd9, %rd2, %rd7;
    ld.volatile.global.u32 %r8, [%rd8];
    st.global.u32 [%rd9], %r8;
    add.s32 %r5, %r5, %r7;
    bra.uni COPY;
DONE:
    ret;
}
"#;

/// `words` words of a recognisable pattern (`salt` tells tests apart).
pub fn word_pattern(words: usize, salt: u32) -> Vec<u32> {
    (0..words as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ salt)
        .collect()
}

/// Queues `spin_copy` on `stream`: `spin` of spinning, then `src` copied
/// into `dst`. The caller keeps `src` readable until the kernel is done (by
/// the allocator's stream rules) and `dst` alive until it has synchronized.
pub fn launch_spin_copy(
    stream: &CudaStream,
    kernel: &CudaFunction,
    src: &DeviceBuffer<u32>,
    dst: &mut DeviceBuffer<u32>,
    spin: Duration,
) {
    assert_eq!(src.len(), dst.len(), "spin_copy copies equal lengths");
    let (src, dst, words) = (src.device_address(), dst.device_address(), src.len());
    // SAFETY: both buffers hold `words` u32; their lifetimes are the
    // caller's contract above.
    unsafe { launch_spin_copy_raw(stream, kernel, src, dst, words, spin) }
}

/// [`launch_spin_copy`] between device addresses (blocks of `words` u32).
///
/// # Safety
/// `src` and `dst` hold `words` u32 each, readable and writable until the
/// kernel has run.
pub unsafe fn launch_spin_copy_raw(
    stream: &CudaStream,
    kernel: &CudaFunction,
    src: u64,
    dst: u64,
    words: usize,
    spin: Duration,
) {
    let (n, spin_ns) = (words as u32, spin.as_nanos() as u64);
    let cfg = LaunchConfig {
        grid_dim: (264, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(kernel);
    launch.arg(&src).arg(&dst).arg(&n).arg(&spin_ns);
    // SAFETY: the arguments match the PTX signature (u64, u64, u32, u64);
    // the memory is the caller's contract above.
    unsafe { launch.launch(cfg) }.unwrap();
}

/// Whether compute-sanitizer runs the test (it may serialise launches).
pub fn under_sanitizer() -> bool {
    std::env::var_os("ALLOC_CUDA_SANITIZER").is_some()
}

/// An allocator of device 0 with `config`.
pub fn allocator(config: &str) -> CudaAllocator {
    match CudaAllocator::with_config_str(0, config) {
        Ok(a) => a,
        Err(e) => panic!("creating an allocator with `{config}`: {e}"),
    }
}

/// A new stream of the allocator's context.
pub fn new_stream(alloc: &CudaAllocator) -> Arc<CudaStream> {
    alloc.context().new_stream().expect("cuStreamCreate")
}

/// The `spin_copy` kernel loaded into the allocator's context.
pub fn spin_copy_kernel(alloc: &CudaAllocator) -> CudaFunction {
    let module = alloc
        .context()
        .load_module(Ptx::from_src(SPIN_COPY_PTX))
        .expect("loading the spin_copy PTX");
    module.load_function("spin_copy").expect("spin_copy")
}

/// Everything freed, cache emptied, nothing reserved, invariants hold, and
/// no stream held any more.
pub fn assert_drained(alloc: &CudaAllocator) {
    assert_eq!(
        alloc.allocated_bytes().unwrap(),
        0,
        "blocks still allocated"
    );
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.diagnostics().awaiting_events().unwrap(), 0);
    assert_eq!(
        alloc.reserved_bytes().unwrap(),
        0,
        "segments still reserved"
    );
    alloc.diagnostics().validate().unwrap().unwrap();
    assert_eq!(
        alloc
            .diagnostics()
            .inspect(|e| e.streams().registered())
            .unwrap(),
        0,
        "streams still held with nothing of them cached"
    );
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// A gate in a stream's queue: work queued on the stream after
/// [`StreamGate::close`] waits until [`StreamGate::open`] (or the gate is
/// dropped). Deterministic where a spinning kernel is only likely to be
/// still running (compute-sanitizer may serialise launches). While it is
/// closed, nothing may wait on the host for the stream (a stream or event
/// synchronize, a `cuMemFree`): such a wait ends only when the gate gives
/// up after [`GATE_LIMIT`], which [`StreamGate::open`] reports as a failure.
pub struct StreamGate {
    state: Arc<GateState>,
}

/// How long a closed gate holds its stream at most.
pub const GATE_LIMIT: Duration = Duration::from_secs(60);

#[derive(Default)]
struct GateState {
    /// (opened, gave up waiting)
    flags: Mutex<(bool, bool)>,
    changed: Condvar,
}

/// The host function [`StreamGate::close`] queues: blocks its stream until
/// the gate opens, or [`GATE_LIMIT`] has passed.
unsafe extern "C" fn wait_for_gate(arg: *mut c_void) {
    // SAFETY: `arg` is the `Arc` that `close` leaked with `Arc::into_raw`
    // for this one call, taken back here once.
    let gate = unsafe { Arc::from_raw(arg as *const GateState) };
    let deadline = std::time::Instant::now() + GATE_LIMIT;
    let mut flags = gate.flags.lock().unwrap_or_else(|p| p.into_inner());
    while !flags.0 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            flags.1 = true;
            return;
        }
        flags = gate
            .changed
            .wait_timeout(flags, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

impl StreamGate {
    /// Queues a closed gate on `stream`.
    pub fn close(stream: &CudaStream) -> Self {
        let state = Arc::new(GateState::default());
        let arg = Arc::into_raw(state.clone()) as *mut c_void;
        stream.context().bind_to_thread().expect("cuCtxSetCurrent");
        // SAFETY: the stream is live (borrowed); the host function makes no
        // CUDA call and takes back the `Arc` it is given, once.
        unsafe { result::stream::launch_host_function(stream.cu_stream(), wait_for_gate, arg) }
            .expect("cuLaunchHostFunc");
        StreamGate { state }
    }

    /// Lets the stream's queue run on; fails if the gate had already given
    /// up (something waited on the host for the gated stream).
    pub fn open(&self) {
        let gave_up = self.release();
        assert!(
            !gave_up,
            "the gate gave up after {GATE_LIMIT:?}: something waited for the gated stream"
        );
    }

    /// Opens the gate; whether it had given up.
    fn release(&self) -> bool {
        let mut flags = self.state.flags.lock().unwrap_or_else(|p| p.into_inner());
        flags.0 = true;
        self.state.changed.notify_all();
        flags.1
    }
}

impl Drop for StreamGate {
    fn drop(&mut self) {
        self.release(); // never leave a stream blocked, even on a failed assertion
    }
}
