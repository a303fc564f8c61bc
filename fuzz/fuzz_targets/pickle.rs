//! The snapshot pickle reader, whichever device is asked for.
//!
//! Any input to `alloc_replay::parse_pickle` (made for what
//! `torch.cuda.memory._dump_snapshot()` writes) is read or refused with an
//! error, never a panic, in memory bounded by the input.
#![no_main]

use alloc_replay::{parse_pickle, parse_pickle_device};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = parse_pickle("fuzz", data);
    for device in [0, 1, usize::MAX] {
        let _ = parse_pickle_device("fuzz", data, device);
    }
});
