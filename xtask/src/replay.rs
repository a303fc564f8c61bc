//! `cargo xtask replay`: every trace x every policy on the simulated device.

use std::path::{Path, PathBuf};

use alloc_core::{human_bytes, GIB};
use alloc_replay::plot::{downsample, render_panels, Chart, Series};

/// Points per plotted series: enough to show every peak's shape, small
/// enough to keep a plot of all traces x all policies around a megabyte.
const PLOT_POINTS: usize = 400;
use alloc_replay::{load_trace_of, replay, ReplayOptions, ReplayReport};

/// `cargo xtask replay`'s options.
pub struct Args {
    policies: Vec<String>,
    json: Option<PathBuf>,
    plot: PathBuf,
    traces: Vec<PathBuf>,
    /// A snapshot's device (default: the first with events).
    device: Option<usize>,
    opts: ReplayOptions,
}

/// The command line (`--opt value` or `--opt=value`); a usage error.
pub fn parse(args: &[String]) -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut out = Args {
        policies: Vec::new(),
        json: None,
        plot: crate::workspace_root().join("target/replay/replay.svg"),
        traces: Vec::new(),
        device: None,
        opts: ReplayOptions::default(),
    };
    let text = |e: lexopt::Error| e.to_string();
    let mut p = lexopt::Parser::from_args(args);
    while let Some(arg) = p.next().map_err(text)? {
        match arg {
            Long("policy") => out
                .policies
                .push(p.value().map_err(text)?.string().map_err(text)?),
            Long("json") => out.json = Some(p.value().map_err(text)?.into()),
            Long("plot") => out.plot = p.value().map_err(text)?.into(),
            Long("capacity-gib") => {
                let gib: u64 = p.value().map_err(text)?.parse().map_err(text)?;
                out.opts.capacity = gib * GIB;
            }
            Long("runs") => out.opts.timed_runs = p.value().map_err(text)?.parse().map_err(text)?,
            Long("device") => out.device = Some(p.value().map_err(text)?.parse().map_err(text)?),
            Long("gpu-lag") => {
                out.opts.gpu_lag = Some(p.value().map_err(text)?.parse().map_err(text)?);
            }
            Value(path) => out.traces.push(path.into()),
            other => return Err(other.unexpected().to_string()),
        }
    }
    if out.policies.is_empty() {
        out.policies = alloc_policy::policy_names();
    }
    if out.traces.is_empty() {
        out.traces = bundled_traces()?;
    }
    Ok(out)
}

/// Every trace file in the repository's `traces/` folder.
fn bundled_traces() -> Result<Vec<PathBuf>, String> {
    let dir = crate::workspace_root().join("traces");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("reading {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.ends_with(".trace.gz") || name.ends_with(".trace") || name.ends_with(".pickle")
        })
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(format!("no traces in {}", dir.display()));
    }
    Ok(found)
}

/// A policy argument as a configuration string.
fn config_for(policy: &str) -> String {
    if policy.contains(':') {
        policy.to_string()
    } else {
        format!("policy:{policy}")
    }
}

/// Replays every trace through every policy and writes the reports.
pub fn run(args: Args) -> Result<(), String> {
    let mut reports: Vec<ReplayReport> = Vec::new();
    let mut charts = Vec::new();
    for path in &args.traces {
        let trace =
            load_trace_of(path, args.device).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut chart = Chart {
            title: format!("{} ({} events)", trace.name, trace.events.len()),
            x_label: "event".into(),
            y_label: "bytes".into(),
            series: Vec::new(),
        };
        for policy in &args.policies {
            let run = replay(&trace, &config_for(policy), &args.opts).map_err(|e| e.to_string())?;
            let label = &run.report.policy;
            chart.series.push(series(
                &format!("{label} reserved"),
                &run.timeline,
                |p| p.2,
                false,
            ));
            chart.series.push(series(
                &format!("{label} allocated"),
                &run.timeline,
                |p| p.1,
                true,
            ));
            reports.push(run.report);
        }
        charts.push(chart);
    }
    println!(
        "simulated device: {} (--capacity-gib N to change)",
        human_bytes(args.opts.capacity)
    );
    print_table(&reports);
    if let Some(json) = &args.json {
        write(
            json,
            &serde_json::to_string_pretty(&reports).map_err(|e| e.to_string())?,
        )?;
        println!("wrote {}", json.display());
    }
    write(&args.plot, &render_panels(&charts, 1))?;
    println!("wrote {}", args.plot.display());
    Ok(())
}

fn series(
    label: &str,
    timeline: &[(u64, u64, u64)],
    pick: fn(&(u64, u64, u64)) -> u64,
    dashed: bool,
) -> Series {
    Series {
        label: label.to_string(),
        points: downsample(
            &timeline
                .iter()
                .map(|p| (p.0 as f64, pick(p) as f64))
                .collect::<Vec<_>>(),
            PLOT_POINTS,
        ),
        dashed,
    }
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

fn print_table(reports: &[ReplayReport]) {
    println!(
        "| trace | policy | peak requested | peak allocated | peak reserved | reserved/requested | device allocs | device frees | pages moved | waits | retries | OOMs | ns/op |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in reports {
        println!(
            "| {} | {} | {} | {} | {} | {:.3} | {} | {} | {} | {} | {} | {} | {:.0} |",
            r.trace,
            r.policy,
            human_bytes(r.peak_requested_bytes),
            human_bytes(r.peak_allocated_bytes),
            human_bytes(r.peak_reserved_bytes),
            r.reserved_over_requested,
            r.device_allocs,
            r.device_frees,
            r.pages_moved,
            r.stream_waits,
            r.retries,
            r.ooms,
            r.ns_per_op
        );
    }
}
