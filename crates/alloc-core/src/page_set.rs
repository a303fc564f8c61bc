//! The unmapped pages of a growable segment (`unmap_free_pages`): page
//! addresses in a set, with the range queries the engine needs to unmap and
//! map whole runs of pages in one backend call each.

use std::collections::BTreeSet;

/// Page-aligned addresses of unmapped pages, all of one page size.
#[derive(Debug, Clone, Default)]
pub(crate) struct PageSet {
    pages: BTreeSet<u64>,
}

impl PageSet {
    /// Number of pages in the set.
    pub(crate) fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether any page of `[lo, hi)` is in the set.
    pub(crate) fn any_in(&self, lo: u64, hi: u64) -> bool {
        self.pages.range(lo..hi).next().is_some()
    }

    /// Pages of `[lo, hi)` (page-aligned bounds) in the set, as maximal runs
    /// `(start, bytes)`.
    pub(crate) fn runs_in(&self, lo: u64, hi: u64, page: u64) -> Vec<(u64, u64)> {
        runs(self.pages.range(lo..hi).copied(), page)
    }

    /// Pages of `[lo, hi)` (page-aligned bounds) not in the set, as maximal
    /// runs `(start, bytes)`.
    pub(crate) fn gaps_in(&self, lo: u64, hi: u64, page: u64) -> Vec<(u64, u64)> {
        runs(
            (lo..hi)
                .step_by(page as usize)
                .filter(|p| !self.pages.contains(p)),
            page,
        )
    }

    /// Adds the pages of the run `[start, start + bytes)`.
    pub(crate) fn insert_run(&mut self, start: u64, bytes: u64, page: u64) {
        self.pages
            .extend((start..start + bytes).step_by(page as usize));
    }

    /// Removes every page of `[lo, hi)`; returns how many were there.
    pub(crate) fn remove_in(&mut self, lo: u64, hi: u64) -> u64 {
        let gone: Vec<u64> = self.pages.range(lo..hi).copied().collect();
        for p in &gone {
            self.pages.remove(p);
        }
        gone.len() as u64
    }
}

/// Groups ascending page addresses into maximal contiguous runs.
fn runs(pages: impl Iterator<Item = u64>, page: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for p in pages {
        match out.last_mut() {
            Some((start, bytes)) if *start + *bytes == p => *bytes += page,
            _ => out.push((p, page)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_and_gaps_partition_a_range() {
        let page = 2;
        let mut s = PageSet::default();
        s.insert_run(4, 4, page); // pages 4, 6
        s.insert_run(12, 2, page); // page 12
        assert_eq!(s.len(), 3);
        assert_eq!(s.runs_in(0, 16, page), vec![(4, 4), (12, 2)]);
        assert_eq!(s.gaps_in(0, 16, page), vec![(0, 4), (8, 4), (14, 2)]);
        assert!(s.any_in(6, 8) && !s.any_in(8, 12));
        assert_eq!(s.remove_in(0, 8), 2);
        assert_eq!(s.runs_in(0, 16, page), vec![(12, 2)]);
    }
}
