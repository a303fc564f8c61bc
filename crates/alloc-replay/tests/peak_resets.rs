//! `ReplayOptions::reset_peaks_every`: the program's resets of the
//! statistics' peaks, made again during a replay, leave the allocator's
//! decisions and the reported (trace-wide) peaks as they were.

use alloc_replay::{parse_text, replay, ReplayOptions, ReplayReport};

const MIB: u64 = 1 << 20;

/// Stream 0 frees 100 MiB in front of a 20 MiB block it keeps and makes a
/// 2 MiB temporary; then stream 1 asks 30 MiB; twice over. A reset of the
/// peaks after the temporary (the third allocation) finds 22 MiB allocated.
fn trace() -> String {
    let mut t = String::new();
    for step in 0..2u64 {
        let id = step * 10;
        let (a, b, c, d) = (id + 1, id + 2, id + 3, id + 4);
        t += &format!("a {a} {} 0\na {b} {} 0\nf {a} 0\n", 100 * MIB, 20 * MIB);
        t += &format!("a {d} {} 0\nf {d} 0\n", 2 * MIB);
        t += &format!("a {c} {} 1\nf {c} 1\nf {b} 0\n", 30 * MIB);
    }
    t
}

fn run(reset_every: Option<u64>) -> ReplayReport {
    let t = parse_text("resets", &trace()).unwrap();
    let mut opts = ReplayOptions::default();
    opts.timed_runs = 0;
    opts.gpu_lag = Some(0);
    opts.reset_peaks_every = reset_every;
    let level = "expandable_segments:True,unmap_free_pages:True,unmap_page_mb:2,\
                 memory_budget_over_allocated:1.5,idle_mark_mb:64";
    replay(&t, level, &opts).unwrap().report
}

#[test]
fn resets_of_the_peaks_change_neither_the_page_moves_nor_the_reported_peaks() {
    let plain = run(None);
    assert_eq!(plain.pages_moved, 0, "{plain:?}");
    assert_eq!(plain.peak_allocated_bytes, 120 * MIB);
    // A reset after every allocation, and after the third of each four.
    let figures = |r: &ReplayReport| {
        (
            r.pages_moved,
            r.peak_allocated_bytes,
            r.peak_reserved_bytes,
            r.peak_requested_bytes,
        )
    };
    for every in [1, 3] {
        let reset = run(Some(every));
        assert_eq!(figures(&reset), figures(&plain), "every {every}: {reset:?}");
    }
}
