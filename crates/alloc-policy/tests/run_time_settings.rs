//! Settings changed while the allocator runs (`Engine::reconfigure`, what
//! `torch.cuda.memory._set_allocator_settings` reaches): later decisions
//! follow them, existing blocks stay valid and the statistics stay exact.
#![cfg(all(feature = "pytorch-bfc", feature = "size-class"))]

mod common;

use alloc_core::{AllocError, AllocatorConfig, Policy, StreamId, GIB, MIB};
use common::{drain, engine, SimEngine};

fn reconfigure(e: &mut SimEngine, base: &str, change: &str) -> Result<(), AllocError> {
    let cfg = AllocatorConfig::parse(base)
        .unwrap()
        .with_settings(change)?;
    e.reconfigure(&cfg)
}

#[test]
fn rounding_follows_the_divisions_set_last() {
    // PyTorch's test_allocator_settings: 84 MiB with four divisions per
    // power of two is 96 MiB, and back to 84 MiB once they are reset.
    let mut e = engine("", 8 * GIB);
    let plain = e.malloc(84 * MIB, StreamId(1)).unwrap();
    reconfigure(&mut e, "", "roundup_power2_divisions:4").unwrap();
    let rounded = e.malloc(84 * MIB, StreamId(1)).unwrap();
    reconfigure(
        &mut e,
        "",
        "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]",
    )
    .unwrap();
    let eighths = e.malloc(84 * MIB, StreamId(1)).unwrap();
    reconfigure(&mut e, "", "").unwrap();
    let again = e.malloc(84 * MIB, StreamId(1)).unwrap();
    assert_eq!(
        [plain.size, rounded.size, eighths.size, again.size],
        [84 * MIB, 96 * MIB, 88 * MIB, 84 * MIB]
    );
    drain(&mut e, [plain.addr, rounded.addr, eighths.addr, again.addr]);
}

#[test]
fn oversize_counts_follow_a_new_max_split_size() {
    let mut e = engine("", 8 * GIB);
    let big = e.malloc(100 * MIB, StreamId(1)).unwrap();
    let small = e.malloc(30 * MIB, StreamId(1)).unwrap();
    assert_eq!(e.stats().oversize_allocations.current, 0);
    reconfigure(&mut e, "", "max_split_size_mb:40").unwrap();
    assert_eq!(e.stats().oversize_allocations.current, 1);
    assert_eq!(e.stats().oversize_segments.current, 1);
    e.assert_valid();
    // An oversize block is no longer split for a smaller request.
    e.free(big.addr).unwrap();
    let reused = e.malloc(50 * MIB, StreamId(1)).unwrap();
    assert_ne!(
        reused.addr, big.addr,
        "a 100 MiB oversize block served 50 MiB"
    );
    reconfigure(&mut e, "", "").unwrap();
    assert_eq!(e.stats().oversize_allocations.current, 0);
    assert_eq!(e.stats().oversize_segments.current, 0);
    drain(&mut e, [small.addr, reused.addr]);
    assert_eq!(e.stats().oversize_allocations.current, 0);
}

#[test]
fn expandable_segments_turn_on_and_off() {
    let mut e = engine("", 8 * GIB);
    let fixed = e.malloc(30 * MIB, StreamId(1)).unwrap();
    reconfigure(&mut e, "", "expandable_segments:true").unwrap();
    assert!(e.expandable());
    let grown = e.malloc(30 * MIB, StreamId(1)).unwrap();
    let kinds = |e: &SimEngine| {
        // As snapshots report them (PyTorch's `is_expandable`), per segment.
        let mut k: Vec<bool> = e
            .snapshot()
            .segments
            .iter()
            .map(|s| s.is_expandable)
            .collect();
        k.sort();
        k
    };
    assert_eq!(kinds(&e), [false, true]);
    reconfigure(&mut e, "", "expandable_segments:false").unwrap();
    assert!(!e.expandable());
    let later = e.malloc(300 * MIB, StreamId(1)).unwrap();
    assert_eq!(kinds(&e), [false, false, true]);
    e.assert_valid();
    drain(&mut e, [fixed.addr, grown.addr, later.addr]);
}

#[test]
fn options_fixed_at_creation_are_refused_and_nothing_changes() {
    let base = "expandable_segments:true,unmap_free_pages:true";
    let mut e = engine(base, 8 * GIB);
    let err = reconfigure(&mut e, base, "unmap_page_mb:8").unwrap_err();
    assert!(err.to_string().contains("unmap_page_mb"), "{err}");
    let err = reconfigure(&mut e, base, "unmap_worker:true").unwrap_err();
    assert!(err.to_string().contains("unmap_worker"), "{err}");
    let err = reconfigure(&mut e, base, "expandable_segments:false").unwrap_err();
    assert!(err.to_string().contains("unmap_free_pages"), "{err}");
    assert!(e.expandable());

    let mut slabs = engine("policy:size-class", 8 * GIB);
    let err = reconfigure(&mut slabs, "policy:size-class", "idle_slab_limit_mb:64").unwrap_err();
    assert!(err.to_string().contains("idle_slab_limit_mb"), "{err}");
    // Settings that do not reach the policy are taken.
    reconfigure(&mut slabs, "policy:size-class", "stream_wait_reuse:true").unwrap();
}

/// The engine keeps the policy's capabilities and reads them again when the
/// settings change: a new split limit is the new oversize threshold.
#[test]
fn capabilities_are_read_again_on_reconfiguration() {
    let mut e = engine("", 8 * GIB);
    let caps = e.capabilities();
    assert!(caps.coalesces && caps.supports_growth && caps.rebuilds_layouts);
    assert_eq!(caps.oversize_threshold, u64::MAX);
    reconfigure(&mut e, "", "max_split_size_mb:64").unwrap();
    assert_eq!(e.capabilities().oversize_threshold, 64 * MIB);
    assert_eq!(e.capabilities(), e.policy().capabilities());
}
