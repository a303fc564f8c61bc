//! Fidelity: replaying the bundled traces with `pytorch-bfc` reproduces the
//! peak reserved bytes and the number of cudaMalloc calls that PyTorch itself
//! measured while recording them (`traces/measured.json`), within 0.5%.

use std::path::{Path, PathBuf};

use alloc_replay::{load_trace, replay, ReplayOptions};
use serde_json::Value;

const TOLERANCE: f64 = 0.005;
/// Published GiB figures carry two decimals: allow their rounding too.
const GIB_ROUNDING: f64 = 0.005 * (1u64 << 30) as f64;

fn traces_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces")
}

fn within(actual: f64, expected: f64, slack: f64) -> bool {
    (actual - expected).abs() <= expected * TOLERANCE + slack
}

#[test]
fn pytorch_bfc_reproduces_pytorch_measurements() {
    let measured: serde_json::Map<String, Value> = serde_json::from_str(
        &std::fs::read_to_string(traces_dir().join("measured.json")).expect("traces/measured.json"),
    )
    .expect("measured.json is a JSON object");
    let opts = ReplayOptions {
        timed_runs: 0,
        ..ReplayOptions::default()
    };
    let mut checked = 0;
    for (name, m) in &measured {
        let path = ["trace.gz", "snapshot.pickle"]
            .iter()
            .map(|ext| traces_dir().join(format!("{name}.{ext}")))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("no trace file for {name}"));
        let trace = load_trace(&path).unwrap();
        let report = replay(&trace, "policy:pytorch-bfc", &opts).unwrap().report;
        // PyTorch's count includes segments made before recording began; the
        // replay makes their equivalents itself.
        let before_recording =
            m["num_device_alloc"].as_u64().unwrap() as i64 - trace.segment_allocs.len() as i64;
        let (expected_reserved, slack) = match m.get("peak_reserved_bytes") {
            Some(v) => (v.as_f64().unwrap(), 0.0),
            None => (
                m["peak_reserved_gib"].as_f64().unwrap() * (1u64 << 30) as f64,
                GIB_ROUNDING,
            ),
        };
        let expected_allocs = m["num_device_alloc"].as_f64().unwrap();
        println!(
            "{name}: reserved {} vs PyTorch {expected_reserved:.0}, device allocs {} vs {expected_allocs} ({before_recording} before recording)",
            report.peak_reserved_bytes, report.device_allocs
        );
        assert!(
            within(report.peak_reserved_bytes as f64, expected_reserved, slack),
            "{name}: peak reserved {} vs PyTorch {expected_reserved}",
            report.peak_reserved_bytes
        );
        assert!(
            within(report.device_allocs as f64, expected_allocs, 0.0),
            "{name}: {} device allocations vs PyTorch {expected_allocs}",
            report.device_allocs
        );
        // The replay's segments equal PyTorch's own, byte for byte, where the
        // trace marks them.
        let marked: u64 = trace.segment_allocs.iter().sum();
        assert!(
            report.peak_reserved_bytes >= marked,
            "{name}: fewer bytes than PyTorch's segments"
        );
        checked += 1;
    }
    assert!(checked >= 3, "only {checked} traces checked");
}
