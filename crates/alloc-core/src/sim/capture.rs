//! Simulated CUDA graph captures: a stream captures into a graph, other
//! streams fork from it and join back through `wait_stream` (an event
//! recorded on one stream and waited on by another), and every queued
//! kernel becomes a node after its stream's frontier, as CUDA builds the
//! graph. The engine reads it through [`CaptureGraph`].

use std::collections::HashMap;

use smallvec::SmallVec;

use crate::capture::{CaptureFrontier, CaptureGraph, GraphNode};
use crate::error::BackendError;
use crate::types::StreamId;

/// A capturing stream: its capture and the nodes its next work depends on.
#[derive(Debug, Clone)]
struct Capturing {
    capture: u64,
    frontier: SmallVec<[GraphNode; 4]>,
}

/// Simulated captures, driven by the test (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct SimCapture {
    /// The dependencies of node `n` at index `n - 1`.
    dependencies: Vec<SmallVec<[GraphNode; 2]>>,
    streams: HashMap<StreamId, Capturing>,
    captures: u64,
}

impl SimCapture {
    /// Starts capturing `stream` into a new graph (`cuStreamBeginCapture`);
    /// returns the capture's id. A stream already capturing starts over in
    /// the new capture.
    pub fn begin(&mut self, stream: StreamId) -> u64 {
        self.captures += 1;
        let capture = self.captures;
        self.streams.insert(
            stream,
            Capturing {
                capture,
                frontier: SmallVec::new(),
            },
        );
        capture
    }

    /// Queues a kernel on `stream`. While the stream captures, the kernel
    /// becomes a node that depends on the stream's frontier and is the
    /// frontier from then on; otherwise it runs eagerly and `None` is
    /// returned.
    pub fn launch(&mut self, stream: StreamId) -> Option<GraphNode> {
        let capturing = self.streams.get_mut(&stream)?;
        self.dependencies.push(
            std::mem::take(&mut capturing.frontier)
                .into_iter()
                .collect(),
        );
        let node = GraphNode(self.dependencies.len() as u64);
        capturing.frontier.push(node);
        Some(node)
    }

    /// `waiter.wait_stream(on)`: an event recorded on `on`, waited on by
    /// `waiter`. When `on` is capturing, `waiter` takes part in its capture
    /// from now on (a fork, if it was not capturing) and its next work
    /// depends on `on`'s frontier as well as its own (a join).
    pub fn wait_stream(&mut self, waiter: StreamId, on: StreamId) {
        let Some(source) = self.streams.get(&on).cloned() else {
            return; // an eager event: nothing in any graph
        };
        let joined = self.streams.entry(waiter).or_insert(Capturing {
            capture: source.capture,
            frontier: SmallVec::new(),
        });
        joined.capture = source.capture;
        for node in source.frontier {
            if !joined.frontier.contains(&node) {
                joined.frontier.push(node);
            }
        }
    }

    /// Ends the capture that `stream` takes part in
    /// (`cuStreamEndCapture`): every stream of it stops capturing.
    pub fn end(&mut self, stream: StreamId) {
        if let Some(capture) = self.streams.get(&stream).map(|c| c.capture) {
            self.streams.retain(|_, c| c.capture != capture);
        }
    }

    /// Whether `stream` is capturing.
    pub fn is_capturing(&self, stream: StreamId) -> bool {
        self.streams.contains_key(&stream)
    }

    /// Whether `ancestor` is `node` or a node that `node` depends on,
    /// directly or not.
    pub fn precedes(&self, ancestor: GraphNode, node: GraphNode) -> bool {
        let mut stack = vec![node];
        let mut seen = std::collections::HashSet::new();
        while let Some(n) = stack.pop() {
            if n == ancestor {
                return true;
            }
            if seen.insert(n) {
                stack.extend(self.dependencies_of(n).into_iter().flatten().copied());
            }
        }
        false
    }

    fn dependencies_of(&self, node: GraphNode) -> Option<&SmallVec<[GraphNode; 2]>> {
        (node.0 as usize)
            .checked_sub(1)
            .and_then(|i| self.dependencies.get(i))
    }
}

impl CaptureGraph for SimCapture {
    fn frontier(&mut self, stream: StreamId) -> Result<Option<CaptureFrontier>, BackendError> {
        Ok(self.streams.get(&stream).map(|c| CaptureFrontier {
            capture: c.capture,
            nodes: c.frontier.clone(),
        }))
    }

    fn dependencies(
        &mut self,
        node: GraphNode,
        out: &mut Vec<GraphNode>,
    ) -> Result<(), BackendError> {
        let deps = self
            .dependencies_of(node)
            .ok_or_else(|| BackendError::Other(format!("no simulated graph node {}", node.0)))?;
        out.extend(deps.iter().copied());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frontier(c: &mut SimCapture, s: StreamId) -> Vec<GraphNode> {
        c.frontier(s)
            .unwrap()
            .map(|f| f.nodes.to_vec())
            .unwrap_or_default()
    }

    #[test]
    fn fork_and_join_build_the_graph_cuda_builds() {
        let mut c = SimCapture::default();
        let [s1, s2, s3] = [1, 2, 3].map(StreamId);
        assert_eq!(c.launch(s1), None, "eager work leaves no node");
        let id = c.begin(s1);
        assert!(frontier(&mut c, s1).is_empty(), "nothing queued yet");
        let a = c.launch(s1).unwrap();
        c.wait_stream(s2, s1); // fork
        assert_eq!(c.frontier(s2).unwrap().unwrap().capture, id);
        let b = c.launch(s2).unwrap();
        let d = c.launch(s1).unwrap();
        assert!(c.precedes(a, b) && c.precedes(a, d));
        assert!(!c.precedes(b, d), "not joined yet");
        c.wait_stream(s1, s2); // join
        assert_eq!(frontier(&mut c, s1), vec![d, b]);
        let e = c.launch(s1).unwrap();
        assert!(c.precedes(b, e) && c.precedes(d, e) && c.precedes(e, e));
        let mut deps = Vec::new();
        c.dependencies(e, &mut deps).unwrap();
        assert_eq!(deps, vec![d, b]);
        assert!(c.dependencies(GraphNode(99), &mut deps).is_err());
        c.end(s1);
        assert!(!c.is_capturing(s1) && !c.is_capturing(s2));
        assert_eq!(c.frontier(s2).unwrap(), None);
        c.wait_stream(s3, s1);
        assert!(!c.is_capturing(s3), "an eager wait joins no capture");
        assert_ne!(c.begin(s1), id, "each capture has its own id");
    }
}
