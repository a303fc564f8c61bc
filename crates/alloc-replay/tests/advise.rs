//! The advice on the bundled traces: the steps found match the recorded
//! loops, and the recommendation is the one the rule of `docs/advise.md`
//! picks, recomputed here from each setting's own replay.

mod common;

use alloc_replay::advise::MOVE_WEIGHT;
use alloc_replay::{advise, estimate_steps, replay, settings_for};
use common::{bundled_trace, untimed};

/// Steps of each bundled workload as recorded (`traces/README.md`): training
/// steps, ConvNeXt's requests, GPT-2's generated tokens (3 rounds x 256).
const RECORDED_STEPS: &[(&str, u64)] = &[
    ("bert_mlm_varlen_train", 20),
    ("convnext_varres_infer", 40),
    ("gpt2_generate", 768),
    ("gpt2_train", 6),
    ("lstm_lm_varlen_train", 15),
    ("resnet50_train", 6),
    ("seq2seq_varlen_train", 20),
    ("small_mlp", 3),
    ("unet_diffusion_train", 10),
    ("vit_varbatch_infer", 80),
];

#[test]
fn steps_found_match_the_recorded_loops() {
    for &(name, recorded) in RECORDED_STEPS {
        let found =
            estimate_steps(&bundled_trace(name)).unwrap_or_else(|| panic!("{name}: no steps"));
        println!("{name}: {found:?} (recorded {recorded})");
        let error = (found.steps as f64 - recorded as f64).abs() / recorded as f64;
        assert!(
            error <= 0.05,
            "{name}: {} steps, recorded {recorded}",
            found.steps
        );
    }
}

/// What the rule picks per bundled trace (`docs/advise.md` shows these).
const RECOMMENDED: &[(&str, &str)] = &[
    ("bert_mlm_varlen_train", "bound"),
    ("convnext_varres_infer", "bound"),
    ("gpt2_generate", "bound"),
    ("gpt2_train", "unmap16"),
    ("lstm_lm_varlen_train", "unmap16"),
    ("resnet50_train", "bound"),
    ("seq2seq_varlen_train", "bound"),
    ("small_mlp", "unmap16"),
    ("unet_diffusion_train", "expandable"),
    ("vit_varbatch_infer", "unmap8"),
];

#[test]
fn the_recommendation_follows_the_rule_on_every_bundled_trace() {
    for &(name, expected) in RECOMMENDED {
        let trace = bundled_trace(name);
        let advice = advise(&trace, &untimed()).unwrap();
        print!("{}", advice.to_text());

        // The rule, from the settings' own replays.
        let steps = estimate_steps(&trace).map_or(1.0, |s| s.steps as f64);
        let runs: Vec<_> = settings_for(&trace)
            .into_iter()
            .map(|s| {
                (
                    s,
                    replay(&trace, s.engine_config(), &untimed())
                        .unwrap()
                        .report,
                )
            })
            .collect();
        let best = runs
            .iter()
            .filter(|(s, _)| s.pytorch)
            .map(|(_, r)| r.peak_reserved_bytes)
            .min()
            .unwrap() as f64;
        let score = |r: &alloc_replay::ReplayReport| {
            r.peak_reserved_bytes as f64 + r.pages_moved as f64 / steps * MOVE_WEIGHT * best
        };
        let lowest = runs
            .iter()
            .map(|(_, r)| score(r))
            .fold(f64::INFINITY, f64::min);
        let winners: Vec<_> = runs.iter().filter(|(_, r)| score(r) == lowest).collect();
        let fewest_moves = winners.iter().map(|(_, r)| r.pages_moved).min().unwrap();
        let pick = winners
            .iter()
            .find(|(_, r)| r.pages_moved == fewest_moves)
            .unwrap()
            .0;
        assert_eq!(advice.recommendation().setting.name, pick.name, "{name}");
        assert_eq!(pick.name, expected, "{name}: the rule's pick changed");

        // Never worse than PyTorch's best, and the figures are the replays'.
        assert!(advice.recommendation().vs_pytorch_best <= 1.0, "{name}");
        for (o, (s, r)) in advice.outcomes.iter().zip(&runs) {
            let figures = |r: &alloc_replay::ReplayReport| (r.peak_reserved_bytes, r.pages_moved);
            assert_eq!((&o.setting, figures(&o.report)), (*s, figures(r)), "{name}");
        }
    }
}
