//! Which streams the engine may still hand to its stream backend, so that a
//! backend keeping streams alive for the engine (the CUDA one holds their
//! handles) knows which ones it may let go.

use std::collections::BTreeSet;

use super::Engine;
use crate::backend::{MemoryBackend, StreamBackend};
use crate::policy::Policy;
use crate::types::StreamId;

impl<P: Policy, M: MemoryBackend, S: StreamBackend> Engine<P, M, S> {
    /// Every stream the engine may still use: the stream of every segment
    /// (its cached blocks serve later requests on that stream, and a
    /// growable segment records events on it) and every stream recorded on
    /// a live block (its free records an event there, a pause of its sleep
    /// tag waits for it). A stream outside this set is used again only when
    /// a caller names it.
    ///
    /// ```
    /// use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, GIB, MIB};
    /// use alloc_policy::AnyPolicy;
    ///
    /// let cfg = AllocatorConfig::default();
    /// let mut engine = AnyPolicy::engine(&cfg, SimMemory::new(GIB), SimStreams::new())?;
    /// let (compute, copy) = (StreamId(1), StreamId(2));
    /// let a = engine.malloc(4 * MIB, compute)?;
    /// engine.record_stream(a.addr, copy)?;
    /// assert_eq!(engine.streams_in_use().into_iter().collect::<Vec<_>>(), [compute, copy]);
    /// engine.free(a.addr)?; // records an event on the copy stream: done with it
    /// assert_eq!(engine.streams_in_use().into_iter().collect::<Vec<_>>(), [compute]);
    /// engine.streams_mut().complete_stream(copy);
    /// engine.empty_cache()?; // the segment of stream 1 goes back
    /// assert!(engine.streams_in_use().is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn streams_in_use(&self) -> BTreeSet<StreamId> {
        let segments = self.heap.segments().map(|(_, seg)| seg.stream);
        let recorded = self
            .events
            .users()
            .flat_map(|(_, users)| users.iter().copied());
        segments.chain(recorded).collect()
    }
}
