//! Snapshots in the format of `torch.cuda.memory._snapshot()`, pickled for
//! `torch.cuda._memory_viz` and <https://pytorch.org/memory_viz>, and the
//! optional allocation history behind their `device_traces`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use alloc_core::{AllocatorConfig, Pool, Snapshot, SnapshotState};
use serde::Serialize;

/// One block of a segment, as PyTorch's snapshot has it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PyBlock {
    /// Device address.
    pub address: u64,
    /// Bytes of the block.
    pub size: u64,
    /// Bytes the caller asked for (0 for inactive blocks).
    pub requested_size: u64,
    /// `active_allocated`, `active_pending_free` or `inactive`.
    pub state: &'static str,
    /// Python frames of the allocation: always empty here.
    pub frames: Vec<PyFrame>,
}

/// A stack frame (never filled: the allocator sees no Python stacks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PyFrame {
    /// Source file.
    pub filename: String,
    /// Line.
    pub line: i64,
    /// Function.
    pub name: String,
}

/// One segment, as PyTorch's snapshot has it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PySegment {
    /// Device index.
    pub device: i64,
    /// Device address.
    pub address: u64,
    /// Bytes of the segment.
    pub total_size: u64,
    /// Bytes of allocated blocks.
    pub allocated_size: u64,
    /// Bytes of allocated or pending blocks.
    pub active_size: u64,
    /// Bytes requested over active blocks.
    pub requested_size: u64,
    /// Raw `cudaStream_t` of the segment.
    pub stream: u64,
    /// `small` or `large`.
    pub segment_type: &'static str,
    /// Memory pool id: `(0, 0)`, the default pool (a Python tuple).
    pub segment_pool_id: (i64, i64),
    /// Whether the segment grows (expandable segments).
    pub is_expandable: bool,
    /// Frames of the segment's allocation: always empty.
    pub frames: Vec<PyFrame>,
    /// Blocks in address order.
    pub blocks: Vec<PyBlock>,
    /// The sleep tag of the segment's pool (ours; absent when untagged).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Whether that tag is paused (ours): no page of the segment is mapped.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
}

/// One event of `device_traces`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceEntry {
    /// `alloc`, `free_requested`, `free_completed` or `oom`.
    pub action: &'static str,
    /// Block address (0 for `oom`).
    pub addr: u64,
    /// Bytes requested.
    pub size: u64,
    /// Raw `cudaStream_t`.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: i64,
    /// Always empty.
    pub frames: Vec<PyFrame>,
    /// Free device bytes, for `oom` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
}

/// The whole pickled object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PySnapshot {
    /// Segments of every device included, in address order per device.
    pub segments: Vec<PySegment>,
    /// Recorded events, one list per device index `0..=max device`.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// Settings in effect (the first device's when several).
    pub allocator_settings: BTreeMap<String, SettingValue>,
}

/// A value of `allocator_settings`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum SettingValue {
    /// A string.
    Str(String),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A `{interval: divisions}` dict.
    Map(BTreeMap<String, i64>),
}

fn pool_name(p: Pool) -> &'static str {
    match p {
        Pool::Small => "small",
        Pool::Large => "large",
    }
}

fn state_name(s: SnapshotState) -> &'static str {
    match s {
        SnapshotState::ActiveAllocated => "active_allocated",
        SnapshotState::ActivePendingFree => "active_pending_free",
        SnapshotState::Inactive => "inactive",
    }
}

/// The segments of one device's engine snapshot in PyTorch's layout.
pub fn segments_of(device: usize, snap: &Snapshot) -> Vec<PySegment> {
    snap.segments
        .iter()
        .map(|s| PySegment {
            device: device as i64,
            address: s.address,
            total_size: s.total_size,
            allocated_size: s.allocated_size,
            active_size: s.active_size,
            requested_size: s.requested_size,
            stream: s.stream.0,
            segment_type: pool_name(s.segment_type),
            segment_pool_id: s.private_pool.map_or((0, 0), |(a, b)| (a as i64, b as i64)),
            is_expandable: s.is_expandable,
            frames: Vec::new(),
            blocks: s
                .blocks
                .iter()
                .map(|b| PyBlock {
                    address: b.address,
                    size: b.size,
                    requested_size: b.requested_size,
                    state: state_name(b.state),
                    frames: Vec::new(),
                })
                .collect(),
            tag: s.tag.clone(),
            paused: s.paused,
        })
        .collect()
}

/// The snapshot as line-oriented text for the C++ bridge (no JSON or pickle
/// parser needed there). One line per item, fields separated by spaces:
///
/// ```text
/// segment <device> <address> <total_size> <stream> <small|large> <expandable 0|1> <pool_first> <pool_second>
/// block <address> <size> <requested_size> <active_allocated|active_pending_free|inactive>
/// trace <device> <action> <address> <size> <stream> <time_us>
/// ```
/// Blocks follow their segment, in address order; traces come last.
pub fn to_text(snap: &PySnapshot) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for s in &snap.segments {
        let _ = writeln!(
            out,
            "segment {} {} {} {} {} {} {} {}",
            s.device,
            s.address,
            s.total_size,
            s.stream,
            s.segment_type,
            u8::from(s.is_expandable),
            s.segment_pool_id.0,
            s.segment_pool_id.1
        );
        for b in &s.blocks {
            let _ = writeln!(
                out,
                "block {} {} {} {}",
                b.address, b.size, b.requested_size, b.state
            );
        }
    }
    for (device, trace) in snap.device_traces.iter().enumerate() {
        for t in trace {
            let _ = writeln!(
                out,
                "trace {device} {} {} {} {} {}",
                t.action, t.addr, t.size, t.stream, t.time_us
            );
        }
    }
    out
}

/// PyTorch-style `allocator_settings` for a configuration.
pub fn settings_of(
    conf_text: &str,
    cfg: &AllocatorConfig,
    policy: &str,
) -> BTreeMap<String, SettingValue> {
    use SettingValue::*;
    let mut m = BTreeMap::new();
    m.insert("GPUALLOC_CONF".into(), Str(conf_text.into()));
    m.insert("policy".into(), Str(policy.into()));
    let max_split = if cfg.max_split_size == u64::MAX {
        -1
    } else {
        cfg.max_split_size as i64
    };
    m.insert("max_split_size".into(), Int(max_split));
    m.insert(
        "max_non_split_rounding_size".into(),
        Int(cfg.max_non_split_rounding as i64),
    );
    m.insert(
        "garbage_collection_threshold".into(),
        Float(cfg.garbage_collection_threshold.unwrap_or(0.0)),
    );
    m.insert("expandable_segments".into(), Bool(cfg.expandable_segments));
    m.insert("stream_wait_reuse".into(), Bool(cfg.stream_wait_reuse));
    let divisions = cfg
        .roundup_power2_divisions
        .iter()
        .enumerate()
        .map(|(i, d)| (format!("{}", 1u64 << i), *d as i64))
        .collect();
    m.insert("roundup_power2_divisions".into(), Map(divisions));
    m
}

/// The snapshot as pickle bytes (protocol 3; dicts, lists, tuples, ints,
/// strings and booleans only, so `pickle.load` needs no import).
pub fn to_pickle(snap: &PySnapshot) -> Result<Vec<u8>, String> {
    serde_pickle::to_vec(snap, serde_pickle::SerOptions::new()).map_err(|e| e.to_string())
}

/// Default number of events kept per device.
pub const DEFAULT_HISTORY: usize = 100_000;

/// Whether events are being recorded (checked on every malloc / free).
pub(crate) static RECORDING: AtomicBool = AtomicBool::new(false);

struct History {
    capacity: usize,
    devices: Vec<VecDeque<TraceEntry>>,
}

static HISTORY: Mutex<History> = Mutex::new(History {
    capacity: DEFAULT_HISTORY,
    devices: Vec::new(),
});

fn history() -> std::sync::MutexGuard<'static, History> {
    alloc_cuda::lock::lock_consistent(&HISTORY)
}

/// Starts (clearing earlier events) or stops recording.
pub(crate) fn set_recording(enabled: bool, max_entries: isize) {
    let mut h = history();
    if enabled {
        h.capacity = if max_entries <= 0 {
            DEFAULT_HISTORY
        } else {
            max_entries as usize
        };
        h.devices.clear();
    }
    RECORDING.store(enabled, Ordering::Release);
}

/// Whether events are recorded now.
#[inline]
pub(crate) fn recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Records one event of `device` (when recording).
pub(crate) fn record(
    device: usize,
    action: &'static str,
    addr: u64,
    size: u64,
    stream: u64,
    device_free: Option<u64>,
) {
    let mut h = history();
    if !recording() {
        return;
    }
    if h.devices.len() <= device {
        h.devices.resize_with(device + 1, VecDeque::new);
    }
    let cap = h.capacity;
    let q = &mut h.devices[device];
    if q.len() >= cap {
        q.pop_front();
    }
    q.push_back(TraceEntry {
        action,
        addr,
        size,
        stream,
        time_us: now_us(),
        frames: Vec::new(),
        device_free,
    });
}

/// The recorded events of devices `0..n` (empty lists where none).
pub(crate) fn traces(n: usize) -> Vec<Vec<TraceEntry>> {
    let h = history();
    (0..n)
        .map(|d| {
            h.devices
                .get(d)
                .map(|q| q.iter().cloned().collect())
                .unwrap_or_default()
        })
        .collect()
}

/// Devices with recorded events: one past the highest index.
pub(crate) fn traced_devices() -> usize {
    history().devices.len()
}
