//! Project tasks, run as `cargo xtask <command>`.
//!
//! - `replay`: replays allocation traces through every policy on the
//!   simulated device; prints a table, writes JSON and an SVG plot.

mod replay;

use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <command> [args]

commands:
  replay [--policy P]... [--json FILE] [--plot FILE] [--capacity-gib N] [--runs N] [TRACE]...
      Replays traces (text .trace[.gz] or PyTorch snapshot pickles; default: the
      bundled traces/) through each policy P (a name such as `buddy`, or a full
      config string such as `policy:pytorch-bfc,max_split_size_mb:64`; default:
      every compiled-in policy) on the simulated device.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("replay") => replay::main(&args[1..]),
        Some("-h" | "--help" | "help") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(format!("unknown command `{other}`\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("error: {msg}");
            ExitCode::FAILURE
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
