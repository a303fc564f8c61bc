//! `cargo xtask fuzz`: runs a cargo-fuzz target of `fuzz/` (its own
//! workspace, built with nightly Rust) for a given time, from its checked-in
//! seeds (`fuzz/seeds/TARGET`) and the corpus earlier runs grew
//! (`fuzz/corpus/TARGET`, git-ignored), and says how many inputs it ran.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// What to install when the toolchain or cargo-fuzz is missing.
const INSTALL: &str = "the fuzz targets need nightly Rust and cargo-fuzz:\n  \
     rustup toolchain install nightly\n  cargo install cargo-fuzz";

/// Seconds a run lasts when `--seconds` is not given.
const DEFAULT_SECONDS: u64 = 60;

/// The libFuzzer options the reader targets run with unless given after
/// `--`: inputs of up to 64 KiB, which hold a gzip'd file that inflates to
/// 2 MiB (libFuzzer's default of 4 KiB never reaches the costly shapes),
/// and 2 GiB of memory at most, past which the run fails. Each target
/// checks its own peak heap against `read_memory_bound` too.
const READER_OPTIONS: &[&str] = &["-max_len=65536", "-rss_limit_mb=2048"];

/// The libFuzzer options `target` runs with unless `extra` names them.
fn options(target: &str, extra: &[String]) -> Vec<String> {
    let defaults: &[&str] = match target {
        "trace" | "pickle" => READER_OPTIONS,
        _ => &[],
    };
    let name = |o: &str| o.split('=').next().unwrap_or_default().to_string();
    let given: Vec<String> = extra.iter().map(|o| name(o)).collect();
    defaults
        .iter()
        .filter(|d| !given.contains(&name(d)))
        .map(|d| d.to_string())
        .chain(extra.iter().cloned())
        .collect()
}

/// `cargo xtask fuzz`'s options.
#[derive(Debug, PartialEq)]
pub enum Args {
    /// `--list`: print the targets.
    List,
    /// Run `target` for `seconds`, passing `extra` to libFuzzer.
    Run {
        /// The fuzz target.
        target: String,
        /// `-max_total_time` of libFuzzer.
        seconds: u64,
        /// Further libFuzzer options (after `--`).
        extra: Vec<String>,
    },
}

/// The command line; a usage error. Arguments after `--` go to libFuzzer.
pub fn parse(args: &[String]) -> Result<Args, String> {
    use lexopt::prelude::*;
    let (ours, extra) = match args.iter().position(|a| a == "--") {
        Some(i) => (&args[..i], args[i + 1..].to_vec()),
        None => (args, Vec::new()),
    };
    let usage = |e: lexopt::Error| e.to_string();
    let mut target = None;
    let mut seconds = DEFAULT_SECONDS;
    let mut list = false;
    let mut p = lexopt::Parser::from_args(ours);
    while let Some(arg) = p.next().map_err(usage)? {
        match arg {
            Long("list") => list = true,
            Long("seconds") => seconds = p.value().map_err(usage)?.parse().map_err(usage)?,
            Value(v) if target.is_none() => target = Some(v.string().map_err(usage)?),
            Value(v) => return Err(format!("unexpected argument {v:?} (one target at a time)")),
            other => return Err(usage(other.unexpected())),
        }
    }
    match (list, target) {
        (true, None) => Ok(Args::List),
        (true, Some(_)) => Err("--list takes no target".into()),
        (false, Some(target)) => Ok(Args::Run {
            target,
            seconds,
            extra,
        }),
        (false, None) => Err("no fuzz target given (`cargo xtask fuzz --list` lists them)".into()),
    }
}

/// Lists the targets or runs one.
pub fn run(args: Args) -> Result<(), String> {
    let fuzz = crate::workspace_root().join("fuzz");
    let targets = targets(&fuzz)?;
    match args {
        Args::List => {
            for t in &targets {
                println!("{:<8} {}", t.name, t.summary);
            }
            Ok(())
        }
        Args::Run {
            target,
            seconds,
            extra,
        } => {
            if !targets.iter().any(|t| t.name == target) {
                let names: Vec<&str> = targets.iter().map(|t| t.name.as_str()).collect();
                return Err(format!(
                    "no fuzz target `{target}` (targets: {})",
                    names.join(", ")
                ));
            }
            check_tools()?;
            fuzz_run(&fuzz, &target, seconds, &extra)
        }
    }
}

/// A fuzz target: its name and the first line of its documentation.
#[derive(Debug, PartialEq)]
struct Target {
    name: String,
    summary: String,
}

/// The `[[bin]]` targets of `fuzz/Cargo.toml`, each with the first line of
/// its source's `//!` documentation.
fn targets(fuzz: &Path) -> Result<Vec<Target>, String> {
    let manifest = fuzz.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest)
        .map_err(|e| format!("reading {}: {e}", manifest.display()))?;
    bins(&text)
        .into_iter()
        .map(|(name, path)| {
            let source = fuzz.join(&path);
            let code = std::fs::read_to_string(&source)
                .map_err(|e| format!("reading {}: {e}", source.display()))?;
            Ok(Target {
                name,
                summary: summary(&code),
            })
        })
        .collect()
}

/// `(name, path)` of every `[[bin]]` section of a manifest.
fn bins(manifest: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut in_bin = false;
    let (mut name, mut path) = (None, None);
    let mut flush = |name: &mut Option<String>, path: &mut Option<String>| {
        if let (Some(n), Some(p)) = (name.take(), path.take()) {
            out.push((n, p));
        }
    };
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            flush(&mut name, &mut path);
            in_bin = line == "[[bin]]";
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let value = value.trim().trim_matches('"').to_string();
        match key.trim() {
            "name" if in_bin => name = Some(value),
            "path" if in_bin => path = Some(value),
            _ => {}
        }
    }
    flush(&mut name, &mut path);
    out
}

/// The first sentence-line of a target's `//!` documentation.
fn summary(code: &str) -> String {
    code.lines()
        .find_map(|l| l.strip_prefix("//!"))
        .map(|l| l.trim().to_string())
        .unwrap_or_default()
}

/// Checks that nightly Rust and cargo-fuzz are installed.
fn check_tools() -> Result<(), String> {
    let works = |args: &[&str]| {
        Command::new("cargo")
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !works(&["+nightly", "--version"]) {
        return Err(format!("no nightly toolchain; {INSTALL}"));
    }
    if !works(&["+nightly", "fuzz", "--version"]) {
        return Err(format!("cargo-fuzz is not installed; {INSTALL}"));
    }
    Ok(())
}

/// Runs `target` for `seconds` from its seeds and corpus, echoing
/// libFuzzer's output, then prints the executions it counted.
fn fuzz_run(fuzz: &Path, target: &str, seconds: u64, extra: &[String]) -> Result<(), String> {
    let corpus: PathBuf = fuzz.join("corpus").join(target);
    let seeds: PathBuf = fuzz.join("seeds").join(target);
    std::fs::create_dir_all(&corpus).map_err(|e| format!("{}: {e}", corpus.display()))?;
    let mut cmd = Command::new("cargo");
    cmd.current_dir(fuzz)
        .args(["+nightly", "fuzz", "run", target])
        .arg(&corpus);
    if seeds.is_dir() {
        cmd.arg(&seeds);
    }
    cmd.arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .args(options(target, extra))
        .stderr(Stdio::piped());
    eprintln!(
        "fuzz: {target} for {seconds} s (corpus {})",
        corpus.display()
    );
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("starting cargo fuzz: {e}"))?;
    let mut done = None;
    if let Some(stderr) = child.stderr.take() {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if let Some(runs) = done_runs(&line) {
                done = Some(runs);
            }
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!(
            "fuzz target `{target}` failed ({status}): a failing input is saved under {} \
             (see above for how to reproduce it)",
            fuzz.join("artifacts").join(target).display()
        ));
    }
    match done {
        Some((runs, secs)) => println!("fuzz {target}: {runs} executions in {secs} s, no failure"),
        None => println!("fuzz {target}: finished, no failure"),
    }
    Ok(())
}

/// `(executions, seconds)` from libFuzzer's closing `Done N runs in S
/// second(s)` line.
fn done_runs(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix("Done ")?;
    let (runs, rest) = rest.split_once(" runs in ")?;
    let secs = rest.split_whitespace().next()?;
    Some((runs.parse().ok()?, secs.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_a_run_with_seconds_and_libfuzzer_options() {
        assert_eq!(
            parse(&args(&["engine", "--seconds=480", "--", "-jobs=1"])),
            Ok(Args::Run {
                target: "engine".into(),
                seconds: 480,
                extra: vec!["-jobs=1".into()],
            })
        );
        assert_eq!(
            parse(&args(&["--seconds", "5", "config"])),
            Ok(Args::Run {
                target: "config".into(),
                seconds: 5,
                extra: vec![],
            })
        );
        assert_eq!(parse(&args(&["--list"])), Ok(Args::List));
    }

    #[test]
    fn refuses_a_missing_target_and_bad_seconds() {
        assert!(parse(&args(&[])).unwrap_err().contains("--list"));
        assert!(parse(&args(&["engine", "--seconds", "soon"])).is_err());
        assert!(parse(&args(&["engine", "trace"])).is_err());
        assert!(parse(&args(&["--list", "engine"])).is_err());
    }

    #[test]
    fn lists_the_targets_of_the_fuzz_workspace() {
        let fuzz = crate::workspace_root().join("fuzz");
        let names: Vec<String> = targets(&fuzz)
            .unwrap()
            .into_iter()
            .map(|t| t.name)
            .collect();
        assert_eq!(names, ["engine", "config", "trace", "pickle"]);
        for t in targets(&fuzz).unwrap() {
            assert!(!t.summary.is_empty(), "{} has no summary", t.name);
            assert!(
                fuzz.join("seeds").join(&t.name).is_dir(),
                "{} has no seeds",
                t.name
            );
        }
    }

    #[test]
    fn the_readers_run_with_long_inputs_and_a_memory_limit_unless_told() {
        assert_eq!(
            options("trace", &[]),
            ["-max_len=65536", "-rss_limit_mb=2048"]
        );
        assert_eq!(
            options("pickle", &args(&["-max_len=4096", "-jobs=1"])),
            ["-rss_limit_mb=2048", "-max_len=4096", "-jobs=1"]
        );
        assert_eq!(options("engine", &args(&["-jobs=1"])), ["-jobs=1"]);
    }

    #[test]
    fn reads_bins_and_the_closing_count() {
        let manifest = "[package]\nname = \"x\"\n\n[[bin]]\nname = \"a\"\npath = \"t/a.rs\"\n\
                        test = false\n\n[[bin]]\npath = \"t/b.rs\"\nname = \"b\"\n";
        assert_eq!(
            bins(manifest),
            [("a".into(), "t/a.rs".into()), ("b".into(), "t/b.rs".into())]
        );
        assert_eq!(
            done_runs("Done 430674 runs in 21 second(s)"),
            Some((430674, 21))
        );
        assert_eq!(done_runs("#2 DONE cov: 3"), None);
        assert_eq!(
            summary("//! The parser.\n//! More.\n#![no_main]"),
            "The parser."
        );
    }
}
