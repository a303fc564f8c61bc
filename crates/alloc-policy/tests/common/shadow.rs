//! A shadow of what the engine handed out, kept independently of the
//! engine (as rlsf's `ShadowAllocator` is): live address ranges with their
//! streams, and freed ranges that other streams may still be using. It
//! fails when a new block overlaps a live one, when a block is handed out
//! again while a stream that used it may still run work queued before its
//! free (unless the allocating stream was made to wait for that work), and
//! when a live block's memory is not mapped.
//!
//! "Still running" is judged by marker events the shadow records itself on
//! the simulated streams just before each such free (a stream runs its work
//! in order, so a marker completes once the work queued before the free is
//! done): the engine's own events are not consulted. A block may be reused
//! earlier only on a stream the engine made wait for an event recorded on
//! the using stream after the marker.

use std::collections::BTreeMap;

use alloc_core::{Allocation, SimEvent, StreamBackend, StreamId};

use super::SimEngine;

/// A block handed out and not yet freed.
#[derive(Debug, Clone)]
struct Live {
    end: u64,
    stream: StreamId,
    /// Other streams that used it (`record_stream`).
    uses: Vec<StreamId>,
}

/// A freed range that other streams may still be using.
#[derive(Debug, Clone)]
struct InUse {
    start: u64,
    end: u64,
    /// A marker recorded on each other stream just before the free.
    markers: Vec<(StreamId, SimEvent)>,
}

/// The shadow; see the module docs.
#[derive(Debug, Default)]
pub struct Shadow {
    live: BTreeMap<u64, Live>,
    in_use: Vec<InUse>,
    /// Frees during a capture, whose markers wait for its end (nothing may
    /// be recorded on a stream while it is captured).
    deferred: Vec<(u64, Live)>,
}

impl Shadow {
    /// The engine handed out `a`.
    pub fn allocated(&mut self, e: &mut SimEngine, a: Allocation) -> Result<(), String> {
        let (start, end) = (a.addr, a.addr + a.size);
        if let Some((&other, l)) = self.live.range(..end).next_back() {
            if l.end > start {
                return Err(format!(
                    "block {start:#x}+{} overlaps the live block at {other:#x}",
                    a.size
                ));
            }
        }
        if !e.memory().is_accessible(start, a.size) {
            return Err(format!(
                "block {start:#x}+{} handed out over unmapped memory",
                a.size
            ));
        }
        self.settle(e);
        if let Some((addr, _)) = self
            .deferred
            .iter()
            .find(|(addr, l)| *addr < end && start < l.end)
        {
            return Err(format!(
                "block {start:#x}+{} reuses {addr:#x}, freed during the capture while other \
                 streams used it",
                a.size
            ));
        }
        let waits = &e.streams().waits;
        for r in self
            .in_use
            .iter()
            .filter(|r| r.start < end && start < r.end)
        {
            for &(stream, marker) in &r.markers {
                let waited = waits.iter().any(|&(waiter, ev, on)| {
                    waiter == a.stream && on == stream && ev.id() > marker.id()
                });
                if !waited {
                    return Err(format!(
                        "block {start:#x}+{} on stream {} reuses {:#x}..{:#x} while stream \
                         {stream} may still use it",
                        a.size, a.stream, r.start, r.end
                    ));
                }
            }
        }
        self.live.insert(
            start,
            Live {
                end,
                stream: a.stream,
                uses: Vec::new(),
            },
        );
        Ok(())
    }

    /// `record_stream(addr, stream)` succeeded.
    pub fn recorded(&mut self, addr: u64, stream: StreamId) {
        if let Some(l) = self.live.get_mut(&addr) {
            if stream != l.stream && !l.uses.contains(&stream) {
                l.uses.push(stream);
            }
        }
    }

    /// The block at `addr` is about to be freed (`capturing`: during a
    /// capture): other streams that used it may run on.
    pub fn freeing(&mut self, e: &mut SimEngine, addr: u64, capturing: bool) {
        let Some(l) = self.live.remove(&addr) else {
            return;
        };
        if l.uses.is_empty() {
            return;
        }
        if capturing {
            self.deferred.push((addr, l));
            return;
        }
        self.mark(e, addr, l);
    }

    /// The capture is about to end: the frees made during it get their
    /// markers now (the engine records its events as the capture ends).
    pub fn capture_ending(&mut self, e: &mut SimEngine) {
        for (addr, l) in std::mem::take(&mut self.deferred) {
            self.mark(e, addr, l);
        }
    }

    /// Records a marker on every other stream that used the freed block.
    fn mark(&mut self, e: &mut SimEngine, addr: u64, l: Live) {
        let markers = l
            .uses
            .iter()
            .map(|&s| (s, e.streams_mut().record(s).expect("simulated record")))
            .collect();
        self.in_use.push(InUse {
            start: addr,
            end: l.end,
            markers,
        });
    }

    /// Forgets the streams whose marker completed, and the ranges no stream
    /// uses any more.
    fn settle(&mut self, e: &mut SimEngine) {
        for r in &mut self.in_use {
            r.markers.retain(|&(_, m)| {
                let done = e.streams_mut().is_complete(&m).unwrap_or(true);
                if done {
                    e.streams_mut().release(m);
                }
                !done
            });
        }
        self.in_use.retain(|r| !r.markers.is_empty());
    }

    /// Checks that every live block's memory is still mapped.
    pub fn check_mapped(&self, e: &SimEngine) -> Result<(), String> {
        for (&start, l) in &self.live {
            if !e.memory().is_accessible(start, l.end - start) {
                return Err(format!("live block {start:#x} lost its memory"));
            }
        }
        Ok(())
    }
}
