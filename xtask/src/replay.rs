//! `cargo xtask replay`: which setting for each bundled trace.
//!
//! Every trace is replayed under PyTorch's two settings (reproduced byte for
//! byte) and ours ([`alloc_replay::SETTINGS`]); a short summary compares
//! them and names the setting the rule of `docs/advise.md` picks. `--all`
//! prints the full table (every compiled-in policy too), `--json` writes it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use alloc_core::human_bytes;
use alloc_replay::{
    load_trace_of, replay, settings_for, Advice, ReplayOptions, ReplayReport, Trace, TraceEvent,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::figure::{self, Mark, Role, Row};
use crate::table::{Table, MAX_WIDTH};

/// Timed repetitions per replay for the full table's host ns/op.
const FULL_TABLE_RUNS: usize = 3;
/// Runs shorter than this show no progress bar.
const QUIET_FOR: Duration = Duration::from_secs(1);

/// `cargo xtask replay`'s options.
pub struct Args {
    all: bool,
    policies: Vec<String>,
    json: Option<PathBuf>,
    plot: PathBuf,
    traces: Vec<PathBuf>,
    device: Option<usize>,
    runs: Option<usize>,
    opts: ReplayOptions,
}

/// The command line (`--opt value` or `--opt=value`); a usage error.
pub fn parse(args: &[String]) -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut out = Args {
        all: false,
        policies: Vec::new(),
        json: None,
        plot: crate::workspace_root().join("target/replay/replay.svg"),
        traces: Vec::new(),
        device: None,
        runs: None,
        opts: ReplayOptions::default(),
    };
    let text = |e: lexopt::Error| e.to_string();
    let mut p = lexopt::Parser::from_args(args);
    while let Some(arg) = p.next().map_err(text)? {
        match arg {
            Long("all") => out.all = true,
            Long("policy") => out
                .policies
                .push(p.value().map_err(text)?.string().map_err(text)?),
            Long("json") => out.json = Some(p.value().map_err(text)?.into()),
            Long("plot") => out.plot = p.value().map_err(text)?.into(),
            Long("capacity-gib") => {
                let value = p.value().map_err(text)?;
                out.opts.capacity = crate::parse_capacity_gib(&value.to_string_lossy())?;
            }
            Long("runs") => out.runs = Some(p.value().map_err(text)?.parse().map_err(text)?),
            Long("device") => out.device = Some(p.value().map_err(text)?.parse().map_err(text)?),
            Long("fraction") => {
                let value = p.value().map_err(text)?;
                let text = value.to_string_lossy();
                let fraction = text
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|f| (0.0..=1.0).contains(f))
                    .ok_or_else(|| format!("--fraction {text:?}: expected a number in [0, 1]"))?;
                out.opts.memory_fraction = Some(fraction);
            }
            Long("gpu-lag") => {
                out.opts.gpu_lag = Some(p.value().map_err(text)?.parse().map_err(text)?);
            }
            Long("reset-peaks-every") => {
                let value = p.value().map_err(text)?;
                let text = value.to_string_lossy();
                let every = text.trim().parse::<u64>().ok().filter(|&n| n > 0).ok_or_else(|| {
                    format!("--reset-peaks-every {text:?}: expected a number of allocations above 0")
                })?;
                out.opts.reset_peaks_every = Some(every);
            }
            Value(path) => out.traces.push(path.into()),
            other => return Err(other.unexpected().to_string()),
        }
    }
    let full = out.all || out.json.is_some() || !out.policies.is_empty();
    out.opts.timed_runs = out.runs.unwrap_or(if full { FULL_TABLE_RUNS } else { 0 });
    if full && out.policies.is_empty() {
        out.policies = alloc_policy::policy_names();
    }
    if out.traces.is_empty() {
        out.traces = bundled_traces()?;
    }
    Ok(out)
}

/// The trace files of the repository's `traces/` folder and, where the
/// clone has it beside it, `../shared/traces`.
fn bundled_traces() -> Result<Vec<PathBuf>, String> {
    let root = crate::workspace_root();
    let mut found = Vec::new();
    for dir in [root.join("traces"), root.join("../shared/traces")] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut here: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                [".trace.gz", ".trace", ".pickle"]
                    .iter()
                    .any(|s| name.ends_with(s))
            })
            .collect();
        here.sort();
        found.extend(here);
    }
    if found.is_empty() {
        return Err(format!("no traces in {}", root.join("traces").display()));
    }
    Ok(found)
}

/// A policy argument as a configuration string.
fn config_for(policy: &str) -> String {
    // A named setting (`budget`, `bound`) is a configuration of its own.
    if policy.contains(':') || alloc_core::config::named_setting(policy).is_some() {
        policy.to_string()
    } else {
        format!("policy:{policy}")
    }
}

/// One trace (files with the same events count once) and its replays.
struct TraceResult {
    label: String,
    files: Vec<String>,
    advice: Advice,
    /// The full table's other policies.
    others: Vec<ReplayReport>,
    /// Its row of the picture.
    row: Row,
}

/// Replays every trace and writes the reports.
pub fn run(args: Args) -> Result<(), String> {
    let traces = distinct(load(&args)?);
    let extras: Vec<String> = args.policies.iter().map(|p| config_for(p)).collect();
    let mut progress = Progress::new(
        traces
            .iter()
            .map(|(t, _)| settings_for(t).len() + extras.len())
            .sum(),
    );
    let mut results = Vec::new();
    for (trace, files) in &traces {
        results.push(replay_trace(
            trace,
            files,
            &extras,
            &args.opts,
            &mut progress,
        )?);
    }
    progress.done();

    println!(
        "simulated device: {} (--capacity-gib N to change)\n",
        human_bytes(args.opts.capacity)
    );
    print!("{}", summary(&results));
    if args.all || !args.policies.is_empty() {
        println!();
        print!("{}", full_tables(&results));
    }
    if let Some(json) = &args.json {
        write(json, &json_report(&results, args.opts.capacity))?;
        println!("wrote {}", shown(json));
    }
    let png = args.plot.with_extension("png");
    let rows: Vec<Row> = results.into_iter().map(|r| r.row).collect();
    figure::write(
        &rows,
        "Peak reserved memory per trace, PyTorch's settings and ours, as a ratio to PyTorch's best",
        &args.plot,
        &png,
    )?;
    println!("wrote {} and {}", shown(&args.plot), shown(&png));
    Ok(())
}

fn load(args: &Args) -> Result<Vec<(Trace, String)>, String> {
    args.traces
        .iter()
        .map(|path| {
            let trace =
                load_trace_of(path, args.device).map_err(|e| format!("{}: {e}", path.display()))?;
            let file = path.file_name().map_or_else(
                || path.display().to_string(),
                |f| f.to_string_lossy().into_owned(),
            );
            Ok((trace, file))
        })
        .collect()
}

/// Traces with the same events (a `.trace.gz` and the `.pickle` it was
/// converted from, a second recording of the same run, a copy in
/// `../shared/traces`) count once, under the first one's name; traces of the
/// same name with different events are told apart by their file names.
fn distinct(traces: Vec<(Trace, String)>) -> Vec<(Trace, Vec<String>)> {
    let mut out: Vec<(Trace, Vec<String>, Vec<Normalized>)> = Vec::new();
    for (trace, file) in traces {
        let events = normalized(&trace);
        if let Some(same) = out.iter_mut().find(|(_, _, e)| *e == events) {
            if !same.1.contains(&file) {
                same.1.push(file);
            }
            continue;
        }
        out.push((trace, vec![file], events));
    }
    let mut names: HashMap<String, usize> = HashMap::new();
    for (trace, _, _) in &out {
        *names.entry(trace.name.clone()).or_default() += 1;
    }
    out.into_iter()
        .map(|(mut trace, files, _)| {
            if names[&trace.name] > 1 {
                trace.name = files[0].clone();
            }
            (trace, files)
        })
        .collect()
}

/// An event with its id replaced by the order of the id's first use.
type Normalized = (bool, u64, u64, u64);

fn normalized(trace: &Trace) -> Vec<Normalized> {
    let mut ids: HashMap<u64, u64> = HashMap::new();
    let mut id_of = |id: u64| {
        let next = ids.len() as u64;
        *ids.entry(id).or_insert(next)
    };
    let mut out: Vec<Normalized> = trace
        .events
        .iter()
        .map(|e| match *e {
            TraceEvent::Alloc { id, size, stream } => (true, id_of(id), size, stream),
            TraceEvent::Free { id, stream } => (false, id_of(id), 0, stream),
            TraceEvent::FreeCompleted { id } => (false, id_of(id), u64::MAX, u64::MAX),
        })
        .collect();
    out.extend(
        trace
            .segment_allocs
            .iter()
            .map(|&s| (false, u64::MAX, s, 0)),
    );
    out
}

/// A progress bar on stderr, shown once the run has taken a second.
struct Progress {
    bar: ProgressBar,
    start: Instant,
    shown: bool,
}

impl Progress {
    fn new(total: usize) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::hidden());
        bar.set_style(
            ProgressStyle::with_template("{wide_msg} [{bar:20}] {pos}/{len} replays {elapsed}")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        Progress {
            bar,
            start: Instant::now(),
            shown: false,
        }
    }

    fn replaying(&mut self, what: String) {
        if !self.shown && self.start.elapsed() >= QUIET_FOR {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            self.shown = true;
        }
        self.bar.set_message(what);
    }

    fn replayed(&self) {
        self.bar.inc(1);
    }

    fn done(&self) {
        self.bar.finish_and_clear();
    }
}

fn replay_trace(
    trace: &Trace,
    files: &[String],
    extras: &[String],
    opts: &ReplayOptions,
    progress: &mut Progress,
) -> Result<TraceResult, String> {
    let mut runs = Vec::new();
    for setting in settings_for(trace) {
        progress.replaying(format!("{} {}", trace.name, setting.name));
        let run = replay(trace, setting.engine_config(), opts).map_err(|e| e.to_string())?;
        progress.replayed();
        runs.push((*setting, run.report));
    }
    let advice = Advice::new(trace, opts.capacity, runs);
    let mut others = Vec::new();
    for config in extras {
        if advice
            .outcomes
            .iter()
            .any(|o| o.setting.engine_config() == config || o.setting.name == config)
        {
            continue;
        }
        progress.replaying(format!("{} {config}", trace.name));
        others.push(
            replay(trace, config, opts)
                .map_err(|e| e.to_string())?
                .report,
        );
        progress.replayed();
    }
    Ok(TraceResult {
        label: trace.name.clone(),
        files: files.to_vec(),
        row: figure_row(&trace.name, &advice),
        advice,
        others,
    })
}

/// Pages per step: one decimal below 10.
fn per_step(pages: f64) -> String {
    if pages < 10.0 {
        format!("{pages:.1}")
    } else {
        format!("{pages:.0}")
    }
}

/// A trace's row of the picture: each drawn setting's ratio to PyTorch's
/// best, the floor (peak allocated under PyTorch's default), the pick.
fn figure_row(trace: &str, advice: &Advice) -> Row {
    let best = advice.best_of_pytorch().report.peak_reserved_bytes.max(1) as f64;
    let floor = Mark {
        role: Role::Allocated,
        ratio: advice.outcomes[0].report.peak_allocated_bytes as f64 / best,
    };
    let marks = advice
        .outcomes
        .iter()
        .filter_map(|o| {
            Role::of_setting(o.setting.name).map(|role| Mark {
                role,
                ratio: o.vs_pytorch_best,
            })
        })
        .chain(std::iter::once(floor))
        .collect();
    let pick = advice.recommendation();
    let moves = match pick.setting.page_mb {
        Some(_) => format!(" ({})", per_step(pick.pages_moved_per_step)),
        None => String::new(),
    };
    Row {
        trace: trace.to_string(),
        marks,
        pick: format!("{}: {:.3}{moves}", pick.setting.name, pick.vs_pytorch_best),
        pick_role: Role::of_setting(pick.setting.name),
    }
}

/// A setting's cell of the summary: its peak reserved as a ratio to
/// PyTorch's best, and the pages it moved per step where it moved any.
fn ratio_cell(o: &alloc_replay::Outcome) -> String {
    match (o.setting.page_mb, o.report.pages_moved) {
        (Some(_), moved) if moved > 0 => {
            format!(
                "{:.3} ({})",
                o.vs_pytorch_best,
                per_step(o.pages_moved_per_step)
            )
        }
        _ => format!("{:.3}", o.vs_pytorch_best),
    }
}

/// Per trace: every setting against PyTorch's best, the pick, the settings'
/// strings.
fn summary(results: &[TraceResult]) -> String {
    let names: Vec<&str> = alloc_replay::SETTINGS
        .iter()
        .map(|s| s.name)
        .filter(|n| results.iter().any(|r| r.advice.outcome(n).is_some()))
        .collect();
    let mut out = String::from(
        "Peak reserved per trace as a ratio to PyTorch's best setting (its default or\n\
         expandable segments, which the replay reproduces byte for byte: 1.000 in its\n\
         column); in parentheses, pages moved per step.\n\n",
    );
    // One table of every setting where it fits in MAX_WIDTH columns, else
    // the settings split over two tables, each with the trace column.
    let ratios = |names: &[&str]| {
        let mut table = Table::new(std::iter::once("trace").chain(names.iter().copied()));
        for r in results {
            let mut row = vec![r.label.clone()];
            for name in names {
                row.push(r.advice.outcome(name).map_or(String::new(), ratio_cell));
            }
            table.row(row);
        }
        table.plain()
    };
    let whole = ratios(&names);
    if whole.lines().all(|l| l.chars().count() <= MAX_WIDTH) {
        out.push_str(&whole);
    } else {
        let (first, second) = names.split_at(names.len().div_ceil(2));
        out.push_str(&ratios(first));
        out.push('\n');
        out.push_str(&ratios(second));
    }

    out.push_str(
        "\nRecommended (the rule: docs/advise.md; `cargo xtask advise TRACE` explains one):\n",
    );
    let mut picks = Table::new([
        "trace",
        "setting",
        "peak",
        "PyTorch's best",
        "x default",
        "x best",
        "moves/step",
    ]);
    for r in results {
        let o = r.advice.recommendation();
        picks.row([
            r.label.clone(),
            o.setting.name.to_string(),
            human_bytes(o.report.peak_reserved_bytes),
            human_bytes(r.advice.best_of_pytorch().report.peak_reserved_bytes),
            format!("{:.3}", o.vs_pytorch_default),
            format!("{:.3}", o.vs_pytorch_best),
            match o.setting.page_mb {
                Some(_) => per_step(o.pages_moved_per_step),
                None => "-".into(),
            },
        ]);
    }
    out.push_str(&picks.plain());

    out.push_str("\nSettings (GPUALLOC_CONF / gpu_alloc.enable(...)):\n");
    for s in alloc_replay::SETTINGS
        .iter()
        .filter(|s| names.contains(&s.name))
    {
        let config = match (s.config, s.page_mb) {
            ("", _) => "(none: PyTorch's rules)".to_string(),
            (config, Some(16)) => format!("{config} (16 MiB pages)"),
            (config, _) => config.to_string(),
        };
        out.push_str(&wrapped(&format!("  {:<11} ", s.name), &config));
    }
    for r in results.iter().filter(|r| r.files.len() > 1) {
        let (last, rest) = r.files.split_last().expect("a trace has a file");
        out.push_str(&format!(
            "{} and {last}\n  hold the same events: replayed once, as {}\n",
            rest.join(", "),
            r.label
        ));
    }
    for r in results {
        for note in &r.advice.notes {
            out.push_str(&format!("  {}: {note}\n", r.label));
        }
    }
    out
}

/// `head` then `text`, broken after commas into lines of at most
/// [`MAX_WIDTH`] columns, the further lines indented under the first.
fn wrapped(head: &str, text: &str) -> String {
    let indent = " ".repeat(head.chars().count());
    let mut out = String::new();
    let mut line = head.to_string();
    let mut empty = true;
    for piece in text.split_inclusive(',') {
        if !empty && line.chars().count() + piece.chars().count() > MAX_WIDTH {
            out.push_str(line.trim_end());
            out.push('\n');
            line = indent.clone();
        }
        line.push_str(piece);
        empty = false;
    }
    out.push_str(line.trim_end());
    out.push('\n');
    out
}

/// Every replay, every figure, in two markdown tables (memory, then the
/// device calls and host time) narrow enough for a terminal; columns zero
/// in every row and `+gc-age` rows equal to their base are left out (and
/// said so).
fn full_tables(results: &[TraceResult]) -> String {
    let mut memory = Table::new([
        "trace",
        "setting",
        "allocated",
        "reserved",
        "x default",
        "x best",
        "res/req",
    ]);
    let mut calls = Table::new([
        "trace",
        "setting",
        "allocs",
        "frees",
        "pages moved",
        "waits",
        "mem queries",
        "retries",
        "OOMs",
        "ns/op",
    ]);
    // Policy -> traces where it gave its base policy's figures.
    let mut same_as_base: Vec<(String, Vec<&str>)> = Vec::new();
    for r in results {
        let default = r.advice.outcomes[0].report.peak_reserved_bytes.max(1) as f64;
        let best = r.advice.best_of_pytorch().report.peak_reserved_bytes.max(1) as f64;
        let rows = r
            .advice
            .outcomes
            .iter()
            .map(|o| (o.setting.name.to_string(), &o.report))
            .chain(r.others.iter().map(|rep| (rep.policy.clone(), rep)));
        for (name, rep) in rows {
            if let Some(base) = name.strip_suffix("+gc-age") {
                if base_row(r, base).is_some_and(|b| same_figures(b, rep)) {
                    match same_as_base.iter_mut().find(|(p, _)| *p == name) {
                        Some((_, traces)) => traces.push(&r.label),
                        None => same_as_base.push((name, vec![&r.label])),
                    }
                    continue;
                }
            }
            memory.row([
                r.label.clone(),
                name.clone(),
                human_bytes(rep.peak_allocated_bytes),
                human_bytes(rep.peak_reserved_bytes),
                format!("{:.3}", rep.peak_reserved_bytes as f64 / default),
                format!("{:.3}", rep.peak_reserved_bytes as f64 / best),
                format!("{:.3}", rep.reserved_over_requested),
            ]);
            calls.row([
                r.label.clone(),
                name,
                rep.device_allocs.to_string(),
                rep.device_frees.to_string(),
                rep.pages_moved.to_string(),
                rep.stream_waits.to_string(),
                rep.free_queries.to_string(),
                rep.retries.to_string(),
                rep.ooms.to_string(),
                if rep.ns_per_op.is_finite() {
                    format!("{:.0}", rep.ns_per_op)
                } else {
                    "0".into()
                },
            ]);
        }
    }
    let mut out = String::from(
        "Peak memory per replay: allocated in blocks, reserved from the device; reserved\n\
         as a ratio to PyTorch's default and best setting, and to the peak the program\n\
         requested (the same under every setting; in the JSON report).\n\n",
    );
    out.push_str(&memory.markdown());
    out.push_str(
        "\nDevice allocations and frees, page moves, waits, queries of the device's free\n\
         memory (mem queries) and failures per replay; host ns per operation.\n\n",
    );
    let dropped = calls.drop_zero_columns();
    out.push_str(&calls.markdown());
    if !dropped.is_empty() {
        out.push_str(&format!(
            "(zero in every row, left out: {})\n",
            dropped.join(", ")
        ));
    }
    for (policy, traces) in same_as_base {
        let where_ = if traces.len() == results.len() {
            "every trace".to_string()
        } else {
            traces.join(", ")
        };
        out.push_str(&format!(
            "({policy}: its base policy's figures on {where_}, left out)\n"
        ));
    }
    out
}

/// The row of policy `base` of a trace: a setting's or another policy's.
fn base_row<'a>(r: &'a TraceResult, base: &str) -> Option<&'a ReplayReport> {
    let config = config_for(base);
    r.advice
        .outcomes
        .iter()
        .find(|o| o.setting.engine_config() == config)
        .map(|o| &o.report)
        .or_else(|| r.others.iter().find(|rep| rep.policy == base))
}

fn same_figures(a: &ReplayReport, b: &ReplayReport) -> bool {
    let figures = |r: &ReplayReport| {
        [
            r.peak_requested_bytes,
            r.peak_allocated_bytes,
            r.peak_reserved_bytes,
            r.device_allocs,
            r.device_frees,
            r.pages_moved,
            r.stream_waits,
            r.free_queries,
            r.retries,
            r.ooms,
        ]
    };
    figures(a) == figures(b)
}

fn json_report(results: &[TraceResult], capacity: u64) -> String {
    let traces: Vec<serde_json::Value> = results
        .iter()
        .map(|r| {
            serde_json::json!({
                "trace": r.label,
                "files": r.files,
                "advice": r.advice.to_json(),
                "policies": r.others,
            })
        })
        .collect();
    let report = serde_json::json!({
        "capacity_bytes": capacity,
        "move_weight": alloc_replay::advise::MOVE_WEIGHT,
        "traces": traces,
    });
    serde_json::to_string_pretty(&report).expect("the report serializes")
}

/// A path as the user would type it from the current folder.
fn shown(path: &Path) -> String {
    let here = std::env::current_dir().unwrap_or_default();
    path.strip_prefix(&here)
        .unwrap_or(path)
        .display()
        .to_string()
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc_core::GIB;
    use alloc_replay::parse_text;

    #[test]
    fn a_policy_argument_is_a_policy_a_named_setting_or_a_configuration() {
        assert_eq!(config_for("buddy"), "policy:buddy");
        assert_eq!(config_for("budget"), "budget");
        assert_eq!(config_for("bound"), "bound");
        assert_eq!(
            config_for("expandable_segments:True"),
            "expandable_segments:True"
        );
    }

    #[test]
    fn traces_with_the_same_events_count_once_and_names_stay_apart() {
        let a = parse_text("mlp", "a 7 1024 0\na 9 2048 0\nf 7 0\n").unwrap();
        let renumbered = parse_text("mlp", "a 1 1024 0\na 2 2048 0\nf 1 0\n").unwrap();
        let other = parse_text("mlp", "a 1 1024 0\nf 1 0\n").unwrap();
        let out = distinct(vec![
            (a, "mlp.trace.gz".into()),
            (renumbered, "mlp.snapshot.pickle".into()),
            (other, "mlp.trace".into()),
        ]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].1, ["mlp.trace.gz", "mlp.snapshot.pickle"]);
        assert_eq!(out[0].0.name, "mlp.trace.gz", "two traces named mlp differ");
        assert_eq!(out[1].0.name, "mlp.trace");
    }

    /// A trace's results under every setting of [`alloc_replay::SETTINGS`]
    /// and every compiled-in policy, with figures as wide as the bundled
    /// traces' widest (the longest name, GiB peaks, three-digit page moves
    /// per step, four-digit device calls).
    fn widest_result() -> TraceResult {
        let trace = parse_text("bert_mlm_varlen_train", "a 1 1024 0\nf 1 0\n").unwrap();
        let report = |policy: &str, i: u64| ReplayReport {
            trace: trace.name.clone(),
            policy: policy.to_string(),
            ops: 61_351,
            peak_requested_bytes: 13_580 << 20,
            peak_allocated_bytes: 13_650 << 20,
            peak_reserved_bytes: (15_640 - 500 * i) << 20,
            reserved_over_requested: 1.152,
            device_allocs: 2_755,
            device_frees: 2_662,
            pages_moved: 382 + i,
            stream_waits: 1_021,
            free_queries: 7,
            retries: 12,
            ooms: 3,
            ns_per_op: 1_234.5,
        };
        let runs = alloc_replay::SETTINGS
            .iter()
            .zip(0..)
            .map(|(s, i)| (*s, report(s.name, i)))
            .collect();
        let advice = Advice::new(&trace, 80 * GIB, runs);
        TraceResult {
            label: trace.name.clone(),
            files: vec!["bert_mlm_varlen_train.trace.gz".into()],
            row: figure_row(&trace.name, &advice),
            advice,
            others: alloc_policy::policy_names()
                .iter()
                .map(|p| report(p, 1))
                .collect(),
        }
    }

    #[test]
    fn every_table_fits_in_100_columns() {
        let results = [widest_result(), widest_result()];
        let summary = summary(&results);
        assert!(summary.contains("stream-"), "{summary}");
        assert!(summary.contains("0.967 (384)"), "{summary}");
        let full = full_tables(&results);
        assert!(full.contains("| buddy |"), "{full}");
        for line in summary.lines().chain(full.lines()) {
            assert!(
                line.chars().count() <= MAX_WIDTH,
                "{} columns: {line}",
                line.len()
            );
        }
    }

    #[test]
    fn long_settings_wrap_after_commas() {
        let config = alloc_replay::SETTINGS
            .iter()
            .map(|s| s.config)
            .max_by_key(|c| c.len())
            .unwrap();
        let text = wrapped("  bound       ", config);
        assert!(text.lines().count() > 1, "{text}");
        assert!(text.lines().all(|l| l.len() <= MAX_WIDTH), "{text}");
        assert_eq!(
            text.replace(&format!("\n{}", " ".repeat(14)), ""),
            format!("  bound       {config}\n")
        );
    }

    #[test]
    fn the_full_table_is_asked_for_by_all_json_or_policy() {
        let parsed =
            |args: &[&str]| parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        let summary = parsed(&["x.trace"]);
        assert!(summary.policies.is_empty());
        assert_eq!(summary.opts.timed_runs, 0, "the summary shows no host time");
        let all = parsed(&["--all", "x.trace"]);
        assert_eq!(all.policies, alloc_policy::policy_names());
        assert_eq!(all.opts.timed_runs, FULL_TABLE_RUNS);
        let json = parsed(&["--json=r.json", "--runs", "1", "x.trace"]);
        assert_eq!(json.opts.timed_runs, 1);
        assert!(!json.policies.is_empty());
        assert!(parse(&["--bogus".to_string()]).is_err());
    }
}
