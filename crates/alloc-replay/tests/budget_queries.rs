//! The budget setting asks the device for its free memory (`cuMemGetInfo`
//! on a GPU, a driver call of microseconds) only before a mapping, never on
//! an allocation served from pages already mapped: on the bundled traces,
//! replayed with the budget reached (the smallest of a few devices between
//! each trace's peak allocated and peak reserved on which nothing runs out), the
//! replay counts no more queries than device allocations. (A mapping the
//! device refuses, and an out-of-memory report, ask too.) And under
//! PyTorch's memory fraction the budget setting reclaims at the limit.

mod common;

use alloc_replay::replay;
use alloc_replay::settings::BUDGET;
use common::{bundled_trace, untimed};

#[test]
fn at_the_budget_the_device_is_asked_only_before_a_mapping() {
    let mut reached = 0;
    for name in [
        "resnet50_train",
        "gpt2_train",
        "gpt2_generate",
        "vit_varbatch_infer",
        "bert_mlm_varlen_train",
        "convnext_varres_infer",
        "lstm_lm_varlen_train",
        "seq2seq_varlen_train",
    ] {
        let trace = bundled_trace(name);
        let roomy = replay(&trace, BUDGET.config, &untimed()).unwrap().report;
        // The smallest device between the peak allocated and the peak
        // reserved with room to spare on which nothing runs out: the
        // budget, the whole device, is reached.
        let (allocated, reserved) = (roomy.peak_allocated_bytes, roomy.peak_reserved_bytes);
        let tight = (1..=8)
            .map(|eighths| {
                let mut opts = untimed();
                opts.capacity = allocated + (reserved - allocated) * eighths / 8;
                replay(&trace, BUDGET.config, &opts).unwrap().report
            })
            .find(|r| r.ooms == 0 && r.retries == 0)
            .unwrap_or_else(|| panic!("{name}: out of memory on every device tried"));
        println!(
            "{name}: {} queries, {} device allocations, {} pages moved",
            tight.free_queries, tight.device_allocs, tight.pages_moved
        );
        assert!(
            tight.free_queries <= tight.device_allocs,
            "{name}: {} queries of the device's free memory for {} device allocations",
            tight.free_queries,
            tight.device_allocs
        );
        if tight.pages_moved > 0 {
            reached += 1;
        }
    }
    assert!(
        reached >= 2,
        "pages moved at the budget on {reached} traces"
    );
}

/// Replayed under PyTorch's per-process memory fraction (`ReplayOptions::
/// memory_fraction`, as `benchmarks/budget/budget.py` sets its budgets), the
/// budget setting reclaims at the limit: reserved memory stays within it and
/// every allocation fits, with no flush-and-retry, where PyTorch's default
/// rules retry and still fail some (when this was written: 96 retries, 69
/// allocations out of memory).
#[test]
fn under_a_memory_fraction_the_budget_setting_reclaims_before_retrying() {
    use alloc_replay::settings::PYTORCH_DEFAULT as DEFAULT;
    let trace = bundled_trace("resnet50_train");
    // Three quarters of the way between the budget setting's own peak allocated and reserved
    // with the device to itself: below what either setting reserves then.
    let roomy = replay(&trace, BUDGET.config, &untimed()).unwrap().report;
    let (allocated, reserved) = (roomy.peak_allocated_bytes, roomy.peak_reserved_bytes);
    let mut opts = untimed();
    let limit = allocated + (reserved - allocated) * 3 / 4;
    opts.memory_fraction = Some(limit as f64 / opts.capacity as f64);
    let default = replay(&trace, DEFAULT.config, &opts).unwrap().report;
    let budget = replay(&trace, BUDGET.config, &opts).unwrap().report;
    println!(
        "limit {} MiB: default {} retries; budget {} retries, {} pages moved, peak {} MiB",
        limit >> 20,
        default.retries,
        budget.retries,
        budget.pages_moved,
        budget.peak_reserved_bytes >> 20
    );
    assert!(
        default.retries > 0 && default.ooms > 0,
        "the limit binds PyTorch's rules"
    );
    assert_eq!((budget.retries, budget.ooms), (0, 0));
    assert!(budget.peak_reserved_bytes <= limit);
    assert!(budget.pages_moved > 0);
    assert!(budget.free_queries <= budget.device_allocs);
}

/// A memory fraction the engine refuses (outside [0, 1]) is its own error,
/// naming the fraction, not a failure of the trace's first event.
#[test]
fn a_fraction_outside_zero_to_one_is_refused_by_name() {
    let trace = bundled_trace("resnet50_train");
    let mut opts = untimed();
    opts.memory_fraction = Some(1.5);
    let Err(err) = replay(&trace, BUDGET.config, &opts) else {
        panic!("a fraction of 1.5 was accepted")
    };
    assert!(
        matches!(err, alloc_replay::ReplayError::MemoryFraction { fraction, .. } if fraction == 1.5),
        "{err}"
    );
    assert!(err.to_string().contains("memory fraction 1.5"), "{err}");
}
