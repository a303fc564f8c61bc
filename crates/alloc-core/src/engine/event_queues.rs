//! `record_stream`: which streams other than its own used an allocated
//! block, and for a block freed while they may still run, the events
//! recorded on them, queued per stream in recording order. The block is
//! reusable once every one of its events has completed, been waited for on
//! the host, or been made the wait of the stream that takes it.
//!
//! The queues know blocks by id only; handing a block back to the cache is
//! the engine's: every call that may finish a block's events returns it in
//! `done`, in the order its last event was consumed.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::backend::StreamBackend;
use crate::error::BackendError;
use crate::types::{BlockId, StreamId};

/// The streams other than its own that used one block.
pub(super) type Users = SmallVec<[StreamId; 2]>;

/// An event recorded when a block used on another stream was freed.
struct PendingEvent<E> {
    /// `None` once consumed by a stream wait.
    event: Option<E>,
    block: BlockId,
}

/// Events of one stream, in recording order (they complete in that order).
struct StreamQueue<E> {
    stream: StreamId,
    events: VecDeque<PendingEvent<E>>,
}

/// Streams that used allocated blocks, and events that freed blocks await
/// (`E`: the stream backend's event).
pub(super) struct EventQueues<E> {
    /// Extra streams that used an allocated block (`record_stream`).
    users: FxHashMap<BlockId, Users>,
    /// Outstanding event count of each block awaiting events (the events
    /// still to record included).
    awaiting: FxHashMap<BlockId, u32>,
    /// The streams with events queued, in the order of their first event;
    /// a queue that runs dry goes, so that their number follows the streams
    /// with events outstanding, not every stream ever used.
    queues: Vec<StreamQueue<E>>,
    /// The position of each stream's queue in `queues`.
    queue_at: FxHashMap<StreamId, usize>,
    /// Events a free could not record (the driver failed): the block
    /// awaits them too, and they are recorded at the next poll, host wait
    /// or hand-over. An event recorded later covers more of the stream's
    /// work, never less, so the block is never reused early.
    unrecorded: Vec<(BlockId, StreamId)>,
}

impl<E> Default for EventQueues<E> {
    fn default() -> Self {
        EventQueues {
            users: FxHashMap::default(),
            awaiting: FxHashMap::default(),
            queues: Vec::new(),
            queue_at: FxHashMap::default(),
            unrecorded: Vec::new(),
        }
    }
}

impl<E> EventQueues<E> {
    /// `stream` used the allocated `block` too (once counts); returns
    /// whether it is the block's first other stream.
    pub(super) fn record_use(&mut self, block: BlockId, stream: StreamId) -> bool {
        let users = self.users.entry(block).or_default();
        let first = users.is_empty();
        if !users.contains(&stream) {
            users.push(stream);
        }
        first
    }

    /// The other streams that used the allocated `block` (none if none did).
    pub(super) fn users_of(&self, block: BlockId) -> &[StreamId] {
        self.users.get(&block).map_or(&[], |users| users.as_slice())
    }

    /// Whether any allocated block was used by another stream.
    #[inline]
    pub(super) fn any_users(&self) -> bool {
        !self.users.is_empty()
    }

    /// Whether another stream used the allocated `block`.
    #[inline]
    pub(super) fn has_users(&self, block: BlockId) -> bool {
        self.any_users() && self.users.contains_key(&block)
    }

    /// The allocated blocks used by other streams, with those streams.
    pub(super) fn users(&self) -> impl Iterator<Item = (BlockId, &[StreamId])> + '_ {
        self.users.iter().map(|(&id, users)| (id, users.as_slice()))
    }

    /// Forgets and returns the other streams that used `block` (it is being
    /// freed).
    #[inline]
    pub(super) fn take_users(&mut self, block: BlockId) -> Option<Users> {
        if self.any_users() {
            self.users.remove(&block)
        } else {
            None
        }
    }

    /// Whether any block awaits events.
    #[inline]
    pub(super) fn any_awaiting(&self) -> bool {
        !self.awaiting.is_empty()
    }

    /// Number of blocks awaiting events.
    pub(super) fn awaiting_len(&self) -> usize {
        self.awaiting.len()
    }

    /// The blocks awaiting events, with their outstanding event counts.
    pub(super) fn awaiting(&self) -> &FxHashMap<BlockId, u32> {
        &self.awaiting
    }

    /// Every queued event not yet consumed: its stream, its block, itself.
    pub(super) fn pending(&self) -> impl Iterator<Item = (StreamId, BlockId, &E)> + '_ {
        self.queues.iter().flat_map(|q| {
            q.events
                .iter()
                .filter_map(move |e| e.event.as_ref().map(|ev| (q.stream, e.block, ev)))
        })
    }

    /// The freed `block` awaits the work queued so far on each of `users`:
    /// an event is recorded on each and queued. If recording fails, the
    /// block awaits the events recorded until then and those still to
    /// record, which later calls record ([`EventQueues::record_missing`]):
    /// it is never reused while the others run, and not lost either.
    pub(super) fn await_users<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        block: BlockId,
        users: Users,
    ) -> Result<(), BackendError> {
        let mut result = Ok(());
        for &stream in &users {
            if result.is_err() {
                self.unrecorded.push((block, stream));
                continue;
            }
            match streams.record(stream) {
                Ok(event) => self.queue_of(stream).push_back(PendingEvent {
                    event: Some(event),
                    block,
                }),
                Err(e) => {
                    self.unrecorded.push((block, stream));
                    result = Err(e);
                }
            }
        }
        self.awaiting.insert(block, users.len() as u32);
        result
    }

    /// Records the events that frees could not record; those that fail
    /// again stay for the next call, and the first failure is returned.
    pub(super) fn record_missing<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
    ) -> Result<(), BackendError> {
        if self.unrecorded.is_empty() {
            return Ok(());
        }
        self.record_missing_now(streams)
    }

    #[cold]
    #[inline(never)]
    fn record_missing_now<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
    ) -> Result<(), BackendError> {
        let mut result = Ok(());
        for (block, stream) in std::mem::take(&mut self.unrecorded) {
            match result.is_ok().then(|| streams.record(stream)) {
                Some(Ok(event)) => self.queue_of(stream).push_back(PendingEvent {
                    event: Some(event),
                    block,
                }),
                Some(Err(e)) => {
                    result = Err(e);
                    self.unrecorded.push((block, stream));
                }
                None => self.unrecorded.push((block, stream)),
            }
        }
        result
    }

    /// The block of every event still to record, once per event.
    pub(super) fn unrecorded_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.unrecorded.iter().map(|&(block, _)| block)
    }

    /// The queue of `stream`, made on first use.
    fn queue_of(&mut self, stream: StreamId) -> &mut VecDeque<PendingEvent<E>> {
        let queues = &mut self.queues;
        let i = *self.queue_at.entry(stream).or_insert_with(|| {
            queues.push(StreamQueue {
                stream,
                events: VecDeque::new(),
            });
            queues.len() - 1
        });
        &mut self.queues[i].events
    }

    /// Drops the queues that ran dry (their order kept). Called by the
    /// walks over every queue, which pay for it.
    fn drop_empty_queues(&mut self) {
        if self.queues.iter().all(|q| !q.events.is_empty()) {
            return;
        }
        self.queues.retain(|q| !q.events.is_empty());
        self.queue_at.clear();
        for (i, q) in self.queues.iter().enumerate() {
            self.queue_at.insert(q.stream, i);
        }
    }

    /// Number of streams with events queued.
    #[cfg(test)]
    fn queued_streams(&self) -> usize {
        self.queues.len()
    }

    /// One event of `block` was consumed; pushes it to `done` if it was the
    /// last.
    fn event_done(&mut self, block: BlockId, done: &mut Vec<BlockId>) {
        let left = self.awaiting.get_mut(&block).expect("awaiting block");
        *left -= 1;
        if *left == 0 {
            self.awaiting.remove(&block);
            done.push(block);
        }
    }

    /// Takes every completed event off the front of its stream's queue
    /// (later ones cannot have completed before it).
    pub(super) fn poll<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        done: &mut Vec<BlockId>,
    ) -> Result<(), BackendError> {
        // A failure is left to the next poll: the completed events of the
        // other blocks are still taken.
        let _ = self.record_missing(streams);
        for qi in 0..self.queues.len() {
            while let Some(front) = self.queues[qi].events.front() {
                if let Some(ev) = &front.event {
                    if !streams.is_complete(ev)? {
                        break;
                    }
                }
                let entry = self.queues[qi].events.pop_front().expect("front exists");
                if let Some(ev) = entry.event {
                    streams.release(ev);
                    self.event_done(entry.block, done);
                }
            }
        }
        self.drop_empty_queues();
        Ok(())
    }

    /// Waits on the host for every queued event (those still to record
    /// are recorded first).
    pub(super) fn synchronize<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        done: &mut Vec<BlockId>,
    ) -> Result<(), BackendError> {
        let recorded = self.record_missing(streams);
        for qi in 0..self.queues.len() {
            while let Some(entry) = self.queues[qi].events.pop_front() {
                let Some(ev) = entry.event else { continue };
                if let Err(e) = streams.synchronize(&ev) {
                    self.queues[qi].events.push_front(PendingEvent {
                        event: Some(ev),
                        block: entry.block,
                    });
                    return Err(e);
                }
                streams.release(ev);
                self.event_done(entry.block, done);
            }
        }
        self.drop_empty_queues();
        recorded
    }

    /// Hands `block` to `waiter` without a host wait: `waiter` waits on
    /// each of the block's queued events, which are consumed (their queue
    /// entries stay until the stream's earlier events are polled).
    pub(super) fn hand_over<S: StreamBackend<Event = E>>(
        &mut self,
        streams: &mut S,
        block: BlockId,
        waiter: StreamId,
        done: &mut Vec<BlockId>,
    ) -> Result<(), BackendError> {
        // Every event of the block must exist for `waiter` to wait on it.
        self.record_missing(streams)?;
        for qi in 0..self.queues.len() {
            for ei in 0..self.queues[qi].events.len() {
                let entry = &mut self.queues[qi].events[ei];
                if entry.block != block {
                    continue;
                }
                if let Some(ev) = entry.event.take() {
                    if let Err(e) = streams.make_stream_wait(waiter, &ev) {
                        self.queues[qi].events[ei].event = Some(ev);
                        return Err(e);
                    }
                    streams.release(ev);
                    self.event_done(block, done);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimEvent, SimStreams};

    fn block(n: usize) -> BlockId {
        BlockId::from_index(n)
    }

    const A: StreamId = StreamId(1);
    const B: StreamId = StreamId(2);
    const C: StreamId = StreamId(3);

    /// Frees `b` after `users` used it.
    fn free(q: &mut EventQueues<SimEvent>, s: &mut SimStreams, b: BlockId, users: &[StreamId]) {
        for &u in users {
            q.record_use(b, u);
        }
        let users = q.take_users(b).expect("used elsewhere");
        q.await_users(s, b, users).unwrap();
    }

    #[test]
    fn a_block_is_done_once_every_stream_that_used_it_is() {
        let (mut q, mut s) = (EventQueues::default(), SimStreams::new());
        assert!(q.record_use(block(1), A), "its first other stream");
        assert!(!q.record_use(block(1), A));
        assert!(q.has_users(block(1)) && !q.has_users(block(2)));
        assert_eq!(q.users_of(block(1)), &[A], "once");
        assert!(q.users_of(block(2)).is_empty());
        assert_eq!(q.users().count(), 1);
        free(&mut q, &mut s, block(1), &[B]);
        assert!(!q.any_users());
        assert_eq!(q.awaiting().get(&block(1)), Some(&2));
        assert_eq!(q.pending().count(), 2);
        let mut done = Vec::new();
        q.poll(&mut s, &mut done).unwrap();
        assert!(done.is_empty(), "nothing completed");
        s.complete_stream(A);
        q.poll(&mut s, &mut done).unwrap();
        assert!(done.is_empty(), "B may still run");
        assert_eq!(q.awaiting().get(&block(1)), Some(&1));
        s.complete_stream(B);
        q.poll(&mut s, &mut done).unwrap();
        assert_eq!(done, vec![block(1)]);
        assert!(!q.any_awaiting() && q.pending().next().is_none());
        assert_eq!(s.outstanding, 0, "events go back to the backend");
    }

    #[test]
    fn queues_that_run_dry_are_forgotten() {
        let (mut q, mut s) = (EventQueues::default(), SimStreams::new());
        // A block per fresh stream, as a stream made per use leaves them.
        for n in 1..=1000 {
            free(&mut q, &mut s, block(n), &[StreamId(n as u64)]);
        }
        assert_eq!(q.queued_streams(), 1000);
        let mut done = Vec::new();
        for n in 1..=998 {
            s.complete_stream(StreamId(n));
        }
        q.poll(&mut s, &mut done).unwrap();
        assert_eq!(done.len(), 998);
        assert_eq!(q.queued_streams(), 2, "the two streams still running");
        // A stream used again after its queue went gets a new one, found
        // by later frees.
        free(&mut q, &mut s, block(2000), &[StreamId(5)]);
        free(&mut q, &mut s, block(2001), &[StreamId(999)]);
        assert_eq!(q.queued_streams(), 3);
        assert_eq!(q.pending().filter(|p| p.0 == StreamId(999)).count(), 2);
        q.synchronize(&mut s, &mut done).unwrap();
        assert_eq!(q.queued_streams(), 0);
        assert_eq!(done.len(), 1002);
        assert!(!q.any_awaiting());
    }

    #[test]
    fn a_stream_queue_is_polled_in_recording_order() {
        let (mut q, mut s) = (EventQueues::default(), SimStreams::new());
        free(&mut q, &mut s, block(1), &[A]);
        free(&mut q, &mut s, block(2), &[A]);
        free(&mut q, &mut s, block(3), &[C]);
        let second = *q.pending().nth(1).unwrap().2;
        s.complete(second); // completes the first too: A runs in order
        let mut done = Vec::new();
        q.poll(&mut s, &mut done).unwrap();
        assert_eq!(done, vec![block(1), block(2)]);
        assert_eq!(q.awaiting_len(), 1);
        q.synchronize(&mut s, &mut done).unwrap();
        assert_eq!(done, vec![block(1), block(2), block(3)]);
        assert_eq!(s.synchronizations, 1);
    }

    #[test]
    fn a_hand_over_makes_the_taker_wait_instead_of_the_host() {
        let (mut q, mut s) = (EventQueues::default(), SimStreams::new());
        free(&mut q, &mut s, block(1), &[A, B]);
        free(&mut q, &mut s, block(2), &[A]);
        let mut done = Vec::new();
        q.hand_over(&mut s, block(2), C, &mut done).unwrap();
        assert_eq!(done, vec![block(2)]);
        assert_eq!(s.waits.len(), 1);
        assert_eq!((s.waits[0].0, s.waits[0].2), (C, A), "C waits on A's event");
        assert_eq!(q.pending().count(), 2, "block 1's events stay");
        // The consumed entry stays queued behind block 1's event on A and
        // is skipped once that one completes.
        s.complete_stream(A);
        s.complete_stream(B);
        q.poll(&mut s, &mut done).unwrap();
        assert_eq!(done, vec![block(2), block(1)]);
        assert_eq!(s.synchronizations, 0, "the host never waited");
    }

    /// Streams whose `record` fails on one stream.
    /// Recording on the stream named fails (none: the driver works).
    struct FailingOn(SimStreams, Option<StreamId>);

    impl StreamBackend for FailingOn {
        type Event = SimEvent;
        fn record(&mut self, stream: StreamId) -> Result<SimEvent, BackendError> {
            if Some(stream) == self.1 {
                return Err(BackendError::Other("record failed".into()));
            }
            self.0.record(stream)
        }
        fn is_complete(&mut self, event: &SimEvent) -> Result<bool, BackendError> {
            self.0.is_complete(event)
        }
        fn synchronize(&mut self, event: &SimEvent) -> Result<(), BackendError> {
            self.0.synchronize(event)
        }
        fn make_stream_wait(&mut self, s: StreamId, e: &SimEvent) -> Result<(), BackendError> {
            self.0.make_stream_wait(s, e)
        }
        fn release(&mut self, event: SimEvent) {
            self.0.release(event)
        }
    }

    #[test]
    fn a_failed_record_is_recorded_later_and_the_block_awaits_it() {
        let mut q = EventQueues::default();
        let mut s = FailingOn(SimStreams::new(), Some(B));
        let users: Users = [A, B, C].into_iter().collect();
        assert!(q.await_users(&mut s, block(1), users).is_err());
        assert_eq!(q.awaiting().get(&block(1)), Some(&3), "every stream's");
        assert_eq!(q.unrecorded_blocks().count(), 2, "B's and C's to record");
        let mut done = Vec::new();
        s.0.complete_stream(A);
        q.poll(&mut s, &mut done).unwrap();
        assert!(done.is_empty(), "not reused while B or C may run");
        assert_eq!(q.unrecorded_blocks().count(), 2, "B still fails");
        s.1 = None; // the driver works again
        q.poll(&mut s, &mut done).unwrap();
        assert_eq!(q.unrecorded_blocks().count(), 0);
        assert!(done.is_empty(), "B's and C's new events are pending");
        s.0.complete_stream(B);
        s.0.complete_stream(C);
        q.poll(&mut s, &mut done).unwrap();
        assert_eq!(done, vec![block(1)]);
    }

    #[test]
    fn a_host_wait_records_what_was_missing_first() {
        let mut q = EventQueues::default();
        let mut s = FailingOn(SimStreams::new(), Some(A));
        let users: Users = [A].into_iter().collect();
        assert!(q.await_users(&mut s, block(2), users).is_err());
        let mut done = Vec::new();
        assert!(q.synchronize(&mut s, &mut done).is_err(), "A still fails");
        assert!(done.is_empty());
        s.1 = None;
        q.synchronize(&mut s, &mut done).unwrap();
        assert_eq!(done, vec![block(2)]);
        assert!(!q.any_awaiting());
    }
}
