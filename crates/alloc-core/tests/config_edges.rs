//! The configuration parser at its edges: every option of PyTorch's
//! allocator configuration, settings by name, strict numbers, suggestions
//! for misspellings, characters no configuration may hold, and messages
//! that quote a short excerpt of a long input.

use alloc_core::config::{named, Treatment, NAMED_SETTINGS, PYTORCH_KEYS};
use alloc_core::{AllocatorConfig, ConfigError, MIB};

fn parse(text: &str) -> Result<AllocatorConfig, ConfigError> {
    AllocatorConfig::parse(text)
}

#[test]
fn every_pytorch_option_is_honoured_or_answered_with_its_reason() {
    let default = AllocatorConfig::default();
    for k in PYTORCH_KEYS {
        let text = format!("{}:{}", k.key, k.example);
        let result = parse(&text);
        match k.treatment {
            Treatment::Honoured => {
                let cfg = result.unwrap_or_else(|e| panic!("{text}: {e}"));
                assert_ne!(cfg, default, "{text} changed nothing");
            }
            Treatment::PyTorchHost | Treatment::NoEffect(_) => {
                let cfg = result.unwrap_or_else(|e| panic!("{text}: {e}"));
                assert_eq!(cfg, default, "{text} changed the device allocator");
            }
            Treatment::Refused(reason) => {
                let e = result.expect_err(&text).to_string();
                assert!(e.contains(k.key) && e.contains(reason), "{text}: {e}");
            }
        }
        // PyTorch writes booleans True/False; a wrong word is refused.
        if k.example == "True" {
            let e = parse(&format!("{}:banana", k.key)).expect_err(k.key);
            assert!(e.to_string().contains("True or False"), "{e}");
        }
    }
    // The values refused above have accepted counterparts.
    assert_eq!(parse("backend:native").unwrap(), default);
    assert_eq!(parse("throw_on_cudamalloc_oom:False").unwrap(), default);
    // Every option of the table is one the parser knows, and no other
    // name: an unknown key is still refused.
    let e = parse("pinned_reserve_segment_size:64").unwrap_err();
    assert!(matches!(e, ConfigError::UnknownKey { .. }), "{e}");
}

#[test]
fn numbers_are_parsed_strictly() {
    for bad in [
        "pinned_num_register_threads:banana",
        "pinned_num_register_threads:3",
        "pinned_num_register_threads:256",
        "pinned_num_register_threads:-8",
        "pinned_num_register_threads:+8",
        "pinned_num_register_threads:8.0",
        "pinned_reserve_segment_size_mb:0",
        "pinned_reserve_segment_size_mb:1e3",
        "max_split_size_mb:+64",
        "max_split_size_mb:64MB",
        "first_fit_mb:0x10",
        "roundup_power2_divisions:+4",
        "roundup_power2_divisions:4294967296",
        "roundup_power2_divisions:[+256:1]",
    ] {
        let e = parse(bad).expect_err(bad);
        let key = bad.split(':').next().unwrap();
        assert!(e.to_string().contains(key), "{bad}: {e}");
    }
    parse("pinned_num_register_threads:128,pinned_reserve_segment_size_mb:1").unwrap();
}

#[test]
fn misspellings_get_a_suggestion() {
    let cases = [
        ("max_split_size:64", "max_split_size_mb"),
        ("expandable_segment:True", "expandable_segments"),
        (
            "pinned_reserve_segment_size:64",
            "pinned_reserve_segment_size_mb",
        ),
        ("bund", "bound"),
        ("unmap_16", "unmap16"),
        ("expandble", "expandable"),
        ("size_class", "size-class"),
    ];
    for (text, meant) in cases {
        let e = parse(text).unwrap_err().to_string();
        assert!(
            e.contains(&format!("did you mean `{meant}`?")),
            "{text}: {e}"
        );
    }
    let e = parse("banana").unwrap_err();
    assert!(
        matches!(&e, ConfigError::UnknownName { name, suggestion: None } if name == "banana"),
        "{e}"
    );
    assert!(e.to_string().contains("bound"), "the names are listed: {e}");
    // A name used as an option is not silently accepted.
    let e = parse("bound:True").unwrap_err().to_string();
    assert!(e.contains("did you mean `bound`"), "{e}");
}

#[test]
fn settings_by_name_expand_to_their_strings() {
    for s in NAMED_SETTINGS {
        let by_name = parse(s.name).unwrap_or_else(|e| panic!("{}: {e}", s.name));
        assert_eq!(by_name, parse(s.config).unwrap(), "{}", s.name);
        // A setting's string holds options only.
        for item in s.config.split(',').filter(|i| !i.is_empty()) {
            assert!(item.contains(':'), "{}: {item}", s.name);
        }
        assert!(!s.cost.is_empty());
    }
    let bound = parse("bound").unwrap();
    assert!(bound.plan_layout && bound.unmap_free_pages && bound.expandable_segments);
    assert_eq!(bound.first_fit, Some(8 * MIB));
    // Later options override the named ones; earlier ones are kept.
    let c = parse("bound,max_split_size_mb:64,first_fit_mb:16").unwrap();
    assert_eq!(c.max_split_size, 64 * MIB);
    assert_eq!(c.first_fit, Some(16 * MIB));
    let c = parse("garbage_collection_threshold:0.5, bound").unwrap();
    assert_eq!(c.garbage_collection_threshold, Some(0.5));
    assert!(c.plan_layout);
    // The result is checked as a whole.
    let e = parse("bound,expandable_segments:False").unwrap_err();
    assert!(e.to_string().contains("expandable_segments"), "{e}");
    // At run time too: a name is a set of options.
    let c = AllocatorConfig::default()
        .with_settings("expandable")
        .unwrap();
    assert!(c.expandable_segments);
    assert_eq!(parse("default").unwrap(), AllocatorConfig::default());
    assert_eq!(named::BOUND.name, "bound");
    // An option without its value keeps its own message.
    let e = parse("policy").unwrap_err().to_string();
    assert!(e.contains("expected `:`"), "{e}");
}

#[test]
fn old_strings_mean_what_they_meant() {
    let c = parse(
        "max_split_size_mb:128,garbage_collection_threshold:0.6,expandable_segments:True,\
         roundup_power2_divisions:[256:1,512:2,>:4],policy:pytorch-bfc",
    )
    .unwrap();
    assert_eq!(c.max_split_size, 128 * MIB);
    assert!(c.expandable_segments);
    assert_eq!(c.roundup_power2_divisions[9], 4);
    assert_eq!(
        parse("policy:size-class").unwrap().policy.as_deref(),
        Some("size-class")
    );
}

#[test]
fn nul_and_control_characters_are_refused() {
    let e = parse("max_split_size_mb:64\0garbage").unwrap_err();
    assert!(matches!(e, ConfigError::Unusable { .. }), "{e}");
    assert!(e.to_string().contains("NUL byte at offset 20"), "{e}");
    assert!(parse("bound\0").is_err());
    assert!(parse("policy:buddy\u{7}").is_err());
    // Whitespace between options stays allowed.
    parse("max_split_size_mb:64,\n\texpandable_segments:True").unwrap();
}

#[test]
fn messages_quote_a_short_excerpt() {
    let huge = "x".repeat(1 << 20);
    for text in [
        format!("max_split_size_mb:{huge}"),
        format!("{huge}:1"),
        huge.clone(),
        format!("roundup_power2_divisions:[{huge}:1]"),
        format!("max_split_size_mb:64 {huge}"),
        format!("{huge}\0"),
    ] {
        let e = parse(&text).unwrap_err().to_string();
        assert!(e.len() < 1200, "{} bytes: {}", e.len(), &e[..200]);
    }
    let e = parse(&format!("max_split_size_mb:{huge}"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("(1048576 bytes)"), "{e}");
}

#[test]
fn the_documented_names_and_options_are_the_parsers() {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/policies.md"
    ))
    .expect("docs/policies.md");
    for s in NAMED_SETTINGS {
        let expansion = if s.config.is_empty() {
            "(empty: PyTorch's default rules)".to_string()
        } else {
            format!("`{}`", s.config)
        };
        let row = format!("| `{}` | {} | {} |", s.name, expansion, s.cost);
        assert!(doc.contains(&row), "docs/policies.md lacks the row {row}");
    }
    for k in PYTORCH_KEYS {
        assert!(
            doc.contains(&format!("`{}`", k.key)),
            "docs/policies.md lacks {}",
            k.key
        );
    }
}

#[test]
fn every_named_setting_runs_on_the_simulated_device() {
    use alloc_core::{SimMemory, SimStreams, StreamId, GIB};
    use alloc_policy::AnyPolicy;
    let s = StreamId(1);
    for setting in NAMED_SETTINGS {
        let cfg = parse(&format!("{},max_split_size_mb:64", setting.name)).unwrap();
        let mut e = AnyPolicy::engine(&cfg, SimMemory::new(4 * GIB), SimStreams::new())
            .unwrap_or_else(|e| panic!("{}: {e}", setting.name));
        let held: Vec<_> = [512, 3 * MIB, 30 * MIB, 100 * MIB]
            .into_iter()
            .map(|size| e.malloc(size, s).unwrap())
            .collect();
        for a in held.iter().step_by(2) {
            e.free(a.addr).unwrap();
        }
        let extra = e.malloc(20 * MIB, s).unwrap();
        e.assert_valid();
        e.free(extra.addr).unwrap();
        for a in held.iter().skip(1).step_by(2) {
            e.free(a.addr).unwrap();
        }
        e.empty_cache().unwrap();
        assert_eq!(
            e.stats().reserved_bytes.all.current,
            0,
            "{}: memory left reserved",
            setting.name
        );
    }
}
