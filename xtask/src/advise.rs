//! `cargo xtask advise SNAPSHOT`: which setting for one workload, from its
//! PyTorch snapshot (or any trace file), by the rule of `docs/advise.md`.

use std::path::PathBuf;

use alloc_replay::{advise_at, load_trace_of, parse_budget, ReplayOptions};

/// `cargo xtask advise`'s options.
pub struct Args {
    trace: PathBuf,
    device: Option<usize>,
    json: Option<PathBuf>,
    opts: ReplayOptions,
    /// The memory budget (`--budget`); `None`: the device's memory.
    budget: Option<u64>,
}

/// The command line; a usage error.
pub fn parse(args: &[String]) -> Result<Args, String> {
    use lexopt::prelude::*;
    let text = |e: lexopt::Error| e.to_string();
    let mut trace = None;
    let mut out = Args {
        trace: PathBuf::new(),
        device: None,
        json: None,
        opts: ReplayOptions::default(),
        budget: None,
    };
    out.opts.timed_runs = 0;
    let mut p = lexopt::Parser::from_args(args);
    while let Some(arg) = p.next().map_err(text)? {
        match arg {
            Long("device") => out.device = Some(p.value().map_err(text)?.parse().map_err(text)?),
            Long("json") => out.json = Some(p.value().map_err(text)?.into()),
            Long("capacity-gib") => {
                let value = p.value().map_err(text)?;
                out.opts.capacity = crate::parse_capacity_gib(&value.to_string_lossy())?;
            }
            Long("budget") => {
                let text = p.value().map_err(text)?;
                out.budget = Some(parse_budget(&text.to_string_lossy())?);
            }
            Value(path) if trace.is_none() => trace = Some(PathBuf::from(path)),
            other => return Err(other.unexpected().to_string()),
        }
    }
    out.trace = trace.ok_or("advise needs a snapshot (or trace) file")?;
    Ok(out)
}

/// Replays the trace under every setting and prints the advice.
pub fn run(args: Args) -> Result<(), String> {
    let path = &args.trace;
    let trace = load_trace_of(path, args.device).map_err(|e| format!("{}: {e}", path.display()))?;
    let advice = advise_at(&trace, &args.opts, args.budget)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    print!("{}", advice.to_text());
    if let Some(json) = &args.json {
        let text = serde_json::to_string_pretty(&advice.to_json()).expect("the advice serializes");
        std::fs::write(json, text).map_err(|e| format!("{}: {e}", json.display()))?;
        println!("wrote {}", json.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_file_is_needed() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(parse(&args(&[])).is_err());
        assert!(parse(&args(&["a.pickle", "b.pickle"])).is_err());
        let ok = parse(&args(&["--device=1", "a.pickle"])).unwrap();
        assert_eq!((ok.device, ok.trace), (Some(1), PathBuf::from("a.pickle")));
        assert_eq!(ok.budget, None);
        let at = parse(&args(&["--budget", "24GiB", "a.pickle"])).unwrap();
        assert_eq!(at.budget, Some(24 << 30));
        assert!(parse(&args(&["--budget", "lots", "a.pickle"])).is_err());
    }
}
