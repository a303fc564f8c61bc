//! Shared helpers for the policy integration tests.
#![allow(dead_code)]

use alloc_core::{AllocatorConfig, Engine, EngineOptions, SimMemory, SimStreams};
use alloc_policy::AnyPolicy;

/// The engine type used by the tests.
pub type SimEngine = Engine<AnyPolicy, SimMemory, SimStreams>;

/// An engine on a simulated device of `capacity` bytes with the given config.
pub fn engine(config: &str, capacity: u64) -> SimEngine {
    let cfg = AllocatorConfig::parse(config).expect("test config parses");
    let policy = AnyPolicy::from_config(&cfg).expect("policy builds");
    Engine::new(
        policy,
        SimMemory::new(capacity),
        SimStreams::new(),
        EngineOptions::from(&cfg),
    )
}
