//! Shared helpers for the replay integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use alloc_replay::{load_trace, ReplayOptions, Trace};

/// The repository's bundled traces.
pub fn traces_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces")
}

/// The bundled trace `name` (its `.trace.gz`, else its `.snapshot.pickle`).
pub fn bundled_trace(name: &str) -> Trace {
    let path = ["trace.gz", "snapshot.pickle"]
        .iter()
        .map(|ext| traces_dir().join(format!("{name}.{ext}")))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no trace file for {name}"));
    load_trace(&path).unwrap()
}

/// One untimed pass.
pub fn untimed() -> ReplayOptions {
    let mut opts = ReplayOptions::default();
    opts.timed_runs = 0;
    opts
}
