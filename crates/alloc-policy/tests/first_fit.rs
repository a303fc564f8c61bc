#![cfg(feature = "pytorch-bfc")]
//! `first_fit_mb` on the simulated device: large requests take the free
//! block of lowest address instead of the best fit, small ones keep it; and
//! the option's configuration errors. (Its effect on a real workload's
//! memory is tested on the GPT-2 generation trace, in `alloc-replay`.)

use alloc_core::{AllocatorConfig, SimMemory, SimStreams, StreamId, GIB, MIB};
use alloc_policy::AnyPolicy;

#[cfg(feature = "size-class")]
use alloc_core::ConfigError;

const S: StreamId = StreamId(0);

fn engine(config: &str) -> alloc_core::Engine<AnyPolicy, SimMemory, SimStreams> {
    let cfg = AllocatorConfig::parse(config).unwrap();
    AnyPolicy::engine(&cfg, SimMemory::new(64 * GIB), SimStreams::new()).unwrap()
}

#[test]
fn a_large_request_takes_the_lowest_free_block_that_fits() {
    let place = |config: &str| {
        let mut e = engine(config);
        let a = e.malloc(20 * MIB, S).unwrap().addr;
        let _b = e.malloc(2 * MIB, S).unwrap();
        let c = e.malloc(10 * MIB, S).unwrap().addr;
        let _d = e.malloc(2 * MIB, S).unwrap();
        e.free(a).unwrap();
        e.free(c).unwrap();
        let got = e.malloc(9 * MIB, S).unwrap().addr;
        // A small request keeps the best fit whatever the option.
        let small = e.malloc(MIB / 2, S).unwrap().addr;
        e.validate().unwrap();
        (a, c, got, small)
    };
    let (_, c, got, _) = place("expandable_segments:true");
    assert_eq!(got, c, "best fit: the 10 MiB hole");
    let (a, _, got, _) = place("expandable_segments:true,first_fit_mb:8");
    assert_eq!(got, a, "first fit: the 20 MiB hole below it");
    let (_, _, got, _) = place("expandable_segments:true,first_fit_mb:16");
    let (_, c, _, _) = place("expandable_segments:true");
    assert_eq!(got, c, "a 9 MiB request is under first_fit_mb:16: best fit");
}

#[test]
fn the_option_needs_growable_segments() {
    let e = AllocatorConfig::parse("first_fit_mb:8").unwrap_err();
    assert!(e.to_string().contains("expandable_segments"), "{e}");
    assert!(AllocatorConfig::parse("first_fit_mb:eight").is_err());
    let off = AllocatorConfig::parse("expandable_segments:true,first_fit_mb:0").unwrap();
    assert_eq!(off.first_fit, None);
    let on = AllocatorConfig::parse("expandable_segments:true,first_fit_mb:8").unwrap();
    assert_eq!(on.first_fit, Some(8 * MIB));
}

#[cfg(feature = "size-class")]
#[test]
fn other_policies_refuse_the_option() {
    let text = "policy:size-class,expandable_segments:true,first_fit_mb:8";
    match AllocatorConfig::parse(text) {
        Err(ConfigError::InvalidValue { key, reason, .. }) => {
            assert_eq!(key, "first_fit_mb");
            assert!(reason.contains("not `size-class`"), "{reason}");
        }
        other => panic!("expected first_fit_mb refused, got {other:?}"),
    }
}
