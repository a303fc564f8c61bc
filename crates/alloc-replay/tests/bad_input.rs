//! A corrupt or foreign file is an error that says what is wrong, never a
//! panic: the bundled snapshot cut at every length, with bytes flipped, and
//! bytes that are no snapshot at all. What still parses after a flip must
//! replay and be advised on without a panic too.

mod common;

use alloc_replay::{advise, parse_bytes, TraceError};
use common::untimed;

const SNAPSHOT: &[u8] = include_bytes!("../../../traces/small_mlp.snapshot.pickle");

/// xorshift64: reproducible noise without a dependency.
fn noise(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

#[test]
fn a_truncated_snapshot_is_an_error() {
    let lengths = (1..1024).chain((1024..SNAPSHOT.len()).step_by(61));
    for len in lengths {
        match parse_bytes("cut", &SNAPSHOT[..len]) {
            Err(TraceError::Pickle(_) | TraceError::Snapshot(_) | TraceError::Parse { .. }) => {}
            other => panic!("cut at {len}: {other:?}"),
        }
    }
    // The message says which part failed.
    let message = parse_bytes("cut", &SNAPSHOT[..SNAPSHOT.len() / 2])
        .unwrap_err()
        .to_string();
    assert!(message.contains("pickle"), "{message}");
}

#[test]
fn flipped_bytes_give_an_error_or_a_trace_that_replays() {
    let mut next = noise(0x9e37_79b9_7f4a_7c15);
    let (mut errors, mut parsed) = (0, 0);
    for _ in 0..600 {
        let mut bytes = SNAPSHOT.to_vec();
        for _ in 0..1 + next() % 4 {
            let at = (next() % bytes.len() as u64) as usize;
            bytes[at] ^= 1 << (next() % 8);
        }
        match parse_bytes("flipped", &bytes) {
            Err(e) => {
                assert!(!e.to_string().is_empty());
                errors += 1;
            }
            Ok(trace) => {
                parsed += 1;
                // An absurd size is the engine's error, not a panic.
                let _ = advise(&trace, &untimed());
            }
        }
    }
    println!("{errors} errors, {parsed} parsed");
    assert!(errors > 0 && parsed > 0, "{errors} errors, {parsed} parsed");
}

#[test]
fn bytes_that_are_no_snapshot_are_errors() {
    let mut next = noise(42);
    let garbage: Vec<u8> = (0..4096).map(|_| next() as u8).collect();
    let gzip_magic_then_garbage = [&[0x1f, 0x8b][..], &garbage].concat();
    let pickle_proto_then_garbage = [&[0x80, 0x04][..], &garbage].concat();
    let foreign: [&[u8]; 8] = [
        &garbage,
        &gzip_magic_then_garbage,
        &pickle_proto_then_garbage,
        // pickle.dumps([1, 2, 3], protocol=2)
        b"\x80\x02]q\x00(K\x01K\x02K\x03e.",
        // pickle.dumps({"segments": []}, protocol=2): no device_traces
        b"\x80\x02}q\x00X\x08\x00\x00\x00segmentsq\x01]q\x02s.",
        // pickle.dumps({"device_traces": [[1]]}, protocol=2): an entry that is no dict
        b"\x80\x02}q\x00X\r\x00\x00\x00device_tracesq\x01]q\x02]q\x03K\x01aas.",
        // pickle.dumps({"device_traces": 7}, protocol=2)
        b"\x80\x02}q\x00X\r\x00\x00\x00device_tracesq\x01K\x07s.",
        b"",
    ];
    for (i, bytes) in foreign.iter().enumerate() {
        match parse_bytes("foreign", bytes) {
            Err(e) => println!("{i}: {e}"),
            // Empty text is an empty trace: advising on it is the error.
            Ok(trace) if trace.events.is_empty() => {
                assert!(bytes.is_empty());
                let e = advise(&trace, &untimed()).unwrap_err().to_string();
                assert!(e.contains("no allocations"), "{e}");
            }
            Ok(trace) => panic!("{i}: parsed as {} events", trace.events.len()),
        }
    }
}
