//! What the engine reads of a CUDA graph while it is captured: where a
//! capturing stream stands (the nodes its next work will depend on) and
//! what each node depends on. From these the engine sees whether the graph
//! already orders a stream's next work after the last uses of a block on
//! other streams, so that a block freed during a capture can be reused in
//! it (PyTorch's `graph_capture_record_stream_reuse`). A stream backend
//! offers this through [`StreamBackend::capture_graph`](crate::StreamBackend::capture_graph).

use smallvec::SmallVec;

use crate::error::BackendError;
use crate::types::StreamId;

/// A node of a graph under capture: the driver's `CUgraphNode` handle value
/// (or a simulated node's number). Compared, never dereferenced by the
/// engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphNode(pub u64);

/// Where a capturing stream stands in its capture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CaptureFrontier {
    /// The capture's id, unique among the captures of the process
    /// (`cuStreamGetCaptureInfo`'s `id_out`).
    pub capture: u64,
    /// The nodes that work queued next on the stream will depend on: the
    /// capture's terminal nodes for this stream (none before its first
    /// work in the capture).
    pub nodes: SmallVec<[GraphNode; 4]>,
}

/// Reads the graph of captures underway: a capability of a stream backend.
pub trait CaptureGraph {
    /// Where `stream` stands in the capture it takes part in; `None` when
    /// the stream is not capturing (or its capture was invalidated).
    fn frontier(&mut self, stream: StreamId) -> Result<Option<CaptureFrontier>, BackendError>;

    /// Appends the nodes that `node` depends on (its incoming edges) to
    /// `out`. `node` is a node of a capture still underway: one of a
    /// frontier, or a dependency of one.
    fn dependencies(
        &mut self,
        node: GraphNode,
        out: &mut Vec<GraphNode>,
    ) -> Result<(), BackendError>;
}
