//! The two seams between the engine and a device: where segments come from,
//! and how streams and events are recorded, queried and waited on.

use crate::error::BackendError;
use crate::types::StreamId;

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
