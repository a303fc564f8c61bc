//! Shared helpers for the policy integration tests.
#![allow(dead_code)]

pub mod shadow;

use alloc_core::{AllocatorConfig, Engine, SimMemory, SimStreams};
use alloc_policy::AnyPolicy;

/// The engine type used by the tests.
pub type SimEngine = Engine<AnyPolicy, SimMemory, SimStreams>;

/// An engine on a simulated device of `capacity` bytes with the given config.
pub fn engine(config: &str, capacity: u64) -> SimEngine {
    let cfg = AllocatorConfig::parse(config).expect("test config parses");
    AnyPolicy::engine(&cfg, SimMemory::new(capacity), SimStreams::new()).expect("policy builds")
}

/// Frees `addrs`, empties the cache and checks that nothing stays on the
/// simulated device and the engine's invariants hold.
pub fn drain(e: &mut SimEngine, addrs: impl IntoIterator<Item = u64>) {
    for addr in addrs {
        e.free(addr).unwrap();
    }
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0, "memory left on the device");
    e.assert_valid();
}
