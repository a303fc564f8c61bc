#![cfg(feature = "pytorch-bfc")]
//! `plan_layout` on the simulated device: a training-like loop (weights,
//! then steps whose activations live part of a step and gradients until the
//! next step) is learned, planned and then laid out the same way every
//! step, with fewer page moves than best fit; a loop whose sizes change
//! every step never follows a plan; and the option's configuration errors.

use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, GIB, MIB};
use alloc_policy::layout_plan::PlanStats;
use alloc_policy::AnyPolicy;

const S: StreamId = StreamId(0);

/// The sizes of one step's activations, in allocation order (unequal, so
/// that a best fit's choices move from step to step).
fn activations(step: u64, vary: bool) -> Vec<u64> {
    (0..40u64)
        .map(|i| {
            let mb = 2 + (i * 7 + 3) % 23 + if vary { step % 5 } else { 0 };
            mb * MIB + (i % 3) * 300 * 1024
        })
        .collect()
}

/// Runs `steps` training-like steps; returns the addresses of each step's
/// allocations and the engine's page moves at the end of each step.
fn train(config: &str, steps: u64, vary: bool) -> (Vec<Vec<u64>>, Vec<u64>, Option<PlanStats>) {
    let cfg = AllocatorConfig::parse(config).unwrap();
    let mut e = AnyPolicy::engine(&cfg, SimMemory::new(64 * GIB), SimStreams::new()).unwrap();
    let weights: Vec<u64> = (0..6)
        .map(|i| e.malloc((30 + i) * MIB, S).unwrap().addr)
        .collect();
    let mut grads: Vec<u64> = Vec::new();
    let (mut layouts, mut moves) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let mut addrs = Vec::new();
        // The last step's gradients go when this one starts (zero_grad).
        for g in grads.drain(..) {
            e.free(g).unwrap();
        }
        let mut live: Vec<u64> = Vec::new();
        for (i, size) in activations(step, vary).into_iter().enumerate() {
            let a = e.malloc(size, S).unwrap().addr;
            addrs.push(a);
            live.push(a);
            // Activations die in a backward-like order, some at once.
            if i % 4 == 3 {
                e.free(live.remove(live.len() / 2)).unwrap();
            }
            e.validate().unwrap();
        }
        for (i, a) in live.into_iter().enumerate() {
            let g = e.malloc((8 + i as u64 % 5) * MIB, S).unwrap().addr;
            addrs.push(g);
            grads.push(g);
            e.free(a).unwrap();
            e.validate().unwrap();
        }
        layouts.push(addrs);
        moves.push(e.stats().page_moves.pages_unmapped);
    }
    for w in weights.into_iter().chain(grads) {
        e.free(w).unwrap();
    }
    e.validate().unwrap();
    (layouts, moves, e.policy().plan_stats())
}

const UNMAP2: &str = "expandable_segments:true,unmap_free_pages:true,unmap_page_mb:2";

#[test]
fn a_repeating_step_is_learned_and_then_laid_out_alike_every_step() {
    let (layouts, moves, stats) = train(&format!("{UNMAP2},plan_layout:true"), 16, false);
    let stats = stats.expect("plan_layout is on");
    assert!(stats.plans >= 1, "{stats:?}");
    assert!(stats.period > 0, "a plan is followed at the end: {stats:?}");
    assert!(stats.placed > 0, "{stats:?}");
    // Once followed, every step lands where the step before landed.
    let (a, b) = (&layouts[14], &layouts[15]);
    assert_eq!(a, b, "the last two steps differ in layout");
    // And nothing moves any more.
    assert_eq!(
        moves[15], moves[12],
        "pages moved in followed steps: {moves:?}"
    );
}

#[test]
fn following_a_plan_moves_no_more_pages_than_best_fit() {
    let (_, planned, _) = train(&format!("{UNMAP2},plan_layout:true"), 16, false);
    let (_, best_fit, stats) = train(UNMAP2, 16, false);
    assert!(stats.is_none());
    let late = |m: &[u64]| m[15] - m[8];
    assert!(
        late(&planned) <= late(&best_fit),
        "planned {planned:?} best fit {best_fit:?}"
    );
}

#[test]
fn steps_that_change_every_time_never_follow_a_plan() {
    let (_, _, stats) = train(&format!("{UNMAP2},plan_layout:true"), 16, true);
    let stats = stats.unwrap();
    assert_eq!(stats.placed, 0, "{stats:?}");
}

/// A run of equal sizes confirms a period of one request; when the sizes
/// then grow request by request (a cache extended every token), the plan is
/// dropped once its requests stop matching, however short its period, not
/// followed for ever with every request a mismatch.
#[test]
fn a_period_of_one_request_is_dropped_when_sizes_stop_matching() {
    let cfg = AllocatorConfig::parse(&format!("{UNMAP2},plan_layout:true")).unwrap();
    let mut e = AnyPolicy::engine(&cfg, SimMemory::new(64 * GIB), SimStreams::new()).unwrap();
    let mut live = Vec::new();
    for i in 0..400u64 {
        let size = if i < 100 {
            4 * MIB
        } else {
            4 * MIB + i * 512 * 1024
        };
        live.push(e.malloc(size, S).unwrap().addr);
        if live.len() > 3 {
            e.free(live.remove(0)).unwrap();
        }
    }
    let stats = e.policy().plan_stats().unwrap();
    assert!(stats.plans >= 1, "a period was found: {stats:?}");
    assert_eq!(stats.period, 0, "the plan was dropped: {stats:?}");
    assert!(stats.mismatches < 64, "{stats:?}");
    e.assert_valid();
}

#[test]
fn plan_layout_needs_expandable_segments_and_pytorch_bfc() {
    let e = AllocatorConfig::parse("plan_layout:true").unwrap_err();
    assert!(e.to_string().contains("expandable_segments"), "{e}");
    for policy in alloc_policy::BASE_POLICIES
        .iter()
        .filter(|p| **p != "pytorch-bfc")
    {
        // The policy named, the parser refuses the option as another's.
        let e = AllocatorConfig::parse(&format!(
            "policy:{policy},expandable_segments:true,plan_layout:true"
        ))
        .unwrap_err();
        let expected = format!("applies to policy `pytorch-bfc` only, not `{policy}`");
        assert!(e.to_string().contains(&expected), "{e}");
        // Built from a view that skipped the parser, the policy refuses it.
        let mut cfg = AllocatorConfig::parse("").unwrap();
        cfg.policy = Some(policy.to_string());
        cfg.plan_layout = true;
        let e = AnyPolicy::from_config(&cfg).unwrap_err();
        assert!(e.to_string().contains(&expected), "{e}");
    }
}
