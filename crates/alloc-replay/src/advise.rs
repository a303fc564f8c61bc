//! Which setting for a workload: a trace replayed through every
//! [`Setting`] and the one the rule picks.
//!
//! ## The rule (`docs/advise.md`)
//!
//! 1. PyTorch's best is the lower peak reserved of PyTorch's default and its
//!    expandable segments, both replayed on the trace (the replay reproduces
//!    PyTorch's figures byte for byte).
//! 2. Each setting scores its peak reserved plus a charge for the pages it
//!    moves: every page moved per step costs [`MOVE_WEIGHT`] of PyTorch's
//!    best peak (a setting that moves 100 pages a step must save more than
//!    4% to be chosen), [`MULTI_STREAM_MOVE_WEIGHT`] on a trace of several
//!    allocating streams ([`move_weight`]). Steps come from the trace's repetition
//!    ([`estimate_steps`]); a trace that does not repeat counts as one step,
//!    which charges its moves in full.
//! 3. The lowest score wins; on a tie, fewer page moves, then the earlier
//!    setting in [`SETTINGS`](crate::settings::SETTINGS) (PyTorch's own
//!    first).

use std::fmt::Write as _;

use alloc_core::human_bytes;
use serde::Serialize;

use crate::replay::{replay, ReplayError, ReplayOptions, ReplayReport};
use crate::settings::{enable_call_of, settings_for, Setting};
use crate::steps::{estimate_steps, StepEstimate};
use crate::trace::Trace;

/// Fraction of PyTorch's best peak that one page moved per step weighs.
///
/// Calibrated on the H100 runs of `docs/policies.md`: with 16 MiB pages GPT-2
/// training moves 111 pages a step and ResNet-50 8, and both ran within 2%
/// of PyTorch's step; with 8 MiB pages they move 249 and 22, for 1% and 0.4%
/// less memory, and ran at 1.03-1.30x and 1.03-1.05x the step. Weights from
/// 0.00031 to 0.00060 pick 16 MiB pages on both, over 8 MiB pages and over
/// PyTorch's expandable segments; this one lies inside.
pub const MOVE_WEIGHT: f64 = 0.0004;

/// Fraction of PyTorch's best peak that one page moved per step weighs on a
/// trace where more than one stream allocates (FSDP and other multi-stream
/// training).
///
/// Calibrated on FSDP2 over the fake process group on two H200s
/// (`docs/benchmarks.md`, 2026-11-30, 19 rounds side by side with PyTorch):
/// 2.85 pages of 16 MiB moved a step cost 2.0% of the mean step against
/// PyTorch's (the steps that moved none ran at 0.990x, all steps at
/// 1.011x), 0.7% of the step a page, against at most 0.018% a page for
/// GPT-2 training on the H100 that [`MOVE_WEIGHT`] was set on: about 40
/// times as much, so 40 times the weight. A step that moves pages on
/// several streams' GPU costs far more than its driver calls.
pub const MULTI_STREAM_MOVE_WEIGHT: f64 = 0.016;

/// The weight of one page moved per step on a trace whose allocations come
/// from `streams` streams: [`MOVE_WEIGHT`], or [`MULTI_STREAM_MOVE_WEIGHT`]
/// for more than one.
pub fn move_weight(streams: u64) -> f64 {
    if several(streams) {
        MULTI_STREAM_MOVE_WEIGHT
    } else {
        MOVE_WEIGHT
    }
}

/// Whether a trace of `streams` allocating streams is weighed, and its cost
/// told, as multi-stream training ([`move_weight`]).
fn several(streams: u64) -> bool {
    streams > 1
}

/// Host time of one page move on an H100 (unmap, map, set access; measured
/// with `benchmarks/vmm_cost`, `docs/policies.md`), for the cost in words.
pub const H100_MICROS_PER_PAGE_MOVE: f64 = 67.0;

/// One setting's replay, with its place against PyTorch's settings.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The setting.
    pub setting: Setting,
    /// The replay's figures.
    pub report: ReplayReport,
    /// Pages moved per step (per whole trace when it has no steps).
    pub pages_moved_per_step: f64,
    /// Peak reserved / PyTorch's default's.
    pub vs_pytorch_default: f64,
    /// Peak reserved / PyTorch's best's.
    pub vs_pytorch_best: f64,
    /// The rule's score: peak reserved plus the charge for page moves, bytes.
    pub score_bytes: f64,
}

/// A trace's replays under every setting that applies, and the pick.
#[derive(Debug, Clone, Serialize)]
pub struct Advice {
    /// Trace name.
    pub trace: String,
    /// Allocations in the trace.
    pub allocations: u64,
    /// Streams that allocate.
    pub streams: u64,
    /// What the reader found (a wrapped history, ...).
    pub notes: Vec<String>,
    /// The simulated device's memory.
    pub capacity_bytes: u64,
    /// Steps found in the trace's repetition; `None`: costs are per trace.
    pub steps: Option<StepEstimate>,
    /// What one page moved per step weighs, as a fraction of PyTorch's best
    /// peak ([`move_weight`] of the trace's streams).
    pub move_weight: f64,
    /// One per setting, in [`SETTINGS`](crate::settings::SETTINGS) order.
    pub outcomes: Vec<Outcome>,
    /// Index of PyTorch's best setting in `outcomes`.
    pub pytorch_best: usize,
    /// Index of the recommended setting in `outcomes`.
    pub recommended: usize,
    /// The memory budget the advice was asked for (`--budget`); `None`:
    /// the simulated device's memory.
    pub budget_bytes: Option<u64>,
}

/// Replays `trace` under every setting that applies and picks one; a trace
/// without allocations is an error.
pub fn advise(trace: &Trace, opts: &ReplayOptions) -> Result<Advice, ReplayError> {
    advise_at(trace, opts, None)
}

/// [`advise`] for a user with a memory budget of `budget` bytes (`None`:
/// the simulated device's memory): the budget setting reclaims at it, and
/// no setting whose peak reserved passes it is recommended while one stays
/// under it.
pub fn advise_at(
    trace: &Trace,
    opts: &ReplayOptions,
    budget: Option<u64>,
) -> Result<Advice, ReplayError> {
    if trace.alloc_count() == 0 {
        return Err(ReplayError::NoAllocations {
            trace: trace.name.clone(),
        });
    }
    let mut runs = Vec::new();
    for setting in settings_for(trace) {
        let config = match setting.config_at(budget) {
            c if c.is_empty() => setting.engine_config().into(),
            c => c,
        };
        runs.push((*setting, replay(trace, &config, opts)?.report));
    }
    Ok(Advice::new(trace, opts.capacity, runs).at_budget(budget))
}

impl Advice {
    /// Weighs replays already made: `runs` pairs each setting (PyTorch's
    /// default and expandable segments among them) with its report.
    ///
    /// # Panics
    ///
    /// If PyTorch's default or expandable segments has no run.
    pub fn new(trace: &Trace, capacity: u64, runs: Vec<(Setting, ReplayReport)>) -> Advice {
        let steps = estimate_steps(trace);
        let peak_of = |setting: &Setting| {
            runs.iter()
                .find(|(s, _)| s == setting)
                .map(|(_, r)| r.peak_reserved_bytes)
                .unwrap_or_else(|| panic!("no replay under {}", setting.label))
        };
        let default_peak = peak_of(&crate::settings::PYTORCH_DEFAULT).max(1) as f64;
        let best_peak = peak_of(&crate::settings::PYTORCH_DEFAULT)
            .min(peak_of(&crate::settings::PYTORCH_EXPANDABLE))
            .max(1) as f64;
        let per_step = steps.map_or(1.0, |s| s.steps.max(1) as f64);
        let streams = trace.stream_count() as u64;
        let weight = move_weight(streams);
        let outcomes: Vec<Outcome> = runs
            .into_iter()
            .map(|(setting, report)| {
                let peak = report.peak_reserved_bytes as f64;
                let moves = report.pages_moved as f64 / per_step;
                Outcome {
                    setting,
                    pages_moved_per_step: moves,
                    vs_pytorch_default: peak / default_peak,
                    vs_pytorch_best: peak / best_peak,
                    score_bytes: peak + moves * weight * best_peak,
                    report,
                }
            })
            .collect();
        let pytorch_best = lowest(&outcomes, |o| {
            (
                if o.setting.pytorch {
                    o.report.peak_reserved_bytes as f64
                } else {
                    f64::INFINITY
                },
                0.0,
            )
        });
        let recommended = recommend(&outcomes, capacity, false);
        Advice {
            trace: trace.name.clone(),
            allocations: trace.alloc_count() as u64,
            streams,
            notes: trace
                .header
                .iter()
                .filter(|h| h.starts_with("wrapped history"))
                .cloned()
                .collect(),
            capacity_bytes: capacity,
            steps,
            move_weight: weight,
            outcomes,
            pytorch_best,
            recommended,
            budget_bytes: None,
        }
    }

    /// The advice for a memory budget of `budget` bytes (`None`: the
    /// device's memory and the rule as without one), the budget setting
    /// replayed at it: among the settings whose peak stays under a budget
    /// given, memory below it costs nothing, so the fewest page moves per
    /// step win (then the rule's score).
    pub fn at_budget(mut self, budget: Option<u64>) -> Advice {
        self.budget_bytes = budget;
        self.recommended = recommend(
            &self.outcomes,
            budget.unwrap_or(self.capacity_bytes),
            budget.is_some(),
        );
        self
    }

    /// The configuration string of `setting` as replayed here (the budget
    /// setting's with the budget asked for).
    pub fn config_of(&self, setting: &Setting) -> String {
        setting.config_at(self.budget_bytes).into_owned()
    }

    /// The recommended setting's outcome.
    pub fn recommendation(&self) -> &Outcome {
        &self.outcomes[self.recommended]
    }

    /// PyTorch's best setting's outcome.
    pub fn best_of_pytorch(&self) -> &Outcome {
        &self.outcomes[self.pytorch_best]
    }

    /// The outcome of the setting called `name`, if it was replayed.
    pub fn outcome(&self, name: &str) -> Option<&Outcome> {
        self.outcomes.iter().find(|o| o.setting.name == name)
    }

    /// What a step is here, in words.
    pub fn step_words(&self) -> String {
        match self.steps {
            Some(s) => format!(
                "a step is {} allocations, repeated about {} times (estimated from the trace's \
                 repetition: {:.0}% of allocations recur a step later)",
                s.allocations_per_step,
                s.steps,
                s.repeat_fraction * 100.0
            ),
            None => "no repeating step found: page moves are counted over the whole trace".into(),
        }
    }

    /// The recommendation's cost, in words and numbers.
    pub fn cost_words(&self) -> String {
        let r = self.recommendation();
        let Some(page) = r.setting.page_mb else {
            return "no page moves: the same work per allocation as PyTorch's allocator".into();
        };
        if r.report.pages_moved == 0 {
            return format!(
                "no page moves on this trace ({page} MiB pages): nothing beyond PyTorch's \
                 expandable segments"
            );
        }
        let per = match self.steps {
            Some(s) => format!(
                "about {:.1} a step over {} steps",
                r.pages_moved_per_step, s.steps
            ),
            None => "a step could not be told from the trace".into(),
        };
        let millis = r.pages_moved_per_step * H100_MICROS_PER_PAGE_MOVE / 1000.0;
        format!(
            "{} pages of {page} MiB unmapped and mapped again over the trace ({per}): about \
             {millis:.1} ms of driver calls {} on an H100 ({H100_MICROS_PER_PAGE_MOVE:.0} us a \
             page), {}",
            r.report.pages_moved,
            if self.steps.is_some() {
                "a step"
            } else {
                "for the whole trace"
            },
            if several(self.streams) {
                "and where several streams allocate a step that moves pages costs the GPU more \
                 than those calls (docs/advise.md)"
            } else {
                "on the host while the GPU works through queued kernels"
            },
        )
    }

    /// The report `advise` prints.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{}: {} allocations on {} stream{}, replayed on a simulated {} device",
            self.trace,
            self.allocations,
            self.streams,
            if self.streams == 1 { "" } else { "s" },
            human_bytes(self.capacity_bytes)
        );
        for note in &self.notes {
            out.push_str(&wrap(&format!("note: {note}"), "  "));
        }
        if let Some(budget) = self.budget_bytes {
            let line = format!(
                "memory budget: {} (the budget setting reclaims at it; among the settings \
                 that stay under it, the fewest page moves win)",
                human_bytes(budget)
            );
            out.push_str(&wrap(&line, "  "));
        }
        out.push_str(&wrap(&self.step_words(), "  "));
        out.push('\n');
        let _ = writeln!(
            out,
            "{:<44} {:>13}  {:>9}  {:>6}  {:>10}",
            "setting", "peak reserved", "x default", "x best", "moves/step"
        );
        for o in &self.outcomes {
            let mark = if std::ptr::eq(o, self.recommendation()) {
                "> "
            } else {
                "  "
            };
            let row = format!(
                "{mark}{:<42} {:>13}  {:>9.3}  {:>6.3}  {:>10}",
                o.setting.label,
                human_bytes(o.report.peak_reserved_bytes),
                o.vs_pytorch_default,
                o.vs_pytorch_best,
                moves_cell(o)
            );
            let _ = writeln!(out, "{}", row.trim_end());
        }
        let r = self.recommendation();
        let best = self.best_of_pytorch();
        let _ = writeln!(
            out,
            "\nrecommended: {} (`{}`)",
            r.setting.label, r.setting.name
        );
        let _ = writeln!(
            out,
            "  {} peak reserved: {:.3}x PyTorch's default, {:.3}x its best ({})",
            human_bytes(r.report.peak_reserved_bytes),
            r.vs_pytorch_default,
            r.vs_pytorch_best,
            best.setting.label
        );
        let conf = self.config_of(&r.setting);
        if conf.is_empty() {
            let _ = writeln!(out, "  {} (GPUALLOC_CONF unset)", r.setting.enable_call());
        } else if conf != r.setting.config {
            // The setting at the budget asked for: its full string.
            let _ = writeln!(
                out,
                "  {}, or GPUALLOC_CONF=\"{conf}\"",
                enable_call_of(&conf)
            );
        } else {
            // The name, which every configuration entry point takes, and
            // the string it stands for.
            let _ = writeln!(
                out,
                "  {}, or GPUALLOC_CONF=\"{}\"; `{}` stands for\n  {}",
                r.setting.enable_call(),
                r.setting.name,
                r.setting.name,
                r.setting.config
            );
        }
        if r.setting.pytorch {
            let _ = writeln!(
                out,
                "  PyTorch's own allocator does as well here{}",
                if r.setting.config.is_empty() {
                    String::new()
                } else {
                    format!(": PYTORCH_CUDA_ALLOC_CONF=\"{}\"", r.setting.config)
                }
            );
        }
        out.push_str(&wrap(&format!("cost: {}", self.cost_words()), "  "));
        out.push_str(&wrap(
            &format!(
                "rule: the lowest peak reserved, each page moved per step charged {}% of \
                 PyTorch's best peak{} \
                 (https://github.com/gpu-alloc/gpu-alloc/blob/main/docs/advise.md)",
                self.move_weight * 100.0,
                if several(self.streams) {
                    " (several streams allocate: a page moved costs them more)"
                } else {
                    ""
                }
            ),
            "  ",
        ));
        out
    }

    /// The advice as JSON: the fields, the `enable()` call, the
    /// `GPUALLOC_CONF` value, the cost in words and the text report.
    pub fn to_json(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(self).expect("the advice serializes");
        let r = self.recommendation();
        if let serde_json::Value::Object(map) = &mut value {
            map.insert("recommended_setting".into(), r.setting.name.into());
            let conf = self.config_of(&r.setting);
            // By name, unless a budget of the caller's changed its string.
            let call = if conf == r.setting.config {
                r.setting.enable_call()
            } else {
                enable_call_of(&conf)
            };
            map.insert("enable_call".into(), call.into());
            map.insert("gpualloc_conf".into(), conf.into());
            map.insert("cost".into(), self.cost_words().into());
            map.insert("text".into(), self.to_text().into());
        }
        value
    }
}

/// Width of the text report, for a terminal of 100 columns.
const TEXT_WIDTH: usize = 96;

/// `text` broken at spaces into lines of at most [`TEXT_WIDTH`], the
/// continuation lines indented.
fn wrap(text: &str, indent: &str) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split(' ') {
        if !line.is_empty() && line.len() + 1 + word.len() > TEXT_WIDTH {
            out.push_str(&line);
            out.push('\n');
            line = indent.to_string();
        } else if !line.is_empty() && line != indent {
            line.push(' ');
        }
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
    out
}

/// A memory budget as `advise --budget` takes it: bytes (`25769803776`),
/// or a number with `MiB` or `GiB` after it (`24576MiB`, `24GiB`).
pub fn parse_budget(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (number, unit) = if let Some(n) = text.strip_suffix("GiB") {
        (n, 1u64 << 30)
    } else if let Some(n) = text.strip_suffix("MiB") {
        (n, 1 << 20)
    } else {
        (text, 1)
    };
    number
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .filter(|&bytes| bytes > 0)
        .ok_or_else(|| {
            format!("budget {text:?}: expected bytes, or a whole number of MiB or GiB (24GiB)")
        })
}

/// A page-move count for the tables: blank for settings that move none.
fn moves_cell(o: &Outcome) -> String {
    match (o.setting.page_mb, o.report.pages_moved) {
        (None, _) => String::new(),
        (Some(_), 0) => "0".into(),
        (Some(_), _) => format!("{:.1}", o.pages_moved_per_step),
    }
}

/// The rule's pick (the lowest score, then fewer moves; with
/// `moves_first`, fewer moves, then the score) among the outcomes whose
/// peak reserved stays within `budget` bytes; among all of them, by the
/// score, when none does.
fn recommend(outcomes: &[Outcome], budget: u64, moves_first: bool) -> usize {
    let any_fits = outcomes
        .iter()
        .any(|o| o.report.peak_reserved_bytes <= budget);
    lowest(outcomes, |o| {
        if !any_fits {
            (o.score_bytes, o.pages_moved_per_step)
        } else if o.report.peak_reserved_bytes > budget {
            (f64::INFINITY, f64::INFINITY)
        } else if moves_first {
            (o.pages_moved_per_step, o.score_bytes)
        } else {
            (o.score_bytes, o.pages_moved_per_step)
        }
    })
}

/// Index of the outcome with the lowest key; the earliest among equals.
fn lowest(outcomes: &[Outcome], key: impl Fn(&Outcome) -> (f64, f64)) -> usize {
    let mut best = 0;
    for (i, o) in outcomes.iter().enumerate().skip(1) {
        if key(o).partial_cmp(&key(&outcomes[best])) == Some(std::cmp::Ordering::Less) {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{PYTORCH_DEFAULT, PYTORCH_EXPANDABLE, SETTINGS};

    fn report(peak: u64, moved: u64) -> ReplayReport {
        ReplayReport {
            trace: "t".into(),
            policy: "p".into(),
            ops: 0,
            peak_requested_bytes: peak / 2,
            peak_allocated_bytes: peak / 2,
            peak_reserved_bytes: peak,
            reserved_over_requested: 2.0,
            device_allocs: 1,
            device_frees: 0,
            pages_moved: moved,
            stream_waits: 0,
            free_queries: 0,
            retries: 0,
            ooms: 0,
            ns_per_op: f64::NAN,
        }
    }

    /// Advice over a trace without steps: moves are charged per trace.
    fn advice(runs: &[(usize, u64, u64)]) -> Advice {
        let runs = runs
            .iter()
            .map(|&(i, peak, moved)| (SETTINGS[i], report(peak, moved)))
            .collect();
        Advice::new(&Trace::default(), 1 << 30, runs)
    }

    #[test]
    fn a_budget_rules_out_the_settings_that_pass_it() {
        // The unmap setting saves 20 of 800 but pays for 500 moves.
        let a = advice(&[(0, 1000, 0), (1, 800, 0), (2, 780, 500)]);
        assert_eq!(a.recommendation().setting, PYTORCH_EXPANDABLE);
        assert_eq!(a.budget_bytes, None);
        // Under a budget of 790 only it fits.
        let at = a.clone().at_budget(Some(790));
        assert_eq!(at.recommendation().setting, SETTINGS[2]);
        assert_eq!(at.budget_bytes, Some(790));
        assert!(
            at.to_text().contains("memory budget: 790"),
            "{}",
            at.to_text()
        );
        // Under 700 none fits: the rule picks among all, as without one.
        let none = a.clone().at_budget(Some(700));
        assert_eq!(none.recommendation().setting, PYTORCH_EXPANDABLE);
        // Memory under a budget given costs nothing: fewer moves win.
        let b = advice(&[(0, 1000, 0), (1, 950, 0), (2, 700, 60), (3, 690, 120)]);
        assert_eq!(b.recommendation().setting, SETTINGS[2]);
        assert_eq!(
            b.clone().at_budget(Some(900)).recommendation().setting,
            SETTINGS[2]
        );
        assert_eq!(
            b.clone().at_budget(Some(960)).recommendation().setting,
            PYTORCH_EXPANDABLE
        );
        assert_eq!(
            b.clone().at_budget(Some(695)).recommendation().setting,
            SETTINGS[3]
        );
        assert_eq!(parse_budget("24GiB"), Ok(24 << 30));
        assert_eq!(parse_budget("512MiB"), Ok(512 << 20));
        assert_eq!(parse_budget("1048576"), Ok(1 << 20));
        for bad in ["", "0", "-1", "24 GB", "lots", "99999999999GiB"] {
            assert!(parse_budget(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_page_moved_weighs_more_where_several_streams_allocate() {
        // unmap16 saves 2% of PyTorch's best for 2 pages moved (per trace):
        // worth it on one stream (2 x 0.04% of the peak), not on several
        // (2 x 1.6%), where PyTorch's expandable segments win.
        let runs = [(0, 1200, 0), (1, 1000, 0), (2, 980, 2)];
        let one = advice(&runs);
        assert_eq!(one.move_weight, MOVE_WEIGHT);
        assert_eq!(one.recommendation().setting, SETTINGS[2]);
        let two_streams = crate::trace::parse_text("two", "a 1 1024 0\na 2 1024 7\n").unwrap();
        let runs = runs
            .iter()
            .map(|&(i, peak, moved)| (SETTINGS[i], report(peak, moved)))
            .collect();
        let several = Advice::new(&two_streams, 1 << 30, runs);
        assert_eq!(several.move_weight, MULTI_STREAM_MOVE_WEIGHT);
        assert_eq!(several.recommendation().setting, PYTORCH_EXPANDABLE);
        assert!(several.to_text().contains("several streams allocate"));
    }

    #[test]
    fn pytorchs_best_is_the_lower_of_its_two_settings() {
        let a = advice(&[(0, 1000, 0), (1, 800, 0)]);
        assert_eq!(a.best_of_pytorch().setting, PYTORCH_EXPANDABLE);
        assert_eq!(a.recommendation().setting, PYTORCH_EXPANDABLE);
        assert!((a.outcomes[0].vs_pytorch_best - 1.25).abs() < 1e-12);
        let a = advice(&[(0, 800, 0), (1, 800, 0)]);
        assert_eq!(
            a.best_of_pytorch().setting,
            PYTORCH_DEFAULT,
            "ties: the default"
        );
    }

    #[test]
    fn page_moves_are_charged_against_the_saving() {
        // 100 pages moved: 4% of 1,000,000 bytes, so a 3.5% saving loses...
        let a = advice(&[(0, 1_000_000, 0), (1, 1_000_000, 0), (2, 965_000, 100)]);
        assert_eq!(a.recommendation().setting, PYTORCH_DEFAULT);
        // ... and a 4.5% saving wins.
        let a = advice(&[(0, 1_000_000, 0), (1, 1_000_000, 0), (2, 955_000, 100)]);
        assert_eq!(a.recommendation().setting.name, "unmap16");
        // More moves must buy more: 8 MiB pages win only past their charge.
        let a = advice(&[
            (0, 1_000_000, 0),
            (1, 1_000_000, 0),
            (2, 955_000, 100),
            (3, 950_000, 200),
        ]);
        assert_eq!(a.recommendation().setting.name, "unmap16");
        let a = advice(&[
            (0, 1_000_000, 0),
            (1, 1_000_000, 0),
            (2, 955_000, 100),
            (3, 900_000, 200),
        ]);
        assert_eq!(a.recommendation().setting.name, "unmap8");
    }

    #[test]
    fn equal_scores_go_to_fewer_moves_then_pytorchs_setting() {
        let a = advice(&[(0, 900, 0), (1, 800, 0), (2, 800, 0)]);
        assert_eq!(a.recommendation().setting, PYTORCH_EXPANDABLE);
    }

    #[test]
    fn the_text_names_the_call_and_the_cost() {
        let a = advice(&[(0, 1_000_000, 0), (1, 1_000_000, 0), (2, 955_000, 100)]);
        let text = a.to_text();
        assert!(text.contains("(`unmap16`)"), "{text}");
        assert!(
            text.contains("gpu_alloc.enable(\"unmap16\"), or GPUALLOC_CONF=\"unmap16\""),
            "{text}"
        );
        assert!(
            text.contains("stands for\n  expandable_segments:True,unmap_free_pages:True\n"),
            "{text}"
        );
        assert!(text.lines().all(|l| l.len() <= 100), "{text}");
        assert!(text.contains("100 pages of 16 MiB"), "{text}");
        assert!(text.contains("for the whole trace"), "{text}");
        let json = a.to_json();
        assert_eq!(json["recommended_setting"], "unmap16");
        assert_eq!(
            json["gpualloc_conf"],
            "expandable_segments:True,unmap_free_pages:True"
        );
        assert_eq!(json["text"], text.as_str());
    }

    #[test]
    fn long_lines_are_wrapped_at_spaces() {
        let text = wrap(&"word ".repeat(40), "  ");
        assert!(text.lines().all(|l| l.len() <= TEXT_WIDTH), "{text}");
        assert!(
            text.lines().skip(1).all(|l| l.starts_with("  word")),
            "{text}"
        );
        assert_eq!(text.split_whitespace().count(), 40);
        assert_eq!(wrap("short", "  "), "short\n");
    }

    #[test]
    fn pytorchs_own_setting_says_pytorch_does_as_well() {
        let a = advice(&[(0, 1000, 0), (1, 800, 0), (2, 800, 10)]);
        let text = a.to_text();
        assert!(
            text.contains("PYTORCH_CUDA_ALLOC_CONF=\"expandable_segments:True\""),
            "{text}"
        );
        assert!(
            a.cost_words().starts_with("no page moves"),
            "{}",
            a.cost_words()
        );
    }
}
