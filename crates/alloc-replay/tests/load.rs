//! Loading trace files from disk: format detection, the synthetic snapshot pickle made by
//! `tests/data/make_pickle.py`, and (when present) the recorded traces.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use alloc_replay::{load_trace, load_trace_of, parse_pickle_device, Trace, TraceEvent};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn alloc(id: u64, size: u64, stream: u64) -> TraceEvent {
    TraceEvent::Alloc { id, size, stream }
}

fn free(id: u64, stream: u64) -> TraceEvent {
    TraceEvent::Free { id, stream }
}

#[test]
fn synthetic_pickle_maps_device_0() {
    let t = load_trace(&data("synthetic.snapshot.pickle")).unwrap();
    assert_eq!(t.name, "synthetic");
    assert_eq!(
        t.events,
        vec![
            alloc(4, 256, 0),  // freed below, allocated before the trace: first
            alloc(0, 1000, 0), // requested_size wins over size
            alloc(1, 512, 0),  // no requested_size: size
            free(0, 0),
            alloc(2, 4096, 1), // requested_size 0: size; first side stream -> 1
            alloc(3, 2000, 2), // address of id 0 reused; second side stream -> 2
            free(4, 0),        // free of an address the trace never allocated
            free(2, 1),
        ]
    );
    assert_eq!(t.segment_allocs, vec![2 << 20, 20 << 20]);
    assert_eq!(t.header[0], "pytorch memory snapshot, device 0");
    assert!(
        t.header[1].starts_with("allocator_settings"),
        "{:?}",
        t.header
    );
    assert!(
        t.header[2].starts_with("wrapped history: 1 blocks"),
        "{:?}",
        t.header
    );
}

#[test]
fn synthetic_pickle_device_1() {
    let bytes = std::fs::read(data("synthetic.snapshot.pickle")).unwrap();
    let t = parse_pickle_device("d1", &bytes, 1).unwrap();
    assert_eq!(t.events, vec![alloc(0, 60, 0), free(0, 0)]);
    assert!(t.segment_allocs.is_empty());
    assert!(parse_pickle_device("d2", &bytes, 2).is_err());
    // The same through the file loader, which text traces ignore it in.
    let path = data("synthetic.snapshot.pickle");
    assert_eq!(load_trace_of(&path, Some(1)).unwrap().events, t.events);
    assert!(load_trace_of(&path, Some(2)).is_err());
}

#[test]
fn truncated_pickle_is_an_error_not_a_panic() {
    let bytes = std::fs::read(data("synthetic.snapshot.pickle")).unwrap();
    for cut in [1, 2, 10, bytes.len() / 3, bytes.len() / 2, bytes.len() - 1] {
        assert!(
            alloc_replay::parse_pickle("cut", &bytes[..cut]).is_err(),
            "cut at {cut}"
        );
    }
}

/// Writes `bytes` to a scratch file named `name` and loads it.
fn load_scratch(name: &str, bytes: &[u8]) -> Trace {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("alloc-replay-load");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    load_trace(&path).unwrap()
}

#[test]
fn detection_is_by_content_not_extension() {
    let text = "# hi\n# segment_alloc 2097152\na 0 100 0\nf 0 0\n";
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(text.as_bytes()).unwrap();
    let gz = enc.finish().unwrap();

    let plain = load_scratch("plain.trace", text.as_bytes());
    let zipped = load_scratch("zipped.trace.gz", &gz);
    let zipped_no_ext = load_scratch("zipped_no_ext", &gz);
    assert_eq!(plain.name, "plain");
    assert_eq!(zipped.name, "zipped");
    assert_eq!(plain.events, zipped.events);
    assert_eq!(plain.events, zipped_no_ext.events);
    assert_eq!(plain.segment_allocs, vec![2097152]);

    // A pickle under a text-looking name, and a gzip'd pickle.
    let pickle = std::fs::read(data("synthetic.snapshot.pickle")).unwrap();
    let p = load_scratch("looks_like.trace", &pickle);
    assert_eq!(p.events.len(), 8);
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(&pickle).unwrap();
    let pz = load_scratch("snap.pickle.gz", &enc.finish().unwrap());
    assert_eq!(pz.name, "snap");
    assert_eq!(pz.events, p.events);
}

/// The recorded traces described in /work/shared/traces/README.md, when present.
#[test]
fn recorded_traces_load_when_present() {
    let dir = Path::new("/work/shared/traces");
    // (name, '# segment_alloc' markers, alloc lines, free lines)
    let expected = [
        ("resnet50_train", 110, 4600, 4597),
        ("gpt2_train", 153, 9045, 9042),
    ];
    for (name, segments, allocs, frees) in expected {
        let path = dir.join(format!("{name}.trace.gz"));
        if !path.exists() {
            eprintln!("skipping {}: not present", path.display());
            continue;
        }
        let t = load_trace(&path).unwrap();
        assert_eq!(t.name, name);
        assert_eq!(t.segment_allocs.len(), segments);
        assert_eq!(t.alloc_count(), allocs);
        assert_eq!(t.events.len() - allocs, frees);
        assert!(t.header[0].starts_with(&format!("workload {name}")));
    }
}

/// A snapshot recorded on the GPU, when present.
#[test]
fn recorded_snapshot_loads_when_present() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/small_mlp.snapshot.pickle");
    if !path.exists() {
        eprintln!("skipping {}: not present", path.display());
        return;
    }
    let t = load_trace(&path).unwrap();
    assert_eq!(t.name, "small_mlp");
    assert!(t.alloc_count() > 0, "no alloc events");
}
