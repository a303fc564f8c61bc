//! A simulated device: address bookkeeping without memory, and streams whose
//! events complete when the test (or replay) says so, with CUDA graph
//! captures whose forks and joins the test drives (`SimCapture`).

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rustc_hash::FxHashMap;

mod capture;
pub mod data;

use crate::backend::{DetachPages, MemoryBackend, StreamBackend, VirtualMemory};
use crate::capture::CaptureGraph;
use crate::error::BackendError;
use crate::page_layout::{PageLayout, RangePages};
use crate::types::StreamId;
pub use capture::SimCapture;

/// Address alignment and spacing of simulated segments (the driver's 2 MiB
/// granularity).
const SIM_ALIGN: u64 = 2 << 20;
/// First simulated address: a typical CUDA device address.
const SIM_BASE: u64 = 0x7f00_0000_0000;
/// Where addresses go once the recorded addresses are used up or abandoned: above
/// any address a 49-bit device address space hands out.
const UNRECORDED_BASE: u64 = 0x2_0000_0000_0000;

/// A device that hands out addresses only. Never touches memory.
#[derive(Debug, Clone)]
pub struct SimMemory {
    capacity: u64,
    used: u64,
    next_addr: u64,
    live: BTreeMap<u64, u64>,
    /// Recorded (size, address) of segments, handed out in order.
    recorded: VecDeque<(u64, u64)>,
    /// Reserved address ranges: start -> (size, pages).
    ranges: BTreeMap<u64, (u64, PageLayout)>,
    /// Mapped chunks (granularity-sized) inside reserved ranges.
    chunks: BTreeSet<u64>,
    /// Chunks still mapped whose memory was detached to a later map.
    detached: BTreeSet<u64>,
    /// Bytes other processes hold on the device.
    elsewhere: u64,
    /// Number of successful `allocate` calls.
    pub allocs: u64,
    /// Number of successful `free` calls.
    pub frees: u64,
    /// Number of device free-memory queries (`free_bytes`, `cuMemGetInfo`
    /// on a GPU: a driver call worth avoiding on the hot path).
    free_queries: Cell<u64>,
}

impl SimMemory {
    /// A device with `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        SimMemory {
            capacity,
            used: 0,
            next_addr: SIM_BASE,
            live: BTreeMap::new(),
            recorded: VecDeque::new(),
            ranges: BTreeMap::new(),
            chunks: BTreeSet::new(),
            detached: BTreeSet::new(),
            elsewhere: 0,
            allocs: 0,
            frees: 0,
            free_queries: Cell::new(0),
        }
    }

    /// A device that hands out the addresses a real device gave a recording:
    /// segment `i` gets `recorded[i]`'s address when its size matches. Best fit
    /// breaks ties by lowest address, so reproducing a recording exactly needs
    /// the real address order (the CUDA driver does not hand out ascending
    /// addresses). At the first mismatch the recording is abandoned and addresses
    /// come from a range no recording uses.
    pub fn with_recorded_addresses(
        capacity: u64,
        recorded: impl IntoIterator<Item = (u64, u64)>,
    ) -> Self {
        SimMemory {
            recorded: recorded.into_iter().collect(),
            next_addr: UNRECORDED_BASE,
            ..SimMemory::new(capacity)
        }
    }

    /// Bytes currently allocated from the device.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// How often the device's free memory was asked for so far.
    pub fn free_queries(&self) -> u64 {
        self.free_queries.get()
    }

    /// Another process now holds `bytes` of the device (as `cuMemGetInfo`
    /// would then report): allocations and mappings fail where they would
    /// not fit beside it, and [`MemoryBackend::free_bytes`] counts it.
    pub fn set_used_elsewhere(&mut self, bytes: u64) {
        self.elsewhere = bytes;
    }

    /// Bytes neither this allocator nor another process holds.
    fn available(&self) -> u64 {
        self.capacity
            .saturating_sub(self.used)
            .saturating_sub(self.elsewhere)
    }

    /// Whether `[addr, addr + size)` is memory the device can use now: inside
    /// one allocated segment, or made of mapped pages of a reserved range
    /// (not pages whose memory was detached to another address).
    pub fn is_accessible(&self, addr: u64, size: u64) -> bool {
        let in_segment = self
            .live
            .range(..=addr)
            .next_back()
            .is_some_and(|(&start, &len)| addr + size <= start + len);
        if in_segment {
            return true;
        }
        let first = addr - addr % SIM_ALIGN;
        let end = (addr + size).div_ceil(SIM_ALIGN) * SIM_ALIGN;
        size > 0 && chunks_of(first, end - first).all(|c| self.chunks.contains(&c))
    }

    /// The recorded address for a segment of `size`, if there is one and
    /// it is free. A recording comes from a file: an address whose segment
    /// would reach into the fallback range (or past the end of the address
    /// space) abandons the recording like any other mismatch.
    fn recorded_address(&mut self, size: u64) -> Option<u64> {
        let &(want, addr) = self.recorded.front()?;
        let clear = |(&start, &len): (&u64, &u64)| start + len <= addr;
        let free = want == size
            && addr
                .checked_add(size)
                .filter(|&end| end <= UNRECORDED_BASE)
                .is_some_and(|end| self.live.range(..end).next_back().is_none_or(clear));
        if free {
            self.recorded.pop_front();
            Some(addr)
        } else {
            self.recorded.clear();
            None
        }
    }
}

impl MemoryBackend for SimMemory {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        if size == 0 || size > self.available() {
            return Err(BackendError::OutOfMemory);
        }
        let addr = match self.recorded_address(size) {
            Some(addr) => addr,
            None => {
                let addr = self.next_addr;
                // Leave a gap so that no two segments are address neighbours:
                // the engine must never merge across segments.
                self.next_addr = size
                    .div_ceil(SIM_ALIGN)
                    .checked_mul(SIM_ALIGN)
                    .and_then(|s| s.checked_add(SIM_ALIGN))
                    .and_then(|s| s.checked_add(addr))
                    .ok_or(BackendError::OutOfMemory)?;
                addr
            }
        };
        self.used += size;
        self.live.insert(addr, size);
        self.allocs += 1;
        Ok(addr)
    }

    fn free(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        match self.live.remove(&addr) {
            Some(s) if s == size => {
                self.used -= size;
                self.frees += 1;
                Ok(())
            }
            Some(s) => {
                self.live.insert(addr, s);
                Err(BackendError::Other(format!(
                    "simulated free of {addr:#x} with size {size}, allocated with {s}"
                )))
            }
            None => Err(BackendError::Other(format!(
                "simulated free of unknown segment {addr:#x}"
            ))),
        }
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn free_bytes(&self) -> u64 {
        self.free_queries.set(self.free_queries.get() + 1);
        self.available()
    }

    fn virtual_memory(&mut self) -> Option<&mut dyn VirtualMemory> {
        Some(self)
    }
}

impl VirtualMemory for SimMemory {
    fn granularity(&self) -> u64 {
        SIM_ALIGN
    }

    fn reserve(&mut self, size: u64, pages: PageLayout) -> Result<u64, BackendError> {
        let page = pages.largest();
        if !pages.smallest().is_power_of_two()
            || pages.smallest() < SIM_ALIGN
            || size == 0
            || !size.is_multiple_of(page)
        {
            return Err(BackendError::Other(format!(
                "reserve of {size} bytes in pages of {pages}: not whole power-of-two pages \
                 of at least the granularity"
            )));
        }
        // Address space runs out as memory does: a typed error, no overflow.
        let exhausted = || BackendError::Other("simulated address space exhausted".into());
        let addr = self
            .next_addr
            .div_ceil(page)
            .checked_mul(page)
            .ok_or_else(exhausted)?;
        self.next_addr = addr
            .checked_add(size)
            .and_then(|end| end.checked_add(SIM_ALIGN))
            .ok_or_else(exhausted)?;
        self.ranges.insert(addr, (size, pages));
        Ok(addr)
    }

    fn map(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.check_range(addr, size)?;
        if chunks_of(addr, size).any(|c| self.chunks.contains(&c) || self.detached.contains(&c)) {
            return Err(BackendError::Other(format!(
                "map over mapped memory at {addr:#x}"
            )));
        }
        if size > self.available() {
            return Err(BackendError::OutOfMemory);
        }
        self.chunks.extend(chunks_of(addr, size));
        self.used += size;
        self.allocs += 1;
        Ok(())
    }

    fn unmap(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.take_mapped(addr, size)?;
        self.used -= size;
        self.frees += 1;
        Ok(())
    }

    fn release(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        if self.ranges.get(&addr).map(|r| r.0) != Some(size) {
            return Err(BackendError::Other(format!(
                "release of unknown range {addr:#x}"
            )));
        }
        if self.chunks.range(addr..addr + size).next().is_some()
            || self.detached.range(addr..addr + size).next().is_some()
        {
            return Err(BackendError::Other(format!(
                "release of range {addr:#x} with memory mapped"
            )));
        }
        self.ranges.remove(&addr);
        Ok(())
    }

    fn detach_pages(&mut self) -> Option<&mut dyn DetachPages> {
        Some(self)
    }
}

impl DetachPages for SimMemory {
    fn detach(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.take_mapped(addr, size)?;
        // The memory goes to the next map (counted free until then); the
        // address range stays taken until `unmap_detached`.
        self.detached.extend(chunks_of(addr, size));
        self.used -= size;
        self.frees += 1;
        Ok(())
    }

    fn unmap_detached(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.check_range(addr, size)?;
        if !take_chunks(&mut self.detached, addr, size) {
            return Err(BackendError::Other(format!(
                "unmap_detached of memory not detached at {addr:#x}"
            )));
        }
        Ok(())
    }
}

/// The granularity-sized chunks of `[addr, addr + size)`.
fn chunks_of(addr: u64, size: u64) -> impl Iterator<Item = u64> {
    (addr..addr + size).step_by(SIM_ALIGN as usize)
}

/// Removes the chunks of `[addr, addr + size)` from `set` if all are in it;
/// otherwise removes nothing and returns false.
fn take_chunks(set: &mut BTreeSet<u64>, addr: u64, size: u64) -> bool {
    if !chunks_of(addr, size).all(|c| set.contains(&c)) {
        return false;
    }
    for c in chunks_of(addr, size) {
        set.remove(&c);
    }
    true
}

impl SimMemory {
    /// Removes the chunks of `[addr, addr + size)` from the mapped ones;
    /// all must be mapped.
    fn take_mapped(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.check_range(addr, size)?;
        if !take_chunks(&mut self.chunks, addr, size) {
            return Err(BackendError::Other(format!(
                "unmap of unmapped memory at {addr:#x}"
            )));
        }
        Ok(())
    }

    fn check_range(&self, addr: u64, size: u64) -> Result<(), BackendError> {
        let pages = self
            .ranges
            .range(..=addr)
            .next_back()
            .filter(|(&start, &(len, _))| {
                addr.checked_add(size).is_some_and(|end| end <= start + len)
            })
            .map(|(&base, &(_, layout))| RangePages { base, layout });
        if !pages.is_some_and(|p| p.is_whole(addr, size)) {
            return Err(BackendError::Other(format!(
                "mapping [{addr:#x}, +{size}) is not whole pages of a reserved range"
            )));
        }
        Ok(())
    }
}

/// Handle of a simulated event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimEvent(u64);

impl SimEvent {
    /// Its id: events recorded later have larger ids.
    pub fn id(self) -> u64 {
        self.0
    }
}

#[derive(Debug, Clone)]
struct SimEventState {
    stream: StreamId,
    /// Host clock when it was recorded (see [`SimStreams::with_gpu_lag`]).
    at: u64,
}

/// A stream with events outstanding: how many, and the id through which
/// its events were completed (a stream runs its work in order, so one
/// watermark stands for every event before it: completing is not a scan
/// of every outstanding event).
#[derive(Debug, Clone, Copy, Default)]
struct StreamDone {
    outstanding: usize,
    through: u64,
}

/// Simulated streams: every recorded event stays pending until completed by
/// [`SimStreams::complete`], [`SimStreams::complete_stream`] or
/// [`SimStreams::complete_all`] (or a host synchronize), or, with a GPU lag
/// ([`SimStreams::with_gpu_lag`]), once the simulated GPU has caught up with
/// the moment it was recorded. A stream made to wait on an event not yet
/// complete runs no further than the wait until that event completes.
#[derive(Debug, Clone, Default)]
pub struct SimStreams {
    next: u64,
    /// The events recorded and not released. Fx-hashed: a replay with many
    /// streams (a pseudo stream for each free that completes late) queries
    /// one event a stream on every operation, and SipHash was half its time.
    /// Nothing iterates these maps, so their order decides nothing.
    events: FxHashMap<u64, SimEventState>,
    /// Per stream with events outstanding (forgotten with its last event).
    done: FxHashMap<StreamId, StreamDone>,
    /// Every event up to this id is complete ([`SimStreams::complete_all`]).
    all_through: u64,
    /// Every wait the engine asked for, in order: `(waiting stream, event,
    /// the stream the event was recorded on)`.
    pub waits: Vec<(StreamId, SimEvent, StreamId)>,
    /// Number of host synchronizations.
    pub synchronizations: u64,
    /// Events recorded and not yet released.
    pub outstanding: usize,
    /// Host clock: [`SimStreams::tick`]s so far.
    clock: u64,
    /// With a GPU lag: how many ticks the GPU runs behind the host.
    lag: Option<u64>,
    /// With a GPU lag: the host clock up to which the GPU has run the work
    /// (`None`: nothing yet).
    gpu_at: Option<u64>,
    /// CUDA graph captures on these streams.
    capture: SimCapture,
    /// Waits on events not complete when they were made, until those are.
    waits_pending: Vec<PendingWait>,
    /// Per stream, the id through which [`SimStreams::complete`] and
    /// [`SimStreams::complete_stream`] completed its events, kept after
    /// they are released (a pending wait may name one that is gone).
    ran_through: FxHashMap<StreamId, u64>,
}

/// A wait made on an event not yet complete: a stream runs no further than
/// such a wait, so its events recorded after it complete only once the
/// waited one has (a host synchronize on them completes it too), as on a
/// GPU.
#[derive(Debug, Clone, Copy)]
struct PendingWait {
    /// The stream made to wait.
    waiter: StreamId,
    /// The last event id when the wait was made: the waiter's later events
    /// follow it.
    after: u64,
    /// The waited event's stream, id and host clock.
    on: StreamId,
    event: u64,
    at: u64,
}

impl SimStreams {
    /// No events yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Streams whose GPU runs `lag` ticks behind the host (a tick is one
    /// host operation, e.g. one replayed allocation or free): an event
    /// completes once the host clock has passed its recording by `lag`
    /// ticks, or once the host synchronized on it or on a later event (the
    /// GPU then ran everything queued before it, and falls behind again).
    /// Models a GPU that the host runs ahead of, as in training.
    pub fn with_gpu_lag(lag: u64) -> Self {
        SimStreams {
            lag: Some(lag),
            ..Self::default()
        }
    }

    /// Advances the host clock by one operation.
    pub fn tick(&mut self) {
        self.clock += 1;
        if let Some(done) = self.lag.and_then(|lag| self.clock.checked_sub(lag)) {
            self.gpu_at = self.gpu_at.max(Some(done));
        }
    }

    /// Completes one event, and with it every earlier event of its stream
    /// (a stream runs its work in order).
    pub fn complete(&mut self, event: SimEvent) {
        let Some(stream) = self.events.get(&event.0).map(|e| e.stream) else {
            return;
        };
        self.ran_to(stream, event.0);
    }

    /// Completes every event recorded on `stream` (the stream ran dry), up
    /// to a wait on an event not yet complete.
    pub fn complete_stream(&mut self, stream: StreamId) {
        self.ran_to(stream, self.next);
    }

    /// Completes the events that event `id` of `stream` waits for, and
    /// theirs (a host synchronize on it waits for them).
    fn run_waited(&mut self, stream: StreamId, id: u64) {
        let waited: Vec<PendingWait> = self
            .waits_pending
            .iter()
            .copied()
            .filter(|w| w.waiter == stream && w.after < id)
            .collect();
        for w in waited {
            self.run_waited(w.on, w.event);
            self.ran_to(w.on, w.event);
        }
    }

    /// `stream` ran through event `id`.
    fn ran_to(&mut self, stream: StreamId, id: u64) {
        if let Some(d) = self.done.get_mut(&stream) {
            d.through = d.through.max(id);
        }
        let ran = self.ran_through.entry(stream).or_default();
        *ran = (*ran).max(id);
        let pending = std::mem::take(&mut self.waits_pending);
        self.waits_pending = pending
            .iter()
            .copied()
            .filter(|w| !self.wait_done(w, &pending))
            .collect();
    }

    /// Whether the event `w` waits on is complete (by the calls above, or
    /// the GPU lag), its own stream's earlier pending waits included.
    fn wait_done(&self, w: &PendingWait, pending: &[PendingWait]) -> bool {
        let ran = w.event <= self.all_through
            || self.ran_through.get(&w.on).is_some_and(|&r| w.event <= r);
        self.gpu_passed(w.at) || (ran && self.waits_done(w.on, w.event, pending))
    }

    /// Whether every pending wait that event `id` of `stream` follows is
    /// done.
    fn waits_done(&self, stream: StreamId, id: u64, pending: &[PendingWait]) -> bool {
        pending
            .iter()
            .filter(|w| w.waiter == stream && w.after < id)
            .all(|w| self.wait_done(w, pending))
    }

    /// With a GPU lag: whether the simulated GPU has run the work queued
    /// up to host clock `at`.
    fn gpu_passed(&self, at: u64) -> bool {
        self.gpu_at.is_some_and(|g| at <= g)
    }

    /// Completes every event.
    pub fn complete_all(&mut self) {
        self.all_through = self.next;
        self.waits_pending.clear();
    }

    /// Whether the event `id` (of `e`) was completed by the calls above or
    /// a host synchronize (the GPU lag aside).
    fn completed(&self, id: u64, e: &SimEventState) -> bool {
        let ran = self.done.get(&e.stream).is_some_and(|d| id <= d.through);
        id <= self.all_through || (ran && self.waits_done(e.stream, id, &self.waits_pending))
    }

    /// Pending (recorded, not complete, not released) events.
    pub fn pending(&self) -> usize {
        self.events
            .iter()
            .filter(|&(&id, e)| !self.completed(id, e))
            .count()
    }

    /// The CUDA graph captures on these streams: begin one, queue kernels,
    /// fork and join streams.
    pub fn capture(&mut self) -> &mut SimCapture {
        &mut self.capture
    }
}

impl StreamBackend for SimStreams {
    type Event = SimEvent;

    fn record(&mut self, stream: StreamId) -> Result<SimEvent, BackendError> {
        self.next += 1;
        self.events.insert(
            self.next,
            SimEventState {
                stream,
                at: self.clock,
            },
        );
        self.done.entry(stream).or_default().outstanding += 1;
        self.outstanding += 1;
        Ok(SimEvent(self.next))
    }

    fn is_complete(&mut self, event: &SimEvent) -> Result<bool, BackendError> {
        self.events
            .get(&event.0)
            .map(|e| self.completed(event.0, e) || self.gpu_passed(e.at))
            .ok_or_else(|| BackendError::Other(format!("query of released event {}", event.0)))
    }

    fn synchronize(&mut self, event: &SimEvent) -> Result<(), BackendError> {
        self.synchronizations += 1;
        // The host waits for what the event's work waited for as well.
        if let Some(stream) = self.events.get(&event.0).map(|e| e.stream) {
            self.run_waited(stream, event.0);
        }
        self.complete(*event);
        if self.lag.is_some() {
            if let Some(e) = self.events.get(&event.0) {
                self.gpu_at = self.gpu_at.max(Some(e.at));
            }
        }
        Ok(())
    }

    fn make_stream_wait(&mut self, stream: StreamId, event: &SimEvent) -> Result<(), BackendError> {
        let (recorded_on, at) = self
            .events
            .get(&event.0)
            .map(|e| (e.stream, e.at))
            .ok_or_else(|| BackendError::Other(format!("wait on released event {}", event.0)))?;
        self.waits.push((stream, *event, recorded_on));
        if !self.is_complete(event)? {
            self.waits_pending.push(PendingWait {
                waiter: stream,
                after: self.next,
                on: recorded_on,
                event: event.0,
                at,
            });
        }
        Ok(())
    }

    fn release(&mut self, event: SimEvent) {
        if let Some(e) = self.events.remove(&event.0) {
            self.outstanding -= 1;
            if let Some(d) = self.done.get_mut(&e.stream) {
                d.outstanding -= 1;
                if d.outstanding == 0 {
                    // Later events have larger ids: its watermark is moot.
                    self.done.remove(&e.stream);
                }
            }
        }
    }

    fn capture_graph(&mut self) -> Option<&mut dyn CaptureGraph> {
        Some(&mut self.capture)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_runs_no_further_than_a_wait_on_work_not_done() {
        let (a, b) = (StreamId(1), StreamId(2));
        let mut s = SimStreams::new();
        let on_b = s.record(b).unwrap();
        let before = s.record(a).unwrap();
        s.make_stream_wait(a, &on_b).unwrap();
        s.release(on_b); // the wait outlives the event, as the engine's do
        let after = s.record(a).unwrap();
        s.complete_stream(a);
        assert!(s.is_complete(&before).unwrap(), "queued before the wait");
        assert!(!s.is_complete(&after).unwrap(), "b has not run its work");
        s.complete_stream(b);
        assert!(s.is_complete(&after).unwrap());
        // A host synchronize on the later event waits for the waited one.
        let on_b = s.record(b).unwrap();
        s.make_stream_wait(a, &on_b).unwrap();
        let later = s.record(a).unwrap();
        s.synchronize(&later).unwrap();
        assert!(s.is_complete(&on_b).unwrap() && s.is_complete(&later).unwrap());
        // A wait on work already done holds nothing back.
        s.make_stream_wait(a, &on_b).unwrap();
        let last = s.record(a).unwrap();
        s.complete_stream(a);
        assert!(s.is_complete(&last).unwrap());
    }

    #[test]
    fn memory_respects_capacity_and_checks_frees() {
        let mut m = SimMemory::new(10 << 20);
        let a = m.allocate(6 << 20).unwrap();
        assert_eq!(m.allocate(6 << 20), Err(BackendError::OutOfMemory));
        let b = m.allocate(4 << 20).unwrap();
        assert!(b >= a + (6 << 20));
        assert!(m.free(a, 1).is_err());
        m.free(a, 6 << 20).unwrap();
        assert!(m.free(a, 6 << 20).is_err());
        assert_eq!(m.free_bytes(), 6 << 20);
        assert_eq!((m.allocs, m.frees), (2, 1));
    }

    #[test]
    fn recorded_addresses_are_followed_then_abandoned() {
        let mut m = SimMemory::with_recorded_addresses(
            1 << 30,
            [
                (4 << 20, 0x9000_0000),
                (2 << 20, 0x8000_0000),
                (2 << 20, 0x7000_0000),
            ],
        );
        assert_eq!(m.allocate(4 << 20), Ok(0x9000_0000));
        assert_eq!(m.allocate(2 << 20), Ok(0x8000_0000));
        // Size mismatch: the recording is abandoned.
        let other = m.allocate(6 << 20).unwrap();
        assert!(other >= UNRECORDED_BASE);
        assert!(m.allocate(2 << 20).unwrap() >= UNRECORDED_BASE);
        // A recorded address that overlaps a live segment is not used.
        let mut m = SimMemory::with_recorded_addresses(
            1 << 30,
            [(4 << 20, 0x9000_0000), (2 << 20, 0x9020_0000)],
        );
        m.allocate(4 << 20).unwrap();
        assert!(m.allocate(2 << 20).unwrap() >= UNRECORDED_BASE);
    }

    #[test]
    fn addresses_from_a_corrupt_recording_are_abandoned() {
        // A segment address at the top of the address space overflowed: a
        // corrupt trace's replay panicked.
        let mut m = SimMemory::with_recorded_addresses(1 << 30, [(2 << 20, u64::MAX)]);
        assert!(m.allocate(2 << 20).unwrap() >= UNRECORDED_BASE);
        // One in the fallback range would collide with fallback segments.
        let mut m = SimMemory::with_recorded_addresses(1 << 30, [(2 << 20, UNRECORDED_BASE)]);
        let recorded_there = m.allocate(2 << 20).unwrap();
        let next = m.allocate(2 << 20).unwrap();
        assert_ne!(recorded_there, next);
        assert!(recorded_there >= UNRECORDED_BASE && next > recorded_there);
    }

    #[test]
    fn growable_ranges_map_and_unmap_chunks() {
        let mut m = SimMemory::new(10 << 20);
        assert!(
            m.reserve(64 << 20, PageLayout::uniform(3 << 20)).is_err(),
            "page not a power of two"
        );
        assert!(
            m.reserve(60 << 20, PageLayout::uniform(8 << 20)).is_err(),
            "not whole pages"
        );
        let big = m.reserve(64 << 20, PageLayout::uniform(8 << 20)).unwrap();
        assert!(big.is_multiple_of(8 << 20), "aligned to its page");
        assert!(m.map(big, 2 << 20).is_err(), "part of a page");
        m.release(big, 64 << 20).unwrap();
        let r = m.reserve(64 << 20, PageLayout::uniform(2 << 20)).unwrap();
        assert_eq!(m.used(), 0);
        m.map(r, 4 << 20).unwrap();
        assert!(m.map(r + (2 << 20), 2 << 20).is_err(), "double map");
        assert!(m.map(r + 1, 2 << 20).is_err(), "unaligned");
        assert!(m.map(r + (62 << 20), 4 << 20).is_err(), "outside the range");
        assert_eq!(
            m.map(r + (4 << 20), 8 << 20),
            Err(BackendError::OutOfMemory)
        );
        assert!(m.release(r, 64 << 20).is_err(), "still mapped");
        m.unmap(r + (2 << 20), 2 << 20).unwrap();
        m.unmap(r, 2 << 20).unwrap();
        assert_eq!(m.used(), 0);
        m.release(r, 64 << 20).unwrap();
    }

    #[test]
    fn a_lagging_gpu_completes_events_lag_ticks_later_or_at_a_sync() {
        let mut s = SimStreams::with_gpu_lag(3);
        let e1 = s.record(StreamId(0)).unwrap();
        s.tick();
        let e2 = s.record(StreamId(0)).unwrap();
        s.tick();
        assert!(!s.is_complete(&e1).unwrap(), "2 ticks behind a lag of 3");
        s.tick();
        assert!(s.is_complete(&e1).unwrap());
        assert!(!s.is_complete(&e2).unwrap());
        let e3 = s.record(StreamId(0)).unwrap();
        s.synchronize(&e3).unwrap();
        assert!(
            s.is_complete(&e2).unwrap(),
            "a sync runs everything before it"
        );
        s.tick();
        let e4 = s.record(StreamId(0)).unwrap();
        s.tick();
        assert!(
            !s.is_complete(&e4).unwrap(),
            "then the GPU falls behind again"
        );
        let mut keeps_up = SimStreams::with_gpu_lag(0);
        let e = keeps_up.record(StreamId(0)).unwrap();
        keeps_up.tick();
        assert!(keeps_up.is_complete(&e).unwrap());
        let mut never = SimStreams::new();
        let e = never.record(StreamId(0)).unwrap();
        for _ in 0..100 {
            never.tick();
        }
        assert!(!never.is_complete(&e).unwrap(), "no lag: only on command");
    }

    #[test]
    fn events_complete_on_command() {
        let mut s = SimStreams::new();
        let e1 = s.record(StreamId(1)).unwrap();
        let e2 = s.record(StreamId(2)).unwrap();
        assert!(!s.is_complete(&e1).unwrap());
        s.complete_stream(StreamId(1));
        assert!(s.is_complete(&e1).unwrap());
        assert!(!s.is_complete(&e2).unwrap());
        s.release(e1);
        assert!(s.is_complete(&e1).is_err());
        assert_eq!(s.outstanding, 1);
    }

    #[test]
    fn completing_an_event_completes_the_earlier_ones_of_its_stream_only() {
        let mut s = SimStreams::new();
        let a: Vec<SimEvent> = (0..3).map(|_| s.record(StreamId(1)).unwrap()).collect();
        let b = s.record(StreamId(2)).unwrap();
        let late = s.record(StreamId(1)).unwrap();
        s.complete(a[1]);
        let done: Vec<bool> = a.iter().map(|e| s.is_complete(e).unwrap()).collect();
        assert_eq!(done, [true, true, false]);
        assert!(!s.is_complete(&b).unwrap() && !s.is_complete(&late).unwrap());
        assert_eq!(s.pending(), 3);
        s.complete_all();
        assert_eq!(s.pending(), 0);
        let after = s.record(StreamId(2)).unwrap();
        assert!(!s.is_complete(&after).unwrap(), "recorded after");
        // A stream's record goes with its last event: a later event of it
        // is pending again.
        for e in a.into_iter().chain([late]) {
            s.release(e);
        }
        assert!(!s.done.contains_key(&StreamId(1)), "stream 1 forgotten");
        let again = s.record(StreamId(1)).unwrap();
        assert!(!s.is_complete(&again).unwrap());
        s.complete_stream(StreamId(1));
        assert!(s.is_complete(&again).unwrap() && !s.is_complete(&after).unwrap());
    }
}
