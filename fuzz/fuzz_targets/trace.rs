//! The trace reader (text, gzip'd text, snapshot pickles) and the replay.
//!
//! Any input to `alloc_replay::parse_bytes`, which tells the formats apart
//! by their content, is read or refused with an error, never a panic, and
//! its peak heap (counted by the allocator of `peak`) stays within
//! `alloc_replay::trace::read_memory_bound` of its size. A text trace that
//! reads writes back to itself; every trace that reads replays on the
//! simulated device, or fails with an error.
#![no_main]

#[path = "../../crates/alloc-replay/tests/peak/mod.rs"]
mod peak;

use alloc_core::GIB;
use alloc_replay::trace::read_memory_bound;
use alloc_replay::{parse_bytes, parse_text, replay, ReplayOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (read, peak) = peak::peak_of(|| parse_bytes("fuzz", data));
    let bound = read_memory_bound(data.len(), data.starts_with(&[0x1f, 0x8b]));
    assert!(
        peak <= bound,
        "reading {} bytes took {peak} bytes of heap, above the bound of {bound}",
        data.len()
    );
    let Ok(trace) = read else {
        return;
    };
    if std::str::from_utf8(data).is_ok() {
        let text = trace.to_text();
        let again = parse_text("fuzz", &text).expect("a written trace reads");
        assert_eq!(again, trace, "text trace round trip");
    }
    let mut opts = ReplayOptions::default();
    opts.capacity = 8 * GIB;
    opts.timed_runs = 0;
    let _ = replay(&trace, "", &opts);
});
