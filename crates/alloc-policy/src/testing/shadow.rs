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
//! the using stream after the marker, or on the using stream itself (a
//! block another stream's segment lends it, `lend_idle_blocks`), whose new
//! work is queued after its old.
//!
//! During a CUDA graph capture, a block freed while other streams used it
//! may be handed out again only if every use was recorded by a stream
//! capturing in that capture, and the graph orders the allocating stream's
//! next work after where each of those streams (and the block's own) stood
//! at the free: each such node precedes one of its frontier's, as the
//! simulated graph itself tells.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use alloc_core::pytorch::MIN_BLOCK_SIZE;
use alloc_core::{
    Allocation, CaptureGraph, GraphNode, SimDataMemory, SimEvent, StreamBackend, StreamId,
};

use super::SimEngine;

/// The alignment of every block address, whatever the policy: PyTorch's
/// 512 bytes. Every policy cuts blocks in multiples of [`MIN_BLOCK_SIZE`]
/// (best fit and size classes round to it, buddy blocks are powers of two
/// of at least it, planned layouts pack at it) from segments aligned to the
/// device's granularity.
pub const BLOCK_ALIGN: u64 = MIN_BLOCK_SIZE;

/// Spacing of the pattern's words inside a block, past its first ones: the
/// simulated device's page.
const PATTERN_STRIDE: u64 = 2 << 20;

/// A block handed out and not yet freed.
#[derive(Debug, Clone)]
struct Live {
    end: u64,
    /// Which allocation it is: the pattern in its memory names it.
    id: u64,
    stream: StreamId,
    /// Other streams that used it (`record_stream`).
    uses: Vec<StreamId>,
    /// The capture every use was recorded in (`None`: a use was recorded by
    /// a stream not capturing, or in another capture, or none yet).
    uses_captured_in: Option<u64>,
}

/// A block freed during a capture while other streams used it.
#[derive(Debug, Clone)]
struct Deferred {
    addr: u64,
    live: Live,
    /// Where every stream that used it stood in the capture at the free
    /// (`None`: a use lies outside the capture's graph).
    stood: Option<(u64, Vec<GraphNode>)>,
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
    deferred: Vec<Deferred>,
    /// The live blocks by allocation id: where each starts.
    owners: HashMap<u64, u64>,
    /// The last allocation id given (ids start at 1).
    last_id: u64,
}

impl Shadow {
    /// The engine handed out `a`.
    pub fn allocated(&mut self, e: &mut SimEngine, a: Allocation) -> Result<(), String> {
        let (start, end) = (a.addr, a.addr + a.size);
        if !start.is_multiple_of(BLOCK_ALIGN) {
            return Err(format!(
                "block {start:#x}+{} is not aligned to {BLOCK_ALIGN} bytes",
                a.size
            ));
        }
        self.check_unowned(e.memory(), start, end)?;
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
        let mut deferred = std::mem::take(&mut self.deferred);
        let overlapped = deferred
            .iter()
            .filter(|d| d.addr < end && start < d.live.end);
        for d in overlapped {
            if !ordered_after(e, d, a.stream) {
                return Err(format!(
                    "block {start:#x}+{} on stream {} reuses {:#x}, freed during the capture \
                     while other streams used it, before the graph joined them",
                    a.size, a.stream, d.addr
                ));
            }
        }
        // Reused: the engine forgot its other streams.
        deferred.retain(|d| !(d.addr < end && start < d.live.end));
        self.deferred = deferred;
        let waits = &e.streams().waits;
        for r in self
            .in_use
            .iter()
            .filter(|r| r.start < end && start < r.end)
        {
            for &(stream, marker) in &r.markers {
                // The using stream's own new work is queued after its old
                // (a block lent back to a stream that used it before).
                let own = stream == a.stream;
                let waited = waits.iter().any(|&(waiter, ev, on)| {
                    waiter == a.stream && on == stream && ev.id() > marker.id()
                });
                if !own && !waited {
                    return Err(format!(
                        "block {start:#x}+{} on stream {} reuses {:#x}..{:#x} while stream \
                         {stream} may still use it",
                        a.size, a.stream, r.start, r.end
                    ));
                }
            }
        }
        self.last_id += 1;
        let id = self.last_id;
        for w in pattern_words(start, end) {
            e.memory_mut()
                .write(w, pattern(id, w))
                .map_err(|err| format!("block {start:#x}+{}: {err}", a.size))?;
        }
        self.owners.insert(id, start);
        self.live.insert(
            start,
            Live {
                end,
                id,
                stream: a.stream,
                uses: Vec::new(),
                uses_captured_in: None,
            },
        );
        Ok(())
    }

    /// `record_stream(addr, stream)` succeeded.
    pub fn recorded(&mut self, e: &mut SimEngine, addr: u64, stream: StreamId) {
        let capture = capture_of(e, stream);
        if let Some(l) = self.live.get_mut(&addr) {
            if stream == l.stream {
                return;
            }
            l.uses_captured_in = match (l.uses.is_empty(), capture) {
                (true, c) => c,
                (false, c) if c == l.uses_captured_in => c,
                _ => None,
            };
            if !l.uses.contains(&stream) {
                l.uses.push(stream);
            }
        }
    }

    /// The block at `addr` is about to be freed (`capturing`: during a
    /// capture): its pattern must be intact; other streams that used it
    /// may run on.
    pub fn freeing(&mut self, e: &mut SimEngine, addr: u64, capturing: bool) -> Result<(), String> {
        let Some(l) = self.live.remove(&addr) else {
            return Ok(());
        };
        self.owners.remove(&l.id);
        check_pattern(e.memory(), addr, &l)?;
        if l.uses.is_empty() {
            return Ok(());
        }
        if capturing {
            let stood = l.uses_captured_in.and_then(|c| {
                let mut nodes = Vec::new();
                for &s in std::iter::once(&l.stream).chain(&l.uses) {
                    let f = e.streams_mut().capture().frontier(s).unwrap()?;
                    if f.capture != c {
                        return None;
                    }
                    nodes.extend(f.nodes);
                }
                Some((c, nodes))
            });
            self.deferred.push(Deferred {
                addr,
                live: l,
                stood,
            });
            return Ok(());
        }
        self.mark(e, addr, l);
        Ok(())
    }

    /// Fails when a word of `[start, end)` holds the pattern of a live
    /// allocation: the bytes still belong to it.
    fn check_unowned(&self, memory: &SimDataMemory, start: u64, end: u64) -> Result<(), String> {
        for (w, word) in memory.written(start, end) {
            let Some(id) = writer(w, word) else { continue };
            if let Some(&owner) = self.owners.get(&id) {
                return Err(format!(
                    "block {start:#x}+{} handed out over the word at {w:#x}, which holds \
                     the pattern of allocation #{id}, live at {owner:#x}",
                    end - start
                ));
            }
        }
        Ok(())
    }

    /// The capture is about to end: the frees made during it get their
    /// markers now (the engine records its events as the capture ends),
    /// except those the graph orders before their stream's next work: no
    /// eager work of theirs needs waiting for.
    pub fn capture_ending(&mut self, e: &mut SimEngine) {
        for d in std::mem::take(&mut self.deferred) {
            if !ordered_after(e, &d, d.live.stream) {
                self.mark(e, d.addr, d.live);
            }
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

/// Where the pattern of the block `[start, end)` goes: its first and last
/// two words, and the first word of every [`PATTERN_STRIDE`] inside it.
fn pattern_words(start: u64, end: u64) -> BTreeSet<u64> {
    const W: u64 = SimDataMemory::WORD;
    let first = start.div_ceil(W) * W;
    let last = (end / W * W).saturating_sub(W);
    let mut words: BTreeSet<u64> = [first, first + W, last.saturating_sub(W), last]
        .into_iter()
        .filter(|&w| start <= w && w + W <= end)
        .collect();
    let mut page = start.div_ceil(PATTERN_STRIDE) * PATTERN_STRIDE;
    while page + W <= end {
        words.insert(page);
        page += PATTERN_STRIDE;
    }
    words
}

/// The word written at `addr` for allocation `id`: the id (modulo 2^32)
/// in the high half, a hash of the address and the id in the low half, so
/// that a word read back names its writer and whether it was written there.
fn pattern(id: u64, addr: u64) -> u64 {
    let mut x = addr ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    // splitmix64's finaliser.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    ((id & 0xffff_ffff) << 32) | (x & 0xffff_ffff)
}

/// The allocation whose pattern `word`, read at `addr`, is (`None`: not a
/// pattern written at this address).
fn writer(addr: u64, word: u64) -> Option<u64> {
    let id = word >> 32;
    (pattern(id, addr) == word).then_some(id)
}

/// Fails unless the live block `l` at `addr` still holds its pattern.
fn check_pattern(memory: &SimDataMemory, addr: u64, l: &Live) -> Result<(), String> {
    for w in pattern_words(addr, l.end) {
        let found = memory
            .read(w)
            .map_err(|err| format!("block {addr:#x}: its word at {w:#x}: {err}"))?;
        match found {
            Some(word) if word == pattern(l.id, w) => {}
            Some(word) => {
                let by = writer(w, word).map_or_else(
                    || "with data no block wrote there".to_string(),
                    |id| format!("by allocation #{id}"),
                );
                return Err(format!(
                    "block {addr:#x} (allocation #{}): its word at {w:#x} was overwritten {by}",
                    l.id
                ));
            }
            None => {
                return Err(format!(
                    "block {addr:#x} (allocation #{}): its word at {w:#x} was lost (its memory \
                     went back to the device and was mapped again)",
                    l.id
                ))
            }
        }
    }
    Ok(())
}

/// The capture `stream` takes part in, if any.
fn capture_of(e: &mut SimEngine, stream: StreamId) -> Option<u64> {
    let frontier = e.streams_mut().capture().frontier(stream).unwrap();
    frontier.map(|f| f.capture)
}

/// Whether the capture orders the next work on `stream` after every use
/// of the block freed in `d`.
fn ordered_after(e: &mut SimEngine, d: &Deferred, stream: StreamId) -> bool {
    let Some((capture, stood)) = &d.stood else {
        return false;
    };
    let graph = e.streams_mut().capture();
    let Some(now) = graph.frontier(stream).unwrap() else {
        return false;
    };
    now.capture == *capture
        && stood
            .iter()
            .all(|&m| now.nodes.iter().any(|&n| graph.precedes(m, n)))
}
