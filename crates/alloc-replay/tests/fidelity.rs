//! Fidelity: replaying the bundled traces with `pytorch-bfc` reproduces the
//! peak reserved bytes and the number of cudaMalloc calls that PyTorch itself
//! measured while recording them (`traces/measured.json`), within 0.5%; and
//! with `expandable_segments:true`, the peak reserved bytes of PyTorch's own
//! runs with expandable segments.

mod common;

use alloc_replay::replay;
use common::{bundled_trace, traces_dir, untimed};
use serde_json::Value;

const TOLERANCE: f64 = 0.005;
/// Published GiB figures carry two decimals: allow their rounding too.
const GIB_ROUNDING: f64 = 0.005 * (1u64 << 30) as f64;

fn within(actual: f64, expected: f64, slack: f64) -> bool {
    (actual - expected).abs() <= expected * TOLERANCE + slack
}

fn measured() -> serde_json::Map<String, Value> {
    serde_json::from_str(
        &std::fs::read_to_string(traces_dir().join("measured.json")).expect("traces/measured.json"),
    )
    .expect("measured.json is a JSON object")
}

/// A measured figure in bytes (`<key>_bytes`, exact) or GiB (`<key>_gib`,
/// two decimals), with the slack its rounding needs.
fn figure(m: &Value, key: &str) -> Option<(f64, f64)> {
    if let Some(v) = m.get(format!("{key}_bytes")) {
        return Some((v.as_f64().unwrap(), 0.0));
    }
    m.get(format!("{key}_gib"))
        .map(|v| (v.as_f64().unwrap() * (1u64 << 30) as f64, GIB_ROUNDING))
}

#[test]
fn expandable_segments_reproduce_pytorchs_expandable_runs() {
    let mut checked = 0;
    for (name, m) in &measured() {
        let Some((expected, slack)) = figure(m, "peak_reserved_expandable") else {
            continue;
        };
        let trace = bundled_trace(name);
        let config = "policy:pytorch-bfc,expandable_segments:true";
        let report = replay(&trace, config, &untimed()).unwrap().report;
        println!(
            "{name}: expandable reserved {} vs PyTorch {expected:.0}, device allocs {} vs {:?}",
            report.peak_reserved_bytes,
            report.device_allocs,
            m.get("num_device_alloc_expandable")
        );
        assert!(
            within(report.peak_reserved_bytes as f64, expected, slack),
            "{name}: peak reserved with expandable segments {} vs PyTorch {expected}",
            report.peak_reserved_bytes
        );
        if slack == 0.0 {
            // Exact figures: the same bytes, and as many mapping steps.
            assert_eq!(report.peak_reserved_bytes as f64, expected, "{name}");
            if let Some(n) = m.get("num_device_alloc_expandable") {
                assert_eq!(report.device_allocs, n.as_u64().unwrap(), "{name}");
            }
        }
        checked += 1;
    }
    assert!(checked >= 9, "only {checked} traces checked");
}

#[test]
fn pytorch_bfc_reproduces_pytorch_measurements() {
    let opts = untimed();
    let mut checked = 0;
    for (name, m) in &measured() {
        let trace = bundled_trace(name);
        let report = replay(&trace, "policy:pytorch-bfc", &opts).unwrap().report;
        // PyTorch's count includes segments made before recording began; the
        // replay makes their equivalents itself.
        let before_recording =
            m["num_device_alloc"].as_u64().unwrap() as i64 - trace.segment_allocs.len() as i64;
        let (expected_reserved, slack) = figure(m, "peak_reserved").expect("peak reserved");
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
