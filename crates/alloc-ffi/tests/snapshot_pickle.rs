//! Snapshots pickle to the structure of `torch.cuda.memory._snapshot()`:
//! checked by loading them with the system's `python3` (no torch needed) and
//! running the invariants of `torch.cuda._memory_viz.segsum` on them.

use std::process::Command;

use alloc_core::{AllocatorConfig, Engine, EngineOptions, SimMemory, SimStreams, StreamId, MIB};
use alloc_ffi::snapshot::{segments_of, settings_of, to_pickle, PySnapshot, TraceEntry};
use alloc_policy::AnyPolicy;

mod common;

/// PyTorch's default policy on an 80 GiB simulated device.
fn sim_engine() -> Engine<AnyPolicy, SimMemory, SimStreams> {
    let policy = AnyPolicy::from_config(&AllocatorConfig::default()).unwrap();
    Engine::new(
        policy,
        SimMemory::new(80 << 30),
        SimStreams::new(),
        EngineOptions::default(),
    )
}

/// An engine on the simulated device with allocated, cached and pending blocks
/// in both pools.
fn engine_snapshot() -> alloc_core::Snapshot {
    let mut e = sim_engine();
    let s0 = StreamId(0);
    let s1 = StreamId(0x5555_0000);
    let a = e.malloc(1000, s0).unwrap();
    let _b = e.malloc(3000, s0).unwrap();
    let c = e.malloc(5 * MIB + 7, s0).unwrap();
    let _d = e.malloc(30 * MIB, s1).unwrap();
    let p = e.malloc(4096, s0).unwrap();
    e.free(a.addr).unwrap();
    e.free(c.addr).unwrap();
    e.record_stream(p.addr, s1).unwrap();
    e.free(p.addr).unwrap(); // pending on s1's event
    e.validate().unwrap();
    e.snapshot()
}

fn python3() -> Option<&'static str> {
    Command::new("python3")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| "python3")
}

const CHECK: &str = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], "rb"))
assert isinstance(d, dict) and set(d) == {"segments", "device_traces", "allocator_settings"}, d.keys()
segs = d["segments"]
assert len(segs) >= 3, len(segs)
states = set()
for seg in segs:
    for k, t in [("device", int), ("address", int), ("total_size", int), ("allocated_size", int),
                 ("active_size", int), ("requested_size", int), ("stream", int),
                 ("segment_type", str), ("segment_pool_id", tuple), ("is_expandable", bool),
                 ("frames", list), ("blocks", list)]:
        assert isinstance(seg[k], t), (k, type(seg[k]))
    assert seg["segment_pool_id"] == (0, 0)
    assert seg["segment_type"] in ("small", "large")
    assert seg["device"] == 0
    addr = seg["address"]
    for b in seg["blocks"]:
        assert b["address"] == addr, "blocks tile the segment in order"
        addr += b["size"]
        assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
        assert isinstance(b["frames"], list) and isinstance(b["requested_size"], int)
        states.add(b["state"])
    assert addr == seg["address"] + seg["total_size"]
    # segsum's invariant (torch/cuda/_memory_viz.py)
    alloc = sum(b["requested_size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    internal = sum(b["size"] - b["requested_size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    external = sum(b["size"] for b in seg["blocks"] if b["state"] != "active_allocated")
    assert alloc + internal + external == seg["total_size"]
    assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
assert states == {"active_allocated", "active_pending_free", "inactive"}, states
assert 0x55550000 in {s["stream"] for s in segs}
tr = d["device_traces"]
assert isinstance(tr, list) and len(tr) == 1 and len(tr[0]) == 4, tr
assert [e["action"] for e in tr[0]] == ["alloc", "free_requested", "free_completed", "oom"]
for e in tr[0]:
    assert set(e) >= {"action", "addr", "size", "stream", "time_us", "frames"}, e
assert tr[0][3]["device_free"] == 123 and "device_free" not in tr[0][0]
st = d["allocator_settings"]
assert st["max_split_size"] == -1 and st["expandable_segments"] is False
assert st["garbage_collection_threshold"] == 0.0
assert st["roundup_power2_divisions"]["1"] == 0
print("pickle ok", len(segs), "segments")
"#;

#[test]
fn snapshot_pickle_loads_in_python_with_pytorchs_structure() {
    let snap = engine_snapshot();
    let entry = |action, size, device_free| TraceEntry {
        action,
        addr: 0x7000_0000,
        size,
        stream: 0,
        time_us: 1_700_000_000_000_000,
        frames: vec![],
        device_free,
    };
    let py = PySnapshot {
        segments: segments_of(0, &snap),
        device_traces: vec![vec![
            entry("alloc", 512, None),
            entry("free_requested", 512, None),
            entry("free_completed", 512, None),
            entry("oom", 1 << 40, Some(123)),
        ]],
        allocator_settings: settings_of("", &AllocatorConfig::default(), "pytorch-bfc"),
    };
    let bytes = to_pickle(&py).unwrap();
    let Some(python) = python3() else {
        common::missing_tool("no python3 to load the pickle");
        return;
    };
    let dir = std::env::temp_dir().join(format!("gpualloc_pickle_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("snapshot.pickle");
    std::fs::write(&path, bytes).unwrap();
    let out = Command::new(python)
        .args(["-c", CHECK])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "python3 check failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("pickle ok"));
}

/// The text the C++ bridge parses: one line per segment, block and trace
/// event, fields as documented on `to_text`, private pools named.
#[test]
fn snapshot_text_for_the_bridge_lists_every_segment_block_and_event() {
    let mut e = sim_engine();
    let a = e.malloc(1000, StreamId(0)).unwrap();
    e.begin_allocate_to_pool((7, 0));
    let g = e.malloc_in(3 * MIB, StreamId(0x40), Some((7, 0))).unwrap();
    e.end_allocate_to_pool((7, 0)).unwrap();
    let snap = e.snapshot();
    let py = PySnapshot {
        segments: segments_of(0, &snap),
        device_traces: vec![vec![TraceEntry {
            action: "alloc",
            addr: a.addr,
            size: 1000,
            stream: 0,
            time_us: 42,
            frames: Vec::new(),
            device_free: None,
        }]],
        allocator_settings: settings_of("", &AllocatorConfig::default(), "pytorch-bfc"),
    };
    let text = alloc_ffi::snapshot::to_text(&py);
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
    let segments: Vec<&Vec<&str>> = lines.iter().filter(|l| l[0] == "segment").collect();
    assert_eq!(segments.len(), snap.segments.len());
    for l in &lines {
        let fields = match l[0] {
            "segment" => 9,
            "block" => 5,
            "trace" => 7,
            other => panic!("unknown line kind {other}: {text}"),
        };
        assert_eq!(l.len(), fields, "{l:?}");
    }
    let blocks = lines.iter().filter(|l| l[0] == "block").count();
    let expected: usize = snap.segments.iter().map(|s| s.blocks.len()).sum();
    assert_eq!(blocks, expected);
    // The graph's segment names its pool and its real stream.
    let pooled = segments
        .iter()
        .find(|l| l[7] == "7" && l[8] == "0")
        .expect("a segment of pool (7, 0)");
    assert_eq!(pooled[4], "64", "stream 0x40");
    let seg_addr: u64 = pooled[2].parse().unwrap();
    let seg_size: u64 = pooled[3].parse().unwrap();
    assert!((seg_addr..seg_addr + seg_size).contains(&g.addr));
    assert!(
        text.contains(&format!("block {} 1024 1000 active_allocated\n", a.addr)),
        "{text}"
    );
    assert!(text.contains(&format!("trace 0 alloc {} 1000 0 42", a.addr)));
}
