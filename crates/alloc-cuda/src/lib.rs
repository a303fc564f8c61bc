#![doc = include_str!("../README.md")]
//!
//! ## Items
//!
//! Nothing here loads `libcuda` until an allocator or backend is created.
//!
//! - [`CudaMemory`]: segments from `cuMemAlloc` / `cuMemFree` in the primary
//!   context of a device; capacity and free bytes from `cuMemGetInfo`. It
//!   frees, unmaps and releases only what it allocated, mapped or reserved.
//! - [`CudaStreams`]: the engine's stream backend over CUDA events, taken from
//!   a recycler ([`EventRecycler`]) of `CU_EVENT_DISABLE_TIMING` events; `synchronize`
//!   is `cuEventSynchronize`, `make_stream_wait` is `cuStreamWaitEvent`.
//!   Only streams registered with it reach the driver.
//! - [`StreamHandle`]: a stream the allocator may use, from a cudarc stream
//!   (an `Arc` the allocator holds while it may use the stream) or from a raw
//!   `CUstream` through the `unsafe` [`StreamHandle::from_raw`]. Stream
//!   arguments accept `&Arc<CudaStream>` or `&StreamHandle` ([`AsStream`]).
//! - [`CudaAllocator<P>`]: the thread-safe handle (`Send + Sync`, cheap to
//!   clone): a `Mutex` around the engine per allocator, held only for the
//!   engine call. The policy `P` is [`AnyPolicy`] (chosen by `policy:`) or
//!   one of your own ([`CudaAllocator::with_policy`]). One process-wide
//!   allocator per device is created on first use by
//!   [`CudaAllocator::global`]; independent ones by [`CudaAllocator::new`].
//! - [`DeviceBuffer<T>`]: a typed buffer owning one block, freed back to the
//!   allocator when dropped (and only then: [`CudaAllocator::free`] refuses
//!   its block, and no two live buffers overlap); it implements cudarc's
//!   `DeviceSlice`, `DevicePtr` and `DevicePtrMut` (so
//!   `CudaStream::memcpy_htod` / `dtoh` take it) and is a kernel argument of
//!   `LaunchArgs`.
//!
//! The engine names streams by their raw `CUstream` value ([`StreamId`];
//! `0` is the legacy default stream). A block is reused only on its
//! allocation stream, unless the streams recorded with `record_stream` are
//! proven done (event polled at the next `malloc`) or, with
//! `stream_wait_reuse:true`, made to wait on those events.
//!
//! Expandable segments (`expandable_segments:True`) grow one segment per
//! stream and pool on the driver's virtual-memory API: see [`vmm`].
//!
//! [`CudaAllocator`] is a small facade: what a program needs every day
//! (construction, `malloc`, `free`, `record_stream`, `empty_cache`,
//! statistics, settings) is on it, and the rest is reached through parts
//! that borrow it, each in a file of its own:
//!
//! - [`CudaAllocator::pools`] ([`Pools`]): private pools (CUDA graphs,
//!   PyTorch `MemPool`s): routing, holders, their cache, checkpoints.
//! - [`CudaAllocator::sleep`] ([`SleepWake`]): sleep and wake. Allocations
//!   through a [`Tag`] ([`SleepWake::tag`]) go to a pool of their own on
//!   growable segments; [`SleepWake::pause`] gives its physical memory
//!   back (optionally saving live blocks to pinned host memory from the
//!   [`PinnedAllocator`], our caching pinned-host allocator) and
//!   [`SleepWake::resume`] takes fresh memory at the same addresses.
//! - [`CudaAllocator::ipc`] ([`Ipc`]): sharing a live block with another
//!   process (CUDA IPC): [`Ipc::shared_range`] gives the memory shared for
//!   it (its `cuMemAlloc` segment, or the pages of an expandable segment
//!   under it) and [`Ipc::export_pages`] exports those pages as POSIX file
//!   descriptors.
//! - [`CudaAllocator::diagnostics`] ([`Diagnostics`]): the invariant
//!   check, stream and event counters, a segment observer, and the engine
//!   itself under the lock ([`Diagnostics::inspect`]).
//!
//! ## Where `unsafe` is
//!
//! All of it sits at the CUDA boundary, each block with its `// SAFETY:`
//! reason. No safe call hands the driver a stream that was not registered
//! from a [`StreamHandle`], nor frees memory the crate did not allocate:
//!
//! - the private `driver` module (`driver.rs`): every raw driver call, each
//!   in a small function (those taking a raw stream, graph node or memory,
//!   `event_record`, `stream_wait_event`, `stream_capture_info`,
//!   `graph_node_dependencies`, `memset_d8_async` and the host/device
//!   copies, are `unsafe fn`s themselves), the look-up of the driver's
//!   capture-graph symbols, and `Send` for the event and pinned-memory
//!   handles;
//! - `events.rs`: [`CudaStreams`] records events on, makes wait and reads
//!   the captures of streams it checked to be registered, and reads the
//!   dependencies of graph nodes it read itself from a capture it checked
//!   to be still underway;
//! - `pinned.rs`: [`PinnedBuffer`]'s byte views of its own pinned block, the
//!   zeroing of a new block, and events recorded on the streams it holds
//!   handles of;
//! - `sleep.rs`: the copies of a pausing or resuming tag's live blocks to
//!   and from pinned host memory;
//! - `buffer.rs`: [`DeviceBuffer`]'s memset on its own block and stream,
//!   and its `PushKernelArg` implementations for cudarc's launch builder;
//! - `unsafe fn`s of the API, whose callers vouch for what the crate cannot
//!   check: [`StreamHandle::from_raw`] (a raw stream's context and lifetime),
//!   [`Diagnostics::with_engine`] (no block of a live [`DeviceBuffer`]
//!   freed through the engine, segment sources as below) and
//!   [`Pools::set_source`] (a pool's segments are device memory
//!   of the device).

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
mod buffer_ranges;
mod deferred_unmaps;
mod device_limit;
mod diagnostics;
mod driver;
mod error;
mod events;
mod host_register;
mod ipc;
pub mod lock;
mod memory;
mod notice;
mod observer;
mod pinned;
mod pools;
mod sleep;
mod sleep_wake;
mod stream;
mod stream_engines;
mod tag;
pub mod vmm;

pub use allocator::{CudaAllocator, MAX_DEVICES};
pub use buffer::{DeviceBuffer, Plain};
pub use diagnostics::Diagnostics;
pub use error::{CudaError, CUDARC_CALL};
pub use events::{CudaStreams, EventRecycler, EventRecyclerStats, RecycledEvent, StreamOpCounts};
pub use host_register::{HostRegistry, RegisteredStats, Registrations};
pub use ipc::{Ipc, SharedRange};
pub use memory::CudaMemory;
pub use observer::{SegmentAction, SegmentEvent, SegmentObserver};
pub use pinned::{pinned_block_size, HostCache, PinnedAllocator, PinnedBuffer, PinnedStats};
pub use pools::Pools;
pub use sleep_wake::SleepWake;

/// The former name of [`EventRecycler`].
#[deprecated(since = "0.1.0", note = "renamed to `EventRecycler`")]
pub type EventPool<H> = EventRecycler<H>;
/// The former name of [`EventRecyclerStats`].
#[deprecated(since = "0.1.0", note = "renamed to `EventRecyclerStats`")]
pub type EventPoolStats = EventRecyclerStats;
/// The former name of [`RecycledEvent`].
#[deprecated(since = "0.1.0", note = "renamed to `RecycledEvent`")]
pub type PooledEvent = RecycledEvent;
/// The former name of [`PinnedAllocator`].
#[deprecated(since = "0.1.0", note = "renamed to `PinnedAllocator`")]
pub type PinnedPool = PinnedAllocator;
pub use stream::{AsStream, StreamHandle};
pub use stream_engines::{StreamEngines, MAX_STREAM_ENGINES};
pub use tag::Tag;
pub use vmm::SharedPages;

/// The engine and its seams, for writing a policy of one's own.
pub use alloc_core;
pub use alloc_core::{
    Allocation, AllocatorConfig, Backup, PauseReport, ResumeReport, Snapshot, Stats, StreamId,
    TagInfo,
};
pub use alloc_policy::AnyPolicy;
pub use cudarc;

/// The engine type behind a [`CudaAllocator`] running policy `P`.
pub type CudaEngine<P = AnyPolicy> = alloc_core::Engine<P, CudaMemory, CudaStreams>;

/// The raw stream id of a cudarc stream (the `CUstream` pointer value).
pub fn stream_id(stream: &cudarc::driver::CudaStream) -> StreamId {
    StreamId(stream.cu_stream() as usize as u64)
}

/// Whether the CUDA driver library can be loaded on this machine. Tries to
/// `dlopen` it (once per process); never panics.
pub fn driver_available() -> bool {
    driver::driver_present()
}
