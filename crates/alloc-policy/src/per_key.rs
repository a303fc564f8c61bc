//! Per-key state of a policy: what it keeps for each [`CacheKey`] (a
//! stream's free blocks, device-wide or in one private pool), found by key.
//!
//! A process has one or a few streams, so the entries are a vector sorted
//! by key: the first entry, then the one a search found last, are checked
//! before a binary search, and an entry's position stays valid until the
//! next insertion or removal (a policy may look a key up once per operation
//! and use the position).

use std::cell::Cell;

use alloc_core::CacheKey;

/// State of type `T` per cache key, in key order.
#[derive(Debug, Clone)]
pub struct PerKey<T> {
    entries: Vec<(CacheKey, T)>,
    /// The position a search past the first entry found last, checked
    /// before searching again: which key sorts first is the streams' order,
    /// not their use, and the stream a program works on may sort after one
    /// that is idle.
    hot: Cell<usize>,
}

impl<T> Default for PerKey<T> {
    fn default() -> Self {
        PerKey {
            entries: Vec::new(),
            hot: Cell::new(0),
        }
    }
}

impl<T> PerKey<T> {
    /// The position of `key`, or where it would be inserted.
    #[inline]
    fn search(&self, key: CacheKey) -> Result<usize, usize> {
        match self.entries.first() {
            // One stream in most processes: no search at all.
            Some((first, _)) if *first == key => Ok(0),
            None => Err(0),
            _ => self.search_past_first(key),
        }
    }

    /// [`PerKey::search`] past the first entry: the entry found last, else
    /// a binary search (whose hit becomes the one found last).
    #[inline(never)]
    fn search_past_first(&self, key: CacheKey) -> Result<usize, usize> {
        let hot = self.hot.get();
        if let Some((k, _)) = self.entries.get(hot) {
            if *k == key {
                return Ok(hot);
            }
        }
        let found = self.entries.binary_search_by(|(k, _)| k.cmp(&key));
        if let Ok(i) = found {
            self.hot.set(i);
        }
        found
    }

    /// The position of `key`'s entry, if it has one.
    #[inline]
    pub fn position(&self, key: CacheKey) -> Option<usize> {
        self.search(key).ok()
    }

    /// Whether `key` has the first entry (one stream in most processes).
    #[inline(always)]
    fn is_first(&self, key: CacheKey) -> bool {
        self.entries.first().is_some_and(|(k, _)| *k == key)
    }

    /// The entry of `key` if it is the first entry or the one a search
    /// found last, without a search.
    #[inline(always)]
    pub fn first_or_hot_mut(&mut self, key: CacheKey) -> Option<&mut T> {
        if self.is_first(key) {
            return self.entries.first_mut().map(|(_, v)| v);
        }
        match self.entries.get_mut(self.hot.get()) {
            Some((k, v)) if *k == key => Some(v),
            _ => None,
        }
    }

    /// The entry of `key`, if it has one.
    // The first entry is reached through `first` rather than a position,
    // here and below: the position's bounds check then goes.
    #[inline]
    pub fn get(&self, key: CacheKey) -> Option<&T> {
        match self.entries.first() {
            Some((k, v)) if *k == key => Some(v),
            _ => self.position(key).map(|i| &self.entries[i].1),
        }
    }

    /// The entry of `key`, mutably, if it has one.
    #[inline]
    pub fn get_mut(&mut self, key: CacheKey) -> Option<&mut T> {
        if self.is_first(key) {
            return self.entries.first_mut().map(|(_, v)| v);
        }
        self.position(key).map(|i| &mut self.entries[i].1)
    }

    /// The position of `key`'s entry, made with `make` if it has none.
    #[inline]
    pub fn position_or_insert_with(&mut self, key: CacheKey, make: impl FnOnce() -> T) -> usize {
        match self.search(key) {
            Ok(i) => i,
            Err(i) => self.insert_at(i, key, make()),
        }
    }

    #[cold]
    #[inline(never)]
    fn insert_at(&mut self, at: usize, key: CacheKey, value: T) -> usize {
        self.entries.insert(at, (key, value));
        at
    }

    /// The entry of `key`, made with `make` if it has none.
    #[inline]
    pub fn get_or_insert_with(&mut self, key: CacheKey, make: impl FnOnce() -> T) -> &mut T {
        if !self.is_first(key) {
            return self.get_or_insert_searched(key, make);
        }
        &mut self.entries[0].1
    }

    /// [`PerKey::get_or_insert_with`] past the first entry, out of line: a
    /// new `T` built in the caller's frame (a policy's bins are hundreds of
    /// bytes) would enlarge every call's stack frame.
    #[cold]
    #[inline(never)]
    fn get_or_insert_searched(&mut self, key: CacheKey, make: impl FnOnce() -> T) -> &mut T {
        let i = self.position_or_insert_with(key, make);
        &mut self.entries[i].1
    }

    /// The entry at `position` (from [`PerKey::position`]).
    #[inline]
    pub fn at(&self, position: usize) -> &T {
        &self.entries[position].1
    }

    /// The entry at `position`, mutably.
    #[inline]
    pub fn at_mut(&mut self, position: usize) -> &mut T {
        &mut self.entries[position].1
    }

    /// Every entry with its key, in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (CacheKey, &T)> + '_ {
        self.entries.iter().map(|(k, v)| (*k, v))
    }

    /// Keeps the entries for which `keep` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        // Positions move; the hot one is always checked by its key.
        self.entries.retain(|(_, v)| keep(v));
    }

    /// Number of keys with an entry.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no key has an entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc_core::StreamId;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// Key `i`: the device-wide cache of one of a few streams, the top bit
    /// included (private pools get their numbers from the engine).
    fn key(i: u8) -> CacheKey {
        let n = u64::from(i / 4);
        let stream = match i % 4 {
            0 => n,
            1 => 7 + n,
            2 => (1 << 63) + n,
            _ => u64::MAX - n,
        };
        CacheKey::shared(StreamId(stream))
    }

    #[test]
    fn positions_hold_until_the_next_insertion() {
        let mut m: PerKey<u32> = PerKey::default();
        assert!(m.is_empty() && m.get(key(0)).is_none());
        let a = m.position_or_insert_with(key(1), || 10);
        assert_eq!(
            m.position_or_insert_with(key(1), || 99),
            a,
            "no second entry"
        );
        *m.get_or_insert_with(key(0), || 20) += 1;
        assert_eq!(m.position(key(0)), Some(0), "sorted: stream 0 first");
        assert_eq!(m.at(m.position(key(1)).unwrap()), &10);
        *m.at_mut(0) += 1;
        assert_eq!(m.get(key(0)), Some(&22));
        m.retain(|&v| v != 10);
        assert_eq!(m.len(), 1);
        assert!(m.get_mut(key(1)).is_none());
    }

    #[test]
    fn a_key_past_the_first_is_found_again_without_a_search() {
        let mut m: PerKey<u32> = PerKey::default();
        for i in 0..4 {
            m.get_or_insert_with(key(i), || u32::from(i));
        }
        assert_eq!(m.hot.get(), 0, "an insertion moves nothing");
        assert_eq!(m.get(key(2)), Some(&2));
        let at = m.position(key(2)).unwrap();
        assert_eq!(m.hot.get(), at, "the search's hit is remembered");
        *m.first_or_hot_mut(key(2)).expect("hot") += 10;
        assert_eq!(m.get(key(2)), Some(&12));
        assert!(
            m.first_or_hot_mut(key(3)).is_none(),
            "neither first nor hot"
        );
        assert!(m.first_or_hot_mut(key(0)).is_some(), "the first");
        m.retain(|&v| v != 12);
        assert!(m.get(key(2)).is_none() && m.first_or_hot_mut(key(2)).is_none());
    }

    proptest! {
        /// Answers exactly like an ordered map.
        #[test]
        fn matches_an_ordered_map(ops in proptest::collection::vec((0u8..3, 0u8..12, any::<u16>()), 1..200)) {
            let mut m: PerKey<u16> = PerKey::default();
            let mut model: BTreeMap<CacheKey, u16> = BTreeMap::new();
            for (op, k, v) in ops {
                let k = key(k);
                match op {
                    0 => {
                        *m.get_or_insert_with(k, || v) = v;
                        model.insert(k, v);
                    }
                    1 => prop_assert_eq!(m.get(k), model.get(&k)),
                    _ => {
                        m.retain(|&x| x % 3 != v % 3);
                        model.retain(|_, x| *x % 3 != v % 3);
                    }
                }
                let got: Vec<_> = m.iter().map(|(k, v)| (k, *v)).collect();
                let want: Vec<_> = model.iter().map(|(k, v)| (*k, *v)).collect();
                prop_assert_eq!(got, want);
            }
        }
    }
}
