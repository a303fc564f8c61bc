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

use rustc_hash::FxHashSet;

use super::growable::SegmentKey;

/// The growable segments that may hold free mapped pages, and a count of
/// the segments the walks visited.
#[derive(Debug, Default)]
pub(super) struct FreePageIndex {
    keys: FxHashSet<SegmentKey>,
    /// Segments handed to walks so far (what a walk costs, for tests that
    /// bound the work rather than the time).
    visited: u64,
}

impl FreePageIndex {
    /// The segment `key` may now hold free mapped pages.
    #[inline]
    pub(super) fn note(&mut self, key: SegmentKey) {
        self.keys.insert(key);
    }

    /// The segment `key` holds no free mapped page (a walk found none), or
    /// is gone.
    pub(super) fn forget(&mut self, key: &SegmentKey) {
        self.keys.remove(key);
    }

    /// The segments a walk may visit.
    pub(super) fn to_visit(&self) -> Vec<SegmentKey> {
        self.keys.iter().copied().collect()
    }

    /// A walk visited one more segment.
    #[inline]
    pub(super) fn count_visit(&mut self) {
        self.visited += 1;
    }

    /// Whether `key` is listed.
    pub(super) fn contains(&self, key: &SegmentKey) -> bool {
        self.keys.contains(key)
    }

    /// Segments handed to walks so far.
    pub(super) fn visited(&self) -> u64 {
        self.visited
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{CacheKey, PoolKind, StreamId};

    fn key(stream: u64) -> SegmentKey {
        (
            CacheKey {
                stream: StreamId(stream),
                private_pool: None,
            },
            PoolKind::Large,
        )
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
}
