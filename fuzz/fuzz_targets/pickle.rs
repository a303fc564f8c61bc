//! The snapshot pickle reader, whichever device is asked for.
//!
//! Any input to `alloc_replay::parse_pickle` (made for what
//! `torch.cuda.memory._dump_snapshot()` writes) is read or refused with an
//! error, never a panic, and its peak heap (counted by the allocator of
//! `peak`) stays within `alloc_replay::trace::read_memory_bound` of its size.
#![no_main]

#[path = "../../crates/alloc-replay/tests/peak/mod.rs"]
mod peak;

use alloc_replay::trace::read_memory_bound;
use alloc_replay::{parse_pickle, parse_pickle_device};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let bound = read_memory_bound(data.len(), false);
    let (_, peak) = peak::peak_of(|| {
        let _ = parse_pickle("fuzz", data);
        for device in [0, 1, usize::MAX] {
            let _ = parse_pickle_device("fuzz", data, device);
        }
    });
    assert!(
        peak <= bound,
        "reading {} bytes took {peak} bytes of heap, above the bound of {bound}",
        data.len()
    );
});
