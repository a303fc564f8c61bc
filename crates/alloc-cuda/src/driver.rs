//! The CUDA boundary: every raw driver call of the allocator, each behind a
//! small function with the reason it is sound. Nothing else in this crate
//! calls the driver except through cudarc's safe API.

use std::ffi::c_int;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use cudarc::driver::{result, sys, CudaContext};

use crate::error::{driver_error, CudaError};

/// Whether `libcuda` can be loaded; checked once per process.
#[cfg(feature = "dynamic-loading")]
pub(crate) fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries `dlopen` on the driver's library names and closes
    // what it opened; loading the NVIDIA driver library is what any CUDA
    // program does, and cudarc would do the same at its first call.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Whether `libcuda` can be loaded: linked at build time, it was loaded
/// with the program.
#[cfg(not(feature = "dynamic-loading"))]
pub(crate) fn driver_present() -> bool {
    true
}

/// Fails with [`CudaError::DriverNotFound`] instead of letting cudarc panic
/// when `libcuda` is absent.
pub(crate) fn ensure_driver() -> Result<(), CudaError> {
    if driver_present() {
        Ok(())
    } else {
        Err(CudaError::DriverNotFound)
    }
}

/// `Ok(())` when the loaded driver exports the function `$name`, else
/// [`CudaError::MissingFunction`]: cudarc would panic on the missing
/// symbol (a driver older than the API version of the build, or a stand-in
/// library), and a failure is an error here, never a panic. Looked up once
/// per call site.
macro_rules! require {
    ($name:literal) => {{
        static PRESENT: OnceLock<bool> = OnceLock::new();
        if *PRESENT.get_or_init(|| symbol_present($name)) {
            Ok(())
        } else {
            Err(CudaError::MissingFunction { call: $name })
        }
    }};
}

/// Number of CUDA devices (initialises the driver).
pub(crate) fn device_count() -> Result<usize, CudaError> {
    ensure_driver()?;
    require!("cuInit")?;
    require!("cuDeviceGetCount")?;
    result::init().map_err(|e| driver_error("cuInit", e.0))?;
    let n = result::device::get_count().map_err(|e| driver_error("cuDeviceGetCount", e.0))?;
    Ok(n.max(0) as usize)
}

/// Makes `ctx` current on the calling thread (a `cuCtxGetCurrent` when it
/// already is).
pub(crate) fn bind(ctx: &CudaContext) -> Result<(), CudaError> {
    ctx.bind_to_thread()
        .map_err(|e| driver_error("cuCtxSetCurrent", e.0))
}

/// `cuMemAlloc`: a new segment of `size` bytes in the current context.
pub(crate) fn mem_alloc(size: u64) -> Result<u64, CudaError> {
    require!("cuMemAlloc_v2")?;
    let bytes = usize::try_from(size)
        .map_err(|_| driver_error("cuMemAlloc_v2", sys::CUresult::CUDA_ERROR_INVALID_VALUE))?;
    // SAFETY: cuMemAlloc writes one device address into a local; the memory
    // it returns is uninitialised, but only its address is handed out (as a
    // plain integer), never read on the host.
    unsafe { result::malloc_sync(bytes) }.map_err(|e| driver_error("cuMemAlloc_v2", e.0))
}

/// `cuMemFree` of a segment obtained from [`mem_alloc`].
pub(crate) fn mem_free(addr: u64) -> Result<(), CudaError> {
    require!("cuMemFree_v2")?;
    // SAFETY: `CudaMemory` frees only segments it obtained from `mem_alloc`
    // and has not freed yet (it keeps their addresses), and the engine frees
    // a segment only when no block of it is allocated or awaiting events.
    unsafe { result::free_sync(addr) }.map_err(|e| driver_error("cuMemFree_v2", e.0))
}

/// `cuMemGetInfo` of the current context: (free, total) bytes.
pub(crate) fn mem_get_info() -> Result<(u64, u64), CudaError> {
    require!("cuMemGetInfo_v2")?;
    let (free, total) = result::mem_get_info().map_err(|e| driver_error("cuMemGetInfo_v2", e.0))?;
    Ok((free as u64, total as u64))
}

/// `cuMemsetD8Async`: sets `bytes` bytes at `addr` to `value`, on `stream`.
///
/// # Safety
/// `addr..addr + bytes` must be device memory of the current context that
/// stays allocated until the memset has run, and `stream` a live stream of
/// that context.
pub(crate) unsafe fn memset_d8_async(
    addr: u64,
    value: u8,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    require!("cuMemsetD8Async")?;
    // SAFETY: forwarded to the caller's contract above.
    unsafe { result::memset_d8_async(addr, value, bytes, stream) }
        .map_err(|e| driver_error("cuMemsetD8Async", e.0))
}

/// A CUDA event handle owned by an [`crate::EventRecycler`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct RawEvent(sys::CUevent);

// SAFETY: a CUevent is an opaque driver handle that may be used from any
// thread; the driver synchronises its own state. The pool hands each handle
// to one owner at a time.
unsafe impl Send for RawEvent {}

/// `cuEventCreate` with `CU_EVENT_DISABLE_TIMING`, in the current context.
pub(crate) fn event_create() -> Result<RawEvent, CudaError> {
    require!("cuEventCreate")?;
    result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map(RawEvent)
        .map_err(|e| driver_error("cuEventCreate", e.0))
}

/// `cuEventRecord` of `event` on the raw stream `stream`.
///
/// # Safety
/// `stream` must be `0` (the legacy default stream), a per-thread default
/// stream handle, or a live stream of the event's context.
pub(crate) unsafe fn event_record(event: &RawEvent, stream: u64) -> Result<(), CudaError> {
    require!("cuEventRecord")?;
    // SAFETY: the event is live (owned by the pool, destroyed only when the
    // pool is dropped); the stream is valid by the caller's contract.
    unsafe { result::event::record(event.0, stream as usize as sys::CUstream) }
        .map_err(|e| driver_error("cuEventRecord", e.0))
}

/// `cuEventQuery`: `true` once the work captured by the event is done.
pub(crate) fn event_query(event: &RawEvent) -> Result<bool, CudaError> {
    require!("cuEventQuery")?;
    // SAFETY: the event is live (see `event_record`).
    match unsafe { result::event::query(event.0) } {
        Ok(()) => Ok(true),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        Err(e) => Err(driver_error("cuEventQuery", e.0)),
    }
}

/// `cuEventSynchronize`: blocks until the event's work is done.
pub(crate) fn event_synchronize(event: &RawEvent) -> Result<(), CudaError> {
    require!("cuEventSynchronize")?;
    // SAFETY: the event is live (see `event_record`).
    unsafe { result::event::synchronize(event.0) }
        .map_err(|e| driver_error("cuEventSynchronize", e.0))
}

/// `cuStreamWaitEvent`: future work on `stream` waits for the event.
///
/// # Safety
/// As for [`event_record`]: `stream` must be a valid stream of the event's
/// context.
pub(crate) unsafe fn stream_wait_event(stream: u64, event: &RawEvent) -> Result<(), CudaError> {
    require!("cuStreamWaitEvent")?;
    // SAFETY: live event; valid stream by the caller's contract.
    unsafe {
        result::stream::wait_event(
            stream as usize as sys::CUstream,
            event.0,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(|e| driver_error("cuStreamWaitEvent", e.0))
}

/// `cuEventDestroy` of a pooled event that no one uses any more.
pub(crate) fn event_destroy(event: RawEvent) -> Result<(), CudaError> {
    require!("cuEventDestroy_v2")?;
    // SAFETY: the handle is consumed, so it is destroyed once; the driver
    // releases an event still pending asynchronously.
    unsafe { result::event::destroy(event.0) }.map_err(|e| driver_error("cuEventDestroy_v2", e.0))
}

// ----- Pinned host memory and copies (sleep tags' host backups) -----

/// A block of page-locked host memory from [`host_alloc`], released with
/// [`host_free`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct HostPtr(*mut u8);

// SAFETY: pinned host memory is plain process memory, usable from any
// thread; the pool hands each block to one owner at a time.
unsafe impl Send for HostPtr {}

impl HostPtr {
    /// The block's address.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.0
    }
}

/// `cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE)`: `size` bytes of page-locked
/// host memory, usable with every context of the process.
pub(crate) fn host_alloc(size: usize) -> Result<HostPtr, CudaError> {
    require!("cuMemHostAlloc")?;
    // SAFETY: writes one pointer into a local; the memory is uninitialised
    // and only ever reached through raw pointers (copies, `&[u8]` views
    // after a copy filled it or a caller wrote it).
    let ptr = unsafe { result::malloc_host(size.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
        .map_err(|e| driver_error("cuMemHostAlloc", e.0))?;
    Ok(HostPtr(ptr.cast()))
}

/// `cuMemFreeHost` of a block from [`host_alloc`].
pub(crate) fn host_free(ptr: HostPtr) -> Result<(), CudaError> {
    require!("cuMemFreeHost")?;
    // SAFETY: consumes the handle, so the block is freed once; the pool
    // frees only blocks no copy or caller uses any more.
    unsafe { result::free_host(ptr.0.cast()) }.map_err(|e| driver_error("cuMemFreeHost", e.0))
}

/// `cuMemHostRegister` (portable, and mapped into the device address space
/// when `mapped`): page-locks `len` bytes at `ptr` that the caller
/// allocated, for every context of the process.
///
/// # Safety
/// `ptr..ptr + len` is memory of this process that stays allocated until
/// [`host_unregister`] of `ptr`.
pub(crate) unsafe fn host_register(
    ptr: *mut u8,
    len: usize,
    mapped: bool,
) -> Result<(), CudaError> {
    require!("cuMemHostRegister_v2")?;
    let mut flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
    if mapped {
        flags |= sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    }
    // SAFETY: the caller's contract above; the driver only pins the pages
    // and records the range, it writes none of its bytes.
    check("cuMemHostRegister_v2", unsafe {
        sys::cuMemHostRegister_v2(ptr.cast(), len, flags)
    })
}

/// `cuMemHostUnregister`: unpins the range that [`host_register`] pinned
/// at `ptr`.
///
/// # Safety
/// `ptr` is the start of a range registered with [`host_register`], and no
/// queued copy uses it any more.
pub(crate) unsafe fn host_unregister(ptr: *mut u8) -> Result<(), CudaError> {
    require!("cuMemHostUnregister")?;
    // SAFETY: the caller's contract above.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(ptr.cast())
    })
}

/// `cuMemcpyDtoHAsync`: `bytes` bytes from device address `src` to the
/// pinned host memory at `dst`, queued on `stream`.
///
/// # Safety
/// `dst..dst + bytes` is pinned host memory and `src..src + bytes` mapped
/// device memory of the current context, both left alone until the copy has
/// run; `stream` is a live stream of that context.
pub(crate) unsafe fn copy_to_host_async(
    dst: *mut u8,
    src: u64,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    require!("cuMemcpyDtoHAsync_v2")?;
    // SAFETY: the caller's contract above.
    check("cuMemcpyDtoHAsync_v2", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream)
    })
}

/// `cuMemcpyHtoDAsync`: `bytes` bytes from pinned host memory at `src` to
/// device address `dst`, queued on `stream`.
///
/// # Safety
/// As for [`copy_to_host_async`], the other way round.
pub(crate) unsafe fn copy_to_device_async(
    dst: u64,
    src: *const u8,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    require!("cuMemcpyHtoDAsync_v2")?;
    // SAFETY: the caller's contract above.
    check("cuMemcpyHtoDAsync_v2", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream)
    })
}

// ----- Graph captures (`graph_capture_record_stream_reuse`) -----
//
// The driver API version bound by the build's feature picks the entry
// points: from CUDA 12.3 `cuStreamGetCaptureInfo_v3` and
// `cuGraphNodeGetDependencies_v2` (edges carry data), before that
// `cuStreamGetCaptureInfo_v2` and `cuGraphNodeGetDependencies`. A build whose
// version comes from the build system names none: it reads no graph, and
// frees during a capture wait for its end.

/// `cuStreamGetCaptureInfo`'s answer about one stream.
struct CaptureInfo {
    status: sys::CUstreamCaptureStatus,
    id: u64,
    /// `count` nodes, valid until the next driver call on the stream.
    nodes: *const sys::CUgraphNode,
    count: usize,
}

/// Expands the first item whose `cfg` holds and no other, so that each
/// version list below is written once.
macro_rules! first_cfg {
    (#[cfg($first:meta)] $a:item else #[cfg($second:meta)] $b:item else $c:item) => {
        #[cfg($first)]
        $a
        #[cfg(all(not($first), $second))]
        $b
        #[cfg(not(any($first, $second)))]
        $c
    };
}

// The entry points of the bound API version (see above). Each function's
// safety contract: `stream` is valid for the current context; `node` is a
// live graph node and `out`, unless null, holds `*count` nodes.
first_cfg! {
    #[cfg(any(
        feature = "cuda-12030",
        feature = "cuda-12040",
        feature = "cuda-12050",
        feature = "cuda-12060",
        feature = "cuda-12080",
        feature = "cuda-12090",
        feature = "cuda-13000",
        feature = "cuda-13010",
        feature = "cuda-13020",
        feature = "cuda-13030",
        feature = "cuda-13040",
    ))]
    mod capture_api {
        use super::{sys, CaptureInfo};
        use std::ptr;

        pub(super) const SYMBOLS: Option<[&str; 2]> =
            Some(["cuStreamGetCaptureInfo_v3", "cuGraphNodeGetDependencies_v2"]);

        pub(super) unsafe fn capture_info(
            stream: sys::CUstream,
            i: &mut CaptureInfo,
        ) -> sys::CUresult {
            let (mut graph, mut edges) = (ptr::null_mut(), ptr::null());
            let (status, id) = (&mut i.status, &mut i.id);
            let (nodes, count) = (&mut i.nodes, &mut i.count);
            // SAFETY: the module's contract; every out-pointer is live.
            unsafe {
                sys::cuStreamGetCaptureInfo_v3(
                    stream, status, id, &mut graph, nodes, &mut edges, count,
                )
            }
        }

        pub(super) unsafe fn dependencies(
            node: sys::CUgraphNode,
            out: *mut sys::CUgraphNode,
            count: &mut usize,
        ) -> sys::CUresult {
            // The edges' data is asked for whenever nodes are, so that edges
            // with data (programmatic launches) make no lossy query.
            let empty = sys::CUgraphEdgeData {
                from_port: 0,
                to_port: 0,
                type_: 0,
                reserved: [0; 5],
            };
            let mut edges = vec![empty; if out.is_null() { 0 } else { *count }];
            let edges_out = if out.is_null() {
                ptr::null_mut()
            } else {
                edges.as_mut_ptr()
            };
            // SAFETY: the module's contract; `edges` holds as many entries as
            // `out`.
            unsafe { sys::cuGraphNodeGetDependencies_v2(node, out, edges_out, count) }
        }
    }

    else #[cfg(any(
        feature = "cuda-11040",
        feature = "cuda-11050",
        feature = "cuda-11060",
        feature = "cuda-11070",
        feature = "cuda-11080",
        feature = "cuda-12000",
        feature = "cuda-12010",
        feature = "cuda-12020",
    ))]
    mod capture_api {
        use super::{sys, CaptureInfo};

        pub(super) const SYMBOLS: Option<[&str; 2]> =
            Some(["cuStreamGetCaptureInfo_v2", "cuGraphNodeGetDependencies"]);

        pub(super) unsafe fn capture_info(
            stream: sys::CUstream,
            i: &mut CaptureInfo,
        ) -> sys::CUresult {
            let mut graph = std::ptr::null_mut();
            let (status, id) = (&mut i.status, &mut i.id);
            let (nodes, count) = (&mut i.nodes, &mut i.count);
            // SAFETY: the module's contract; every out-pointer is live.
            unsafe {
                sys::cuStreamGetCaptureInfo_v2(stream, status, id, &mut graph, nodes, count)
            }
        }

        pub(super) unsafe fn dependencies(
            node: sys::CUgraphNode,
            out: *mut sys::CUgraphNode,
            count: &mut usize,
        ) -> sys::CUresult {
            // SAFETY: the module's contract.
            unsafe { sys::cuGraphNodeGetDependencies(node, out, count) }
        }
    }

    // No API version named at build time: no graph is read
    // (`capture_graph_present` is false, so these are never called).
    else
    mod capture_api {
        use super::{sys, CaptureInfo};

        pub(super) const SYMBOLS: Option<[&str; 2]> = None;

        pub(super) unsafe fn capture_info(
            _: sys::CUstream,
            _: &mut CaptureInfo,
        ) -> sys::CUresult {
            sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
        }

        pub(super) unsafe fn dependencies(
            _: sys::CUgraphNode,
            _: *mut sys::CUgraphNode,
            _: &mut usize,
        ) -> sys::CUresult {
            sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
        }
    }
}

/// Whether the driver has the graph-reading entry points of the bound API
/// version (an older driver may lack them, and cudarc would panic on the
/// missing symbol); checked once per process.
pub(crate) fn capture_graph_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        capture_api::SYMBOLS.is_some_and(|names| names.iter().all(|name| symbol_present(name)))
    })
}

/// Whether the loaded driver library exports `name`.
#[cfg(feature = "dynamic-loading")]
fn symbol_present(name: &str) -> bool {
    // SAFETY: looks `name` up in the driver library that cudarc loads and
    // keeps for the life of the process; the symbol is not called here.
    driver_present() && unsafe { sys::culib().get::<*const ()>(name.as_bytes()).is_ok() }
}

/// Linked at build time: the loader resolved every symbol at start.
#[cfg(not(feature = "dynamic-loading"))]
fn symbol_present(_name: &str) -> bool {
    true
}

/// `cuStreamGetCaptureInfo`: the id of the capture that `stream` takes part
/// in, with the nodes its next work will depend on appended to `nodes`;
/// `None` when the stream is not capturing or its capture was invalidated.
/// Only when [`capture_graph_present`].
///
/// # Safety
/// As for [`event_record`]: `stream` must be `0`, a per-thread default
/// stream handle, or a live stream of the current context.
pub(crate) unsafe fn stream_capture_info(
    stream: u64,
    nodes: &mut Vec<u64>,
) -> Result<Option<u64>, CudaError> {
    let mut info = CaptureInfo {
        status: sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        id: 0,
        nodes: std::ptr::null(),
        count: 0,
    };
    // SAFETY: valid stream by the caller's contract; `info` is a live local.
    let code = unsafe { capture_api::capture_info(stream as usize as sys::CUstream, &mut info) };
    check("cuStreamGetCaptureInfo", code)?;
    if info.status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Ok(None);
    }
    if info.count > 0 && !info.nodes.is_null() {
        // SAFETY: the driver returned `count` nodes at `nodes`, valid until
        // the next call on the stream; they are copied out now.
        let frontier = unsafe { std::slice::from_raw_parts(info.nodes, info.count) };
        nodes.extend(frontier.iter().map(|&n| n as usize as u64));
    }
    Ok(Some(info.id))
}

/// `cuGraphNodeGetDependencies`: appends the nodes `node` depends on to
/// `out`. Only when [`capture_graph_present`].
///
/// # Safety
/// `node` must be a node of a graph still alive: one returned by
/// [`stream_capture_info`] or by this function for a capture still underway
/// (its graph lives until the capture ends).
pub(crate) unsafe fn graph_node_dependencies(
    node: u64,
    out: &mut Vec<u64>,
) -> Result<(), CudaError> {
    let node = node as usize as sys::CUgraphNode;
    let mut count = 0usize;
    // SAFETY: a live node by the caller's contract; a null array asks for
    // the count only.
    let code = unsafe { capture_api::dependencies(node, std::ptr::null_mut(), &mut count) };
    check("cuGraphNodeGetDependencies", code)?;
    if count == 0 {
        return Ok(());
    }
    let mut deps: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
    // SAFETY: as above; `deps` holds `count` entries and the driver writes
    // at most that many, setting `count` to how many it wrote.
    let code = unsafe { capture_api::dependencies(node, deps.as_mut_ptr(), &mut count) };
    check("cuGraphNodeGetDependencies", code)?;
    deps.truncate(count);
    out.extend(deps.iter().map(|&n| n as usize as u64));
    Ok(())
}

// ----- Virtual memory management (expandable segments) -----

/// A physical allocation from `cuMemCreate`, to be mapped into a reserved
/// range and released with [`mem_release`]; with the POSIX file descriptor
/// that [`export_fd`] made for it, if any, closed on release.
#[derive(Debug)]
pub(crate) struct PhysicalHandle {
    raw: sys::CUmemGenericAllocationHandle,
    fd: OnceLock<OwnedFd>,
}

/// Whether physical allocations on `ctx`'s device can be exported as POSIX
/// file descriptors (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`).
pub(crate) fn posix_fd_supported(ctx: &CudaContext) -> bool {
    ctx.attribute(
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    )
    .is_ok_and(|v| v != 0)
}

/// The `CUmemLocation` of `device`. Its C layout is the same in every CUDA
/// version (the location type, then the device id), but cudarc's bindings
/// name the id differently (a field up to CUDA 13.1, a union member from
/// 13.2), so it is built through a copy of that layout rather than by name.
fn device_location(device: i32) -> sys::CUmemLocation {
    #[repr(C)]
    struct Location {
        type_: sys::CUmemLocationType,
        id: std::ffi::c_int,
    }
    let location = Location {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    };
    // SAFETY: `Location` is `CUmemLocation`'s C layout in every CUDA version
    // (transmute checks that the sizes agree), with a valid location type
    // and an int for the id.
    unsafe { std::mem::transmute::<Location, sys::CUmemLocation>(location) }
}

/// The properties of device memory on `device`; `shareable` requests POSIX
/// file descriptor handles (as PyTorch's expandable segments do), so that
/// pages can be shared with other processes.
fn device_allocation_prop(device: i32, shareable: bool) -> sys::CUmemAllocationProp {
    let handle_types = if shareable {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
    };
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handle_types,
        location: device_location(device),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// `cuMemGetAllocationGranularity` (minimum) of device memory on `device`.
pub(crate) fn vmm_granularity(device: i32, shareable: bool) -> Result<u64, CudaError> {
    require!("cuMemGetAllocationGranularity")?;
    let prop = device_allocation_prop(device, shareable);
    let mut granularity = 0usize;
    // SAFETY: both pointers are to live locals of the types the call expects;
    // it only writes the granularity.
    let code = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    };
    check("cuMemGetAllocationGranularity", code)?;
    Ok(granularity as u64)
}

/// `cuMemAddressReserve`: `size` bytes of address space, no memory.
pub(crate) fn address_reserve(size: u64, alignment: u64) -> Result<u64, CudaError> {
    require!("cuMemAddressReserve")?;
    let mut addr: sys::CUdeviceptr = 0;
    // SAFETY: writes one address into a local; reserves address space only.
    let code =
        unsafe { sys::cuMemAddressReserve(&mut addr, size as usize, alignment as usize, 0, 0) };
    check("cuMemAddressReserve", code)?;
    Ok(addr)
}

/// `cuMemAddressFree` of a range from [`address_reserve`] with nothing mapped.
pub(crate) fn address_free(addr: u64, size: u64) -> Result<(), CudaError> {
    require!("cuMemAddressFree")?;
    // SAFETY: the backend frees only ranges it reserved, once, after
    // unmapping everything in them.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(addr, size as usize)
    })
}

/// `cuMemCreate`: `size` bytes of physical memory on `device`, exportable
/// as a POSIX file descriptor when `shareable`.
pub(crate) fn mem_create(
    size: u64,
    device: i32,
    shareable: bool,
) -> Result<PhysicalHandle, CudaError> {
    require!("cuMemCreate")?;
    let prop = device_allocation_prop(device, shareable);
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: pointers to live locals; the handle is owned by the returned
    // value and released exactly once by `mem_release`.
    let code = unsafe { sys::cuMemCreate(&mut handle, size as usize, &prop, 0) };
    check("cuMemCreate", code)?;
    Ok(PhysicalHandle {
        raw: handle,
        fd: OnceLock::new(),
    })
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor, made once per
/// physical allocation and kept open (owned by `handle`) until
/// [`mem_release`], so that other processes can duplicate it
/// (`pidfd_getfd`) for as long as the memory exists. The allocation must
/// have been created shareable.
pub(crate) fn export_fd(handle: &PhysicalHandle) -> Result<RawFd, CudaError> {
    require!("cuMemExportToShareableHandle")?;
    if let Some(fd) = handle.fd.get() {
        return Ok(fd.as_raw_fd());
    }
    let mut fd: c_int = -1;
    // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver writes
    // one `int` through the pointer, which points to a live local `c_int`;
    // the handle is live (owned by `handle`, not yet released).
    let code = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut c_int).cast(),
            handle.raw,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    check("cuMemExportToShareableHandle", code)?;
    if fd < 0 {
        return Err(driver_error(
            "cuMemExportToShareableHandle",
            sys::CUresult::CUDA_ERROR_INVALID_HANDLE,
        ));
    }
    // SAFETY: the driver just opened `fd` for this process and hands its
    // ownership to the caller; nothing else holds or closes it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // Callers hold the allocator's lock, so no other export races this one;
    // were it to, the second descriptor would be closed here.
    let _ = handle.fd.set(owned);
    Ok(handle.fd.get().map_or(fd, |f| f.as_raw_fd()))
}

/// `cuMemMap` of a whole physical allocation at `addr` (not yet accessible:
/// see [`mem_set_access`]).
pub(crate) fn mem_map(addr: u64, size: u64, handle: &PhysicalHandle) -> Result<(), CudaError> {
    require!("cuMemMap")?;
    // SAFETY: `addr..addr+size` lies in a range this backend reserved and is
    // not mapped (the backend tracks every mapped page); `size` is the
    // handle's size.
    check("cuMemMap", unsafe {
        sys::cuMemMap(addr, size as usize, 0, handle.raw, 0)
    })
}

/// `cuMemSetAccess` read-write for `device` over `[addr, addr + size)`, which
/// may span several mapped physical allocations (one call per run, as
/// PyTorch's expandable segments do).
pub(crate) fn mem_set_access(addr: u64, size: u64, device: i32) -> Result<(), CudaError> {
    require!("cuMemSetAccess")?;
    let access = sys::CUmemAccessDesc {
        location: device_location(device),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the whole range is mapped (the caller mapped every page of
    // it); one access descriptor is passed.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(addr, size as usize, &access, 1)
    })
}

/// `cuMemUnmap` of one mapped page.
pub(crate) fn mem_unmap(addr: u64, size: u64) -> Result<(), CudaError> {
    require!("cuMemUnmap")?;
    // SAFETY: the backend unmaps only pages it mapped, when the engine holds
    // no live block in them and the GPU is done with them (after a context
    // synchronize, or for idle and detached pages once their streams passed
    // the block's last use). From the unmap worker, the range is pending:
    // nothing maps it again or frees its reservation before this returns.
    check("cuMemUnmap", unsafe {
        sys::cuMemUnmap(addr, size as usize)
    })
}

/// `cuMemRelease` of a physical allocation (after it is unmapped), closing
/// its exported file descriptor first: the memory goes back to the device
/// once no other process holds it either.
pub(crate) fn mem_release(handle: PhysicalHandle) -> Result<(), CudaError> {
    require!("cuMemRelease")?;
    let PhysicalHandle { raw, fd } = handle;
    drop(fd);
    // SAFETY: consumes the handle, so it is released once.
    check("cuMemRelease", unsafe { sys::cuMemRelease(raw) })
}

/// `cuCtxSynchronize`: waits for all work in the current context. Unmapping
/// does not synchronize implicitly (unlike `cuMemFree`), so kernels still
/// reading freed blocks must finish first.
pub(crate) fn ctx_synchronize() -> Result<(), CudaError> {
    require!("cuCtxSynchronize")?;
    // SAFETY: no arguments; blocks the host until the context is idle.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// This thread's stream-capture mode set to relaxed until dropped: a CUDA
/// graph captured in global mode (PyTorch's default) would otherwise be
/// invalidated by the allocation calls (`cuMemAlloc`, `cuMemMap`) of a
/// capture's private pool.
pub(crate) struct RelaxedCaptureMode(sys::CUstreamCaptureMode);

impl RelaxedCaptureMode {
    /// Switches to relaxed mode, remembering the previous one.
    pub(crate) fn enter() -> Result<Self, CudaError> {
        require!("cuThreadExchangeStreamCaptureMode")?;
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out pointer for the duration of the call.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        })?;
        Ok(RelaxedCaptureMode(mode))
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        let mut mode = self.0;
        // SAFETY: as in `enter`; restores the mode this thread had before.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
}

fn check(call: &'static str, code: sys::CUresult) -> Result<(), CudaError> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(call, code))
    }
}
