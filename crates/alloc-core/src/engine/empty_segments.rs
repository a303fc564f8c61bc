//! Growable segments that hold nothing: every page unmapped, no block in
//! use (`unmap_free_pages` moved all their pages elsewhere).
//!
//! A growable segment is kept for its stream until `empty_cache`, with its
//! address range and bookkeeping, so that the stream's next allocation maps
//! pages where its blocks already lie. A program that makes a stream per
//! use leaves one such segment for every stream it ever made. This list
//! names the empty ones in the order they became empty; the engine gives
//! back the oldest once there are more of them than segments in use (and
//! more than [`KEPT_AT_LEAST`]), so that the segments kept follow the
//! streams that hold memory, not every stream seen, at a cost of one
//! release per segment, paid once.
//!
//! An entry may go stale (pages mapped in the segment again, or the segment
//! gone): those say so when their turn comes, and entries are removed on
//! both events, so that the list never holds more than the empty segments.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use super::growable::SegmentKey;

/// Empty segments kept in any case: a program with a few streams (most of
/// them) never gives one back before `empty_cache`, whose decisions are
/// therefore those of a segment kept per stream.
pub(super) const KEPT_AT_LEAST: usize = 64;

/// The growable segments that hold nothing, oldest first.
#[derive(Debug, Default)]
pub(super) struct EmptySegments {
    /// By the order in which they became empty.
    by_age: BTreeMap<u64, SegmentKey>,
    /// The age of each.
    age_of: FxHashMap<SegmentKey, u64>,
    /// Ages handed out so far.
    next: u64,
}

impl EmptySegments {
    /// The segment `key` holds nothing now (a segment listed already keeps
    /// its place).
    pub(super) fn note(&mut self, key: SegmentKey) {
        if self.age_of.contains_key(&key) {
            return;
        }
        self.next += 1;
        self.age_of.insert(key, self.next);
        self.by_age.insert(self.next, key);
    }

    /// The segment `key` holds pages again, or is gone.
    #[inline]
    pub(super) fn remove(&mut self, key: &SegmentKey) {
        if self.age_of.is_empty() {
            return;
        }
        if let Some(age) = self.age_of.remove(key) {
            self.by_age.remove(&age);
        }
    }

    /// Whether more are listed than may be kept beside `held` growable
    /// segments in all (the empty ones included): at most as many as
    /// those in use, or [`KEPT_AT_LEAST`].
    #[inline]
    pub(super) fn too_many(&self, held: usize) -> bool {
        let empty = self.age_of.len();
        empty > KEPT_AT_LEAST && empty > held.saturating_sub(empty)
    }

    /// Takes out the segment that became empty first.
    pub(super) fn pop_oldest(&mut self) -> Option<SegmentKey> {
        let (_, key) = self.by_age.pop_first()?;
        self.age_of.remove(&key);
        Some(key)
    }

    /// Number listed.
    pub(super) fn len(&self) -> usize {
        self.age_of.len()
    }

    /// Whether `key` is listed.
    pub(super) fn contains(&self, key: &SegmentKey) -> bool {
        self.age_of.contains_key(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{CacheKey, Pool, StreamId};

    fn key(stream: u64) -> SegmentKey {
        (CacheKey::shared(StreamId(stream)), Pool::Large)
    }

    #[test]
    fn the_oldest_empty_segment_goes_first_and_mapped_ones_leave() {
        let mut empty = EmptySegments::default();
        for s in [5, 3, 9, 1] {
            empty.note(key(s));
        }
        empty.note(key(5)); // listed already: keeps its place
        empty.remove(&key(3)); // mapped again
        empty.remove(&key(42)); // never listed
        assert_eq!(empty.len(), 3);
        assert!(empty.contains(&key(9)) && !empty.contains(&key(3)));
        assert_eq!(empty.pop_oldest(), Some(key(5)));
        empty.note(key(3)); // empty again: now the newest
        assert_eq!(empty.pop_oldest(), Some(key(9)));
        assert_eq!(empty.pop_oldest(), Some(key(1)));
        assert_eq!(empty.pop_oldest(), Some(key(3)));
        assert_eq!(empty.pop_oldest(), None);
        assert_eq!(empty.len(), 0);
    }

    #[test]
    fn as_many_are_kept_as_segments_in_use_and_a_few_in_any_case() {
        let mut empty = EmptySegments::default();
        for s in 0..KEPT_AT_LEAST as u64 {
            empty.note(key(s));
        }
        assert!(!empty.too_many(KEPT_AT_LEAST), "a few in any case");
        empty.note(key(1000));
        let n = KEPT_AT_LEAST + 1;
        assert!(empty.too_many(n), "none in use");
        assert!(empty.too_many(2 * n - 1), "one fewer in use than empty");
        assert!(!empty.too_many(2 * n), "as many in use as empty");
    }
}
