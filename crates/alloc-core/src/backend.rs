//! The seams between the engine and a device: where segments come from (a
//! small core, with virtual memory and detaching pages as capabilities the
//! engine asks for), and how streams and events are recorded, queried and
//! waited on.

use crate::capture::CaptureGraph;
use crate::error::BackendError;
use crate::page_layout::PageLayout;
use crate::types::StreamId;

/// Where the segments of one private pool come from instead of the device
/// backend: another allocator that the pool's owner chose (PyTorch's
/// `MemPool(allocator)`, e.g. NCCL's `ncclMemAlloc`). The engine caches and
/// splits its segments like any other and gives them back only through it.
pub trait SegmentSource: Send {
    /// A segment of `size` bytes; [`BackendError::OutOfMemory`] when the
    /// source has no room.
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError>;
    /// Returns a segment obtained from [`SegmentSource::allocate`].
    fn free(&mut self, addr: u64, size: u64) -> Result<(), BackendError>;
}

/// Hands out and takes back segments of device memory: the small core every
/// device has. What only some devices can do is a capability the engine
/// asks for ([`MemoryBackend::virtual_memory`]) and does without when it is
/// absent, never an operation that fails at run time as unsupported.
pub trait MemoryBackend {
    /// Reserves `size` bytes; returns the address of the first byte.
    /// [`BackendError::OutOfMemory`] when the device has no room.
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError>;
    /// Returns a segment obtained from [`MemoryBackend::allocate`].
    fn free(&mut self, addr: u64, size: u64) -> Result<(), BackendError>;
    /// Total memory of the device.
    fn capacity(&self) -> u64;
    /// Memory the device reports free right now.
    fn free_bytes(&self) -> u64;

    /// The device's virtual memory (address ranges mapped page by page),
    /// which growable segments need (`expandable_segments`,
    /// `unmap_free_pages`, sleep tags); `None` (the default) when it has
    /// none. The answer must not change over the backend's life: the engine
    /// decides at construction whether segments grow.
    fn virtual_memory(&mut self) -> Option<&mut dyn VirtualMemory> {
        None
    }
}

/// Address ranges reserved without memory behind them and mapped page by
/// page: the capability behind growable segments. Maps and unmaps cover
/// whole pages of a range.
pub trait VirtualMemory {
    /// The smallest page the device maps (its granularity; not 0).
    fn granularity(&self) -> u64;

    /// Reserves `size` bytes of address space with no memory behind it,
    /// aligned to `pages.largest()`, cut into the pages of `pages`: each
    /// page one physical allocation that [`VirtualMemory::map`] puts in it
    /// (every page a power-of-two multiple of the granularity; `size` a
    /// multiple of the largest). The driver cannot unmap part of a physical
    /// allocation, and moving a page costs about the same whatever its
    /// size, so large pages make moving memory cheaper per byte.
    fn reserve(&mut self, size: u64, pages: PageLayout) -> Result<u64, BackendError>;

    /// Backs `[addr, addr + size)` of a reserved range with memory (whole
    /// pages of the range). [`BackendError::OutOfMemory`] when the device is
    /// full.
    fn map(&mut self, addr: u64, size: u64) -> Result<(), BackendError>;

    /// Gives back the memory behind `[addr, addr + size)`, keeping the range.
    fn unmap(&mut self, addr: u64, size: u64) -> Result<(), BackendError>;

    /// Gives back a reserved range whose memory is all unmapped.
    fn release(&mut self, addr: u64, size: u64) -> Result<(), BackendError>;

    /// Unmaps pages the device no longer uses: the caller knows that the
    /// work that used them is done (it waited for their stream, or an event
    /// recorded there after their last use completed), so no device-wide
    /// wait is needed. The backend may keep their physical memory for the
    /// next [`VirtualMemory::map`] until [`VirtualMemory::release_spare`].
    /// Default: [`VirtualMemory::unmap`].
    fn unmap_idle(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.unmap(addr, size)
    }

    /// Gives back the physical memory [`VirtualMemory::unmap_idle`] kept for
    /// reuse and [`VirtualMemory::map`] did not take. Default: none is kept.
    fn release_spare(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Moving busy pages without a host wait ([`DetachPages`]), if the device
    /// can map one physical allocation at two addresses; `None` (the
    /// default) otherwise, and the engine leaves busy pages mapped.
    fn detach_pages(&mut self) -> Option<&mut dyn DetachPages> {
        None
    }
}

/// Hands the physical memory of mapped pages to the next mapping while the
/// old mapping stays for the work still queued on it: memory moves without
/// the host waiting for the GPU.
pub trait DetachPages {
    /// Hands the physical memory behind the whole pages of
    /// `[addr, addr + size)` to the next [`VirtualMemory::map`] while the
    /// range keeps it mapped, because queued work may still use it there;
    /// [`DetachPages::unmap_detached`] drops that old mapping once the work is
    /// done. The same memory is then mapped at two addresses for a while:
    /// the caller must order every use of the new mapping after the last use
    /// of the old one (the same stream), and must not map the old range
    /// again before unmapping it. Memory that no map takes goes back at
    /// [`VirtualMemory::release_spare`] (physically once the old mapping is
    /// dropped too).
    fn detach(&mut self, addr: u64, size: u64) -> Result<(), BackendError>;

    /// Drops the old mapping of `[addr, addr + size)`, detached by
    /// [`DetachPages::detach`]; the caller knows the work that used it is done.
    fn unmap_detached(&mut self, addr: u64, size: u64) -> Result<(), BackendError>;
}

/// Records, queries and waits on events on streams.
pub trait StreamBackend {
    /// A recorded event.
    type Event;
    /// Records an event capturing all work queued on `stream` so far.
    fn record(&mut self, stream: StreamId) -> Result<Self::Event, BackendError>;
    /// True once all the work captured by the event has completed.
    fn is_complete(&mut self, event: &Self::Event) -> Result<bool, BackendError>;
    /// Blocks the host until the event completes.
    fn synchronize(&mut self, event: &Self::Event) -> Result<(), BackendError>;
    /// Makes all future work on `stream` wait for the event, without blocking
    /// the host.
    fn make_stream_wait(
        &mut self,
        stream: StreamId,
        event: &Self::Event,
    ) -> Result<(), BackendError>;
    /// Gives the event back (to a pool) once the engine no longer needs it.
    fn release(&mut self, event: Self::Event);

    /// The graph of CUDA graph captures underway on these streams, if this
    /// backend can read it. Without it (the default) a block freed during a
    /// capture while other streams used it waits for the capture's end.
    fn capture_graph(&mut self) -> Option<&mut dyn CaptureGraph> {
        None
    }
}
