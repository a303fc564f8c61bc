//! A snapshot whose memory history wrapped (`max_entries`, or recording
//! started late) replays from the state it describes: with its first 40
//! events cut, the bundled small MLP snapshot reaches the peak reserved of
//! the whole history, where dropping the missed blocks used to halve it.

use std::path::Path;

use alloc_replay::{parse_pickle, replay, ReplayOptions};
use serde_pickle::{HashableValue, Value};

const SNAPSHOT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../traces/small_mlp_stacks.snapshot.pickle"
);

fn peak_reserved(bytes: &[u8]) -> u64 {
    let trace = parse_pickle("p", bytes).unwrap();
    let mut opts = ReplayOptions::default();
    opts.timed_runs = 0;
    replay(&trace, "", &opts)
        .unwrap()
        .report
        .peak_reserved_bytes
}

/// The snapshot with the first `n` events of device 0's trace dropped.
fn cut(bytes: &[u8], n: usize) -> Vec<u8> {
    let options = serde_pickle::DeOptions::new()
        .replace_unresolved_globals()
        .replace_recursive_structures();
    let mut root = serde_pickle::value_from_slice(bytes, options).unwrap();
    let Value::Dict(map) = &mut root else {
        panic!("a snapshot is a dict")
    };
    let traces = map
        .get_mut(&HashableValue::String("device_traces".into()))
        .unwrap();
    let Value::List(devices) = traces else {
        panic!("device_traces is a list")
    };
    let Value::List(events) = &mut devices[0] else {
        panic!("a device trace is a list")
    };
    events.drain(..n);
    serde_pickle::value_to_vec(&root, Default::default()).unwrap()
}

#[test]
fn a_wrapped_history_keeps_the_peak() {
    if !Path::new(SNAPSHOT).exists() {
        panic!("the bundled snapshot {SNAPSHOT} is missing");
    }
    let whole = std::fs::read(SNAPSHOT).unwrap();
    let full = peak_reserved(&whole);
    let wrapped = cut(&whole, 40);
    assert_eq!(peak_reserved(&wrapped), full);
    let trace = parse_pickle("p", &wrapped).unwrap();
    assert!(
        trace
            .header
            .iter()
            .any(|h| h.starts_with("wrapped history")),
        "{:?}",
        trace.header
    );
}
