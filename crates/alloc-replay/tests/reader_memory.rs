//! Every reader's memory is bounded by its input: the peak heap of
//! `parse_bytes`, counted by this binary's allocator, on the bundled traces
//! and on inputs made to cost as much as possible per byte (runs of `MARK`,
//! gzip bombs of them, memo and copy opcodes, text of empty lines), stays
//! within `alloc_replay::trace::read_memory_bound` of the file's size, and
//! what is refused is a typed error.

mod peak;

use std::io::Write as _;

use alloc_replay::trace::read_memory_bound;
use alloc_replay::{parse_bytes, TraceError};

/// What `parse_bytes` on `bytes` returned (whether it read, and the error),
/// and the most heap it held.
fn peak_of_reading(bytes: &[u8]) -> (Result<(), TraceError>, u64) {
    peak::peak_of(|| parse_bytes("measured", bytes).map(drop))
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// `PROTO 4`, `body` and `STOP`.
fn pickle(body: &[u8]) -> Vec<u8> {
    [&[0x80, 4][..], body, b"."].concat()
}

/// `unit` repeated to `len` bytes.
fn run_of(unit: &[u8], len: usize) -> Vec<u8> {
    unit.iter().copied().cycle().take(len).collect()
}

/// Reads `bytes`, prints its peak against the bound, and checks the bound;
/// the result for the caller's checks.
fn within_bound(what: &str, bytes: &[u8]) -> Result<(), TraceError> {
    let (result, peak) = peak_of_reading(bytes);
    let bound = read_memory_bound(bytes.len(), bytes.starts_with(&[0x1f, 0x8b]));
    println!(
        "{what}: {} bytes, peak {peak} bytes ({:.1} per byte), bound {bound}: {}",
        bytes.len(),
        peak as f64 / bytes.len() as f64,
        match &result {
            Ok(()) => "read".to_string(),
            Err(e) => format!("refused: {}", &e.to_string()[..e.to_string().len().min(90)]),
        }
    );
    assert!(
        peak <= bound,
        "{what}: {peak} bytes at the peak, above the bound of {bound} for {} bytes",
        bytes.len()
    );
    result
}

#[test]
fn a_gzip_of_marks_is_refused_within_the_bound() {
    // 2 MiB of MARKs gzip'd to about 2 KB: 8.4 GB and 13.8 s before its
    // inflation and the MARKs were limited. Its cousin: 16 MiB in 16 KB.
    for (mib, most_bytes) in [(2usize, 2_100), (16, 16_500)] {
        let bomb = gzip(&pickle(&vec![b'('; mib << 20]));
        assert!(bomb.len() <= most_bytes, "{} bytes", bomb.len());
        let result = within_bound(&format!("{mib} MiB of MARKs gzip'd"), &bomb);
        assert!(matches!(result, Err(TraceError::Gzip(_))), "{result:?}");
    }
}

#[test]
fn a_gzip_of_marks_that_inflates_within_its_limit_is_refused_as_a_pickle() {
    // Inflation stays within the gzip limit: the pickle reader refuses it.
    let bomb = gzip(&pickle(&vec![b'('; 64 << 10]));
    let result = within_bound("64 KiB of MARKs gzip'd", &bomb);
    assert!(matches!(result, Err(TraceError::Pickle(_))), "{result:?}");
}

#[test]
fn a_raw_run_of_marks_is_refused_within_the_bound() {
    // 406 MB before MARKs were counted.
    let marks = pickle(&vec![b'('; 100 << 10]);
    let result = within_bound("100 KiB of MARKs", &marks);
    assert!(matches!(result, Err(TraceError::Pickle(_))), "{result:?}");
}

#[test]
fn pickles_made_to_cost_the_most_per_byte_stay_within_the_bound() {
    let len = 100 << 10;
    let shapes: [(&str, Vec<u8>); 9] = [
        // Lists and tuples that keep a MARK's 128 slots however few items
        // they hold.
        ("empty tuples from MARKs", pickle(&run_of(b"(t", len))),
        ("empty lists from MARKs", pickle(&run_of(b"(l", len))),
        ("one-item lists from MARKs", pickle(&run_of(b"(Nl", len))),
        // Memo entries, and references to one.
        ("memoized Nones", pickle(&run_of(b"N\x94", len))),
        (
            "references to a memoized list",
            pickle(&[&b"]\x94"[..], &run_of(b"h\x00", len)].concat()),
        ),
        // Copies of the top item.
        (
            "copies of None",
            pickle(&[&b"N"[..], &run_of(b"2", len)].concat()),
        ),
        // A long string copied by each reference.
        (
            "references to a 64 KiB string",
            pickle(
                &[
                    &b"\x8d\x00\x00\x01\x00\x00\x00\x00\x00"[..],
                    &vec![b'x'; 1 << 16],
                    b"\x94",
                    &run_of(b"h\x00", len),
                ]
                .concat(),
            ),
        ),
        // Dicts made from MARKs, and MARKs closed as they open.
        ("dicts from MARKs", pickle(&run_of(b"(d", len))),
        ("MARKs popped", pickle(&run_of(b"(1", len))),
    ];
    for (what, bytes) in &shapes {
        let result = within_bound(what, bytes);
        assert!(
            matches!(
                result,
                Ok(()) | Err(TraceError::Pickle(_) | TraceError::Snapshot(_))
            ),
            "{what}: {result:?}"
        );
    }
}

#[test]
fn a_list_copied_as_often_as_the_budget_allows_stays_within_the_bound() {
    // A short pickle may build the budget's base (64 Ki values) however
    // short it is: 4,096 Nones in a list, copied by DUP up to 22 times (and once more by
    // the conversion).
    let list = [&b"]("[..], &[b'N'; 4096], b"e"].concat();
    for copies in [8, 16, 22] {
        let bytes = pickle(&[&list[..], &vec![b'2'; copies]].concat());
        let result = within_bound(&format!("a list of 4,096 copied {copies} times"), &bytes);
        // Decoded in full: a list is no snapshot.
        assert!(matches!(result, Err(TraceError::Snapshot(_))), "{result:?}");
    }
    let too_many = pickle(&[&list[..], &[b'2'; 24]].concat());
    let result = within_bound("a list of 4,096 copied 24 times", &too_many);
    assert!(matches!(result, Err(TraceError::Pickle(_))), "{result:?}");
}

#[test]
fn text_made_to_cost_the_most_per_byte_stays_within_the_bound() {
    let len = 1 << 20;
    let ids: String = (0..)
        .map(|i| format!("a {i} 1 0\n"))
        .take_while({
            let mut total = 0;
            move |l: &String| {
                total += l.len();
                total <= len
            }
        })
        .collect();
    let shapes: [(&str, Vec<u8>); 4] = [
        ("empty comment lines", run_of(b"#\n", len)),
        ("segment markers", run_of(b"#segment_alloc 1\n", len)),
        ("one allocation a line", ids.into_bytes()),
        ("frees of unknown ids", run_of(b"f 1 0\n", len / 6 * 6)),
    ];
    for (what, bytes) in &shapes {
        within_bound(what, bytes).unwrap();
        // Text this regular inflates past the limit: refused, or read.
        let gzipped = within_bound(&format!("{what} gzip'd"), &gzip(bytes));
        assert!(
            matches!(gzipped, Ok(()) | Err(TraceError::Gzip(_))),
            "{gzipped:?}"
        );
    }
}

#[test]
fn the_bundled_traces_read_within_the_bound() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.ends_with(".trace.gz") || name.ends_with(".pickle")
        })
        .collect();
    names.sort();
    assert!(names.len() >= 10, "{names:?}");
    for path in names {
        let bytes = std::fs::read(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        within_bound(&name, &bytes).unwrap();
    }
}
