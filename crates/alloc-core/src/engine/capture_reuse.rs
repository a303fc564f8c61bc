//! Reuse during a CUDA graph capture of blocks that other streams used
//! (`record_stream`): PyTorch's `graph_capture_record_stream_reuse`.
//!
//! Events can be neither recorded nor queried while a stream is captured,
//! so a block freed during a capture while other streams used it is
//! deferred: its events are recorded once no capture is underway. With the
//! option on, the free also notes where the capture stands on every stream
//! that used the block, its allocation stream included: the nodes their
//! next work would follow, the block's *markers*. A later allocation on the
//! block's stream in the same capture takes the block back once every
//! marker is that stream's frontier or precedes it: the graph then orders
//! whatever the stream queues next after every use of the block, as a wait
//! on an event would. Only the graph's edges are read; nothing waits.
//!
//! This is PyTorch's rule with one difference: a block qualifies only if
//! every other stream recorded its use while capturing in the same capture
//! as the free. A use recorded otherwise (eager work queued before the
//! capture, or work of another capture) is not in this graph, so no marker
//! orders it; such a block waits for the capture's end and its events, as
//! with the option off.

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use crate::capture::{CaptureGraph, GraphNode};
use crate::error::BackendError;
use crate::types::{BlockId, StreamId};

/// Where the uses of a block freed during a capture end in its graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Markers {
    /// The block's allocation stream: the only one that may take it back.
    stream: StreamId,
    /// The capture the markers belong to.
    capture: u64,
    /// The frontiers of every stream that used the block, at its free.
    nodes: SmallVec<[GraphNode; 4]>,
}

/// A free deferred while a capture is underway.
#[derive(Debug)]
struct DeferredFree {
    addr: u64,
    /// `None`: it waits for the end of the capture.
    markers: Option<Markers>,
}

/// Frees deferred by captures, and what deciding their early reuse needs.
#[derive(Debug, Default)]
pub(super) struct CaptureFrees {
    deferred: Vec<DeferredFree>,
    /// Deferred frees with markers.
    with_markers: usize,
    /// Per (capture, stream): every node the stream's next work follows
    /// (its frontier and their ancestors), grown as the capture goes on so
    /// that each node's dependencies are read once.
    reached: FxHashMap<(u64, StreamId), FxHashSet<GraphNode>>,
    /// Blocks whose every extra use was recorded by a stream capturing in
    /// the capture with this id.
    captured_uses: FxHashMap<BlockId, u64>,
}

impl CaptureFrees {
    /// Whether `addr` was freed during the capture and waits for its end.
    #[inline]
    pub(super) fn is_deferred(&self, addr: u64) -> bool {
        !self.deferred.is_empty() && self.deferred.iter().any(|d| d.addr == addr)
    }

    /// Whether a deferred free might be reused before the capture ends.
    #[inline]
    pub(super) fn has_markers(&self) -> bool {
        self.with_markers > 0
    }

    /// Defers the free of `addr`, reusable early once its `markers` (if
    /// any) are joined.
    pub(super) fn defer(&mut self, addr: u64, markers: Option<Markers>) {
        self.with_markers += usize::from(markers.is_some());
        self.deferred.push(DeferredFree { addr, markers });
    }

    /// Every deferred free, in free order, for the end of the captures
    /// (what was read of their graphs goes too).
    pub(super) fn take_all(&mut self) -> Vec<u64> {
        self.with_markers = 0;
        self.reached.clear();
        self.deferred.drain(..).map(|d| d.addr).collect()
    }

    /// The markers of block `id`, freed now during a capture while `uses`
    /// streams used it besides `stream`, its allocation stream, read from
    /// the capture's `graph`; `None` when it must wait for the capture's
    /// end: a use lies outside the capture, a stream is not capturing in
    /// it, or the graph cannot be read (waiting is always safe).
    pub(super) fn markers(
        &self,
        graph: &mut dyn CaptureGraph,
        id: BlockId,
        stream: StreamId,
        uses: &[StreamId],
    ) -> Option<Markers> {
        let capture = *self.captured_uses.get(&id)?;
        let mut nodes = SmallVec::new();
        for &s in std::iter::once(&stream).chain(uses) {
            let frontier = graph.frontier(s).ok()??;
            if frontier.capture != capture {
                return None;
            }
            for node in frontier.nodes {
                if !nodes.contains(&node) {
                    nodes.push(node);
                }
            }
        }
        // No node at all (nothing queued yet in the capture): PyTorch
        // defers such a free to the capture's end; so do we.
        (!nodes.is_empty()).then_some(Markers {
            stream,
            capture,
            nodes,
        })
    }

    /// `record_stream` gave block `id` a use on `stream` (`first`: its
    /// first extra one); `graph` is the capture's when the use may count
    /// (the option is on and a capture is underway): notes whether it was
    /// recorded in a capture.
    pub(super) fn note_use_on(
        &mut self,
        graph: Option<&mut dyn CaptureGraph>,
        id: BlockId,
        stream: StreamId,
        first: bool,
    ) {
        match graph {
            None => {
                if !self.captured_uses.is_empty() {
                    self.note_use(id, first, None);
                }
            }
            Some(g) => {
                let capture = g.frontier(stream).ok().flatten().map(|f| f.capture);
                self.note_use(id, first, capture);
            }
        }
    }

    /// `record_stream` gave block `id` a use (`first`: its first extra
    /// one) on a stream capturing in `capture` (`None`: not capturing).
    fn note_use(&mut self, id: BlockId, first: bool, capture: Option<u64>) {
        match capture {
            Some(c) if first => {
                self.captured_uses.insert(id, c);
            }
            _ => {
                if self
                    .captured_uses
                    .get(&id)
                    .is_some_and(|&c| Some(c) != capture)
                {
                    self.captured_uses.remove(&id);
                }
            }
        }
    }

    /// Block `id` was freed for good: its uses are forgotten.
    #[inline]
    pub(super) fn forget(&mut self, id: BlockId) {
        if !self.captured_uses.is_empty() {
            self.captured_uses.remove(&id);
        }
    }

    /// Removes and returns the deferred frees of `stream` whose markers
    /// its frontier in `graph` has joined.
    pub(super) fn take_joined(
        &mut self,
        graph: &mut dyn CaptureGraph,
        stream: StreamId,
    ) -> Result<SmallVec<[u64; 4]>, BackendError> {
        let mut joined = SmallVec::new();
        let Some(frontier) = graph.frontier(stream)? else {
            return Ok(joined);
        };
        let waiting_here = |d: &DeferredFree| {
            d.markers
                .as_ref()
                .is_some_and(|m| m.stream == stream && m.capture == frontier.capture)
        };
        if frontier.nodes.is_empty() || !self.deferred.iter().any(waiting_here) {
            return Ok(joined);
        }
        let key = (frontier.capture, stream);
        let reached = self.reached.entry(key).or_default();
        if let Err(e) = extend_reach(graph, &frontier.nodes, reached) {
            // Nodes whose dependencies were not read would hide them later.
            self.reached.remove(&key);
            return Err(e);
        }
        let reached = &self.reached[&key];
        let mut released = 0;
        self.deferred.retain(|d| {
            let ready = waiting_here(d)
                && d.markers
                    .as_ref()
                    .is_some_and(|m| m.nodes.iter().all(|n| reached.contains(n)));
            if ready {
                joined.push(d.addr);
                released += 1;
            }
            !ready
        });
        self.with_markers -= released;
        Ok(joined)
    }
}

/// Adds to `reached` the nodes of `frontier` and everything they depend on.
/// A node already there had its dependencies added then. On an error the
/// set may hold nodes whose dependencies are missing.
fn extend_reach(
    graph: &mut dyn CaptureGraph,
    frontier: &[GraphNode],
    reached: &mut FxHashSet<GraphNode>,
) -> Result<(), BackendError> {
    let mut stack: Vec<GraphNode> = frontier.to_vec();
    while let Some(node) = stack.pop() {
        if reached.insert(node) {
            graph.dependencies(node, &mut stack)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimCapture;

    fn markers(stream: StreamId, capture: u64, nodes: &[GraphNode]) -> Option<Markers> {
        Some(Markers {
            stream,
            capture,
            nodes: nodes.iter().copied().collect(),
        })
    }

    #[test]
    fn a_free_is_taken_back_on_its_stream_once_its_markers_are_joined() {
        let mut g = SimCapture::default();
        let (s1, s2, s3) = (StreamId(1), StreamId(2), StreamId(3));
        let capture = g.begin(s1);
        let a = g.launch(s1).unwrap();
        g.wait_stream(s2, s1);
        g.wait_stream(s3, s1);
        let b = g.launch(s2).unwrap();
        let c = g.launch(s3).unwrap();
        let mut frees = CaptureFrees::default();
        frees.defer(0x100, markers(s1, capture, &[a, b, c]));
        frees.defer(0x200, None);
        assert!(frees.has_markers() && frees.is_deferred(0x100) && frees.is_deferred(0x200));
        g.wait_stream(s1, s2);
        g.launch(s1).unwrap();
        assert!(
            frees.take_joined(&mut g, s1).unwrap().is_empty(),
            "s3 not joined"
        );
        assert!(
            frees.take_joined(&mut g, s3).unwrap().is_empty(),
            "another stream's block"
        );
        g.wait_stream(s1, s3);
        assert_eq!(frees.take_joined(&mut g, s1).unwrap().as_slice(), &[0x100]);
        assert!(!frees.has_markers() && !frees.is_deferred(0x100));
        assert_eq!(frees.take_all(), vec![0x200]);
        assert!(frees.reached.is_empty());
    }

    #[test]
    fn markers_of_another_capture_are_never_joined() {
        let mut g = SimCapture::default();
        let s = StreamId(1);
        let first = g.begin(s);
        let a = g.launch(s).unwrap();
        g.end(s);
        g.begin(s);
        g.launch(s).unwrap();
        let mut frees = CaptureFrees::default();
        // The same node number in another capture's graph proves nothing.
        frees.defer(0x100, markers(s, first, &[a]));
        assert!(frees.take_joined(&mut g, s).unwrap().is_empty());
        assert!(frees.is_deferred(0x100));
    }

    #[test]
    fn uses_count_only_when_all_recorded_in_one_capture() {
        let id = BlockId::from_index(7);
        let mut frees = CaptureFrees::default();
        frees.note_use(id, true, Some(4));
        frees.note_use(id, false, Some(4));
        assert_eq!(frees.captured_uses.get(&id), Some(&4));
        frees.note_use(id, false, None);
        assert_eq!(frees.captured_uses.get(&id), None, "an eager use");
        frees.note_use(id, false, Some(4));
        assert_eq!(frees.captured_uses.get(&id), None, "stays out");
        frees.note_use(id, true, Some(5));
        frees.note_use(id, false, Some(6));
        assert_eq!(frees.captured_uses.get(&id), None, "another capture");
        frees.note_use(id, true, Some(5));
        frees.forget(id);
        assert!(frees.captured_uses.is_empty());
    }

    /// A graph whose reads fail after a number of them.
    struct Failing {
        inner: SimCapture,
        reads_left: u32,
    }

    impl CaptureGraph for Failing {
        fn frontier(
            &mut self,
            stream: StreamId,
        ) -> Result<Option<crate::CaptureFrontier>, BackendError> {
            self.inner.frontier(stream)
        }

        fn dependencies(
            &mut self,
            node: GraphNode,
            out: &mut Vec<GraphNode>,
        ) -> Result<(), BackendError> {
            if self.reads_left == 0 {
                return Err(BackendError::Other("lost".into()));
            }
            self.reads_left -= 1;
            self.inner.dependencies(node, out)
        }
    }

    #[test]
    fn a_failed_read_defers_and_a_later_one_starts_over() {
        let (s1, s2) = (StreamId(1), StreamId(2));
        let mut inner = SimCapture::default();
        let capture = inner.begin(s1);
        inner.wait_stream(s2, s1);
        let b = inner.launch(s2).unwrap();
        inner.launch(s1).unwrap();
        inner.wait_stream(s1, s2);
        inner.launch(s1).unwrap();
        let mut g = Failing {
            inner,
            reads_left: 1,
        };
        let mut frees = CaptureFrees::default();
        frees.defer(0x100, markers(s1, capture, &[b]));
        assert!(frees.take_joined(&mut g, s1).is_err());
        assert!(frees.is_deferred(0x100) && frees.reached.is_empty());
        g.reads_left = u32::MAX;
        assert_eq!(frees.take_joined(&mut g, s1).unwrap().as_slice(), &[0x100]);
    }
}
