//! The engine's stream backend over CUDA events, with a pool of events so
//! that a cross-stream free costs a `cuEventRecord`, not a create + destroy;
//! it also reads the graphs of captures underway (`cuStreamGetCaptureInfo`,
//! `cuGraphNodeGetDependencies`) for `graph_capture_record_stream_reuse`.

use std::sync::Arc;

use alloc_core::{BackendError, CaptureFrontier, CaptureGraph, GraphNode, StreamBackend, StreamId};
use cudarc::driver::CudaContext;

use crate::driver::{self, RawEvent};

/// Counters of an [`EventPool`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventPoolStats {
    /// Events created over the pool's life.
    pub created: u64,
    /// Events handed out and not yet given back.
    pub in_use: u64,
    /// Idle events waiting in the pool.
    pub pooled: u64,
    /// Times an event was taken from the pool instead of created.
    pub reused: u64,
}

/// A free list of event handles: `acquire` pops one (or creates one when the
/// list is empty), `release` pushes it back. Generic over the handle so its
/// logic is tested without a GPU.
#[derive(Debug)]
pub struct EventPool<H> {
    free: Vec<H>,
    stats: EventPoolStats,
}

impl<H> Default for EventPool<H> {
    fn default() -> Self {
        EventPool {
            free: Vec::new(),
            stats: EventPoolStats::default(),
        }
    }
}

impl<H> EventPool<H> {
    /// An empty pool.
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

    /// The pool's counters.
    pub fn stats(&self) -> EventPoolStats {
        EventPoolStats {
            pooled: self.free.len() as u64,
            ..self.stats
        }
    }
}

/// An event recorded for the engine; goes back to the pool through
/// [`StreamBackend::release`].
#[derive(Debug)]
pub struct PooledEvent(RawEvent);

/// [`StreamBackend`] over CUDA events of one device's primary context.
/// `StreamId`s are raw `CUstream` values (`0`: legacy default stream).
#[derive(Debug)]
pub struct CudaStreams {
    ctx: Arc<CudaContext>,
    pool: EventPool<RawEvent>,
    /// Node handles read from the driver, before they become `GraphNode`s.
    nodes: Vec<u64>,
}

impl CudaStreams {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        CudaStreams {
            ctx,
            pool: EventPool::new(),
            nodes: Vec::new(),
        }
    }

    /// Counters of the event pool.
    pub fn pool_stats(&self) -> EventPoolStats {
        self.pool.stats()
    }
}

impl StreamBackend for CudaStreams {
    type Event = PooledEvent;

    fn record(&mut self, stream: StreamId) -> Result<PooledEvent, BackendError> {
        driver::bind(&self.ctx)?;
        let event = self.pool.acquire(driver::event_create)?;
        // SAFETY: stream ids reach the engine only from `&CudaStream`s kept
        // alive by their owners (`DeviceBuffer` holds an `Arc`) or from the
        // `unsafe` raw-stream entry points of `CudaAllocator`, whose callers
        // promise the stream lives until the block is freed.
        match unsafe { driver::event_record(&event, stream.0) } {
            Ok(()) => Ok(PooledEvent(event)),
            Err(e) => {
                self.pool.release(event);
                Err(e.into())
            }
        }
    }

    fn is_complete(&mut self, event: &PooledEvent) -> Result<bool, BackendError> {
        driver::bind(&self.ctx)?;
        Ok(driver::event_query(&event.0)?)
    }

    fn synchronize(&mut self, event: &PooledEvent) -> Result<(), BackendError> {
        driver::bind(&self.ctx)?;
        Ok(driver::event_synchronize(&event.0)?)
    }

    fn make_stream_wait(
        &mut self,
        stream: StreamId,
        event: &PooledEvent,
    ) -> Result<(), BackendError> {
        driver::bind(&self.ctx)?;
        // SAFETY: `stream` is the allocating stream of the `malloc` in
        // progress: a live `&CudaStream`, or a raw id its caller vouched for.
        Ok(unsafe { driver::stream_wait_event(stream.0, &event.0) }?)
    }

    fn release(&mut self, event: PooledEvent) {
        self.pool.release(event.0);
    }

    fn capture_graph(&mut self) -> Option<&mut dyn CaptureGraph> {
        if driver::capture_graph_present() {
            Some(self)
        } else {
            None
        }
    }
}

impl CaptureGraph for CudaStreams {
    fn frontier(&mut self, stream: StreamId) -> Result<Option<CaptureFrontier>, BackendError> {
        driver::bind(&self.ctx)?;
        self.nodes.clear();
        // SAFETY: the engine asks about its callers' streams: the stream of
        // an allocation, or one given to `record_stream`, each vouched for
        // as in `record`.
        let capture = unsafe { driver::stream_capture_info(stream.0, &mut self.nodes) }?;
        Ok(capture.map(|capture| CaptureFrontier {
            capture,
            nodes: self.nodes.iter().map(|&n| GraphNode(n)).collect(),
        }))
    }

    fn dependencies(
        &mut self,
        node: GraphNode,
        out: &mut Vec<GraphNode>,
    ) -> Result<(), BackendError> {
        driver::bind(&self.ctx)?;
        self.nodes.clear();
        // SAFETY: the engine asks only about nodes of a capture underway:
        // a frontier `frontier` just returned, or a dependency of one; the
        // capture's graph lives until the capture ends, after which no node
        // of it is asked about (the engine forgets them with the capture).
        unsafe { driver::graph_node_dependencies(node.0, &mut self.nodes) }?;
        out.extend(self.nodes.iter().map(|&n| GraphNode(n)));
        Ok(())
    }
}

impl Drop for CudaStreams {
    fn drop(&mut self) {
        if driver::bind(&self.ctx).is_err() {
            return;
        }
        for event in self.pool.drain() {
            let _ = driver::event_destroy(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_reuses_released_events_lifo() {
        let mut next = 0u32;
        let mut make = || -> Result<u32, ()> {
            next += 1;
            Ok(next)
        };
        let mut pool = EventPool::new();
        let a = pool.acquire(&mut make).unwrap();
        let b = pool.acquire(&mut make).unwrap();
        assert_eq!((a, b), (1, 2));
        pool.release(a);
        // The released handle comes back; nothing new is created.
        assert_eq!(pool.acquire(&mut make).unwrap(), 1);
        pool.release(b);
        pool.release(1);
        let s = pool.stats();
        assert_eq!(
            s,
            EventPoolStats {
                created: 2,
                in_use: 0,
                pooled: 2,
                reused: 1
            }
        );
        // A thousand record/release cycles still use the same two handles.
        for _ in 0..1000 {
            let x = pool.acquire(&mut make).unwrap();
            let y = pool.acquire(&mut make).unwrap();
            pool.release(x);
            pool.release(y);
        }
        assert_eq!(pool.stats().created, 2);
        assert_eq!(pool.drain().count(), 2);
        assert_eq!(pool.stats().pooled, 0);
    }

    #[test]
    fn failed_creation_is_an_error_and_counts_nothing() {
        let mut pool: EventPool<u32> = EventPool::new();
        let r = pool.acquire(|| Err("no events"));
        assert_eq!(r, Err("no events"));
        assert_eq!(pool.stats(), EventPoolStats::default());
    }
}
