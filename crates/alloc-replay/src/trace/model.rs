//! The in-memory model of a trace: its events, the trace with the metadata
//! recorded with it, and the errors of reading one. The readers (text in
//! the parent module, pickles in `pickle`) build it.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::PathBuf;

/// One request in an allocation trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceEvent {
    /// An allocation request of `size` bytes (as requested, before any rounding) on `stream`.
    ///
    /// `id` identifies the allocation until it is freed; it may be reused afterwards.
    Alloc {
        /// Identifier of the allocation, unique among live allocations.
        id: u64,
        /// Requested size in bytes.
        size: u64,
        /// Stream id (0 = the default stream).
        stream: u64,
    },
    /// A free request of allocation `id` on `stream`.
    ///
    /// Traces may contain frees of ids that were never allocated in the trace (allocations
    /// made before recording began); such events are kept and left for the replayer to skip.
    Free {
        /// Identifier of the allocation being freed.
        id: u64,
        /// Stream id (0 = the default stream).
        stream: u64,
    },
    /// The free of allocation `id` (its last [`TraceEvent::Free`]) has completed: the
    /// block's uses on other streams are done, and only now could the recording
    /// allocator reuse it. Present only where that came later than the free (PyTorch's
    /// `record_stream`, FSDP's and other multi-stream code's frees); a free without one
    /// completes at once.
    FreeCompleted {
        /// Identifier of the allocation whose free completed.
        id: u64,
    },
}

/// A whole allocation trace: the request sequence plus the metadata recorded with it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Trace {
    /// Name of the trace: the file stem without `.trace.gz`, `.pickle` and similar suffixes.
    pub name: String,
    /// The allocation and free requests, in request order.
    pub events: Vec<TraceEvent>,
    /// Sizes (bytes) of the segments the recording allocator obtained from the device
    /// (`# segment_alloc <bytes>` markers in text, `segment_alloc` actions in pickles), in order.
    pub segment_allocs: Vec<u64>,
    /// Device address of each of those segments where the recording gave it
    /// (`# segment_alloc <bytes> <addr>`, or a pickle's `addr`): parallel to
    /// [`Trace::segment_allocs`]. The replay reuses them so that best fit's
    /// lowest-address tie-breaks see the real device's address order.
    pub segment_addrs: Vec<Option<u64>>,
    /// The other comment lines, without the leading `# `.
    pub header: Vec<String>,
}

impl Trace {
    /// Serializes the trace in the text format accepted by [`parse_text`](super::parse_text).
    ///
    /// Header lines come first, then the `segment_alloc` markers, then the events: the
    /// positions of markers among the events are not part of the model, so they are not
    /// reproduced, but `parse_text(name, &trace.to_text())` yields an equal [`Trace`].
    pub fn to_text(&self) -> String {
        let mut out = String::with_capacity(self.events.len() * 16);
        for line in &self.header {
            if line.is_empty() {
                out.push_str("#\n");
            } else {
                let _ = writeln!(out, "# {line}");
            }
        }
        for (size, addr) in self.segment_allocs.iter().zip(&self.segment_addrs) {
            let _ = match addr {
                Some(addr) => writeln!(out, "# segment_alloc {size} {addr}"),
                None => writeln!(out, "# segment_alloc {size}"),
            };
        }
        for ev in &self.events {
            let _ = match *ev {
                TraceEvent::Alloc { id, size, stream } => writeln!(out, "a {id} {size} {stream}"),
                TraceEvent::Free { id, stream } => writeln!(out, "f {id} {stream}"),
                TraceEvent::FreeCompleted { id } => writeln!(out, "c {id}"),
            };
        }
        out
    }

    /// Number of [`TraceEvent::Alloc`] events.
    pub fn alloc_count(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e, TraceEvent::Alloc { .. }))
            .count()
    }

    /// Number of frees that completed after other events
    /// ([`TraceEvent::FreeCompleted`]): blocks other streams used.
    pub fn late_completions(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e, TraceEvent::FreeCompleted { .. }))
            .count()
    }

    /// Number of distinct streams that allocate.
    pub fn stream_count(&self) -> usize {
        self.events
            .iter()
            .filter_map(|e| match *e {
                TraceEvent::Alloc { stream, .. } => Some(stream),
                TraceEvent::Free { .. } | TraceEvent::FreeCompleted { .. } => None,
            })
            .collect::<HashSet<u64>>()
            .len()
    }
}

/// Errors from reading or parsing a trace.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read trace {}: {source}", path.display())]
    Io {
        /// The file that was being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The content starts with the gzip magic bytes but does not decompress.
    #[error("gzip decompression failed: {0}")]
    Gzip(#[source] std::io::Error),
    /// A line of a text trace is malformed.
    #[error("line {line}: {reason}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: String,
    },
    /// The bytes are not a pickle that can be decoded.
    #[error("cannot decode pickle: {0}")]
    Pickle(String),
    /// The pickle decodes, but is not shaped like a PyTorch memory snapshot.
    #[error("not a valid memory snapshot: {0}")]
    Snapshot(String),
}
