//! The budget setting asks the device for its free memory (`cuMemGetInfo`
//! on a GPU, a driver call of microseconds) only before a mapping, never on
//! an allocation served from pages already mapped: on the bundled traces,
//! replayed with the budget reached (the smallest of a few devices between
//! each trace's peak allocated and peak reserved on which nothing runs out), the
//! replay counts no more queries than device allocations. (A mapping the
//! device refuses, and an out-of-memory report, ask too.)

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
