//! The engine's stream backend over CUDA events, with recycled events so
//! that a cross-stream free costs a `cuEventRecord`, not a create + destroy;
//! it also reads the graphs of captures underway (`cuStreamGetCaptureInfo`,
//! `cuGraphNodeGetDependencies`) for `graph_capture_record_stream_reuse`.

use std::sync::Arc;
use std::time::Instant;

use alloc_core::{BackendError, CaptureFrontier, CaptureGraph, GraphNode, StreamBackend, StreamId};
use cudarc::driver::{CudaContext, CudaStream};
use rustc_hash::FxHashMap;

use crate::driver::{self, RawEvent};
use crate::error::CudaError;
use crate::stream::{stream_ref, AsStream, StreamRef, StreamTable};

/// What the engine asked of streams and events through a [`CudaStreams`]:
/// the costs stream ordering puts on the host (waits for the GPU) and on
/// the GPU (waits one stream makes on another), counted so that a step's
/// share of them can be read from the statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamOpCounts {
    /// Events recorded (`cuEventRecord`): one per stream a freed block was
    /// used on, and the marks page recycling and sleep tags record.
    pub recorded: u64,
    /// Event queries (`cuEventQuery`): the host asking, without waiting,
    /// whether the GPU is done.
    pub queried: u64,
    /// Host waits (`cuEventSynchronize`): the allocating thread blocked
    /// until a stream reached an event.
    pub host_waits: u64,
    /// Nanoseconds the host spent in those waits.
    pub host_wait_ns: u64,
    /// Stream waits (`cuStreamWaitEvent`): a stream made to wait on
    /// another's event before using a block (`stream_wait_reuse`).
    pub stream_waits: u64,
}

impl StreamOpCounts {
    /// The counters as `(name, value)` pairs, named `stream_ops.<field>`.
    pub fn named(&self) -> [(&'static str, u64); 5] {
        [
            ("stream_ops.recorded", self.recorded),
            ("stream_ops.queried", self.queried),
            ("stream_ops.host_waits", self.host_waits),
            ("stream_ops.host_wait_ns", self.host_wait_ns),
            ("stream_ops.stream_waits", self.stream_waits),
        ]
    }
}

/// Counters of an [`EventRecycler`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventRecyclerStats {
    /// Events created over the recycler's life.
    pub created: u64,
    /// Events handed out and not yet given back.
    pub in_use: u64,
    /// Idle events waiting to be reused.
    pub pooled: u64,
    /// Times an event was reused instead of created.
    pub reused: u64,
}

/// A free list of event handles: `acquire` pops one (or creates one when the
/// list is empty), `release` pushes it back. Generic over the handle so its
/// logic is tested without a GPU.
#[derive(Debug)]
pub struct EventRecycler<H> {
    free: Vec<H>,
    stats: EventRecyclerStats,
}

impl<H> Default for EventRecycler<H> {
    fn default() -> Self {
        EventRecycler {
            free: Vec::new(),
            stats: EventRecyclerStats::default(),
        }
    }
}

impl<H> EventRecycler<H> {
    /// An empty recycler.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes an idle handle, or makes one with `create`.
    pub fn acquire<E>(&mut self, create: impl FnOnce() -> Result<H, E>) -> Result<H, E> {
        let handle = match self.free.pop() {
            Some(h) => {
                self.stats.reused += 1;
                h
            }
            None => {
                let h = create()?;
                self.stats.created += 1;
                h
            }
        };
        self.stats.in_use += 1;
        Ok(handle)
    }

    /// Gives a handle back for reuse.
    pub fn release(&mut self, handle: H) {
        self.stats.in_use = self.stats.in_use.saturating_sub(1);
        self.free.push(handle);
    }

    /// Removes every idle handle (to destroy them).
    pub fn drain(&mut self) -> impl Iterator<Item = H> + '_ {
        self.free.drain(..)
    }

    /// The recycler's counters.
    pub fn stats(&self) -> EventRecyclerStats {
        EventRecyclerStats {
            pooled: self.free.len() as u64,
            ..self.stats
        }
    }
}

/// An event recorded for the engine; goes back to the recycler through
/// [`StreamBackend::release`].
#[derive(Debug)]
pub struct RecycledEvent(RawEvent);

/// [`StreamBackend`] over CUDA events of one device's primary context.
/// `StreamId`s are raw `CUstream` values (`0`: legacy default stream), and
/// only those registered with [`CudaStreams::register`] reach the driver:
/// recording on or waiting with any other id is an error, so no safe call
/// can hand the driver a bogus stream. A registered cudarc stream is kept
/// alive (its `Arc` held) until [`CudaStreams::retain`] lets it go.
///
/// ```no_run
/// use alloc_core::{StreamBackend, StreamId};
/// use alloc_cuda::{cudarc::driver::CudaContext, CudaStreams};
///
/// let ctx = CudaContext::new(0)?;
/// let stream = ctx.new_stream()?;
/// let mut streams = CudaStreams::new(ctx);
/// assert!(streams.record(StreamId(0xdead_beef)).is_err()); // never registered: no driver call
/// let id = streams.register(&stream)?;
/// let event = streams.record(id)?; // cuEventRecord on `stream`
/// streams.synchronize(&event)?;
/// streams.release(event);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct CudaStreams {
    ctx: Arc<CudaContext>,
    spare: EventRecycler<RawEvent>,
    streams: StreamTable<Arc<CudaStream>>,
    /// The cudarc stream whose `Arc` the table holds for the entry
    /// registered last through a cudarc stream: the address of its
    /// `CudaStream` and its id. While the table holds that `Arc` no other
    /// stream can live at that address, so a cudarc stream found there is
    /// this one, of this context (checked when it was registered): the
    /// next registration of it is one comparison. Cleared by `retain`.
    last_cudarc: Option<(usize, StreamId)>,
    /// Node handles read from the driver, before they become `GraphNode`s.
    nodes: Vec<u64>,
    /// Every graph node handed out by [`CaptureGraph`], with the stream and
    /// the capture it was read from: only those reach the driver again.
    known_nodes: FxHashMap<u64, (StreamId, u64)>,
    /// What the engine asked of streams and events.
    counts: StreamOpCounts,
}

impl CudaStreams {
    /// The stream backend of `ctx`'s device, with no stream registered.
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        CudaStreams {
            ctx,
            spare: EventRecycler::new(),
            streams: StreamTable::default(),
            last_cudarc: None,
            nodes: Vec::new(),
            known_nodes: FxHashMap::default(),
            counts: StreamOpCounts::default(),
        }
    }

    /// What the engine asked of streams and events since creation or the
    /// last [`CudaStreams::reset_op_counts`].
    pub fn op_counts(&self) -> StreamOpCounts {
        self.counts
    }

    /// Zeroes [`CudaStreams::op_counts`].
    pub fn reset_op_counts(&mut self) {
        self.counts = StreamOpCounts::default();
    }

    /// Registers `stream` so that the engine may use its id; returns the
    /// id. A cudarc stream is kept alive from now on (until
    /// [`CudaStreams::retain`] drops it) and must belong to this backend's
    /// context ([`CudaError::WrongContext`] otherwise).
    pub fn register<S: AsStream + ?Sized>(&mut self, stream: &S) -> Result<StreamId, CudaError> {
        self.register_ref(stream_ref(stream))
    }

    #[inline]
    pub(crate) fn register_ref(&mut self, stream: StreamRef<'_>) -> Result<StreamId, CudaError> {
        match stream {
            StreamRef::Cudarc(s) => match self.last_cudarc {
                Some((addr, id)) if addr == Arc::as_ptr(s) as usize => Ok(id),
                _ => self.register_cudarc(s),
            },
            StreamRef::Raw(id) => {
                self.streams.register(id, None::<fn() -> Arc<CudaStream>>);
                Ok(id)
            }
        }
    }

    /// Registers a cudarc stream other than the one registered last: checks
    /// its context, holds an `Arc` of it, and remembers the stream the
    /// table holds for its id (the first one registered with that id) as
    /// the last one.
    #[inline(never)]
    fn register_cudarc(&mut self, s: &Arc<CudaStream>) -> Result<StreamId, CudaError> {
        if s.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(CudaError::WrongContext {
                ordinal: self.ctx.ordinal(),
            });
        }
        let id = crate::stream_id(s);
        self.streams.register(id, Some(|| s.clone()));
        self.last_cudarc = self
            .streams
            .owner(id)
            .map(|held| (Arc::as_ptr(held) as usize, id));
        Ok(id)
    }

    /// Whether `id` was registered (and not let go since).
    pub fn is_registered(&self, id: StreamId) -> bool {
        self.streams.contains(id)
    }

    /// Streams registered now.
    pub fn registered(&self) -> usize {
        self.streams.len()
    }

    /// Lets go of every registered stream `keep` refuses (dropping the
    /// `Arc`s held for them). Give it the engine's
    /// [`alloc_core::Engine::streams_in_use`]: a stream the engine still
    /// uses must stay, or its later events fail (the block concerned is
    /// kept out of reuse) and a new stream may take its handle value and be
    /// served its cached blocks.
    pub fn retain(&mut self, keep: impl FnMut(StreamId) -> bool) {
        // The stream registered last may be let go: its address may then
        // be taken by a stream of another context.
        self.last_cudarc = None;
        self.streams.retain(keep);
    }

    /// Whether enough streams were registered since the last
    /// [`CudaStreams::retain`] for another one to be worth its cost.
    pub(crate) fn wants_pruning(&self) -> bool {
        self.streams.wants_pruning()
    }

    /// Counters of the event recycler.
    pub fn event_stats(&self) -> EventRecyclerStats {
        self.spare.stats()
    }

    /// `stream` if registered, else the error the engine reports.
    fn registered_stream(&self, stream: StreamId) -> Result<StreamId, CudaError> {
        if self.streams.contains(stream) {
            Ok(stream)
        } else {
            Err(CudaError::UnregisteredStream { stream })
        }
    }
}

impl StreamBackend for CudaStreams {
    type Event = RecycledEvent;

    fn record(&mut self, stream: StreamId) -> Result<RecycledEvent, BackendError> {
        let stream = self.registered_stream(stream)?;
        driver::bind(&self.ctx)?;
        let event = self.spare.acquire(driver::event_create)?;
        // SAFETY: `stream` is registered: a cudarc stream of this context
        // that the table keeps alive, or a raw handle whose creator vouched
        // (`StreamHandle::from_raw`) that it lives while the engine uses it.
        match unsafe { driver::event_record(&event, stream.0) } {
            Ok(()) => {
                self.counts.recorded += 1;
                Ok(RecycledEvent(event))
            }
            Err(e) => {
                self.spare.release(event);
                Err(e.into())
            }
        }
    }

    fn is_complete(&mut self, event: &RecycledEvent) -> Result<bool, BackendError> {
        driver::bind(&self.ctx)?;
        self.counts.queried += 1;
        Ok(driver::event_query(&event.0)?)
    }

    fn synchronize(&mut self, event: &RecycledEvent) -> Result<(), BackendError> {
        driver::bind(&self.ctx)?;
        let started = Instant::now();
        let waited = driver::event_synchronize(&event.0);
        self.counts.host_waits += 1;
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.counts.host_wait_ns = self.counts.host_wait_ns.saturating_add(ns);
        Ok(waited?)
    }

    fn make_stream_wait(
        &mut self,
        stream: StreamId,
        event: &RecycledEvent,
    ) -> Result<(), BackendError> {
        let stream = self.registered_stream(stream)?;
        driver::bind(&self.ctx)?;
        self.counts.stream_waits += 1;
        // SAFETY: `stream` is registered (see `record`).
        Ok(unsafe { driver::stream_wait_event(stream.0, &event.0) }?)
    }

    fn release(&mut self, event: RecycledEvent) {
        self.spare.release(event.0);
    }

    fn capture_graph(&mut self) -> Option<&mut dyn CaptureGraph> {
        if driver::capture_graph_present() {
            Some(self)
        } else {
            None
        }
    }
}

impl CudaStreams {
    /// The capture `stream` takes part in, with the nodes its next work will
    /// depend on in `self.nodes`; `None` when it is not capturing.
    fn read_capture(&mut self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        let stream = self.registered_stream(stream)?;
        driver::bind(&self.ctx)?;
        self.nodes.clear();
        // SAFETY: `stream` is registered (see `record`).
        Ok(unsafe { driver::stream_capture_info(stream.0, &mut self.nodes) }?)
    }
}

/// The graph of a capture is read only through nodes this backend handed
/// out, and only while their capture is still underway on the stream they
/// were read from (checked before every read): a node of an ended capture,
/// whose graph its owner may have destroyed, or any other value, is an
/// error before any driver call.
impl CaptureGraph for CudaStreams {
    fn frontier(&mut self, stream: StreamId) -> Result<Option<CaptureFrontier>, BackendError> {
        let capture = self.read_capture(stream)?;
        // A stream takes part in one capture at a time: nodes read from it
        // for another capture belong to one that ended.
        self.known_nodes
            .retain(|_, &mut (s, c)| s != stream || Some(c) == capture);
        let Some(capture) = capture else {
            return Ok(None);
        };
        for &n in &self.nodes {
            self.known_nodes.insert(n, (stream, capture));
        }
        Ok(Some(CaptureFrontier {
            capture,
            nodes: self.nodes.iter().map(|&n| GraphNode(n)).collect(),
        }))
    }

    fn dependencies(
        &mut self,
        node: GraphNode,
        out: &mut Vec<GraphNode>,
    ) -> Result<(), BackendError> {
        let Some(&(stream, capture)) = self.known_nodes.get(&node.0) else {
            return Err(BackendError::Other(format!(
                "graph node {:#x} was not read from a capture by this backend",
                node.0
            )));
        };
        if self.read_capture(stream)? != Some(capture) {
            // The capture ended: its graph may be gone, and its nodes with it.
            self.known_nodes.retain(|_, &mut (_, c)| c != capture);
            return Err(BackendError::Other(format!(
                "graph node {:#x} belongs to capture {capture}, which has ended",
                node.0
            )));
        }
        driver::bind(&self.ctx)?;
        self.nodes.clear();
        // SAFETY: `node` was read from capture `capture`, which is still
        // underway on `stream` (checked just above), and a capturing graph
        // keeps its nodes until the capture ends.
        unsafe { driver::graph_node_dependencies(node.0, &mut self.nodes) }?;
        for &n in &self.nodes {
            self.known_nodes.insert(n, (stream, capture));
        }
        out.extend(self.nodes.iter().map(|&n| GraphNode(n)));
        Ok(())
    }
}

impl Drop for CudaStreams {
    fn drop(&mut self) {
        if driver::bind(&self.ctx).is_err() {
            return;
        }
        for event in self.spare.drain() {
            let _ = driver::event_destroy(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycler_reuses_released_events_lifo() {
        let mut next = 0u32;
        let mut make = || -> Result<u32, ()> {
            next += 1;
            Ok(next)
        };
        let mut spare = EventRecycler::new();
        let a = spare.acquire(&mut make).unwrap();
        let b = spare.acquire(&mut make).unwrap();
        assert_eq!((a, b), (1, 2));
        spare.release(a);
        // The released handle comes back; nothing new is created.
        assert_eq!(spare.acquire(&mut make).unwrap(), 1);
        spare.release(b);
        spare.release(1);
        let s = spare.stats();
        assert_eq!(
            s,
            EventRecyclerStats {
                created: 2,
                in_use: 0,
                pooled: 2,
                reused: 1
            }
        );
        // A thousand record/release cycles still use the same two handles.
        for _ in 0..1000 {
            let x = spare.acquire(&mut make).unwrap();
            let y = spare.acquire(&mut make).unwrap();
            spare.release(x);
            spare.release(y);
        }
        assert_eq!(spare.stats().created, 2);
        assert_eq!(spare.drain().count(), 2);
        assert_eq!(spare.stats().pooled, 0);
    }

    #[test]
    fn failed_creation_is_an_error_and_counts_nothing() {
        let mut spare: EventRecycler<u32> = EventRecycler::new();
        let r = spare.acquire(|| Err("no events"));
        assert_eq!(r, Err("no events"));
        assert_eq!(spare.stats(), EventRecyclerStats::default());
    }
}
