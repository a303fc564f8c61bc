//! The typed configuration: what the parser gives for every named setting
//! and policy, which options belong to which policy, and the engine options
//! it yields, the same as the flat view's.

use alloc_core::config::{
    Config, GarbageCollection, PolicyConfig, PolicyKind, Segments, GC_AGE_SUFFIX, NAMED_SETTINGS,
    ROUNDUP_INTERVALS,
};
use alloc_core::{AllocatorConfig, EngineOptions, PageLayout, MIB};

#[test]
fn every_named_setting_and_policy_round_trips_through_the_flat_view() {
    let mut texts: Vec<String> = NAMED_SETTINGS.iter().map(|s| s.name.to_string()).collect();
    for kind in PolicyKind::ALL {
        texts.push(format!("policy:{}", kind.name()));
        texts.push(format!(
            "policy:{}{GC_AGE_SUFFIX},garbage_collection_threshold:0.5",
            kind.name()
        ));
    }
    texts.push("budget,memory_budget_mb:1024,unmap_worker:true".into());
    texts.push("policy:size-class,idle_slab_limit_mb:64,stream_wait_reuse:true".into());
    for text in texts {
        let typed = Config::parse(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        let flat = typed.flat();
        assert_eq!(flat.typed().unwrap(), typed, "{text}");
        // The engine sees what it saw from the flat form.
        let parsed = AllocatorConfig::parse(&text).unwrap();
        assert_eq!(
            EngineOptions::from(&typed),
            EngineOptions::from(&parsed),
            "{text}"
        );
    }
}

#[test]
fn a_policy_option_given_to_another_policy_names_both() {
    for (text, key, owner, given) in [
        (
            "policy:buddy,plan_layout:true",
            "plan_layout",
            "pytorch-bfc",
            "buddy",
        ),
        (
            "policy:size-class,first_fit_mb:8",
            "first_fit_mb",
            "pytorch-bfc",
            "size-class",
        ),
        (
            "policy:buddy,idle_slab_limit_mb:0",
            "idle_slab_limit_mb",
            "size-class",
            "buddy",
        ),
        (
            "policy:pytorch-bfc+gc-age,idle_slab_limit_mb:64",
            "idle_slab_limit_mb",
            "size-class",
            "pytorch-bfc",
        ),
    ] {
        for e in [
            Config::parse(text).unwrap_err(),
            AllocatorConfig::parse(text).unwrap_err(),
        ] {
            let msg = e.to_string();
            assert!(msg.contains(&format!("`{key}`")), "{text}: {msg}");
            assert!(
                msg.contains(&format!("applies to policy `{owner}` only, not `{given}`")),
                "{text}: {msg}"
            );
        }
    }
    // Unnamed, the policy is the builder's default: left to it.
    assert!(AllocatorConfig::parse("idle_slab_limit_mb:0").is_ok());
    let e = Config::parse("idle_slab_limit_mb:0").unwrap_err();
    assert!(e.to_string().contains("not `pytorch-bfc`"), "{e}");
    let c = AllocatorConfig::parse("idle_slab_limit_mb:0").unwrap();
    assert!(c.typed_or(PolicyKind::SizeClass).is_ok());
}

#[test]
fn pytorch_options_are_accepted_with_every_policy_and_kept_by_bfc_only() {
    let text = "max_split_size_mb:128,roundup_power2_divisions:4,max_non_split_rounding_mb:64";
    for kind in PolicyKind::ALL {
        let cfg = Config::parse(&format!("policy:{},{text}", kind.name())).unwrap();
        match cfg.policy {
            PolicyConfig::PytorchBfc(bfc) => {
                assert_eq!(bfc.max_split_size, 128 * MIB);
                assert_eq!(bfc.max_non_split_rounding, 64 * MIB);
                assert_eq!(bfc.roundup_power2_divisions, [4; ROUNDUP_INTERVALS]);
            }
            other => assert_eq!(other.kind(), kind),
        }
    }
}

#[test]
fn unknown_policies_are_refused_with_a_suggestion() {
    let e = Config::parse("policy:pytorch_bfc").unwrap_err().to_string();
    assert!(e.contains("did you mean `pytorch-bfc`?"), "{e}");
    let e = Config::parse("policy:buddy+gc_age")
        .unwrap_err()
        .to_string();
    assert!(e.contains("did you mean `buddy+gc-age`?"), "{e}");
    let e = Config::parse("policy:first-fit").unwrap_err().to_string();
    assert!(
        e.contains("policies are pytorch-bfc, buddy, size-class"),
        "{e}"
    );
    // The flat parser leaves unknown names to the policy's builder.
    assert!(AllocatorConfig::parse("policy:first-fit").is_ok());
}

#[test]
fn garbage_collection_is_a_threshold_or_by_age() {
    assert_eq!(Config::parse("").unwrap().gc, None);
    assert_eq!(
        Config::parse("garbage_collection_threshold:0.6")
            .unwrap()
            .gc,
        Some(GarbageCollection::Threshold(0.6))
    );
    let cfg = Config::parse("policy:buddy+gc-age,garbage_collection_threshold:0.7").unwrap();
    assert_eq!(
        cfg.gc,
        Some(GarbageCollection::ByAge {
            threshold: Some(0.7)
        })
    );
    assert_eq!(
        EngineOptions::from(&cfg).garbage_collection_threshold,
        Some(0.7)
    );
}

#[test]
fn unmapping_lives_inside_expandable_segments() {
    let cfg = Config::parse("expandable_segments:True").unwrap();
    assert_eq!(cfg.engine.segments, Segments::Expandable { unmap: None });
    let cfg = Config::parse("unmap8,unmap_worker:true").unwrap();
    let unmap = cfg.engine.segments.unmap().unwrap();
    assert_eq!(unmap.pages, PageLayout::uniform(8 * MIB));
    assert!(unmap.worker);
    let opts = EngineOptions::from(&cfg);
    assert!(opts.unmap_free_pages && opts.unmap_worker && opts.expandable_segments);
    assert_eq!(
        EngineOptions::from(&Config::default()),
        EngineOptions::default()
    );
}

#[test]
fn a_hand_built_flat_view_is_checked_whole() {
    let mut flat = AllocatorConfig::default();
    flat.unmap_free_pages = true;
    let e = flat.typed().unwrap_err();
    assert!(e.to_string().contains("needs expandable_segments"), "{e}");
}

#[test]
fn a_configuration_written_in_code_is_checked_as_a_string_is() {
    use alloc_core::config::{BfcConfig, UnmapFreePages};
    assert_eq!(Config::default().check(), Ok(()));
    let placed = Config {
        policy: PolicyConfig::PytorchBfc(BfcConfig {
            plan_layout: true,
            ..BfcConfig::default()
        }),
        ..Config::default()
    };
    let e = placed.check().unwrap_err().to_string();
    assert!(
        e.contains("plan_layout") && e.contains("needs expandable_segments"),
        "{e}"
    );
    let scaled = Config {
        engine: alloc_core::config::EngineConfig {
            segments: Segments::Expandable {
                unmap: Some(UnmapFreePages {
                    pages: alloc_core::SCALED_UNMAP_PAGES,
                    ..UnmapFreePages::default()
                }),
            },
            ..Default::default()
        },
        ..placed
    };
    let e = scaled.check().unwrap_err().to_string();
    assert!(e.contains("pages of one size"), "{e}");
}
