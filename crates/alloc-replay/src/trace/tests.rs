use super::*;
use std::io::Write as _;

fn alloc(id: u64, size: u64, stream: u64) -> TraceEvent {
    TraceEvent::Alloc { id, size, stream }
}

fn completed(id: u64) -> TraceEvent {
    TraceEvent::FreeCompleted { id }
}

fn free(id: u64, stream: u64) -> TraceEvent {
    TraceEvent::Free { id, stream }
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

fn parse_err(text: &str) -> (usize, String) {
    match parse_text("t", text) {
        Err(TraceError::Parse { line, reason }) => (line, reason),
        other => panic!("expected a parse error, got {other:?}"),
    }
}

const SAMPLE: &str = "# workload demo torch 2.11\n\
# segment_alloc 2097152\n\
a 0 512 0\n\
\n\
a 1 1000 3\n\
   \n\
f 0 0\n\
# segment_alloc 20971520\n\
#   another note  \n\
f 7 0\n\
a 0 64 0\n";

#[test]
fn parses_sample() {
    let t = parse_text("demo", SAMPLE).unwrap();
    assert_eq!(t.name, "demo");
    assert_eq!(
        t.events,
        vec![
            alloc(0, 512, 0),
            alloc(1, 1000, 3),
            free(0, 0),
            free(7, 0),
            alloc(0, 64, 0)
        ]
    );
    assert_eq!(t.segment_allocs, vec![2097152, 20971520]);
    assert_eq!(t.header, vec!["workload demo torch 2.11", "another note"]);
    assert_eq!(t.alloc_count(), 3);
}

#[test]
fn accepts_crlf_and_tabs_and_bare_hash() {
    let t = parse_text("t", "#\r\na\t1\t2\t0\r\nf 1 0\r\n").unwrap();
    assert_eq!(t.header, vec![""]);
    assert_eq!(t.events, vec![alloc(1, 2, 0), free(1, 0)]);
}

#[test]
fn empty_text_is_an_empty_trace() {
    let t = parse_text("e", "").unwrap();
    assert!(t.events.is_empty() && t.segment_allocs.is_empty() && t.header.is_empty());
}

#[test]
fn text_round_trip() {
    let t = parse_text("demo", SAMPLE).unwrap();
    let again = parse_text("demo", &t.to_text()).unwrap();
    assert_eq!(t, again);
    // And a trace built by hand, with an empty header line.
    let built = Trace {
        name: "x".into(),
        events: vec![alloc(5, u64::MAX, 2), free(5, 2), free(9, 0)],
        segment_allocs: vec![1, 2, 3],
        segment_addrs: vec![None, Some(0x7f59_e600_0000), None],
        header: vec!["".into(), "hello world".into()],
    };
    assert_eq!(parse_text("x", &built.to_text()).unwrap(), built);
}

#[test]
fn error_unknown_op() {
    let (line, reason) = parse_err("a 0 1 0\nx 1 2\n");
    assert_eq!(line, 2);
    assert!(reason.contains("unknown operation \"x\""), "{reason}");
}

#[test]
fn error_wrong_token_count() {
    let (line, reason) = parse_err("a 0 1\n");
    assert_eq!(line, 1);
    assert!(reason.contains("expected 4 fields"), "{reason}");
    assert!(reason.contains("found 3"), "{reason}");
    let (line, reason) = parse_err("\n\nf 0 0 0\n");
    assert_eq!(line, 3);
    assert!(reason.contains("expected 3 fields"), "{reason}");
}

#[test]
fn error_non_integer_fields() {
    let (_, reason) = parse_err("a x 1 0\n");
    assert!(reason.contains("id \"x\""), "{reason}");
    let (_, reason) = parse_err("a 0 1.5 0\n");
    assert!(reason.contains("requested_bytes \"1.5\""), "{reason}");
    let (_, reason) = parse_err("a 0 1 -1\n");
    assert!(reason.contains("stream \"-1\""), "{reason}");
    let (_, reason) = parse_err("f 0 zz\n");
    assert!(reason.contains("stream \"zz\""), "{reason}");
    let (_, reason) = parse_err("a 0 18446744073709551616 0\n");
    assert!(reason.contains("non-negative integer"), "{reason}");
}

#[test]
fn error_bad_segment_marker() {
    let (line, reason) = parse_err("a 0 1 0\n# segment_alloc lots\n");
    assert_eq!(line, 2);
    assert!(reason.contains("segment size \"lots\""), "{reason}");
    let (_, reason) = parse_err("# segment_alloc\n");
    assert!(reason.contains("found 0 fields"), "{reason}");
}

#[test]
fn error_duplicate_live_id() {
    let (line, reason) = parse_err("a 4 1 0\na 5 1 0\na 4 8 0\n");
    assert_eq!(line, 3);
    assert!(reason.contains("id 4 is already live"), "{reason}");
    // Reuse after a free is fine.
    assert!(parse_text("t", "a 4 1 0\nf 4 0\na 4 8 0\n").is_ok());
}

#[test]
fn error_display_includes_line() {
    let e = parse_text("t", "a 0 1 0\nq\n").unwrap_err();
    assert!(e.to_string().starts_with("line 2: "), "{e}");
}

#[test]
fn gzip_is_detected() {
    let plain = parse_bytes("demo", SAMPLE.as_bytes()).unwrap();
    let zipped = parse_bytes("demo", &gzip(SAMPLE.as_bytes())).unwrap();
    assert_eq!(plain, zipped);
}

#[test]
fn multi_member_gzip_is_read_whole() {
    let (a, b) = SAMPLE.split_at(SAMPLE.find("f 0 0").unwrap());
    let mut both = gzip(a.as_bytes());
    both.extend(gzip(b.as_bytes()));
    assert_eq!(
        parse_bytes("demo", &both).unwrap(),
        parse_text("demo", SAMPLE).unwrap()
    );
}

#[test]
fn corrupt_gzip_is_an_error() {
    let mut bytes = gzip(SAMPLE.as_bytes());
    bytes.truncate(bytes.len() / 2);
    assert!(matches!(parse_bytes("t", &bytes), Err(TraceError::Gzip(_))));
    assert!(matches!(
        parse_bytes("t", &[0x1f, 0x8b]),
        Err(TraceError::Gzip(_))
    ));
}

#[test]
fn invalid_utf8_reports_the_line() {
    let bytes = b"a 0 1 0\na 1 \xff 0\n";
    match parse_bytes("t", bytes) {
        Err(TraceError::Parse { line, reason }) => {
            assert_eq!(line, 2);
            assert!(reason.contains("UTF-8"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn names_strip_known_suffixes() {
    let name = |p: &str| trace_name(Path::new(p));
    assert_eq!(name("/a/b/gpt2_train.trace.gz"), "gpt2_train");
    assert_eq!(name("small_mlp.snapshot.pickle"), "small_mlp");
    assert_eq!(name("x.pkl"), "x");
    assert_eq!(name("run.v2.txt.gz"), "run.v2");
    assert_eq!(name(".gz"), ".gz");
    assert_eq!(name("plain"), "plain");
}

#[test]
fn missing_file_is_an_io_error() {
    let e = load_trace(Path::new("/nonexistent/dir/x.trace.gz")).unwrap_err();
    assert!(matches!(e, TraceError::Io { .. }));
    assert!(e.to_string().contains("/nonexistent/dir/x.trace.gz"), "{e}");
}

/// Pickles built by hand with protocol-2 opcodes, for the error paths.
mod pickles {
    use super::*;

    /// `PROTO 2`, the given body, `STOP`.
    fn pickle(body: &[u8]) -> Vec<u8> {
        let mut v = vec![0x80, 2];
        v.extend_from_slice(body);
        v.push(b'.');
        v
    }

    /// SHORT_BINUNICODE-free encoding: BINUNICODE `X` + u32 length + bytes.
    fn s(text: &str) -> Vec<u8> {
        let mut v = vec![b'X'];
        v.extend_from_slice(&(text.len() as u32).to_le_bytes());
        v.extend_from_slice(text.as_bytes());
        v
    }

    /// BININT `J` (i32).
    fn int(n: i32) -> Vec<u8> {
        let mut v = vec![b'J'];
        v.extend_from_slice(&n.to_le_bytes());
        v
    }

    /// A dict of the given key/value encodings: EMPTY_DICT MARK ... SETITEMS.
    fn dict(items: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        let mut v = vec![b'}', b'('];
        for (k, val) in items {
            v.extend_from_slice(k);
            v.extend_from_slice(val);
        }
        v.push(b'u');
        v
    }

    /// A list: EMPTY_LIST MARK ... APPENDS.
    fn list(items: &[Vec<u8>]) -> Vec<u8> {
        let mut v = vec![b']', b'('];
        for it in items {
            v.extend_from_slice(it);
        }
        v.push(b'e');
        v
    }

    fn snapshot(entries: &[Vec<u8>]) -> Vec<u8> {
        pickle(&dict(&[(s("device_traces"), list(&[list(entries)]))]))
    }

    fn entry(action: &str, addr: i32, size: i32) -> Vec<u8> {
        dict(&[
            (s("action"), s(action)),
            (s("addr"), int(addr)),
            (s("size"), int(size)),
            (s("stream"), int(0)),
        ])
    }

    /// The trace of a snapshot of these entries, which must parse.
    fn parsed(entries: &[Vec<u8>]) -> Trace {
        parse_pickle("p", &snapshot(entries)).unwrap()
    }

    fn snapshot_err(bytes: &[u8]) -> String {
        match parse_pickle("p", bytes) {
            Err(TraceError::Snapshot(m)) => m,
            other => panic!("expected a snapshot error, got {other:?}"),
        }
    }

    #[test]
    fn minimal_snapshot_parses() {
        let t = parsed(&[entry("alloc", 4096, 10), entry("free_requested", 4096, 10)]);
        assert_eq!(t.events, vec![alloc(0, 10, 0), free(0, 0)]);
        // Dispatch on content works for pickles too, and through gzip.
        let bytes = snapshot(&[entry("alloc", 4096, 10)]);
        assert_eq!(parse_bytes("p", &gzip(&bytes)).unwrap().events.len(), 1);
    }

    #[test]
    fn a_free_waiting_for_other_streams_completes_where_pytorch_completed_it() {
        // A block used on another stream (record_stream): its free completes
        // after a later allocation, which therefore could not reuse it. A
        // free completed at once adds nothing.
        let t = parsed(&[
            entry("alloc", 4096, 10),
            entry("free_requested", 4096, 10),
            entry("alloc", 8192, 10),
            entry("free_completed", 4096, 10),
            entry("alloc", 4096, 10),
            entry("free_requested", 8192, 10),
            entry("free_completed", 8192, 10),
        ]);
        assert_eq!(
            t.events,
            vec![
                alloc(0, 10, 0),
                free(0, 0),
                alloc(1, 10, 0),
                completed(0),
                alloc(2, 10, 0),
                free(1, 0)
            ]
        );
        // The text format carries the completion.
        assert_eq!(parse_text("p", &t.to_text()).unwrap().events, t.events);
    }

    #[test]
    fn frees_never_completed_complete_at_once() {
        // The snapshot was taken while both frees waited: neither completion
        // is recorded.
        let t = parsed(&[
            entry("alloc", 4096, 10),
            entry("alloc", 8192, 20),
            entry("free_requested", 8192, 20),
            entry("free_requested", 4096, 10),
            entry("alloc", 32768, 40),
        ]);
        assert_eq!(
            t.events,
            vec![
                alloc(0, 10, 0),
                alloc(1, 20, 0),
                free(1, 0),
                free(0, 0),
                alloc(2, 40, 0),
            ]
        );
    }

    #[test]
    fn a_free_completed_of_a_block_from_before_the_history_waits_until_then() {
        let t = parsed(&[entry("alloc", 4096, 10), entry("free_completed", 8192, 30)]);
        assert_eq!(
            t.events,
            vec![alloc(1, 30, 0), free(1, 0), alloc(0, 10, 0), completed(1)]
        );
    }

    #[test]
    fn completions_missing_or_without_a_request_change_nothing() {
        // The address handed out again with no completion recorded: the
        // free completed at once. A completion of a live block: ignored.
        let t = parsed(&[
            entry("alloc", 4096, 10),
            entry("free_requested", 4096, 10),
            entry("alloc", 8192, 10),
            entry("alloc", 4096, 10),
            entry("free_completed", 4096, 10),
            entry("free_completed", 8192, 10),
        ]);
        assert_eq!(
            t.events,
            vec![
                alloc(0, 10, 0),
                free(0, 0),
                alloc(1, 10, 0),
                alloc(2, 10, 0)
            ]
        );
    }

    #[test]
    fn undecodable_pickle() {
        assert!(matches!(
            parse_pickle("p", &[0x80, 2, b'}']),
            Err(TraceError::Pickle(_))
        ));
        assert!(matches!(
            parse_bytes("p", &[0x80, 2, 0xff, b'.']),
            Err(TraceError::Pickle(_))
        ));
    }

    #[test]
    fn wrong_top_level() {
        assert!(snapshot_err(&pickle(&list(&[]))).contains("top level is a list"));
        assert!(snapshot_err(&pickle(&dict(&[]))).contains("no 'device_traces'"));
        let bad = pickle(&dict(&[(s("device_traces"), int(3))]));
        assert!(snapshot_err(&bad).contains("'device_traces': is an int"));
    }

    #[test]
    fn missing_device_and_empty_history() {
        let bytes = snapshot(&[]);
        // An empty history is an error that says how to record one.
        let m = snapshot_err(&bytes);
        assert!(m.contains("no allocation events"), "{m}");
        assert!(m.contains("_record_memory_history"), "{m}");
        let m = match parse_pickle_device("p", &bytes, 0) {
            Err(TraceError::Snapshot(m)) => m,
            other => panic!("{other:?}"),
        };
        assert!(
            m.contains("device 0: the snapshot has no allocation events"),
            "{m}"
        );
        let m = match parse_pickle_device("p", &bytes, 3) {
            Err(TraceError::Snapshot(m)) => m,
            other => panic!("{other:?}"),
        };
        assert!(m.contains("no trace for device 3"), "{m}");
        assert!(m.contains("1 device(s)"), "{m}");
    }

    #[test]
    fn the_device_with_events_is_the_default() {
        // Recorded on device 1: device 0's trace is empty.
        let bytes = pickle(&dict(&[(
            s("device_traces"),
            list(&[list(&[]), list(&[entry("alloc", 4096, 10)])]),
        )]));
        let t = parse_pickle("p", &bytes).unwrap();
        assert_eq!(t.events, vec![alloc(0, 10, 0)]);
        assert!(
            t.header.iter().any(|h| h.contains("device 1")),
            "{:?}",
            t.header
        );
    }

    /// A segment of device 0 at `addr` with the given `(size, state)` blocks.
    fn segment(addr: i32, blocks: &[(i32, &str)]) -> Vec<u8> {
        let blocks: Vec<Vec<u8>> = blocks
            .iter()
            .map(|&(size, state)| dict(&[(s("size"), int(size)), (s("state"), s(state))]))
            .collect();
        dict(&[
            (s("device"), int(0)),
            (s("address"), int(addr)),
            (s("stream"), int(0)),
            (s("blocks"), list(&blocks)),
        ])
    }

    #[test]
    fn a_wrapped_history_starts_from_the_blocks_it_missed() {
        // Recorded: a free of a block allocated before the first event, and
        // one allocation; the snapshot's segment also holds a block that
        // was allocated before the first event and is still live.
        let bytes = pickle(&dict(&[
            (
                s("device_traces"),
                list(&[list(&[
                    entry("free_requested", 8192, 30),
                    entry("alloc", 16384, 40),
                ])]),
            ),
            (
                s("segments"),
                list(&[segment(
                    4096,
                    &[
                        (4096, "active_allocated"),
                        (8192, "inactive"),
                        (4096, "active_allocated"),
                    ],
                )]),
            ),
        ]));
        let t = parse_pickle("p", &bytes).unwrap();
        // The missed blocks come first: the freed one (id 0), the live one
        // at 4096 (id 2); 16384 was allocated in the trace (id 1).
        assert_eq!(
            t.events,
            vec![
                alloc(0, 30, 0),
                alloc(2, 4096, 0),
                free(0, 0),
                alloc(1, 40, 0)
            ]
        );
        let note = t
            .header
            .iter()
            .find(|h| h.contains("wrapped history"))
            .unwrap();
        assert!(note.contains("2 blocks") && note.contains("1 freed") && note.contains("1 live"));
    }

    #[test]
    fn a_block_whose_free_waits_at_the_snapshot_holds_its_memory() {
        // Allocated and freed before the history began, its free still
        // waiting for another stream when the snapshot was taken.
        let bytes = pickle(&dict(&[
            (
                s("device_traces"),
                list(&[list(&[entry("alloc", 16384, 40)])]),
            ),
            (
                s("segments"),
                list(&[segment(
                    4096,
                    &[(4096, "active_pending_free"), (8192, "inactive")],
                )]),
            ),
        ]));
        let t = parse_pickle("p", &bytes).unwrap();
        assert_eq!(t.events, vec![alloc(1, 4096, 0), alloc(0, 40, 0)]);
    }

    #[test]
    fn bad_entries() {
        let m = snapshot_err(&snapshot(&[int(1)]));
        assert!(m.contains("device_traces[0][0]: entry is an int"), "{m}");
        let m = snapshot_err(&snapshot(&[dict(&[(s("addr"), int(1))])]));
        assert!(m.contains("no 'action' key"), "{m}");
        let m = snapshot_err(&snapshot(&[dict(&[(s("action"), int(1))])]));
        assert!(m.contains("'action' is an int"), "{m}");
        let no_addr = dict(&[(s("action"), s("alloc")), (s("size"), int(4))]);
        let m = snapshot_err(&snapshot(&[entry("segment_alloc", 0, 8), no_addr]));
        assert!(m.contains("device_traces[0][1]: no 'addr' key"), "{m}");
        let m = snapshot_err(&snapshot(&[entry("alloc", 16, -4)]));
        assert!(m.contains("'size' is -4"), "{m}");
        let str_size = dict(&[(s("action"), s("segment_alloc")), (s("size"), s("big"))]);
        let m = snapshot_err(&snapshot(&[str_size]));
        assert!(m.contains("'size' is a string, expected an integer"), "{m}");
    }

    #[test]
    fn alloc_at_live_address_is_an_error() {
        let m = snapshot_err(&snapshot(&[entry("alloc", 64, 1), entry("alloc", 64, 2)]));
        assert!(m.contains("device_traces[0][1]"), "{m}");
        assert!(m.contains("address 0x40, which is still live"), "{m}");
    }

    #[test]
    fn unknown_actions_and_missing_stream_are_tolerated() {
        let no_stream = dict(&[
            (s("action"), s("alloc")),
            (s("addr"), int(8)),
            (s("size"), int(3)),
        ]);
        let t = parsed(&[entry("some_future_action", 1, 1), no_stream]);
        assert_eq!(t.events, vec![alloc(0, 3, 0)]);
    }
}

#[test]
fn a_completion_of_a_live_allocation_is_an_error() {
    let t = parse_text("t", "a 1 10 0\nf 1 0\nc 1\nc 7\n").unwrap();
    assert_eq!(
        t.events,
        vec![alloc(1, 10, 0), free(1, 0), completed(1), completed(7)]
    );
    match parse_text("t", "a 1 10 0\nc 1\n") {
        Err(TraceError::Parse { line: 2, reason }) => {
            assert!(reason.contains("while it is live"), "{reason}")
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
    assert!(parse_text("t", "c\n").is_err());
}

#[test]
fn segment_markers_carry_an_optional_address() {
    let t = parse_text(
        "m",
        "# segment_alloc 2097152 140024588795904\n# segment_alloc 512\n",
    )
    .unwrap();
    assert_eq!(t.segment_allocs, vec![2097152, 512]);
    assert_eq!(t.segment_addrs, vec![Some(140024588795904), None]);
    let (line, reason) = parse_err("# segment_alloc 1 2 3\n");
    assert_eq!(line, 1);
    assert!(reason.contains("optionally an address"), "{reason}");
    assert!(parse_text("m", "# segment_alloc 1 x\n").is_err());
}

#[test]
fn deeply_nested_pickles_are_errors_not_stack_overflows() {
    // 100,000 levels overflowed the decoder's stack (an abort, not a panic).
    let err = parse_pickle("deep", &nesting::tests::nested_lists(100_000)).unwrap_err();
    assert!(matches!(err, TraceError::Pickle(_)), "{err}");
    assert!(err.to_string().contains("nested"), "{err}");
    // The deepest accepted nesting decodes on a thread with a 2 MiB stack
    // (a Rust thread's default) and is then refused for its shape.
    let worker = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(|| {
            parse_pickle(
                "deepest",
                &nesting::tests::nested_lists(nesting::MAX_DEPTH as usize),
            )
        })
        .unwrap();
    let err = worker.join().expect("no stack overflow").unwrap_err();
    assert!(matches!(err, TraceError::Snapshot(_)), "{err}");
}

#[test]
fn memoized_lists_chained_in_reverse_order_are_refused() {
    // Memoized lists L0..Ln, each appended into the next from the last to
    // the first: as parsed each holds one reference, resolved they nest n
    // deep (the decoder would overflow its stack converting them).
    let n: u32 = 50_000;
    let mut p = vec![0x80, 4];
    for _ in 0..n {
        p.extend_from_slice(b"]\x94");
    }
    for k in (1..n).rev() {
        p.push(b'j');
        p.extend_from_slice(&k.to_le_bytes());
        p.push(b'j');
        p.extend_from_slice(&(k - 1).to_le_bytes());
        p.extend_from_slice(b"a0");
    }
    p.push(b'j');
    p.extend_from_slice(&(n - 1).to_le_bytes());
    p.push(b'.');
    let err = parse_pickle("chain", &p).unwrap_err();
    assert!(matches!(err, TraceError::Pickle(_)), "{err}");
}

#[test]
fn a_gzip_bomb_is_refused_before_it_is_inflated() {
    // 24 MiB of zeros in 24 KB: far past what any trace compresses to.
    let bomb = gzip(&vec![0u8; 24 << 20]);
    assert!(bomb.len() < 64 << 10);
    let err = parse_bytes("bomb", &bomb).unwrap_err().to_string();
    assert!(
        err.contains("decompression bomb"),
        "{}",
        &err[..err.len().min(200)]
    );
    // The bundled traces inflate about 4:1.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces");
    let small = std::fs::read(format!("{dir}/small_mlp.trace.gz")).unwrap();
    assert!(parse_bytes("small_mlp", &small).is_ok());
}

#[test]
fn errors_quote_at_most_the_start_of_a_long_field() {
    // A megabyte-long first field (a binary file read as text) was quoted
    // whole in the error.
    let long = "x".repeat(1 << 20);
    for text in [format!("{long} 1 2 3\n"), format!("a {long} 1 0\n")] {
        let err = parse_text("t", &text).unwrap_err().to_string();
        assert!(err.len() < 200, "{} bytes", err.len());
        assert!(err.contains("(1048576 bytes)"), "{err}");
    }
}
