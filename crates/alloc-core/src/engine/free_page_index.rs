//! Which growable segments may hold free mapped pages (`unmap_free_pages`).
//!
//! There is one growable segment per stream and pool, and a program that
//! makes a stream per use has as many as it ever made. Unmapping free pages
//! before the heap grows used to walk every one of them each time; this
//! index names the few where a walk can find something, so that the cost of
//! a growth follows the segments with free pages, not the streams seen.
//!
//! A segment enters when a block in it becomes free or pages are mapped in
//! it (the pages a mapping leaves beyond its block, or under a split's
//! remainder, are free ones), and leaves when a walk finds no free mapped
//! page in it, or when it goes back to the device. Entering is cheap and
//! may be spurious; leaving happens only on evidence, so that no segment
//! with free mapped pages is ever missing.
//!
//! A segment whose free mapped pages are all busy on the GPU, and whose
//! stream has as many marks outstanding as it may, gains nothing from a
//! walk that does not wait: no page to unmap, no mark to record. Such a
//! segment is *parked* until something can change that: a free or a
//! mapping in it, its oldest mark completing, a host wait on its stream, a
//! mapping on its own stream (which may take its busy pages), or a walk
//! that waits. Parked segments are kept in the order their oldest marks
//! were recorded, the order in which a GPU the host runs ahead of
//! completes them, so that a walk polls the oldest few rather than all.

use std::collections::BTreeMap;

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use super::growable::SegmentKey;
use crate::types::StreamId;

/// The growable segments that may hold free mapped pages, those parked
/// until their busy pages may be idle, and a count of the segments the
/// walks visited.
#[derive(Debug, Default)]
pub(super) struct FreePageIndex {
    keys: FxHashSet<SegmentKey>,
    parked: Parked,
    /// Segments handed to walks so far (what a walk costs, for tests that
    /// bound the work rather than the time).
    visited: u64,
    /// Marks recorded so far (their numbers, in recording order).
    marks: u64,
    /// Segments listed so far (see [`Visits`]).
    listed: u64,
    /// The segment noted last, while it stays listed: every free notes its
    /// segment, and one free after another mostly lands in the same one,
    /// which then costs a compare instead of a hash-set insert.
    last_noted: Option<SegmentKey>,
}

/// Parked segments, by the number of the mark whose completion wakes them
/// and by stream.
#[derive(Debug, Default)]
struct Parked {
    /// By the number of the oldest outstanding mark of each.
    by_mark: BTreeMap<u64, SegmentKey>,
    /// The mark number of each.
    mark_of: FxHashMap<SegmentKey, u64>,
    /// By stream.
    by_stream: FxHashMap<StreamId, SmallVec<[SegmentKey; 2]>>,
    /// Where the next turn of polling past the oldest begins.
    cursor: u64,
}

impl Parked {
    /// Parks `key` until the mark numbered `mark` completes.
    fn park(&mut self, key: SegmentKey, mark: u64) {
        if let Some(old) = self.mark_of.insert(key, mark) {
            self.by_mark.remove(&old);
        } else {
            self.by_stream.entry(key.0.stream).or_default().push(key);
        }
        self.by_mark.insert(mark, key);
    }

    /// Takes `key` out; whether it was parked.
    fn unpark(&mut self, key: &SegmentKey) -> bool {
        // Every free notes its segment: with nothing parked (the usual
        // case below a budget), no key is hashed.
        if self.mark_of.is_empty() {
            return false;
        }
        let Some(mark) = self.mark_of.remove(key) else {
            return false;
        };
        self.by_mark.remove(&mark);
        let stream = key.0.stream;
        if let Some(keys) = self.by_stream.get_mut(&stream) {
            keys.retain(|k| k != key);
            if keys.is_empty() {
                self.by_stream.remove(&stream);
            }
        }
        true
    }
}

impl FreePageIndex {
    /// The segment `key` may now hold free mapped pages (and if parked,
    /// pages the GPU is done with).
    #[inline]
    pub(super) fn note(&mut self, key: SegmentKey) {
        // Listed, hence not parked (parking unlists): nothing to do.
        if self.last_noted == Some(key) {
            return;
        }
        self.parked.unpark(&key);
        self.listed += u64::from(self.keys.insert(key));
        self.last_noted = Some(key);
    }

    /// The segment `key` holds no free mapped page (a walk found none), or
    /// is gone.
    pub(super) fn forget(&mut self, key: &SegmentKey) {
        self.parked.unpark(key);
        self.unlist(key);
    }

    /// Takes `key` off the list of segments walks visit.
    fn unlist(&mut self, key: &SegmentKey) {
        if self.last_noted.as_ref() == Some(key) {
            self.last_noted = None;
        }
        self.keys.remove(key);
    }

    /// The segment `key` holds free mapped pages that are all busy, and
    /// nothing a walk does changes that before its oldest mark, numbered
    /// `mark`, completes: walks skip it until it is woken.
    pub(super) fn park(&mut self, key: SegmentKey, mark: u64) {
        self.unlist(&key);
        self.parked.park(key, mark);
    }

    /// Wakes the parked segment `key`: walks visit it again.
    pub(super) fn wake(&mut self, key: &SegmentKey) {
        if self.parked.unpark(key) {
            self.listed += u64::from(self.keys.insert(*key));
        }
    }

    /// Wakes the parked segments of `stream` (the host waited for it, or a
    /// mapping on it may take their busy pages).
    pub(super) fn wake_stream(&mut self, stream: StreamId) {
        let Some(keys) = self.parked.by_stream.get(&stream) else {
            return;
        };
        for key in keys.clone() {
            self.wake(&key);
        }
    }

    /// Wakes every parked segment (a walk that waits for busy pages).
    pub(super) fn wake_all(&mut self) {
        let keys: Vec<SegmentKey> = self.parked.by_mark.values().copied().collect();
        for key in keys {
            self.wake(&key);
        }
    }

    /// Wakes the parked segments that a walk for a mapping on `stream` may
    /// take something from: those of `stream`, then those whose oldest mark
    /// is `done`, polled oldest first (up to the first not done) and one
    /// more in turn past them, for marks that complete out of order.
    pub(super) fn wake_for<E>(
        &mut self,
        stream: StreamId,
        mut done: impl FnMut(&SegmentKey) -> Result<bool, E>,
    ) -> Result<(), E> {
        self.wake_stream(stream);
        while let Some(key) = self.oldest_parked() {
            if !done(&key)? {
                break;
            }
            self.wake(&key);
        }
        if let Some(key) = self.next_parked_in_turn() {
            if done(&key)? {
                self.wake(&key);
            }
        }
        Ok(())
    }

    /// The parked segment whose mark was recorded first: the first to
    /// complete on a GPU the host runs ahead of.
    pub(super) fn oldest_parked(&self) -> Option<SegmentKey> {
        self.parked.by_mark.values().next().copied()
    }

    /// The next parked segment in turn past the oldest (round robin over
    /// them, one a call), for marks that complete out of their recording
    /// order (streams run independently).
    fn next_parked_in_turn(&mut self) -> Option<SegmentKey> {
        let parked = &mut self.parked;
        let (&mark, &key) = parked
            .by_mark
            .range(parked.cursor..)
            .next()
            .or_else(|| parked.by_mark.iter().next())?;
        parked.cursor = mark + 1;
        Some(key)
    }

    /// The number of the next mark recorded (see [`FreePageIndex::park`]).
    pub(super) fn number_mark(&mut self) -> u64 {
        self.marks += 1;
        self.marks
    }

    /// The segments a walk may visit, all of them (tests).
    #[cfg(test)]
    fn to_visit(&self) -> Vec<SegmentKey> {
        let mut visits = Visits::new(self);
        std::iter::from_fn(|| visits.next(self)).collect()
    }

    /// A walk visited one more segment.
    #[inline]
    pub(super) fn count_visit(&mut self) {
        self.visited += 1;
    }

    /// Whether `key` is listed or parked.
    pub(super) fn contains(&self, key: &SegmentKey) -> bool {
        self.keys.contains(key) || self.parked.mark_of.contains_key(key)
    }

    /// Segments handed to walks so far.
    pub(super) fn visited(&self) -> u64 {
        self.visited
    }

    /// Segments parked now.
    pub(super) fn parked(&self) -> usize {
        self.parked.mark_of.len()
    }
}

/// A walk over the listed segments in the index's order, handed out in
/// batches that double, so that a walk that stops early (its budget met)
/// pays for the segments it visited, not for every one listed (at a budget,
/// thousands with idle pages for a growth that needs one).
///
/// While it runs the walk may take segments out of the list (forget, park)
/// but not list any: a hash set keeps the order of its other elements when
/// one goes, so those of the batches handed out that are still listed come
/// first, and the next batch starts past them. The order is the one a walk
/// over a copy of the whole list had.
#[derive(Debug)]
pub(super) struct Visits {
    batch: Vec<SegmentKey>,
    /// Position in `batch` of the next segment.
    next: usize,
    /// Segments handed out before `batch` that are still listed.
    skip: usize,
    /// Size of the next batch.
    size: usize,
    /// [`FreePageIndex::listed`] when the walk began.
    listed: u64,
}

impl Visits {
    /// A walk over what `index` lists now.
    pub(super) fn new(index: &FreePageIndex) -> Self {
        Visits {
            batch: Vec::new(),
            next: 0,
            skip: 0,
            size: 8,
            listed: index.listed,
        }
    }

    /// The next segment to visit, in the order of `index` (the same index
    /// the walk began on).
    pub(super) fn next(&mut self, index: &FreePageIndex) -> Option<SegmentKey> {
        if self.next == self.batch.len() {
            debug_assert_eq!(self.listed, index.listed, "a segment listed during a walk");
            self.skip += self.batch.iter().filter(|k| index.keys.contains(k)).count();
            self.batch.clear();
            let rest = index.keys.iter().skip(self.skip).take(self.size);
            self.batch.extend(rest.copied());
            self.size = self.size.saturating_mul(2);
            self.next = 0;
        }
        let key = *self.batch.get(self.next)?;
        self.next += 1;
        Some(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{CacheKey, Pool, StreamId};

    fn key(stream: u64) -> SegmentKey {
        (
            CacheKey {
                stream: StreamId(stream),
                private_pool: None,
            },
            Pool::Large,
        )
    }

    #[test]
    fn noting_the_last_noted_segment_again_still_follows_parking_and_forgetting() {
        let mut index = FreePageIndex::default();
        index.note(key(1));
        index.note(key(1)); // the short way: already listed
        assert_eq!(index.to_visit(), vec![key(1)]);
        index.park(key(1), 7);
        assert!(index.to_visit().is_empty(), "parked: off the list");
        index.note(key(1)); // must unpark and list it again
        assert_eq!((index.to_visit(), index.parked()), (vec![key(1)], 0));
        index.forget(&key(1));
        assert!(!index.contains(&key(1)));
        index.note(key(1)); // listed again after being forgotten
        assert_eq!(index.to_visit(), vec![key(1)]);
        index.note(key(2));
        index.forget(&key(1)); // another key's removal keeps the last noted listed
        index.note(key(2));
        assert_eq!(index.to_visit(), vec![key(2)]);
    }

    #[test]
    fn walks_visit_the_noted_segments_only_and_count_them() {
        let mut index = FreePageIndex::default();
        for s in 0..1000 {
            index.note(key(s));
        }
        for s in 0..998 {
            index.forget(&key(s));
        }
        index.note(key(999)); // noted twice, listed once
        let mut visit = index.to_visit();
        visit.sort_by_key(|k| k.0.stream.0);
        assert_eq!(visit, vec![key(998), key(999)]);
        assert!(index.contains(&key(998)) && !index.contains(&key(3)));
        assert_eq!(index.visited(), 0);
        index.count_visit();
        index.count_visit();
        assert_eq!(index.visited(), 2);
    }

    #[test]
    fn a_walk_hands_out_the_list_in_its_order_past_what_it_took_out() {
        let mut index = FreePageIndex::default();
        for s in 0..1000 {
            index.note(key(s));
        }
        let order: Vec<SegmentKey> = index.keys.iter().copied().collect();
        // A walk that takes out every other segment it visits, and parks
        // one in three of the rest, sees every segment once, in order.
        let mut visits = Visits::new(&index);
        let mut seen = Vec::new();
        while let Some(k) = visits.next(&index) {
            match seen.len() % 6 {
                0 | 2 | 4 => index.forget(&k),
                1 => index.park(k, seen.len() as u64),
                _ => {}
            }
            seen.push(k);
        }
        assert_eq!(seen, order);
        assert_eq!(index.keys.len(), 333, "two in six stay listed");
        // A walk that stops after two segments was handed a batch, not the
        // list.
        let mut visits = Visits::new(&index);
        let first = [visits.next(&index), visits.next(&index)];
        assert_eq!(visits.batch.len(), 8);
        assert_eq!(first.map(Option::unwrap).to_vec(), index.to_visit()[..2]);
    }

    #[test]
    fn parked_segments_are_skipped_until_woken_and_polled_oldest_first() {
        let mut index = FreePageIndex::default();
        for s in 0..4 {
            index.note(key(s));
        }
        // Parked with marks recorded in the order 3, 1, 2 (stream 0 stays).
        index.park(key(1), 20);
        index.park(key(2), 30);
        index.park(key(3), 10);
        assert_eq!(index.to_visit(), vec![key(0)]);
        assert_eq!(index.parked(), 3);
        assert!(index.contains(&key(3)), "parked segments are still listed");
        assert_eq!(index.oldest_parked(), Some(key(3)));
        // Round robin past the oldest, wrapping around.
        let turns: Vec<_> = (0..4).filter_map(|_| index.next_parked_in_turn()).collect();
        assert_eq!(turns, vec![key(3), key(1), key(2), key(3)]);
        index.park(key(3), 40); // parked again behind a newer mark
        assert_eq!(index.oldest_parked(), Some(key(1)));
        index.wake(&key(1));
        index.note(key(2)); // a free in it
        index.wake_stream(StreamId(3));
        index.wake_stream(StreamId(7)); // none parked
        assert_eq!(index.parked(), 0);
        let mut visit = index.to_visit();
        visit.sort_by_key(|k| k.0.stream.0);
        assert_eq!(visit, vec![key(0), key(1), key(2), key(3)]);
        index.park(key(0), 50);
        index.park(key(1), 51);
        index.forget(&key(1)); // gone: not woken into the list
        assert_eq!(index.parked(), 1);
        index.wake_all();
        assert_eq!(index.parked(), 0);
        assert!(index.contains(&key(0)) && !index.contains(&key(1)));
        assert_eq!(index.oldest_parked(), None);
        assert_eq!(index.next_parked_in_turn(), None);
        assert_eq!((index.number_mark(), index.number_mark()), (1, 2));
    }

    #[test]
    fn a_mapping_wakes_its_stream_then_the_done_oldest_first_and_one_in_turn() {
        let mut index = FreePageIndex::default();
        for s in 0..5 {
            index.note(key(s));
        }
        // Marks recorded in the order of streams 1, 2, 3, 4.
        for s in 1..5 {
            index.park(key(s), s * 10);
        }
        // A mapping on stream 4; streams 1 and 3 are done, 2 is not.
        let mut asked = Vec::new();
        let woke: Result<(), ()> = index.wake_for(StreamId(4), |k| {
            asked.push(k.0.stream.0);
            Ok(k.0.stream.0 != 2)
        });
        woke.unwrap();
        // 4 woken as the mover's; 1 (the oldest) done; 2 stops the run;
        // the turn after the oldest asks 2 again, not done.
        assert_eq!(asked, vec![1, 2, 2]);
        let mut visit = index.to_visit();
        visit.sort_by_key(|k| k.0.stream.0);
        assert_eq!(visit, vec![key(0), key(1), key(4)]);
        assert_eq!(index.parked(), 2);
        // The next call's turn moves on past 2 and finds 3 done.
        index
            .wake_for(StreamId(0), |k| Ok::<_, ()>(k.0.stream.0 != 2))
            .unwrap();
        assert!(index.to_visit().contains(&key(3)));
        assert_eq!(index.parked(), 1);
        // An error from the check stops the walk and reaches the caller.
        assert_eq!(
            index.wake_for(StreamId(0), |_| Err("query failed")),
            Err("query failed")
        );
        assert_eq!(index.parked(), 1);
    }
}
