//! The two seams between the engine and a device: where segments come from,
//! and how streams and events are recorded, queried and waited on.

use crate::error::BackendError;
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

/// Hands out and takes back segments of device memory.
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

    /// Granularity of growable segments' physical chunks, or 0 when this
    /// backend cannot grow segments (no expandable segments).
    fn growth_granularity(&self) -> u64 {
        0
    }

    /// Reserves `size` bytes of address space with no memory behind it,
    /// aligned to `page`: the size of each physical allocation that
    /// [`MemoryBackend::map`] puts in it (a power-of-two multiple of the
    /// granularity, and a divisor of `size`). Maps and unmaps in the range
    /// cover whole pages: the driver cannot unmap part of one, and moving a
    /// page costs about the same whatever its size, so large pages make
    /// moving memory cheaper per byte.
    fn reserve_range(&mut self, _size: u64, _page: u64) -> Result<u64, BackendError> {
        Err(BackendError::Other(
            "this backend has no expandable segments".into(),
        ))
    }

    /// Backs `[addr, addr + size)` of a reserved range with memory (whole
    /// pages of the range). [`BackendError::OutOfMemory`] when the device is full.
    fn map(&mut self, _addr: u64, _size: u64) -> Result<(), BackendError> {
        Err(BackendError::Other(
            "this backend has no expandable segments".into(),
        ))
    }

    /// Gives back the memory behind `[addr, addr + size)`, keeping the range.
    fn unmap(&mut self, _addr: u64, _size: u64) -> Result<(), BackendError> {
        Err(BackendError::Other(
            "this backend has no expandable segments".into(),
        ))
    }

    /// Unmaps pages the device no longer uses: the caller knows that the
    /// work that used them is done (it waited for their stream, or an event
    /// recorded there after their last use completed), so no device-wide
    /// wait is needed. The backend may keep their physical memory for the
    /// next [`MemoryBackend::map`] until [`MemoryBackend::release_spare`].
    /// Default: [`MemoryBackend::unmap`].
    fn unmap_idle(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.unmap(addr, size)
    }

    /// Whether [`MemoryBackend::detach`] is available.
    fn can_detach(&self) -> bool {
        false
    }

    /// Hands the physical memory behind the whole pages of
    /// `[addr, addr + size)` to the next [`MemoryBackend::map`] while the
    /// range keeps it mapped, because queued work may still use it there;
    /// [`MemoryBackend::unmap_detached`] drops that old mapping once the work
    /// is done. The same memory is then mapped at two addresses for a while:
    /// the caller must order every use of the new mapping after the last
    /// use of the old one (the same stream), and must not map the old range
    /// again before unmapping it. This moves memory without the host
    /// waiting for the GPU. Memory that no map takes goes back at
    /// [`MemoryBackend::release_spare`] (physically once the old mapping is
    /// dropped too).
    fn detach(&mut self, _addr: u64, _size: u64) -> Result<(), BackendError> {
        Err(BackendError::Other(
            "this backend cannot detach mapped memory".into(),
        ))
    }

    /// Drops the old mapping of `[addr, addr + size)`, detached by
    /// [`MemoryBackend::detach`]; the caller knows the work that used it is
    /// done.
    fn unmap_detached(&mut self, _addr: u64, _size: u64) -> Result<(), BackendError> {
        Err(BackendError::Other(
            "this backend cannot detach mapped memory".into(),
        ))
    }

    /// Gives back the physical memory [`MemoryBackend::unmap_idle`] kept for
    /// reuse and [`MemoryBackend::map`] did not take. Default: none is kept.
    fn release_spare(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Gives back a reserved range whose memory is all unmapped.
    fn release_range(&mut self, _addr: u64, _size: u64) -> Result<(), BackendError> {
        Err(BackendError::Other(
            "this backend has no expandable segments".into(),
        ))
    }
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
}
