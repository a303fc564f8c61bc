//! How many steps a trace holds, estimated from its repetition.
//!
//! A training or inference loop makes the same requests in every step. The
//! sizes may change from step to step (a sequence length, a batch), but the
//! *lifetimes* do not: the i-th tensor of a step lives as many events as the
//! i-th tensor of the next one, because the same operators run in the same
//! order. So each allocation is replaced by its lifetime (events until its
//! free), and the step is the shortest lag at which that sequence repeats
//! nearly as well as at any lag: one GPT-2 token rather than a whole
//! generation round, one training step rather than a layer.
//!
//! Candidate lags are the gaps between successive occurrences of the same
//! run of [`window`] lifetimes; each candidate is scored by the fraction of
//! positions whose lifetime equals the one a lag later. On the bundled
//! traces this finds the recorded step counts within 3% (training steps,
//! ConvNeXt's requests, GPT-2's generated tokens; `tests/steps.rs`).

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::trace::{Trace, TraceEvent};

/// A trace's step count, estimated from its repeating pattern.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepEstimate {
    /// Whole steps in the trace (allocations divided by the step's
    /// allocations, rounded down).
    pub steps: u64,
    /// Allocations in one step: the lag at which the trace repeats.
    pub allocations_per_step: u64,
    /// Fraction of allocations whose lifetime equals the one a step later
    /// (1.0: every step alike).
    pub repeat_fraction: f64,
}

/// Lifetime of an allocation never freed in the trace.
const NEVER_FREED: u64 = u64::MAX;
/// Lags tried: the most frequent gaps between repeated windows.
const CANDIDATE_LAGS: usize = 40;
/// Below this repeat fraction the trace has no step worth the name.
const MIN_REPEAT: f64 = 0.25;
/// A shorter lag that repeats within this of the best one is the step (a
/// round of generation repeats its tokens' pattern: the token is the step).
const SHORTER_LAG_SLACK: f64 = 0.01;

/// Estimates the steps of `trace`; `None` when it does not repeat (fewer
/// than two steps, or no lag where at least a quarter of the allocations
/// recur).
pub fn estimate_steps(trace: &Trace) -> Option<StepEstimate> {
    let lifetimes = lifetimes(trace);
    let n = lifetimes.len();
    if n < 8 {
        return None;
    }
    let scored: Vec<(usize, f64)> = candidate_lags(&lifetimes, window(n))
        .into_iter()
        .map(|lag| (lag, repeat_fraction(&lifetimes, lag)))
        .collect();
    let best = scored.iter().map(|&(_, f)| f).fold(0.0, f64::max);
    if best < MIN_REPEAT {
        return None;
    }
    let (lag, fraction) = scored
        .iter()
        .filter(|&&(_, f)| f >= best - SHORTER_LAG_SLACK)
        .min_by_key(|&&(lag, _)| lag)
        .copied()?;
    Some(StepEstimate {
        steps: (n / lag) as u64,
        allocations_per_step: lag as u64,
        repeat_fraction: fraction,
    })
}

/// Length of the runs of lifetimes matched to find candidate lags: long
/// enough to be specific, short enough for small traces.
pub fn window(allocations: usize) -> usize {
    (allocations / 16).clamp(4, 16)
}

/// Each allocation's lifetime in events, in allocation order.
fn lifetimes(trace: &Trace) -> Vec<u64> {
    let mut out = Vec::new();
    let mut open: FxHashMap<u64, (usize, usize)> = FxHashMap::default();
    for (index, event) in trace.events.iter().enumerate() {
        match *event {
            TraceEvent::Alloc { id, .. } => {
                open.insert(id, (out.len(), index));
                out.push(NEVER_FREED);
            }
            TraceEvent::Free { id, .. } => {
                if let Some((slot, born)) = open.remove(&id) {
                    out[slot] = (index - born) as u64;
                }
            }
            // A lifetime ends at its free, as the program saw it.
            TraceEvent::FreeCompleted { .. } => {}
        }
    }
    out
}

/// The most frequent gaps (at most half the trace) between successive
/// occurrences of equal windows, most frequent first.
fn candidate_lags(lifetimes: &[u64], window: usize) -> Vec<usize> {
    let half = lifetimes.len() / 2;
    let mut last_seen: FxHashMap<&[u64], usize> = FxHashMap::default();
    let mut gaps: FxHashMap<usize, u64> = FxHashMap::default();
    for (start, run) in lifetimes.windows(window).enumerate() {
        if let Some(previous) = last_seen.insert(run, start) {
            let gap = start - previous;
            if gap <= half {
                *gaps.entry(gap).or_default() += 1;
            }
        }
    }
    let mut ranked: Vec<(usize, u64)> = gaps.into_iter().collect();
    ranked.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked
        .into_iter()
        .take(CANDIDATE_LAGS)
        .map(|(gap, _)| gap)
        .collect()
}

/// Fraction of positions whose lifetime equals the one `lag` later.
fn repeat_fraction(lifetimes: &[u64], lag: usize) -> f64 {
    let pairs = lifetimes.len() - lag;
    let equal = lifetimes
        .iter()
        .zip(&lifetimes[lag..])
        .filter(|(a, b)| a == b)
        .count();
    equal as f64 / pairs as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop of `steps` steps, each allocating `per_step` tensors of
    /// `size(step, i)` bytes and freeing them in a nested order, after a
    /// prologue of `prologue` tensors that stay live.
    fn looped(prologue: u64, steps: u64, per_step: u64, size: impl Fn(u64, u64) -> u64) -> Trace {
        let mut events = Vec::new();
        let mut id = 0;
        for _ in 0..prologue {
            events.push(TraceEvent::Alloc {
                id,
                size: 4096,
                stream: 0,
            });
            id += 1;
        }
        for step in 0..steps {
            let first = id;
            for i in 0..per_step {
                events.push(TraceEvent::Alloc {
                    id,
                    size: size(step, i),
                    stream: 0,
                });
                id += 1;
                // Every third tensor is a temporary, freed at once.
                if i % 3 == 2 {
                    events.push(TraceEvent::Free {
                        id: id - 1,
                        stream: 0,
                    });
                }
            }
            for done in (first..id).rev().filter(|d| (d - first) % 3 != 2) {
                events.push(TraceEvent::Free {
                    id: done,
                    stream: 0,
                });
            }
        }
        Trace {
            name: "loop".into(),
            events,
            ..Trace::default()
        }
    }

    #[test]
    fn a_loop_with_varying_sizes_has_its_steps_found() {
        // Sizes change every step (a sequence length): lifetimes do not.
        let trace = looped(5, 12, 40, |step, i| (step + 1) * 1000 + i);
        let found = estimate_steps(&trace).expect("a loop repeats");
        assert_eq!(found.allocations_per_step, 40);
        assert_eq!(found.steps, 12);
        assert!(found.repeat_fraction > 0.9, "{found:?}");
    }

    #[test]
    fn the_shortest_lag_that_repeats_as_well_is_the_step() {
        // Steps of 30 repeat at 60, 90, ... as well: 30 is the step.
        let trace = looped(0, 20, 30, |_, i| i);
        assert_eq!(estimate_steps(&trace).unwrap().allocations_per_step, 30);
    }

    #[test]
    fn a_trace_without_repetition_has_no_steps() {
        // Every tensor lives one event longer than the one before.
        let mut events = Vec::new();
        for id in 0..200u64 {
            events.push(TraceEvent::Alloc {
                id,
                size: 512,
                stream: 0,
            });
        }
        for id in (0..200u64).rev() {
            events.push(TraceEvent::Free { id, stream: 0 });
        }
        let trace = Trace {
            name: "ramp".into(),
            events,
            ..Trace::default()
        };
        assert_eq!(estimate_steps(&trace), None);
        assert_eq!(estimate_steps(&Trace::default()), None);
    }

    #[test]
    fn frees_of_unknown_ids_are_ignored() {
        let mut trace = looped(0, 6, 20, |_, i| i);
        trace
            .events
            .insert(0, TraceEvent::Free { id: 999, stream: 0 });
        assert_eq!(estimate_steps(&trace).unwrap().steps, 6);
    }
}
