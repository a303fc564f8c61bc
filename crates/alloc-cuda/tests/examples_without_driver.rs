//! The examples, run where no NVIDIA driver is installed, print `Error: `
//! and the error's message, which says what to do, rather than its variant's
//! name (`Error: DriverNotFound`), and exit with status 1 (their `main`
//! returns `examples/failure.rs`'s `Failure`). Where a driver is
//! installed they run on the GPU instead (`cargo xtask test-gpu`).

use std::path::{Path, PathBuf};
use std::process::Command;

use alloc_cuda::CudaError;

/// The examples' names, from the crate's `examples/` folder.
fn example_names() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| {
            let path = e.ok()?.path();
            let stem = path.file_stem()?.to_str()?.to_string();
            (path.extension()? == "rs").then_some(stem)
        })
        .collect();
    names.sort();
    names
}

/// Where `cargo test` put the examples it built: `target/<profile>/examples`,
/// beside the `deps` folder of this test's binary.
fn built_examples() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("the test binary lies in target/<profile>/deps")
        .join("examples")
}

#[test]
fn examples_without_a_driver_say_what_to_do() {
    if alloc_cuda::driver_available() {
        eprintln!("an NVIDIA driver is installed: the examples run in `cargo xtask test-gpu`");
        return;
    }
    let expected = format!("Error: {}", CudaError::DriverNotFound);
    let names = example_names();
    assert!(names.len() >= 3, "examples found: {names:?}");
    for name in names {
        let path = built_examples().join(&name);
        assert!(
            path.exists(),
            "{} is missing: `cargo test -p alloc-cuda` builds the examples",
            path.display()
        );
        let out = Command::new(&path)
            .output()
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert_eq!(stderr.trim_end(), expected, "{name}");
    }
}
