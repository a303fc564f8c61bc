#![doc = include_str!("../README.md")]
//!
//! ## Items
//!
//! Nothing here loads `libcuda` until an allocator is created.
//!
//! - [`CudaMemory`]: segments from `cuMemAlloc` / `cuMemFree` in the primary
//!   context of a device; capacity and free bytes from `cuMemGetInfo`.
//! - [`CudaStreams`]: the engine's stream backend over CUDA events, taken from
//!   a pool ([`EventPool`]) of `CU_EVENT_DISABLE_TIMING` events; `synchronize`
//!   is `cuEventSynchronize`, `make_stream_wait` is `cuStreamWaitEvent`.
//! - [`CudaAllocator`]: the thread-safe handle (`Send + Sync`, cheap to clone):
//!   a `Mutex<Engine>` per allocator, held only for the engine call. One
//!   process-wide allocator per device is created on first use by
//!   [`CudaAllocator::global`]; independent ones by [`CudaAllocator::new`].
//! - [`DeviceBuffer<T>`]: a typed buffer owning one block, freed back to the
//!   allocator when dropped; it implements cudarc's `DeviceSlice`,
//!   `DevicePtr` and `DevicePtrMut` (so `CudaStream::memcpy_htod` / `dtoh`
//!   take it) and is a kernel argument of `LaunchArgs`.
//!
//! Streams are identified by the raw `CUstream` value ([`StreamId`]; `0` is
//! the legacy default stream). A block is reused only on its allocation
//! stream, unless the streams recorded with `record_stream` are proven done
//! (event polled at the next `malloc`) or, with `stream_wait_reuse:true`,
//! made to wait on those events.
//!
//! Expandable segments (`expandable_segments:True`) grow one segment per
//! stream and pool on the driver's virtual-memory API: see [`vmm`].
//!
//! Sleep and wake: allocations through a [`Tag`] ([`CudaAllocator::tag`])
//! go to a pool of their own on growable segments; [`CudaAllocator::pause`]
//! gives its physical memory back (optionally saving live blocks to pinned
//! host memory from the [`PinnedPool`], our caching pinned-host allocator)
//! and [`CudaAllocator::resume`] takes fresh memory at the same addresses.
//!
//! A live block can be shared with another process (CUDA IPC):
//! [`CudaAllocator::shared_range`] gives the memory shared for it (its
//! `cuMemAlloc` segment, or the pages of an expandable segment under it) and
//! [`CudaAllocator::export_pages`] exports those pages as POSIX file
//! descriptors.
//!
//! All `unsafe` code sits at the CUDA boundary, each block with its
//! `// SAFETY:` reason: the driver calls of the private `driver` module; the
//! cudarc trait implementations of [`DeviceBuffer`] (`buffer.rs`); event
//! records, stream waits and capture-graph reads on raw streams and graph
//! nodes (`events.rs`); and the raw-stream
//! entry points of [`CudaAllocator`] (`malloc_on_stream_id`,
//! `malloc_in_pool_on_stream_id`, `record_stream_id`), `unsafe fn`s whose
//! callers vouch that the stream is a live stream of the device; the
//! pinned host blocks' byte views (`pinned.rs`) and the backup copies of
//! sleep tags (`sleep.rs`).

#![warn(missing_docs)]

#[cfg(not(any(
    feature = "dynamic-loading",
    feature = "dynamic-linking",
    feature = "static-linking"
)))]
compile_error!(
    "alloc-cuda needs to know how libcuda is reached: enable its cargo feature \
     `dynamic-loading` (the default), `dynamic-linking` or `static-linking`"
);

mod allocator;
mod buffer;
mod driver;
mod error;
mod events;
mod ipc;
mod memory;
mod observer;
mod pinned;
mod sleep;
pub mod vmm;

pub use allocator::{CudaAllocator, MAX_DEVICES};
pub use buffer::{DeviceBuffer, Plain};
pub use error::{CudaError, CUDARC_CALL};
pub use events::{CudaStreams, EventPool, EventPoolStats, PooledEvent};
pub use ipc::SharedRange;
pub use memory::CudaMemory;
pub use observer::{SegmentAction, SegmentEvent, SegmentObserver};
pub use pinned::{pinned_block_size, HostCache, PinnedBuffer, PinnedPool, PinnedStats};
pub use sleep::Tag;
pub use vmm::SharedPages;

pub use alloc_core::{
    Allocation, AllocatorConfig, Backup, PauseReport, ResumeReport, Snapshot, Stats, StreamId,
    TagInfo,
};
pub use cudarc;

/// The engine type behind a [`CudaAllocator`].
pub type CudaEngine = alloc_core::Engine<alloc_policy::AnyPolicy, CudaMemory, CudaStreams>;

/// The raw stream id of a cudarc stream (the `CUstream` pointer value).
pub fn stream_id(stream: &cudarc::driver::CudaStream) -> StreamId {
    StreamId(stream.cu_stream() as usize as u64)
}

/// Whether the CUDA driver library can be loaded on this machine. Tries to
/// `dlopen` it (once per process); never panics.
pub fn driver_available() -> bool {
    driver::driver_present()
}
