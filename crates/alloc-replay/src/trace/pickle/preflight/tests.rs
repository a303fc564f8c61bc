use super::*;
use crate::trace::{parse_pickle, TraceError};

/// `PROTO 4`, then `body`, then `STOP`.
fn pickle(body: &[u8]) -> Vec<u8> {
    let mut out = vec![0x80, 4];
    out.extend_from_slice(body);
    out.push(b'.');
    out
}

/// The error `parse_pickle` gives, which must be a decoding error.
fn refused(bytes: &[u8]) -> String {
    match parse_pickle("t", bytes) {
        Err(TraceError::Pickle(msg)) => msg,
        other => panic!("expected a decoding error, got {other:?}"),
    }
}

#[test]
fn a_tuple_paired_with_its_copies_is_refused_before_it_is_built() {
    // Found by the `trace` fuzz target (an out-of-memory): DUP copies the
    // top item, TUPLE2 pairs it with the copy, so each `2 \x86` doubles the
    // value: 2^24 values (half a GiB) from 50 bytes.
    let mut body = b"K\x00".to_vec();
    for _ in 0..24 {
        body.extend_from_slice(b"2\x86");
    }
    assert!(refused(&pickle(&body)).contains("would build more than"));
}

#[test]
fn one_memoized_list_fetched_many_times_is_refused() {
    // serde-pickle copies a memoized value at each fetch: a 4096-item list
    // fetched 20,000 times would be 80 M values from 70 KB.
    let mut body = b"]\x94(".to_vec();
    for _ in 0..4096 {
        body.extend_from_slice(b"K\x07");
    }
    body.extend_from_slice(b"e](");
    for _ in 0..20_000 {
        body.extend_from_slice(b"h\x00");
    }
    body.push(b'e');
    assert!(refused(&pickle(&body)).contains("would build more than"));
}

#[test]
fn a_set_of_numbers_serde_pickle_cannot_order_is_refused() {
    // Found by the `trace` fuzz target (98 bytes, minimized): a frozenset of
    // NaNs and other floats, which serde-pickle orders inconsistently; the
    // standard library's sort then panicked inside parse_pickle.
    let found: &[u8] = b"\x80d(G\x1f\x8bG2GGGG222G\xff\xffN\x1f\x8bGG222GN(N))))))))))))))\
        \x85)))))))))))))))))))))))))))))\x85)))))))))))))))))))\x912.(";
    assert_eq!(found.len(), 98);
    assert!(refused(found).contains("makes a set"));
    // The same through the set and frozenset globals (protocols 2 and 4).
    let nan = b"G\x7f\xf8\x00\x00\x00\x00\x00\x00";
    let mut args = b"](".to_vec();
    for _ in 0..40 {
        args.extend_from_slice(nan);
        args.extend_from_slice(b"K\x01");
    }
    args.extend_from_slice(b"e\x85R");
    for global in [
        &b"c__builtin__\nset\n"[..],
        b"cbuiltins\nfrozenset\n",
        b"\x8c\x08builtins\x94\x8c\x03set\x94\x93",
        // The names memoized, dropped and fetched back.
        b"\x8c\x08builtins\x94\x8c\x09frozenset\x9400h\x00h\x01\x93",
    ] {
        let mut body = global.to_vec();
        body.extend_from_slice(&args);
        assert!(
            refused(&pickle(&body)).contains("makes a set"),
            "{global:?}"
        );
    }
}

#[test]
fn snapshots_cost_a_fraction_of_the_budget() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces");
    for name in [
        "small_mlp.snapshot.pickle",
        "small_mlp_stacks.snapshot.pickle",
    ] {
        let bytes = std::fs::read(format!("{dir}/{name}")).unwrap();
        let units = check(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let per_byte = units as f64 / bytes.len() as f64;
        println!("{name}: {units} units, {per_byte:.2} per byte");
        // A quarter of the budget at most: room for longer stacks and names.
        assert!(
            per_byte < UNITS_PER_BYTE as f64 / 4.0,
            "{name}: {units} units for {} bytes",
            bytes.len()
        );
    }
    let synthetic = include_bytes!("../../../../tests/data/synthetic.snapshot.pickle");
    check(synthetic).unwrap();
}

#[test]
fn the_walk_follows_every_opcode_a_snapshot_uses() {
    // Protocol 2 and 4 pickles of the same dict: the walk reaches STOP.
    for bytes in [
        &b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01K\x02eh\x01h\x02u."[..],
        &b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94]\x94(K\x01K\x02es."[..],
    ] {
        let mut walk = Walk::new(bytes.len());
        let mut at = 0;
        let mut stopped = false;
        while let Some((op, next)) = opcode(bytes, at) {
            at = next;
            match walk.apply(op).unwrap() {
                Step::Go => {}
                Step::Stop(_) => {
                    stopped = true;
                    break;
                }
                Step::Fail => panic!("the walk failed at byte {at}"),
            }
        }
        assert!(stopped, "no STOP reached");
        assert_eq!(at, bytes.len());
    }
}

#[test]
fn marks_count_while_they_are_open() {
    // serde-pickle gives each MARK a fresh 4 KiB stack: a run of them took
    // 4 KB per input byte (100 KB of pickle, 406 MB).
    let run = pickle(&vec![b'('; 100 << 10]);
    assert!(refused(&run).contains("marks open"));
    // The same number closed as they open costs nothing that lasts.
    let closed = pickle(&b"(1".repeat(50 << 10));
    assert!(check(&closed).unwrap() < 16, "{:?}", check(&closed));
    // A list or tuple made from a mark keeps its stack.
    let tuples = pickle(&b"(t".repeat(8 << 10));
    assert!(refused(&tuples).contains("would build more than"));
}
