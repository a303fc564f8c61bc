//! Project tasks, run as `cargo xtask <command>`.
//!
//! - `replay`: replays allocation traces through every policy on the
//!   simulated device; prints a table, writes JSON and an SVG plot.
//! - `test-gpu`: builds and runs (or bundles) alloc-cuda's GPU suite.

#![forbid(unsafe_code)]

mod replay;
mod test_gpu;

use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <command> [args]

commands:
  replay [--policy P]... [--json FILE] [--plot FILE] [--capacity-gib N] [--runs N]
         [--gpu-lag EVENTS] [--device N] [TRACE]...
      Replays traces (text .trace[.gz] or PyTorch snapshot pickles; default: the
      bundled traces/) through each policy P (a name such as `buddy`, or a full
      config string such as `policy:pytorch-bfc,max_split_size_mb:64`; default:
      every compiled-in policy) on the simulated device. --gpu-lag N: the simulated
      GPU runs N events behind the host, so unmap_free_pages meets busy pages and
      waits (the `waits` column); without it, events complete only when waited for.
      --device N: the device of a snapshot pickle (default: the first with events).
      --runs N: timed repetitions per trace and policy (the fastest counts);
      --capacity-gib N: the simulated device's memory (printed before the table).
  test-gpu [--bundle DIR] [--features LIST] [--full]
      Builds alloc-cuda's GPU suite (tests run with --ignored --test-threads=1,
      the examples, the benchmark) and runs it here, or with --bundle packs it
      into DIR (git-ignored, e.g. gpu-bundle/) with a run.sh for a GPU machine
      without Rust (adds compute-sanitizer memcheck).";

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
        Some("test-gpu") => test_gpu::parse(&args[1..]).map(test_gpu::run),
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
