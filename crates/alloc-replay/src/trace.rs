//! Allocation traces: the in-memory model and the readers for the on-disk formats.
//!
//! Two formats are understood:
//!
//! * the **text** format of `/work/shared/traces` (optionally gzip'd):
//!
//!   ```text
//!   # <comment>                         header line; '# segment_alloc <bytes> [<addr>]' marks a cudaMalloc
//!   a <id> <requested_bytes> <stream>   allocation request; id is unique among live allocations
//!   f <id> <stream>                     free request of allocation <id>
//!   c <id>                              the free of <id> completed later (other streams used it)
//!   ```
//!
//! * a **PyTorch memory snapshot pickle** as written by
//!   `torch.cuda.memory._dump_snapshot(path)` (see [`parse_pickle`]).
//!
//! [`load_trace`] detects the format from the file content, not its name.

mod model;
mod nesting;
mod pickle;

use std::collections::HashSet;
use std::io::Read as _;
use std::path::Path;

pub use model::{Trace, TraceError, TraceEvent};
pub use pickle::{parse_pickle, parse_pickle_device};

/// The two magic bytes that start every gzip member.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// The PROTO opcode that starts every pickle of protocol 2 or higher.
const PICKLE_PROTO: u8 = 0x80;

/// Reads a trace file, detecting its format from the content.
///
/// Gzip'd content (magic `1f 8b`) is decompressed first; content that then starts with the
/// pickle PROTO opcode (`0x80`) is read as a PyTorch snapshot (the first device with
/// events), anything else as the text format. The trace name is derived from the path
/// with [`trace_name`].
pub fn load_trace(path: &Path) -> Result<Trace, TraceError> {
    load_trace_of(path, None)
}

/// [`load_trace`], taking a snapshot's trace of `device` when given (text
/// traces have one device and ignore it).
pub fn load_trace_of(path: &Path, device: Option<usize>) -> Result<Trace, TraceError> {
    let bytes = std::fs::read(path).map_err(|source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_bytes_of(&trace_name(path), &bytes, device)
}

/// Parses trace content held in memory, detecting the format as [`load_trace`] does.
pub fn parse_bytes(name: &str, bytes: &[u8]) -> Result<Trace, TraceError> {
    parse_bytes_of(name, bytes, None)
}

/// [`parse_bytes`] with a snapshot's device, as [`load_trace_of`].
pub fn parse_bytes_of(
    name: &str,
    bytes: &[u8],
    device: Option<usize>,
) -> Result<Trace, TraceError> {
    if bytes.starts_with(&GZIP_MAGIC) {
        let limit = max_inflated(bytes.len());
        let mut plain = Vec::new();
        flate2::read::MultiGzDecoder::new(bytes)
            .take(limit + 1)
            .read_to_end(&mut plain)
            .map_err(TraceError::Gzip)?;
        if plain.len() as u64 > limit {
            return Err(TraceError::Gzip(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{} bytes inflate to more than {} KiB: a decompression bomb, not a trace",
                    bytes.len(),
                    limit >> 10
                ),
            )));
        }
        return parse_plain(name, &plain, device);
    }
    parse_plain(name, bytes, device)
}

/// How many times its size a gzip'd file may inflate to, besides
/// [`INFLATED_BASE`]. Text traces compress 3.6 to 4.7:1 and snapshot
/// pickles about 6.5:1; far more is a decompression bomb (deflate reaches
/// 1032:1), which would take memory out of all proportion to the file.
pub const MAX_INFLATION: u64 = 32;

/// Bytes any gzip'd file may inflate to, however short (64 KiB).
pub const INFLATED_BASE: u64 = 64 << 10;

/// Most bytes `len` gzip'd bytes may inflate to: [`MAX_INFLATION`] times as
/// many, and [`INFLATED_BASE`].
fn max_inflated(len: usize) -> u64 {
    (len as u64)
        .saturating_mul(MAX_INFLATION)
        .saturating_add(INFLATED_BASE)
}

/// Bytes of memory a reader may take per byte it reads (of text or pickle,
/// after any inflation): 896. The pickle reader's budget of values per
/// byte three times over (a vector holds up to twice what it uses, and
/// both its buffers while it moves; a dict's tree adds about half), and
/// 128 for the passes that walk the opcodes before decoding. The text
/// reader takes less: at most about 18 bytes per byte (a line of `#`
/// alone is a header entry of 24 bytes).
pub const READ_BYTES_PER_BYTE: u64 = 3 * pickle::UNIT_BYTES * pickle::UNITS_PER_BYTE + 128;

/// Bytes of memory a reader may take for any input, however short
/// (8 MiB): the pickle reader's budget for any pickle three times over,
/// and buffers of fixed size.
pub const READ_BASE_BYTES: u64 = 3 * pickle::UNIT_BYTES * pickle::BASE_UNITS + (2 << 20);

/// The most heap [`parse_bytes`] takes to read `len` bytes, `gzipped` or
/// not: [`READ_BYTES_PER_BYTE`] per byte of text or pickle (after inflation:
/// at most [`MAX_INFLATION`] times `len` and [`INFLATED_BASE`]), and
/// [`READ_BASE_BYTES`]; the inflated bytes themselves count once more, and
/// twice while their buffer grows.
pub fn read_memory_bound(len: usize, gzipped: bool) -> u64 {
    let plain = if gzipped {
        max_inflated(len)
    } else {
        len as u64
    };
    let inflated = if gzipped { 3 * plain } else { 0 };
    plain
        .saturating_mul(READ_BYTES_PER_BYTE)
        .saturating_add(READ_BASE_BYTES)
        .saturating_add(inflated)
}

/// Dispatches uncompressed content to the pickle or the text reader.
fn parse_plain(name: &str, bytes: &[u8], device: Option<usize>) -> Result<Trace, TraceError> {
    if bytes.first() == Some(&PICKLE_PROTO) {
        return match device {
            Some(d) => parse_pickle_device(name, bytes, d),
            None => parse_pickle(name, bytes),
        };
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => parse_text(name, text),
        Err(e) => {
            let valid = &bytes[..e.valid_up_to()];
            let line = 1 + valid.iter().filter(|&&b| b == b'\n').count();
            Err(TraceError::Parse {
                line,
                reason: "invalid UTF-8 (not a text trace, gzip file or pickle)".into(),
            })
        }
    }
}

/// Suffixes stripped (repeatedly, from the end) from a file name by [`trace_name`].
const NAME_SUFFIXES: &[&str] = &[".gz", ".trace", ".txt", ".pickle", ".pkl", ".snapshot"];

/// Derives a trace name from a path: the file name without `.gz`, `.trace`, `.txt`,
/// `.pickle`, `.pkl` and `.snapshot` suffixes, so `gpt2_train.trace.gz` gives `gpt2_train`
/// and `small_mlp.snapshot.pickle` gives `small_mlp`.
pub fn trace_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut name = file.as_str();
    while let Some(stripped) = NAME_SUFFIXES
        .iter()
        .find_map(|s| name.strip_suffix(s).filter(|rest| !rest.is_empty()))
    {
        name = stripped;
    }
    name.to_string()
}

/// Parses a trace in the text format (see the module documentation).
///
/// Blank lines are ignored. A free of an id that is not live is kept (the recording may
/// have started after that allocation was made). Errors, all [`TraceError::Parse`] with the
/// 1-based line number: an unknown operation, a wrong number of fields, a field that is not
/// a non-negative integer, a malformed `# segment_alloc` marker, and an allocation whose id
/// is still live.
pub fn parse_text(name: &str, text: &str) -> Result<Trace, TraceError> {
    let mut trace = Trace {
        name: name.to_string(),
        ..Trace::default()
    };
    let mut live: HashSet<u64> = HashSet::new();
    for (idx, raw) in text.lines().enumerate() {
        let line = idx + 1;
        let err = |reason: String| TraceError::Parse { line, reason };
        let content = raw.trim();
        if content.is_empty() {
            continue;
        }
        if let Some(comment) = content.strip_prefix('#') {
            parse_comment(comment.trim(), &mut trace).map_err(err)?;
            continue;
        }
        let fields: Vec<&str> = content.split_ascii_whitespace().collect();
        match fields[0] {
            "a" => {
                expect_fields(&fields, 4, "a <id> <requested_bytes> <stream>").map_err(err)?;
                let id = parse_u64(fields[1], "id").map_err(err)?;
                let size = parse_u64(fields[2], "requested_bytes").map_err(err)?;
                let stream = parse_u64(fields[3], "stream").map_err(err)?;
                if !live.insert(id) {
                    return Err(err(format!("allocation id {id} is already live")));
                }
                trace.events.push(TraceEvent::Alloc { id, size, stream });
            }
            "f" => {
                expect_fields(&fields, 3, "f <id> <stream>").map_err(err)?;
                let id = parse_u64(fields[1], "id").map_err(err)?;
                let stream = parse_u64(fields[2], "stream").map_err(err)?;
                live.remove(&id);
                trace.events.push(TraceEvent::Free { id, stream });
            }
            "c" => {
                expect_fields(&fields, 2, "c <id>").map_err(err)?;
                let id = parse_u64(fields[1], "id").map_err(err)?;
                if live.contains(&id) {
                    return Err(err(format!(
                        "allocation id {id} completes a free while it is live"
                    )));
                }
                trace.events.push(TraceEvent::FreeCompleted { id });
            }
            op => {
                return Err(err(format!(
                    "unknown operation {} (expected 'a', 'f', 'c' or a '#' comment)",
                    quoted(op)
                )))
            }
        }
    }
    Ok(trace)
}

/// Handles the text after `#` on a comment line.
fn parse_comment(comment: &str, trace: &mut Trace) -> Result<(), String> {
    let mut words = comment.split_ascii_whitespace();
    if words.next() == Some("segment_alloc") {
        let rest: Vec<&str> = words.collect();
        let (bytes, addr) = match rest.as_slice() {
            [bytes] => (bytes, None),
            [bytes, addr] => (bytes, Some(parse_u64(addr, "segment address")?)),
            _ => {
                return Err(format!(
                    "'# segment_alloc' takes a size and optionally an address, found {} fields",
                    rest.len()
                ))
            }
        };
        trace.segment_allocs.push(parse_u64(bytes, "segment size")?);
        trace.segment_addrs.push(addr);
    } else {
        trace.header.push(comment.to_string());
    }
    Ok(())
}

/// Checks the field count of an event line.
fn expect_fields(fields: &[&str], want: usize, form: &str) -> Result<(), String> {
    if fields.len() == want {
        Ok(())
    } else {
        Err(format!(
            "expected {want} fields ({form}), found {}",
            fields.len()
        ))
    }
}

/// Longest part of a field an error message quotes.
const QUOTED_CHARS: usize = 40;

/// `field` quoted for an error message, cut after [`QUOTED_CHARS`]
/// characters: a line of a binary file can be megabytes long.
fn quoted(field: &str) -> String {
    match field.char_indices().nth(QUOTED_CHARS) {
        Some((cut, _)) => format!("{:?}... ({} bytes)", &field[..cut], field.len()),
        None => format!("{field:?}"),
    }
}

/// Parses one non-negative integer field.
fn parse_u64(field: &str, what: &str) -> Result<u64, String> {
    field.parse::<u64>().map_err(|e| {
        format!(
            "{what} {} is not a non-negative integer ({e})",
            quoted(field)
        )
    })
}

#[cfg(test)]
mod tests;
