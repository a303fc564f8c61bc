//! Stream ordering: when a block that other streams used (`record_stream`)
//! may be reused. It owns the event queues (`event_queues.rs`), the frees
//! deferred by captures (`capture_reuse.rs`) and the two options that
//! reuse such blocks early: stream-wait reuse (the allocating stream waits
//! on the block's events) and `graph_capture_record_stream_reuse` (the
//! capture's graph already orders the uses).
//!
//! The part knows blocks by id and reads the heap; giving a block back to
//! the cache (the policy's index, free pages) is the engine's: every call
//! that may finish a block's events pushes it to `done`, in order.

use std::collections::BTreeSet;

use smallvec::SmallVec;

use super::capture_reuse::CaptureFrees;
use super::event_queues::{EventQueues, Users};
use super::live_table::LiveTable;
use crate::backend::StreamBackend;
use crate::error::{AllocError, BackendError};
use crate::heap::{BlockState, Heap};
use crate::policy::Request;
use crate::types::{BlockId, StreamId};

/// Stream ordering of one engine (`E`: the stream backend's event).
pub(super) struct StreamOrder<E> {
    /// Other streams that used allocated blocks, and the events freed
    /// blocks await.
    events: EventQueues<E>,
    /// Addresses freed during a capture while other streams used them:
    /// their events are recorded once no capture is underway, unless the
    /// capture's graph lets them be reused before.
    capture_frees: CaptureFrees,
    /// Reuse blocks awaiting events by making the allocating stream wait.
    stream_wait_reuse: bool,
    /// Reuse blocks freed during a capture once its graph orders their uses.
    capture_reuse: bool,
}

impl<E> StreamOrder<E> {
    /// Empty, with the options `stream_wait_reuse` and
    /// `graph_capture_record_stream_reuse` (`capture_reuse`).
    pub(super) fn new(stream_wait_reuse: bool, capture_reuse: bool) -> Self {
        StreamOrder {
            events: EventQueues::default(),
            capture_frees: CaptureFrees::default(),
            stream_wait_reuse,
            capture_reuse,
        }
    }

    /// Takes the options changed at run time (from the next decision on).
    pub(super) fn set_options(&mut self, stream_wait_reuse: bool, capture_reuse: bool) {
        self.stream_wait_reuse = stream_wait_reuse;
        self.capture_reuse = capture_reuse;
    }

    /// Whether an allocation may have stream order to settle first: events
    /// to poll (unless a capture is underway, which the settling asks), or
    /// frees deferred by a capture that its graph may have ordered.
    #[inline]
    pub(super) fn due_at_malloc(&self) -> bool {
        self.events.any_awaiting() || self.capture_frees.has_markers()
    }

    /// Whether events are to be polled (none while `capturing`).
    #[inline]
    pub(super) fn due_poll(&self, capturing: bool) -> bool {
        self.events.any_awaiting() && !capturing
    }

    /// Whether a free during a capture (`capturing`) may have to be
    /// deferred: some block has other streams' uses.
    #[inline]
    pub(super) fn may_defer_free(&self, capturing: bool) -> bool {
        capturing && self.events.any_users()
    }

    /// Whether stream-wait reuse may hand a block awaiting events over now
    /// (never while `capturing`).
    #[inline]
    pub(super) fn may_hand_over(&self, capturing: bool) -> bool {
        self.stream_wait_reuse && self.events.any_awaiting() && !capturing
    }

    /// The other streams that used `id`, taken at its free (`None`: none).
    #[inline]
    pub(super) fn take_users(&mut self, id: BlockId) -> Option<Users> {
        self.events.take_users(id)
    }

    /// Whether other streams used the allocated block `id`.
    pub(super) fn has_users(&self, id: BlockId) -> bool {
        self.events.has_users(id)
    }

    /// Number of blocks awaiting events.
    pub(super) fn awaiting_len(&self) -> usize {
        self.events.awaiting_len()
    }

    /// The blocks awaiting events with their outstanding counts, and every
    /// block an event (recorded or still to record) names: for `validate`.
    pub(super) fn awaited(
        &self,
    ) -> (
        &rustc_hash::FxHashMap<BlockId, u32>,
        impl Iterator<Item = BlockId> + '_,
    ) {
        let named = self
            .events
            .pending()
            .map(|(_, block, _)| block)
            .chain(self.events.unrecorded_blocks());
        (self.events.awaiting(), named)
    }

    /// Every stream the engine may still use: the stream of every segment
    /// of `heap` and every stream recorded on a live block.
    pub(super) fn streams_in_use(&self, heap: &Heap) -> BTreeSet<StreamId> {
        let segments = heap.segments().map(|(_, seg)| seg.stream);
        let recorded = self
            .events
            .users()
            .flat_map(|(_, users)| users.iter().copied());
        segments.chain(recorded).collect()
    }

    /// The streams recorded on the blocks `mine` picks.
    pub(super) fn users_of_blocks(&self, mine: impl Fn(BlockId) -> bool) -> Vec<StreamId> {
        let mut others = Vec::new();
        for (id, users) in self.events.users() {
            if mine(id) {
                others.extend(users.iter().copied());
            }
        }
        others
    }

    /// Every deferred free, in free order, once the last capture ended.
    pub(super) fn end_captures(&mut self) -> Vec<u64> {
        self.capture_frees.take_all()
    }
}

impl<E> StreamOrder<E> {
    /// `record_stream`: the live block `id` of `heap` is used on `stream`
    /// too; `capturing`: a capture is underway, whose graph may order the
    /// use. A block freed during the capture is a double free.
    pub(super) fn record_use<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        heap: &Heap,
        id: BlockId,
        addr: u64,
        stream: StreamId,
        capturing: bool,
    ) -> Result<(), AllocError> {
        if self.capture_frees.is_deferred(addr) {
            // Freed during a capture, its events still to be recorded.
            return Err(AllocError::DoubleFree { addr });
        }
        if heap.block(id).stream == stream {
            return Ok(());
        }
        let first = self.events.record_use(id, stream);
        let graph = if self.capture_reuse && capturing {
            streams.capture_graph()
        } else {
            None
        };
        self.capture_frees.note_use_on(graph, id, stream, first);
        Ok(())
    }

    /// A free during a capture of a block other streams used: recording
    /// events on them would put the events in the graph, so the decision
    /// waits for the capture's end (or for the graph to join those
    /// streams). `None` when `addr` is not such a block.
    pub(super) fn defer_capture_free<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        heap: &Heap,
        live: &LiveTable,
        addr: u64,
    ) -> Option<Result<(), AllocError>> {
        let id = live.get(addr).filter(|&id| self.events.has_users(id))?;
        if self.capture_frees.is_deferred(addr) {
            return Some(Err(AllocError::DoubleFree { addr }));
        }
        let stream = heap.block(id).stream;
        let users: Users = self.events.users_of(id).into();
        let markers = if self.capture_reuse {
            streams
                .capture_graph()
                .and_then(|g| self.capture_frees.markers(g, id, stream, &users))
        } else {
            None
        };
        self.capture_frees.defer(addr, markers);
        Some(Ok(()))
    }

    /// The block `id` of `heap`, freed while `users` used it, awaits events
    /// recorded on them now.
    pub(super) fn await_freed<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        heap: &mut Heap,
        id: BlockId,
        users: Users,
    ) -> Result<(), BackendError> {
        self.capture_frees.forget(id);
        heap.set_state(id, BlockState::AwaitingEvents, 0);
        self.events.await_users(streams, id, users)
    }

    /// Polls the recorded events; blocks whose events all completed go to
    /// `done`.
    pub(super) fn poll<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        done: &mut Vec<BlockId>,
    ) -> Result<(), BackendError> {
        self.events.poll(streams, done)
    }

    /// Waits for every outstanding event on the host; their blocks go to
    /// `done`.
    pub(super) fn synchronize<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        done: &mut Vec<BlockId>,
    ) -> Result<(), BackendError> {
        self.events.synchronize(streams, done)
    }

    /// Waits on the host for the events of the freed blocks `mine` picks
    /// (events a free could not record are recorded first), telling
    /// `waited` each stream as its event is done. The events complete in
    /// order: the next poll gives their blocks back.
    pub(super) fn synchronize_blocks<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        mine: impl Fn(BlockId) -> bool,
        mut waited: impl FnMut(StreamId),
    ) -> Result<(), BackendError> {
        self.events.record_missing(streams)?;
        for (stream, block, event) in self.events.pending() {
            if mine(block) {
                streams.synchronize(event)?;
                waited(stream);
            }
        }
        Ok(())
    }

    /// Before an allocation on `stream` during a capture: the blocks of
    /// `stream` freed during the capture whose markers its frontier has
    /// joined leave `live` and go to `done`, their other streams' work
    /// ordered before anything queued on `stream` from now on.
    pub(super) fn reuse_joined_frees<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        live: &mut LiveTable,
        stream: StreamId,
        done: &mut Vec<BlockId>,
    ) {
        if !(self.capture_reuse && self.capture_frees.has_markers()) {
            return;
        }
        let Some(graph) = streams.capture_graph() else {
            return;
        };
        // A graph that cannot be read leaves the blocks deferred: waiting
        // for the capture's end is always safe.
        let joined = self
            .capture_frees
            .take_joined(graph, stream)
            .unwrap_or_default();
        for addr in joined {
            let id = live.remove(addr).expect("a deferred free is live");
            self.events.take_users(id);
            self.capture_frees.forget(id);
            done.push(id);
        }
    }

    /// Stream-wait reuse: hands blocks of `heap` still awaiting events on
    /// other streams to `req`'s stream by making it wait on those events.
    /// Prefers the smallest single block that fits; otherwise converts
    /// every awaiting block of the stream and pool so merges can make room.
    /// The blocks handed over go to `done`; returns whether any was chosen.
    pub(super) fn hand_over<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        heap: &Heap,
        req: &Request,
        done: &mut Vec<BlockId>,
    ) -> Result<bool, BackendError> {
        let candidates: SmallVec<[BlockId; 8]> = self
            .events
            .awaiting()
            .keys()
            .copied()
            .filter(|&id| {
                let b = heap.block(id);
                b.key() == req.key && b.pool == req.pool
            })
            .collect();
        let best = candidates
            .iter()
            .copied()
            .filter(|&id| heap.block(id).size >= req.size)
            .min_by_key(|&id| (heap.block(id).size, heap.block(id).addr));
        let chosen: SmallVec<[BlockId; 8]> = match best {
            Some(id) => SmallVec::from_slice(&[id]),
            None => candidates,
        };
        for &block in &chosen {
            self.events
                .hand_over(streams, block, req.key.stream, done)?;
        }
        Ok(!chosen.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimEvent, SimStreams};
    use crate::types::{CacheKey, Pool, MIB};

    /// A heap with one segment on stream 1 cut into live blocks of `sizes`.
    fn heap_of(sizes: &[u64], live: &mut LiveTable) -> (Heap, Vec<BlockId>) {
        let mut heap = Heap::new(u64::MAX);
        let key = CacheKey {
            stream: StreamId(1),
            private_pool: None,
        };
        let sizes: Vec<(u64, bool)> = sizes.iter().map(|&s| (s, true)).collect();
        let (_, ids) = heap.add_cut_segment(0x1000_0000, key, &sizes);
        for &id in &ids {
            live.insert(heap.block(id).addr, id);
        }
        (heap, ids)
    }

    fn free<S: StreamBackend<Event = SimEvent>>(
        order: &mut StreamOrder<SimEvent>,
        streams: &mut S,
        heap: &mut Heap,
        live: &mut LiveTable,
        id: BlockId,
    ) {
        live.remove(heap.block(id).addr);
        let users = order.take_users(id).expect("used elsewhere");
        order.await_freed(streams, heap, id, users).unwrap();
    }

    #[test]
    fn a_block_used_elsewhere_awaits_that_streams_event_then_polls_free() {
        let (mut streams, mut live) = (SimStreams::new(), LiveTable::default());
        let (mut heap, ids) = heap_of(&[MIB, MIB], &mut live);
        let mut order = StreamOrder::new(false, false);
        let (a, b) = (ids[0], ids[1]);
        order
            .record_use(
                &mut streams,
                &heap,
                a,
                heap.block(a).addr,
                StreamId(2),
                false,
            )
            .unwrap();
        order
            .record_use(
                &mut streams,
                &heap,
                b,
                heap.block(b).addr,
                StreamId(1),
                false,
            )
            .unwrap();
        assert!(
            order.has_users(a) && !order.has_users(b),
            "its own stream is no use"
        );
        let in_use: Vec<_> = order.streams_in_use(&heap).into_iter().collect();
        assert_eq!(in_use, [StreamId(1), StreamId(2)]);
        assert_eq!(order.users_of_blocks(|id| id == a), [StreamId(2)]);
        assert!(!order.due_at_malloc());
        free(&mut order, &mut streams, &mut heap, &mut live, a);
        assert_eq!(heap.block(a).state, BlockState::AwaitingEvents);
        assert!(order.due_at_malloc() && !order.due_poll(true));
        let mut done = Vec::new();
        order.poll(&mut streams, &mut done).unwrap();
        assert!(done.is_empty(), "stream 2 still runs");
        streams.complete_stream(StreamId(2));
        order.poll(&mut streams, &mut done).unwrap();
        assert_eq!(done, [a]);
        assert_eq!(order.awaiting_len(), 0);
    }

    #[test]
    fn stream_wait_reuse_hands_over_the_smallest_fitting_block_else_all() {
        let (mut streams, mut live) = (SimStreams::new(), LiveTable::default());
        let (mut heap, ids) = heap_of(&[4 * MIB, 2 * MIB, 3 * MIB], &mut live);
        let mut order = StreamOrder::new(true, false);
        for &id in &ids {
            let addr = heap.block(id).addr;
            order
                .record_use(&mut streams, &heap, id, addr, StreamId(2), false)
                .unwrap();
            free(&mut order, &mut streams, &mut heap, &mut live, id);
        }
        assert!(order.may_hand_over(false) && !order.may_hand_over(true));
        let key = heap.block(ids[0]).key();
        let req = |size| Request {
            requested: size,
            size,
            pool: Pool::Large,
            key,
        };
        let mut done = Vec::new();
        assert!(order
            .hand_over(&mut streams, &heap, &req(3 * MIB), &mut done)
            .unwrap());
        assert_eq!(done, [ids[2]], "3 MiB is the smallest that fits");
        done.clear();
        assert!(order
            .hand_over(&mut streams, &heap, &req(8 * MIB), &mut done)
            .unwrap());
        done.sort();
        let mut rest = vec![ids[0], ids[1]];
        rest.sort();
        assert_eq!(done, rest, "none fits: every one, for merges");
        assert!(!order
            .hand_over(&mut streams, &heap, &req(MIB), &mut done)
            .unwrap());
        let other = StreamOrder::<SimEvent>::new(false, false);
        assert!(!other.may_hand_over(false), "the option is off");
    }

    #[test]
    fn a_free_during_a_capture_waits_for_its_end_and_is_freed_once() {
        let (mut streams, mut live) = (SimStreams::new(), LiveTable::default());
        let (heap, ids) = heap_of(&[MIB], &mut live);
        let mut order = StreamOrder::new(false, true);
        let (a, addr) = (ids[0], heap.block(ids[0]).addr);
        order
            .record_use(&mut streams, &heap, a, addr, StreamId(2), false)
            .unwrap();
        assert!(order.may_defer_free(true) && !order.may_defer_free(false));
        let deferred = order.defer_capture_free(&mut streams, &heap, &live, addr);
        assert!(matches!(deferred, Some(Ok(()))));
        assert!(order.capture_frees.is_deferred(addr));
        assert!(!order.due_at_malloc(), "an eager use: no markers");
        let again = order.defer_capture_free(&mut streams, &heap, &live, addr);
        assert!(matches!(again, Some(Err(AllocError::DoubleFree { .. }))));
        let recorded = order.record_use(&mut streams, &heap, a, addr, StreamId(3), true);
        assert!(matches!(recorded, Err(AllocError::DoubleFree { .. })));
        assert_eq!(order.end_captures(), [addr]);
        assert!(!order.capture_frees.is_deferred(addr));
    }

    #[test]
    fn a_free_during_a_capture_is_reused_once_the_graph_joins_its_uses() {
        let (mut streams, mut live) = (SimStreams::new(), LiveTable::default());
        let (heap, ids) = heap_of(&[MIB], &mut live);
        let mut order = StreamOrder::new(false, true);
        let (a, addr) = (ids[0], heap.block(ids[0]).addr);
        let (s1, s2) = (StreamId(1), StreamId(2));
        streams.capture().begin(s1);
        streams.capture().launch(s1).unwrap();
        streams.capture().wait_stream(s2, s1);
        streams.capture().launch(s2).unwrap();
        order
            .record_use(&mut streams, &heap, a, addr, s2, true)
            .unwrap();
        assert!(order
            .defer_capture_free(&mut streams, &heap, &live, addr)
            .is_some());
        assert!(order.due_at_malloc(), "markers to join");
        let mut done = Vec::new();
        order.reuse_joined_frees(&mut streams, &mut live, s1, &mut done);
        assert!(done.is_empty(), "stream 1 does not follow stream 2 yet");
        streams.capture().wait_stream(s1, s2);
        order.reuse_joined_frees(&mut streams, &mut live, s1, &mut done);
        assert_eq!(done, [a]);
        assert!(live.get(addr).is_none() && !order.has_users(a));
        assert!(!order.due_at_malloc());
    }
}
