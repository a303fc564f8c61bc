//! The unmapped pages of a growable segment (`unmap_free_pages`): page
//! addresses in a set, with the range queries the engine needs to unmap and
//! map whole runs of pages in one backend call each.

use std::collections::BTreeSet;

use crate::page_layout::RangePages;

/// Start addresses of unmapped pages of one range (whose [`RangePages`]
/// the queries take).
#[derive(Debug, Clone, Default)]
pub(crate) struct PageSet {
    pages: BTreeSet<u64>,
}

impl PageSet {
    /// Number of pages in the set.
    pub(crate) fn len(&self) -> usize {
        self.pages.len()
    }

    /// Bytes of the pages in the set.
    pub(crate) fn bytes(&self, layout: &RangePages) -> u64 {
        self.pages.iter().map(|&p| layout.size_at(p)).sum()
    }

    /// Whether any page of `[lo, hi)` is in the set.
    pub(crate) fn any_in(&self, lo: u64, hi: u64) -> bool {
        self.pages.range(lo..hi).next().is_some()
    }

    /// Pages of `[lo, hi)` (page-aligned bounds) in the set, as maximal runs
    /// `(start, bytes)`.
    pub(crate) fn runs_in(&self, lo: u64, hi: u64, layout: &RangePages) -> Vec<(u64, u64)> {
        runs(self.pages.range(lo..hi).map(|&p| (p, layout.size_at(p))))
    }

    /// Pages of `[lo, hi)` (page-aligned bounds) not in the set, as maximal
    /// runs `(start, bytes)`.
    pub(crate) fn gaps_in(&self, lo: u64, hi: u64, layout: &RangePages) -> Vec<(u64, u64)> {
        runs(
            layout
                .pages(lo, hi)
                .filter(|(p, _)| !self.pages.contains(p)),
        )
    }

    /// Adds the pages of the run `[start, start + bytes)`.
    pub(crate) fn insert_run(&mut self, start: u64, bytes: u64, layout: &RangePages) {
        self.pages
            .extend(layout.pages(start, start + bytes).map(|(p, _)| p));
    }

    /// Removes every page of `[lo, hi)`; returns their bytes.
    pub(crate) fn remove_in(&mut self, lo: u64, hi: u64, layout: &RangePages) -> u64 {
        let gone: Vec<u64> = self.pages.range(lo..hi).copied().collect();
        for p in &gone {
            self.pages.remove(p);
        }
        gone.iter().map(|&p| layout.size_at(p)).sum()
    }
}

/// Page runs `(start, bytes)`.
pub(crate) type Runs = Vec<(u64, u64)>;

/// Groups pages `(start, size)` in ascending order into maximal contiguous
/// runs.
fn runs(pages: impl Iterator<Item = (u64, u64)>) -> Runs {
    let mut out: Runs = Vec::new();
    for (p, size) in pages {
        push_page(&mut out, p, size);
    }
    out
}

/// Appends the page `(p, size)` to ascending runs, extending the last one
/// when it ends where the page starts.
fn push_page(out: &mut Runs, p: u64, size: u64) {
    match out.last_mut() {
        Some((start, bytes)) if *start + *bytes == p => *bytes += size,
        _ => out.push((p, size)),
    }
}

/// Splits page runs (ascending, of `layout`'s pages) into the runs of the
/// pages `(start, size)` for which `first` holds and the runs of the others.
pub(crate) fn partition_pages(
    layout: &RangePages,
    page_runs: &[(u64, u64)],
    mut first: impl FnMut(u64, u64) -> bool,
) -> (Runs, Runs) {
    let (mut chosen, mut others) = (Vec::new(), Vec::new());
    for &(start, bytes) in page_runs {
        for (p, size) in layout.pages(start, start + bytes) {
            let out = if first(p, size) {
                &mut chosen
            } else {
                &mut others
            };
            push_page(out, p, size);
        }
    }
    (chosen, others)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page_layout::PageLayout;

    #[test]
    fn runs_and_gaps_partition_a_range() {
        let layout = RangePages {
            base: 0,
            layout: PageLayout::uniform(2),
        };
        let page = &layout;
        let mut s = PageSet::default();
        s.insert_run(4, 4, page); // pages 4, 6
        s.insert_run(12, 2, page); // page 12
        assert_eq!((s.len(), s.bytes(page)), (3, 6));
        assert_eq!(s.runs_in(0, 16, page), vec![(4, 4), (12, 2)]);
        assert_eq!(s.gaps_in(0, 16, page), vec![(0, 4), (8, 4), (14, 2)]);
        assert!(s.any_in(6, 8) && !s.any_in(8, 12));
        assert_eq!(s.remove_in(0, 8, page), 4);
        assert_eq!(s.runs_in(0, 16, page), vec![(12, 2)]);
    }

    #[test]
    fn runs_and_gaps_cross_pages_of_two_sizes() {
        const MIB: u64 = 1 << 20;
        // 2 MiB pages below 2 GiB, 4 MiB pages above.
        let layout = RangePages {
            base: 1 << 40,
            layout: PageLayout::scaled(2 * MIB, 4 * MIB, 512).unwrap(),
        };
        let at = |off: u64| (1u64 << 40) + (2u64 << 30) + off;
        let mut s = PageSet::default();
        s.insert_run(at(0) - 4 * MIB, 12 * MIB, &layout); // 2 + 2 + 4 + 4 MiB
        assert_eq!((s.len(), s.bytes(&layout)), (4, 12 * MIB));
        assert_eq!(
            s.runs_in(at(0) - 8 * MIB, at(16 * MIB), &layout),
            vec![(at(0) - 4 * MIB, 12 * MIB)]
        );
        assert_eq!(
            s.gaps_in(at(0) - 8 * MIB, at(16 * MIB), &layout),
            vec![(at(0) - 8 * MIB, 4 * MIB), (at(8 * MIB), 8 * MIB)]
        );
        let run = [(at(0) - 4 * MIB, 12 * MIB)];
        assert_eq!(
            partition_pages(&layout, &run, |_, size| size == 4 * MIB),
            (vec![(at(0), 8 * MIB)], vec![(at(0) - 4 * MIB, 4 * MIB)])
        );
    }
}
