//! Reader for PyTorch memory snapshot pickles.
//!
//! `torch.cuda.memory._dump_snapshot(path)` writes `pickle.dumps(torch.cuda.memory._snapshot())`:
//! a dict with `segments`, `device_traces` (one list of trace entries per device) and
//! `allocator_settings`. Each trace entry is a dict with at least `action`, and for the
//! actions used here `addr`, `size` and `stream` (optionally `requested_size`); other keys
//! (`frames`, `time_us`, `compile_context`, `user_metadata`, ...) are ignored.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};

use serde_pickle::{DeOptions, HashableValue, Value};

use super::model::{Trace, TraceError, TraceEvent};

mod preflight;

pub(crate) use preflight::{BASE_UNITS, UNITS_PER_BYTE, UNIT_BYTES};

/// Parses a PyTorch memory snapshot pickle, taking the trace of the first
/// device that has events (a snapshot recorded on device 1 has an empty
/// trace for device 0).
///
/// See [`parse_pickle_device`] for how trace entries are mapped to [`TraceEvent`]s.
pub fn parse_pickle(name: &str, bytes: &[u8]) -> Result<Trace, TraceError> {
    let root = decode(bytes)?;
    let devices = device_traces(&root)?;
    let device = devices
        .iter()
        .position(|t| as_seq(t).is_ok_and(|e| !e.is_empty()))
        .ok_or_else(|| TraceError::Snapshot(NO_EVENTS.into()))?;
    build(name, &root, device)
}

/// What an empty history lacks, and how to record one.
const NO_EVENTS: &str = "the snapshot has no allocation events: call \
     torch.cuda.memory._record_memory_history() before the allocations to record, then \
     torch.cuda.memory._dump_snapshot()";

/// Parses a PyTorch memory snapshot pickle, taking the trace of device `device`.
///
/// Mapping of `device_traces[device]` entries:
/// * `alloc` becomes [`TraceEvent::Alloc`] with a fresh id for the address, of
///   `requested_size` bytes when that field is present and nonzero, else `size` bytes;
/// * `free_requested` becomes [`TraceEvent::Free`] of the id live at that address; when
///   the address is unknown (allocated before the first recorded event: the history
///   wrapped, or started late), an [`TraceEvent::Alloc`] of the entry's `size` for a fresh
///   id is placed before all recorded events;
/// * `free_completed` becomes [`TraceEvent::FreeCompleted`] of that id where other entries
///   came between it and the request: PyTorch records the two together unless the block
///   was used on other streams (`record_stream`), when the block waits for those streams'
///   events and no allocation in between can reuse it (a request never completed, the
///   snapshot taken while it waited, or whose address was handed out again without a
///   completion, completes at once; a completion without a request is ignored);
/// * blocks allocated in the snapshot's `segments` of `device` (or freed and waiting for
///   other streams there: `active_pending_free`) that no event of the trace allocated or
///   freed are allocated first too, so the replay starts from the state
///   the snapshot describes; a header line says how many such blocks there were;
/// * `segment_alloc` appends its `size` to [`Trace::segment_allocs`];
/// * every other action (`segment_free`, `segment_map`, `segment_unmap`,
///   `snapshot`, `oom`, ...) is ignored.
///
/// Raw stream handles are renumbered in order of first appearance, keeping raw 0 (the
/// default stream) as 0. Python objects the reader cannot represent (class instances in
/// `frames` or `user_metadata`, for example) are read as `None`.
///
/// Errors: [`TraceError::Pickle`] when the bytes do not decode (or would nest hundreds
/// deep, take far more memory than their size, or make a set), [`TraceError::Snapshot`]
/// when the structure is not that of a snapshot, `device` has no trace or an empty one, a
/// used field is missing or not an integer, or an `alloc` names an address that is still
/// live.
pub fn parse_pickle_device(name: &str, bytes: &[u8], device: usize) -> Result<Trace, TraceError> {
    build(name, &decode(bytes)?, device)
}

/// The snapshot's top-level dict. What the decoder cannot take safely is
/// refused first: nesting that would overflow its stack
/// ([`nesting`](super::nesting)), and copies that would take far more memory
/// than the input or sets it cannot order ([`preflight`]).
fn decode(bytes: &[u8]) -> Result<BTreeMap<HashableValue, Value>, TraceError> {
    // The decoder recurses per level: refuse what would overflow the stack.
    super::nesting::check(bytes, super::nesting::MAX_DEPTH).map_err(TraceError::Pickle)?;
    preflight::check(bytes).map_err(TraceError::Pickle)?;
    let options = DeOptions::new()
        .replace_unresolved_globals()
        .replace_recursive_structures();
    let root = serde_pickle::value_from_slice(bytes, options)
        .map_err(|e| TraceError::Pickle(e.to_string()))?;
    match root {
        Value::Dict(root) => Ok(root),
        other => Err(TraceError::Snapshot(format!(
            "top level is {}, expected a dict",
            kind(&other)
        ))),
    }
}

/// The per-device trace lists.
fn device_traces(root: &BTreeMap<HashableValue, Value>) -> Result<&[Value], TraceError> {
    let snap = |m: String| TraceError::Snapshot(m);
    let traces = field(root, "device_traces")
        .ok_or_else(|| snap("no 'device_traces' key (was memory history recorded?)".into()))?;
    as_seq(traces).map_err(|m| snap(format!("'device_traces': {m}")))
}

/// The trace of `device`, with the blocks allocated before its first event.
fn build(
    name: &str,
    root: &BTreeMap<HashableValue, Value>,
    device: usize,
) -> Result<Trace, TraceError> {
    let snap = |m: String| TraceError::Snapshot(m);
    let devices = device_traces(root)?;
    let entries = devices.get(device).ok_or_else(|| {
        snap(format!(
            "no trace for device {device}: the snapshot has {} device(s)",
            devices.len()
        ))
    })?;
    let entries = as_seq(entries).map_err(|m| snap(format!("device_traces[{device}]: {m}")))?;
    if entries.is_empty() {
        return Err(snap(format!("device {device}: {NO_EVENTS}")));
    }

    let mut builder = Builder::default();
    builder.trace.name = name.to_string();
    builder
        .trace
        .header
        .push(format!("pytorch memory snapshot, device {device}"));
    if let Some(settings) = field(root, "allocator_settings") {
        builder
            .trace
            .header
            .push(format!("allocator_settings {settings}"));
    }
    for (i, entry) in entries.iter().enumerate() {
        builder
            .entry(entry)
            .map_err(|m| snap(format!("device_traces[{device}][{i}]: {m}")))?;
    }
    let orphans = builder.prelude.len();
    if let Some(segments) = field(root, "segments") {
        let segments = as_seq(segments).map_err(|m| snap(format!("'segments': {m}")))?;
        for (i, seg) in segments.iter().enumerate() {
            builder
                .live_at_snapshot(seg, device)
                .map_err(|m| snap(format!("segments[{i}]: {m}")))?;
        }
    }
    let unseen = builder.prelude.len() - orphans;
    if orphans + unseen > 0 {
        // A history that wrapped (max_entries) or started after these
        // blocks were allocated: they are allocated first in the replay.
        builder.trace.header.push(format!(
            "wrapped history: {} blocks allocated before the first recorded event ({orphans} \
             freed in the trace, {unseen} live in the snapshot's segments); the replay \
             allocates them first",
            orphans + unseen
        ));
    }
    let mut events = std::mem::take(&mut builder.prelude);
    events.append(&mut builder.trace.events);
    builder.trace.events = events;
    Ok(builder.trace)
}

/// Accumulates events while walking the trace entries.
#[derive(Default)]
struct Builder {
    trace: Trace,
    /// Live allocations: address -> id.
    live: HashMap<u64, u64>,
    /// Raw stream handle -> small stream id.
    streams: HashMap<i128, u64>,
    next_id: u64,
    /// Allocations of blocks allocated before the first recorded event,
    /// placed before the recorded events.
    prelude: Vec<TraceEvent>,
    /// Addresses allocated or freed in the trace.
    seen: HashSet<u64>,
    /// Frees requested and not yet completed: address -> the id freed, and
    /// the index of its [`TraceEvent::Free`].
    pending: HashMap<u64, (u64, usize)>,
}

impl Builder {
    fn entry(&mut self, entry: &Value) -> Result<(), String> {
        let Value::Dict(map) = entry else {
            return Err(format!("entry is {}, expected a dict", kind(entry)));
        };
        let action = match field(map, "action") {
            Some(Value::String(s)) => s.as_str(),
            Some(Value::Bytes(b)) => std::str::from_utf8(b).unwrap_or(""),
            Some(other) => return Err(format!("'action' is {}, expected a string", kind(other))),
            None => return Err("no 'action' key".into()),
        };
        match action {
            "alloc" => {
                let addr = uint(map, "addr")?;
                let size = match field(map, "requested_size") {
                    Some(v) if !matches!(v, Value::None) => match to_u64(v, "requested_size")? {
                        0 => uint(map, "size")?,
                        n => n,
                    },
                    _ => uint(map, "size")?,
                };
                let stream = self.stream(map)?;
                let id = self.fresh_id();
                self.seen.insert(addr);
                // An address handed out again without its free's completion
                // recorded: that free completed at once.
                self.pending.remove(&addr);
                match self.live.entry(addr) {
                    Entry::Occupied(_) => {
                        return Err(format!("alloc at address {addr:#x}, which is still live"))
                    }
                    Entry::Vacant(v) => v.insert(id),
                };
                self.trace
                    .events
                    .push(TraceEvent::Alloc { id, size, stream });
            }
            "free_requested" => {
                let addr = uint(map, "addr")?;
                let stream = self.stream(map)?;
                let id = match self.live.remove(&addr) {
                    Some(id) => id,
                    None => {
                        // Allocated before the first recorded event.
                        let id = self.fresh_id();
                        let size = uint(map, "size")?.max(1);
                        self.prelude.push(TraceEvent::Alloc { id, size, stream });
                        id
                    }
                };
                self.seen.insert(addr);
                self.pending.insert(addr, (id, self.trace.events.len()));
                self.trace.events.push(TraceEvent::Free { id, stream });
            }
            "free_completed" => {
                let addr = uint(map, "addr")?;
                match self.pending.remove(&addr) {
                    // Right after its request: the free completed at once.
                    Some((_, at)) if at + 1 == self.trace.events.len() => {}
                    Some((id, _)) => self.trace.events.push(TraceEvent::FreeCompleted { id }),
                    // Requested before the first recorded event: the block
                    // was allocated before it too, and waited until now.
                    None if !self.live.contains_key(&addr) => {
                        let stream = self.stream(map)?;
                        let id = self.fresh_id();
                        let size = uint(map, "size")?.max(1);
                        self.prelude.push(TraceEvent::Alloc { id, size, stream });
                        self.prelude.push(TraceEvent::Free { id, stream });
                        self.seen.insert(addr);
                        self.trace.events.push(TraceEvent::FreeCompleted { id });
                    }
                    // A live block's completion without a request: nothing
                    // was freed (the free the allocator recorded is the request).
                    None => {}
                }
            }
            "segment_alloc" => {
                let size = uint(map, "size")?;
                self.trace.segment_allocs.push(size);
                self.trace.segment_addrs.push(Some(uint(map, "addr")?));
            }
            _ => {}
        }
        Ok(())
    }

    /// Blocks of `seg` (a snapshot segment of `device`) allocated at the
    /// snapshot whose allocation the trace never saw: allocated first.
    fn live_at_snapshot(&mut self, seg: &Value, device: usize) -> Result<(), String> {
        let Value::Dict(seg) = seg else {
            return Err(format!("is {}, expected a dict", kind(seg)));
        };
        if field(seg, "device")
            .map(|d| to_u64(d, "device"))
            .transpose()?
            != Some(device as u64)
        {
            return Ok(());
        }
        let stream = self.stream(seg)?;
        let Some(blocks) = field(seg, "blocks") else {
            return Ok(());
        };
        let mut addr = uint(seg, "address")?;
        for block in as_seq(blocks).map_err(|m| format!("'blocks': {m}"))? {
            let Value::Dict(b) = block else {
                return Err(format!("block is {}, expected a dict", kind(block)));
            };
            let size = uint(b, "size")?;
            let here = match field(b, "address") {
                Some(v) => to_u64(v, "address")?,
                None => addr,
            };
            // A block whose free waits for other streams holds its memory
            // as an allocated one does.
            let allocated = matches!(
                field(b, "state"),
                Some(Value::String(s)) if s == "active_allocated" || s == "active_pending_free"
            );
            if allocated && !self.seen.contains(&here) {
                let requested = match field(b, "requested_size") {
                    Some(v) if !matches!(v, Value::None) => to_u64(v, "requested_size")?,
                    _ => 0,
                };
                let id = self.fresh_id();
                let size = if requested > 0 {
                    requested
                } else {
                    size.max(1)
                };
                self.prelude.push(TraceEvent::Alloc { id, size, stream });
            }
            addr = here + size;
        }
        Ok(())
    }

    fn fresh_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Maps the entry's raw `stream` (0 when absent) to a small id.
    fn stream(&mut self, map: &BTreeMap<HashableValue, Value>) -> Result<u64, String> {
        let raw = match field(map, "stream") {
            None | Some(Value::None) => 0,
            Some(v) => to_int(v, "stream")?,
        };
        if raw == 0 {
            return Ok(0);
        }
        let next = self.streams.len() as u64 + 1;
        Ok(*self.streams.entry(raw).or_insert(next))
    }
}

/// Looks up a string key (as `str` or, from old pickles, as `bytes`).
fn field<'a>(map: &'a BTreeMap<HashableValue, Value>, key: &str) -> Option<&'a Value> {
    map.get(&HashableValue::String(key.to_string()))
        .or_else(|| map.get(&HashableValue::Bytes(key.as_bytes().to_vec())))
}

/// A required non-negative integer field.
fn uint(map: &BTreeMap<HashableValue, Value>, key: &str) -> Result<u64, String> {
    match field(map, key) {
        Some(v) => to_u64(v, key),
        None => Err(format!("no '{key}' key")),
    }
}

fn to_u64(v: &Value, what: &str) -> Result<u64, String> {
    let n = to_int(v, what)?;
    u64::try_from(n).map_err(|_| format!("'{what}' is {n}, expected a non-negative 64-bit integer"))
}

fn to_int(v: &Value, what: &str) -> Result<i128, String> {
    match v {
        Value::I64(n) => Ok(i128::from(*n)),
        Value::Bool(b) => Ok(i128::from(*b)),
        Value::Int(big) => big
            .to_string()
            .parse::<i128>()
            .map_err(|_| format!("'{what}' is {big}, which is out of range")),
        other => Err(format!("'{what}' is {}, expected an integer", kind(other))),
    }
}

fn as_seq(v: &Value) -> Result<&[Value], String> {
    match v {
        Value::List(items) | Value::Tuple(items) => Ok(items),
        other => Err(format!("is {}, expected a list", kind(other))),
    }
}

/// Python-ish name of a value's type, for error messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::I64(_) | Value::Int(_) => "an int",
        Value::F64(_) => "a float",
        Value::Bytes(_) => "bytes",
        Value::String(_) => "a string",
        Value::List(_) => "a list",
        Value::Tuple(_) => "a tuple",
        Value::Set(_) | Value::FrozenSet(_) => "a set",
        Value::Dict(_) => "a dict",
    }
}
