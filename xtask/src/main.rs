//! Project tasks, run as `cargo xtask <command>`.
//!
//! - `replay`: which setting for each bundled trace: PyTorch's settings and
//!   ours replayed on the simulated device; a summary, the full table, JSON,
//!   a picture (SVG and PNG).
//! - `advise`: which setting for one workload, from its PyTorch snapshot.
//! - `test-gpu`: builds and runs (or bundles) alloc-cuda's GPU suite.
//! - `fuzz`: runs a fuzz target of `fuzz/` (cargo-fuzz, nightly Rust).

#![forbid(unsafe_code)]

mod advise;
mod figure;
mod fuzz;
mod replay;
mod table;
mod test_gpu;

use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <command> [args]

commands:
  replay [--all] [--json FILE] [--policy P]... [--plot FILE.svg] [--capacity-gib N]
         [--fraction F] [--runs N] [--gpu-lag EVENTS] [--reset-peaks-every ALLOCS]
         [--device N] [TRACE]...
      Which setting for each trace (default: the bundled traces/ and ../shared/traces;
      text .trace[.gz] or PyTorch snapshot pickles): PyTorch's default and expandable
      segments against ours, replayed on the simulated device; prints a summary with
      the setting the rule of docs/advise.md recommends, and draws FILE.svg and
      FILE.png (default target/replay/replay.svg). --all: the full table, with every
      compiled-in policy; --json FILE: writes it; --policy P: these policies (a name
      such as `buddy`, a named setting such as `budget`, or a config string) instead
      of every compiled-in one (implies the full table). --gpu-lag N: the simulated
      GPU runs N events behind the host, so unmap_free_pages meets busy pages (the
      `waits` column). --device N: the
      device of a snapshot pickle (default: the first with events). --runs N: timed
      repetitions for the host ns/op (default 3 for the full table, 0 otherwise);
      --capacity-gib N: the simulated device's memory in GiB, decimals allowed
      (printed first); --fraction F: PyTorch's per-process memory fraction, in
      [0, 1] (reserved memory limited to F of the device, as budget.py's budgets);
      --reset-peaks-every N: reset_peak_memory_stats after every N allocations, as
      a loop that logs each step's peak does (N: a step's allocations).
  advise SNAPSHOT [--device N] [--json FILE] [--capacity-gib N] [--budget BYTES|NMiB|NGiB]
      Which setting for one workload: replays a torch.cuda.memory._dump_snapshot()
      pickle (or a trace file) under each setting and prints the recommendation,
      the gpu_alloc.enable(...) call and its cost in page moves per step.
      --budget: the memory the workload may use (default: the device's memory);
      the budget setting reclaims at it and settings that pass it are not picked.
  test-gpu [--bundle DIR] [--features LIST] [--full]
      Builds alloc-cuda's GPU suite (tests run with --ignored --test-threads=1,
      the examples, the benchmark) and runs it here, or with --bundle packs it
      into DIR (git-ignored, e.g. gpu-bundle/) with a run.sh for a GPU machine
      without Rust (adds compute-sanitizer memcheck).
  fuzz TARGET [--seconds N] [-- LIBFUZZER_OPTION...] | fuzz --list
      Runs a cargo-fuzz target of fuzz/ for N seconds (default 60) from its seeds
      (fuzz/seeds/TARGET) and grown corpus (fuzz/corpus/TARGET); needs nightly Rust
      and cargo-fuzz (`rustup toolchain install nightly`, `cargo install
      cargo-fuzz`). --list: the targets.";

/// Exit status of a bad command line, as clap and most tools use.
const USAGE_ERROR: u8 = 2;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo xtask <command> --help` too: the README points there.
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let result = match args.first().map(String::as_str) {
        Some("replay") => replay::parse(&args[1..]).map(replay::run),
        Some("advise") => advise::parse(&args[1..]).map(advise::run),
        Some("test-gpu") => test_gpu::parse(&args[1..]).map(test_gpu::run),
        Some("fuzz") => fuzz::parse(&args[1..]).map(fuzz::run),
        Some("help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown command `{other}`")),
        None => Err("no command given".to_string()),
    };
    match result {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
        Err(usage) => {
            eprintln!("error: {usage}\n\n{USAGE}");
            ExitCode::from(USAGE_ERROR)
        }
    }
}

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent directory")
        .to_path_buf()
}

/// `--capacity-gib N`: a positive number of GiB, decimals allowed (a budget
/// measured on a device, 16.08), as bytes.
pub fn parse_capacity_gib(text: &str) -> Result<u64, String> {
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|gib| gib.is_finite() && *gib > 0.0 && *gib < (1u64 << 33) as f64)
        .map(|gib| (gib * alloc_core::GIB as f64).round() as u64)
        .filter(|&bytes| bytes > 0)
        .ok_or_else(|| format!("--capacity-gib {text:?}: expected a positive number of GiB"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn capacity_takes_whole_and_decimal_gib_and_refuses_the_rest() {
        use super::parse_capacity_gib as gib;
        assert_eq!(gib("80"), Ok(80 << 30));
        assert_eq!(gib("0.5"), Ok(1 << 29));
        assert_eq!(
            gib("16.08"),
            Ok((16.08 * (1u64 << 30) as f64).round() as u64)
        );
        for bad in ["0", "-1", "nan", "inf", "1e30", "", "16GiB"] {
            assert!(gib(bad).is_err(), "{bad}");
        }
    }

    /// `cargo xtask` builds the release binary on its first run (about a
    /// minute): the alias must not hide cargo's progress with `--quiet`.
    #[test]
    fn the_alias_shows_the_first_builds_progress() {
        let config = std::fs::read_to_string(super::workspace_root().join(".cargo/config.toml"))
            .expect("the workspace's .cargo/config.toml");
        let alias = config
            .lines()
            .find(|l| l.trim_start().starts_with("xtask ="))
            .expect("an xtask alias");
        assert!(alias.contains("--package xtask"), "{alias}");
        let mut words = alias.split(|c: char| c.is_whitespace() || c == '"');
        assert!(!words.any(|w| w == "--quiet" || w == "-q"), "{alias}");
    }
}
