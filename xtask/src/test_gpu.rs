//! `cargo xtask test-gpu`: the GPU suites of alloc-cuda and alloc-ffi, which plain
//! `cargo test` lists as ignored.
//!
//! - `cargo xtask test-gpu` (on a machine with a GPU and a Rust toolchain):
//!   builds the release test binaries, the example(s) and the benchmark, and
//!   runs the tests with `--ignored --test-threads=1`, then the examples
//!   (`--full` adds the benchmark and compute-sanitizer).
//! - `cargo xtask test-gpu --bundle DIR` (for a GPU machine without Rust):
//!   builds the same binaries here and copies them into DIR with a `run.sh`
//!   that runs the tests, the examples, the benchmark, then the tests again
//!   under `compute-sanitizer --tool memcheck --leak-check full`, and the
//!   threads test (`gpu_threads`) under `--tool racecheck` and
//!   `--tool synccheck`, prints a PASS/FAIL summary and exits nonzero on any
//!   failure. DIR must be git-ignored (`gpu-bundle/` is).
//! - Both also carry `liballoc_ffi.so` with the Python helper and run
//!   `python/tests/gpu_torch.py`: the library inside PyTorch through the C++
//!   bridge (record_stream, torch's memory functions, snapshots, CUDA graphs,
//!   MemPool); it needs python3 with torch and a C++ compiler there
//!   (`run.sh --no-torch` leaves it out). Then `python/tests/gpu_libraries.py`:
//!   one cache for PyTorch, CuPy and Numba (needs CuPy and numba-cuda too).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

/// Features of alloc-cuda the suite is built with unless `--features` says
/// otherwise: every policy, so the suite covers them all.
const DEFAULT_FEATURES: &str = "all-policies";

/// `cargo xtask test-gpu`'s options.
pub struct Args {
    bundle: Option<PathBuf>,
    features: String,
    full: bool,
}

/// The command line (`--opt value` or `--opt=value`); a usage error.
pub fn parse(args: &[String]) -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut out = Args {
        bundle: None,
        features: DEFAULT_FEATURES.to_string(),
        full: false,
    };
    let usage = |e: lexopt::Error| e.to_string();
    let mut p = lexopt::Parser::from_args(args);
    while let Some(arg) = p.next().map_err(usage)? {
        match arg {
            Long("bundle") => out.bundle = Some(p.value().map_err(usage)?.into()),
            Long("features") => {
                out.features = p.value().map_err(usage)?.string().map_err(usage)?;
            }
            Long("full") => out.full = true,
            other => return Err(usage(other.unexpected())),
        }
    }
    Ok(out)
}

/// Builds and runs (or bundles) the GPU suite.
pub fn run(args: Args) -> Result<(), String> {
    let root = crate::workspace_root();
    let dir = match &args.bundle {
        Some(d) => {
            let d = if d.is_absolute() {
                d.clone()
            } else {
                std::env::current_dir().map_err(|e| e.to_string())?.join(d)
            };
            check_ignored(&root, &d)?;
            d
        }
        None => root.join("target/test-gpu"),
    };
    let binaries = build(&root, &args.features)?;
    write_bundle(&root, &dir, &binaries, &args.features)?;
    let script = dir.join("run.sh");
    if args.bundle.is_some() {
        let rel = dir
            .strip_prefix(&root)
            .unwrap_or(&dir)
            .display()
            .to_string();
        println!(
            "bundle ready: {} ({} test binaries, {} examples, {} benchmarks, {:.1} MiB)\n\
             on the GPU machine: bash {rel}/run.sh 2>&1 | tee $OUT/gpu-log.txt",
            dir.display(),
            binaries.tests.len(),
            binaries.examples.len(),
            binaries.bins.len(),
            dir_size(&dir) as f64 / (1 << 20) as f64,
        );
        return Ok(());
    }
    let mut cmd = Command::new("bash");
    cmd.arg(&script);
    if !args.full {
        cmd.args(["--no-bench", "--no-sanitizer"]);
    }
    let status = cmd
        .status()
        .map_err(|e| format!("running {}: {e}", script.display()))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("GPU suite failed ({status})"))
    }
}

/// A bundle directory inside the repository must be git-ignored, so that
/// it travels only when named in `carry` and is never committed.
fn check_ignored(root: &Path, dir: &Path) -> Result<(), String> {
    if !dir.starts_with(root) {
        return Ok(());
    }
    let status = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["check-ignore", "-q", "--no-index"])
        .arg(dir.join("run.sh"))
        .status()
        .map_err(|e| format!("git check-ignore: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} is not git-ignored: use gpu-bundle/ (ignored by .gitignore) or add it to .gitignore",
            dir.display()
        ))
    }
}

#[derive(Default)]
struct Binaries {
    /// (name, path) of each test binary.
    tests: Vec<(String, PathBuf)>,
    examples: Vec<(String, PathBuf)>,
    bins: Vec<(String, PathBuf)>,
    /// The C library (`liballoc_ffi.so`).
    ffi_library: PathBuf,
}

/// An executable that cargo built.
struct Artifact {
    /// Target name.
    name: String,
    /// Target kinds (`lib`, `test`, `example`, `bin`).
    kinds: Vec<String>,
    /// Built with the test harness.
    test: bool,
    path: PathBuf,
}

/// Runs cargo with `--message-format=json` and returns its JSON messages.
fn cargo_json(root: &Path, args: &[&str]) -> Result<Vec<Value>, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("$ cargo {}", args.join(" "));
    let out = Command::new(cargo)
        .current_dir(root)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo {} failed ({})", args.join(" "), out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .collect())
}

/// Runs cargo with `--message-format=json` and returns every artifact with
/// an executable.
fn cargo_executables(root: &Path, args: &[&str]) -> Result<Vec<Artifact>, String> {
    let mut found = Vec::new();
    for msg in cargo_json(root, args)? {
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let name = msg["target"]["name"]
            .as_str()
            .unwrap_or("unnamed")
            .to_string();
        let kinds = msg["target"]["kind"]
            .as_array()
            .map(|k| {
                k.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        let test = msg["profile"]["test"].as_bool().unwrap_or(false);
        found.push(Artifact {
            name,
            kinds,
            test,
            path: PathBuf::from(exe),
        });
    }
    Ok(found)
}

fn build(root: &Path, features: &str) -> Result<Binaries, String> {
    let mut b = Binaries::default();
    let feature_args: Vec<&str> = if features.is_empty() {
        vec![]
    } else {
        vec!["--features", features]
    };
    // The CUDA layer's tests (built with the suite's features), and the C
    // ABI's GPU test (with alloc-ffi's default features: every policy).
    let suites: [(&str, &str, Vec<&str>); 2] = [
        ("alloc-cuda", "", feature_args.clone()),
        ("alloc-ffi", "ffi-", vec!["--test", "gpu"]),
    ];
    for (package, prefix, extra) in suites {
        let mut test_args = vec![
            "test",
            "-p",
            package,
            "--release",
            "--no-run",
            "--message-format=json",
        ];
        test_args.extend(&extra);
        for a in cargo_executables(root, &test_args)? {
            // The library's and the integration tests' harnesses (not those
            // of the benchmark binary, which has no tests).
            if a.test && a.kinds.iter().any(|k| k == "lib" || k == "test") {
                let name = if a.kinds.iter().any(|k| k == "lib") {
                    format!("{prefix}unit-{}", a.name)
                } else {
                    format!("{prefix}{}", a.name)
                };
                b.tests.push((name, a.path));
            }
        }
    }
    let mut build_args = vec![
        "build",
        "-p",
        "alloc-cuda",
        "--release",
        "--examples",
        "--bins",
        "--message-format=json",
    ];
    build_args.extend(&feature_args);
    for a in cargo_executables(root, &build_args)? {
        if a.kinds.iter().any(|k| k == "example") {
            b.examples.push((a.name, a.path));
        } else if a.kinds.iter().any(|k| k == "bin") {
            b.bins.push((a.name, a.path));
        }
    }
    if b.tests.is_empty() {
        return Err("cargo reported no test binaries for alloc-cuda".into());
    }
    b.ffi_library = ffi_library(root)?;
    Ok(b)
}

/// Builds `liballoc_ffi.so` (release) and returns its path.
fn ffi_library(root: &Path) -> Result<PathBuf, String> {
    let args = [
        "build",
        "-p",
        "alloc-ffi",
        "--release",
        "--message-format=json",
    ];
    cargo_json(root, &args)?
        .into_iter()
        .filter(|msg| msg["reason"] == "compiler-artifact")
        .flat_map(|msg| {
            msg["filenames"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
        })
        .filter_map(|f| f.as_str().map(PathBuf::from))
        .find(|f| f.file_name().is_some_and(|n| n == "liballoc_ffi.so"))
        .ok_or_else(|| "cargo built no liballoc_ffi.so".to_string())
}

/// Files of the repository that the PyTorch tests need, as (source, place
/// in the bundle).
/// Folders of the Python helper (its sources and the bridge's) and of its
/// GPU tests, copied whole into the bundle.
const PYTHON_DIRS: &[&str] = &["python/gpu_alloc", "python/tests"];
/// Single files the Python helper reads, copied to the same place in the
/// bundle: the C header its ctypes declarations and bridge come from.
const PYTHON_FILES: &[&str] = &["crates/alloc-ffi/include/gpualloc.h"];

/// The files under `dir` (recursively), skipping bytecode caches.
fn files_under(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "__pycache__") {
                out.extend(files_under(&path)?);
            }
        } else {
            out.push(path);
        }
    }
    Ok(out)
}

fn write_bundle(root: &Path, dir: &Path, b: &Binaries, features: &str) -> Result<(), String> {
    let io = |what: &str, p: &Path, e: std::io::Error| format!("{what} {}: {e}", p.display());
    std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, e))?;
    for (sub, list) in [
        ("tests", &b.tests),
        ("examples", &b.examples),
        ("bin", &b.bins),
    ] {
        let sub_dir = dir.join(sub);
        if sub_dir.exists() {
            std::fs::remove_dir_all(&sub_dir).map_err(|e| io("removing", &sub_dir, e))?;
        }
        std::fs::create_dir_all(&sub_dir).map_err(|e| io("creating", &sub_dir, e))?;
        for (name, path) in list.iter() {
            let dest = sub_dir.join(name);
            std::fs::copy(path, &dest).map_err(|e| io("copying", path, e))?;
            // Debug info is most of a release binary's size here; the bundle
            // travels with a 64 MiB limit. Keep symbols for backtraces.
            let _ = Command::new("strip")
                .arg("--strip-debug")
                .arg(&dest)
                .status();
        }
    }
    let lib_dir = dir.join("lib");
    std::fs::create_dir_all(&lib_dir).map_err(|e| io("creating", &lib_dir, e))?;
    let lib = lib_dir.join("liballoc_ffi.so");
    std::fs::copy(&b.ffi_library, &lib).map_err(|e| io("copying", &b.ffi_library, e))?;
    let _ = Command::new("strip")
        .arg("--strip-debug")
        .arg(&lib)
        .status();
    let mut python_files: Vec<PathBuf> = PYTHON_FILES.iter().map(|f| root.join(f)).collect();
    for folder in PYTHON_DIRS {
        python_files.extend(files_under(&root.join(folder))?);
    }
    for src in python_files {
        let rel = src.strip_prefix(root).map_err(|e| e.to_string())?;
        let dest = dir.join(rel);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io("creating", parent, e))?;
        }
        std::fs::copy(&src, &dest).map_err(|e| io("copying", &src, e))?;
    }
    let rev = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let manifest = format!("alloc-cuda GPU bundle: git {rev}, features `{features}`\n");
    std::fs::write(dir.join("MANIFEST"), manifest).map_err(|e| io("writing", dir, e))?;
    let script = dir.join("run.sh");
    std::fs::write(&script, RUN_SH).map_err(|e| io("writing", &script, e))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755));
    }
    Ok(())
}

fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Generated by `cargo xtask test-gpu --bundle`: runs the alloc-cuda GPU suite
# on a machine with a GPU and no Rust toolchain.
#   bash run.sh [--no-bench] [--no-sanitizer] [--no-torch]
# Runs every test binary with --ignored --test-threads=1 --nocapture, the
# examples, the benchmark, then the tests and examples again under
# compute-sanitizer memcheck with --leak-check full, and the threads test
# (tests/gpu_threads) under racecheck and synccheck (full logs in
# ${OUT:-.}/<tool>-*.log, summary lines here; a binary that makes no CUDA
# call, like the CPU-only unit tests, is reported as SKIP). Exits nonzero on
# any failure. Then the PyTorch tests (python/tests/gpu_torch.py with
# lib/liballoc_ffi.so): they need python3 with torch and a C++ compiler; and
# python/tests/gpu_libraries.py (one cache for PyTorch, CuPy and Numba), which
# needs CuPy and numba-cuda too. Tests that arm failures in the null driver
# (null_driver_fault_tests) need its symbols and are left out here
# (crates/alloc-cuda/null-driver/run.sh --tests runs them).
set -u
SKIP=(--skip null_driver_fault_tests)
cd "$(dirname "$0")"
BENCH=1
SANITIZER=1
TORCH=1
for arg in "$@"; do
  case "$arg" in
    --no-bench) BENCH=0 ;;
    --no-sanitizer) SANITIZER=0 ;;
    --no-torch) TORCH=0 ;;
    *) echo "unknown option $arg"; exit 2 ;;
  esac
done
LOGS="${OUT:-$PWD}"
# The sanitizers write their logs there: make sure it exists.
mkdir -p "$LOGS" || { echo "cannot make the log folder $LOGS"; exit 2; }
RESULTS=()
FAILED=0

run_step() {
  local name="$1"; shift
  echo
  echo "=== $name"
  local t0; t0=$(date +%s.%N)
  "$@"
  local rc=$?
  local dt; dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" -eq 0 ]; then
    RESULTS+=("PASS  $name (${dt} s)")
  elif [ "$rc" -eq 77 ]; then
    RESULTS+=("SKIP  $name (no CUDA calls)")
  else
    RESULTS+=("FAIL  $name (exit $rc, ${dt} s)")
    FAILED=1
  fi
}

# Runs a binary under compute-sanitizer's TOOL (memcheck with --leak-check
# full), its full log in $LOGS/TOOL-NAME.log, its summary lines here.
sanitize() {
  local tool="$1"; shift
  local exe="$1"; shift
  local log="$LOGS/$tool-$(basename "$exe").log"
  local opts=()
  [ "$tool" = memcheck ] && opts=(--leak-check full)
  ALLOC_CUDA_SANITIZER=1 "$CS" --tool "$tool" ${opts[@]+"${opts[@]}"} --error-exitcode 86 \
    "$exe" "$@" >"$log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ] && grep -q 'terminated before first instrumented API call' "$log" \
     && grep -q '^test result: ok' "$log"; then
    # A binary that never calls CUDA (the CPU-only unit tests, which by
    # design never load libcuda): nothing for the tool to check.
    echo "no CUDA call in $(basename "$exe"): nothing for $tool to check"
    return 77
  fi
  grep -E '^========= (ERROR SUMMARY|LEAK SUMMARY|RACECHECK SUMMARY|Invalid|Leaked|Error|Warning|Barrier)|^test result:|^test .*FAILED|panicked|vector_add: |still running then|skipping' "$log" | head -40
  grep -E '^========= Program hit' "$log" | sort | uniq -c | head -10
  echo "(exit $rc; full log: $log)"
  return $rc
}

echo "$(cat MANIFEST)"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>/dev/null \
  || echo "(nvidia-smi not found)"

for t in tests/*; do
  run_step "test $(basename "$t")" "$t" --ignored --test-threads=1 --nocapture "${SKIP[@]}"
done
for e in examples/*; do
  [ -e "$e" ] && run_step "example $(basename "$e")" "$e"
done
if [ "$TORCH" = 1 ]; then
  run_step "torch gpu_torch.py" env GPUALLOC_SO="$PWD/lib/liballoc_ffi.so" OUT="$LOGS" \
    python3 python/tests/gpu_torch.py
  run_step "libraries gpu_libraries.py" env GPUALLOC_SO="$PWD/lib/liballoc_ffi.so" \
    python3 python/tests/gpu_libraries.py
fi
if [ "$BENCH" = 1 ]; then
  for b in bin/*; do
    [ -e "$b" ] && run_step "bench $(basename "$b")" "$b"
  done
fi
if [ "$SANITIZER" = 1 ]; then
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
       /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n1)
  if [ -n "$CS" ]; then
    "$CS" --version | tail -n1
    for t in tests/*; do
      run_step "memcheck test $(basename "$t")" sanitize memcheck "$t" --ignored --test-threads=1 --nocapture "${SKIP[@]}"
    done
    for e in examples/*; do
      [ -e "$e" ] && run_step "memcheck example $(basename "$e")" sanitize memcheck "$e"
    done
    # Racecheck and synccheck look at kernels' shared memory and barriers;
    # the library launches no kernel of its own, so they run the threads
    # test alone (see docs/gpu-tests.md for what they can find there).
    for tool in racecheck synccheck; do
      if [ -e tests/gpu_threads ]; then
        run_step "$tool test gpu_threads" sanitize "$tool" tests/gpu_threads --ignored --test-threads=1 --nocapture
      else
        RESULTS+=("FAIL  $tool: tests/gpu_threads not in the bundle")
        FAILED=1
      fi
    done
  else
    RESULTS+=("FAIL  compute-sanitizer not found")
    FAILED=1
  fi
fi

echo
echo "=== summary"
printf '%s\n' "${RESULTS[@]}"
if [ "$FAILED" = 0 ]; then echo "ALL PASSED"; else echo "SOME FAILED"; fi
exit "$FAILED"
"#;

// The script's own logic, run by bash over a fake bundle.
#[cfg(all(test, unix))]
mod tests {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use super::RUN_SH;

    /// A stand-in for compute-sanitizer: runs the program and prints the
    /// summary lines each tool ends a clean run with, or, for the tool named
    /// in `FAKE_HAZARD`, a hazard and the error exit code.
    const FAKE_SANITIZER: &str = r#"#!/usr/bin/env bash
if [ "$1" = --version ]; then echo "fake compute-sanitizer"; exit 0; fi
tool=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --tool) tool="$2"; shift 2 ;;
    --leak-check|--error-exitcode) shift 2 ;;
    *) break ;;
  esac
done
echo "tool $tool, ALLOC_CUDA_SANITIZER=${ALLOC_CUDA_SANITIZER:-unset}"
"$@"
rc=$?
if [ "$tool" = "${FAKE_HAZARD:-}" ]; then
  echo "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"
  exit 86
fi
case "$tool" in
  memcheck) echo "========= LEAK SUMMARY: 0 bytes leaked in 0 allocations"
            echo "========= ERROR SUMMARY: 0 errors" ;;
  racecheck) echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" ;;
  *) echo "========= ERROR SUMMARY: 0 errors" ;;
esac
exit $rc
"#;

    /// A test binary that passes when run with `--ignored`.
    const FAKE_TEST: &str = r#"#!/usr/bin/env bash
[ "$1" = --ignored ] || exit 3
echo "test result: ok. 2 passed; 0 failed"
"#;

    fn write_script(path: &Path, text: &str) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A bundle holding `tests` (fake test binaries) and run.sh, and a
    /// folder with the fake compute-sanitizer.
    fn fake_bundle(name: &str, tests: &[&str]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-run-sh-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for t in tests {
            write_script(&dir.join("bundle/tests").join(t), FAKE_TEST);
        }
        write_script(&dir.join("bundle/run.sh"), RUN_SH);
        std::fs::write(dir.join("bundle/MANIFEST"), "fake bundle\n").unwrap();
        write_script(&dir.join("fake-bin/compute-sanitizer"), FAKE_SANITIZER);
        std::fs::create_dir_all(dir.join("logs")).unwrap();
        dir
    }

    /// Runs the bundle's run.sh as the GPU machine would
    /// (`--no-torch --no-bench`): whether it passed, and its output.
    fn run_bundle(dir: &Path, hazard: &str) -> (bool, String) {
        let path = format!(
            "{}:{}",
            dir.join("fake-bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = Command::new("bash")
            .arg(dir.join("bundle/run.sh"))
            .args(["--no-torch", "--no-bench"])
            .env("PATH", path)
            .env("OUT", dir.join("logs"))
            .env("FAKE_HAZARD", hazard)
            .output()
            .expect("bash");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    }

    #[test]
    fn the_threads_test_runs_under_racecheck_and_synccheck_with_summaries_in_the_log() {
        let dir = fake_bundle("clean", &["gpu", "gpu_threads"]);
        let (passed, out) = run_bundle(&dir, "");
        for line in [
            "PASS  test gpu_threads",
            "PASS  memcheck test gpu",
            "PASS  memcheck test gpu_threads",
            "PASS  racecheck test gpu_threads",
            "PASS  synccheck test gpu_threads",
            "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
            "LEAK SUMMARY: 0 bytes leaked",
            "ALL PASSED",
        ] {
            assert!(out.contains(line), "no `{line}` in:\n{out}");
        }
        assert!(passed, "{out}");
        // The threads test alone: the other binary only under memcheck.
        assert!(!out.contains("racecheck test gpu\n"), "{out}");
        assert!(!out.contains("torch") && !out.contains("bench"), "{out}");
        let log = std::fs::read_to_string(dir.join("logs/racecheck-gpu_threads.log")).unwrap();
        assert!(log.contains("ALLOC_CUDA_SANITIZER=1"), "{log}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_racecheck_hazard_fails_the_run() {
        let dir = fake_bundle("hazard", &["gpu", "gpu_threads"]);
        let (passed, out) = run_bundle(&dir, "racecheck");
        assert!(!passed, "{out}");
        for line in [
            "RACECHECK SUMMARY: 1 hazard displayed",
            "FAIL  racecheck test gpu_threads (exit 86",
            "PASS  synccheck test gpu_threads",
            "SOME FAILED",
        ] {
            assert!(out.contains(line), "no `{line}` in:\n{out}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bundle_without_the_threads_test_fails_its_race_and_sync_checks() {
        let dir = fake_bundle("missing", &["gpu"]);
        let (passed, out) = run_bundle(&dir, "");
        assert!(!passed, "{out}");
        assert!(
            out.contains("FAIL  racecheck: tests/gpu_threads not in the bundle"),
            "{out}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
