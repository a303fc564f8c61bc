//! The configuration parser, and engines built from what it accepts.
//!
//! Any input (a `GPUALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF` string) is
//! accepted or refused with an error, never a panic; an accepted one builds
//! a policy or is refused with an error; a built engine serves requests
//! across the pools and size intervals with its invariants intact and gives
//! everything back.
#![no_main]

use alloc_core::{AllocatorConfig, EngineOptions, SimMemory, SimStreams, StreamId, GIB, MIB};
use alloc_policy::AnyPolicy;
use libfuzzer_sys::fuzz_target;

/// Requests across the small and large pools, the segment size steps and
/// the power-of-two intervals of `roundup_power2_divisions`.
const SIZES: [u64; 8] = [1, 700, MIB, 3 * MIB, 15 * MIB, 40 * MIB, 300 * MIB, 3 * GIB];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = AllocatorConfig::parse(text) else {
        return;
    };
    assert_eq!(
        AllocatorConfig::parse(text).as_ref(),
        Ok(&cfg),
        "parsing is deterministic"
    );
    // A checked form, when there is one, goes back to the flat view and
    // returns unchanged, and gives the engine what the flat view gives.
    if let Ok(typed) = AnyPolicy::typed(&cfg) {
        assert_eq!(
            typed.flat().typed_or(typed.policy.kind()).as_ref(),
            Ok(&typed),
            "{text}: the checked form round-trips"
        );
        assert_eq!(
            EngineOptions::from(&typed),
            EngineOptions::from(&cfg),
            "{text}: the same engine options"
        );
    }
    let Ok(mut engine) = AnyPolicy::engine(&cfg, SimMemory::new(64 * GIB), SimStreams::new())
    else {
        return;
    };
    let mut live = Vec::new();
    for (i, size) in SIZES.into_iter().enumerate() {
        let a = engine
            .malloc(size, StreamId(i as u64 % 2))
            .unwrap_or_else(|e| panic!("{text}: malloc({size}): {e}"));
        assert!(a.size >= size, "{text}: {} bytes for {size}", a.size);
        live.push(a.addr);
        engine.assert_valid();
    }
    for addr in live {
        engine
            .free(addr)
            .unwrap_or_else(|e| panic!("{text}: free: {e}"));
        engine.assert_valid();
    }
    engine
        .empty_cache()
        .unwrap_or_else(|e| panic!("{text}: empty_cache: {e}"));
    assert_eq!(
        engine.memory().used(),
        0,
        "{text}: memory left on the device"
    );
});
