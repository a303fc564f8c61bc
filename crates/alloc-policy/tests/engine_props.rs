//! Property tests over every compiled-in policy: random sequences of
//! allocations (log-uniform 1 B .. 256 MiB, several streams), frees,
//! record_stream with event completion, empty_cache and allocation under a
//! small capacity, with every invariant checked after every step.

mod common;

use alloc_core::{AllocError, MIB};
use alloc_policy::policy_names;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// Allocate 2^(log2_size) bytes (fractional exponent) on a stream.
    Alloc {
        log2_size: f64,
        stream: u64,
    },
    /// Free the n-th live allocation (modulo the count).
    Free {
        pick: usize,
    },
    /// Mark the n-th live allocation as used on a stream.
    RecordStream {
        pick: usize,
        stream: u64,
    },
    /// Complete all events of a stream.
    CompleteStream {
        stream: u64,
    },
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0.0f64..28.0, 0u64..3).prop_map(|(log2_size, stream)| Op::Alloc { log2_size, stream }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (any::<usize>(), 0u64..3).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => (0u64..3).prop_map(|stream| Op::CompleteStream { stream }),
        1 => Just(Op::EmptyCache),
    ]
}

/// Every compiled-in policy, plus PyTorch's with expandable segments.
fn configs() -> Vec<String> {
    let mut all: Vec<String> = policy_names()
        .iter()
        .map(|p| format!("policy:{p}"))
        .collect();
    all.push("policy:pytorch-bfc,expandable_segments:true".into());
    all.push("policy:pytorch-bfc,stream_wait_reuse:true,max_split_size_mb:64".into());
    all
}

fn run(policy: &str, capacity: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut e = common::engine(policy, capacity);
    let mut live: Vec<u64> = Vec::new();
    for op in ops {
        match *op {
            Op::Alloc { log2_size, stream } => {
                let size = (2f64.powf(log2_size) as u64).max(1);
                match e.malloc(size, stream) {
                    Ok(a) => {
                        prop_assert!(a.size >= size, "block smaller than request");
                        live.push(a.addr);
                    }
                    Err(AllocError::OutOfMemory(report)) => {
                        prop_assert_eq!(report.requested, size);
                        prop_assert!(capacity < 8 << 30, "OOM on a roomy device");
                    }
                    Err(other) => return Err(TestCaseError::fail(format!("malloc: {other}"))),
                }
            }
            Op::Free { pick } if !live.is_empty() => {
                let addr = live.swap_remove(pick % live.len());
                e.free(addr)
                    .map_err(|err| TestCaseError::fail(err.to_string()))?;
                let again = e.free(addr);
                let refused = matches!(
                    again,
                    Err(AllocError::DoubleFree { .. }) | Err(AllocError::UnknownPointer { .. })
                );
                prop_assert!(refused, "second free accepted: {:?}", again);
            }
            Op::RecordStream { pick, stream } if !live.is_empty() => {
                e.record_stream(live[pick % live.len()], stream)
                    .map_err(|err| TestCaseError::fail(err.to_string()))?;
            }
            Op::CompleteStream { stream } => e.streams_mut().complete_stream(stream),
            Op::EmptyCache => {
                e.empty_cache()
                    .map_err(|err| TestCaseError::fail(err.to_string()))?;
                prop_assert_eq!(e.awaiting_events(), 0);
            }
            _ => {}
        }
        if let Err(msg) = e.validate() {
            return Err(TestCaseError::fail(format!(
                "{policy}: after {op:?}: {msg}"
            )));
        }
        prop_assert_eq!(
            e.memory().used() as i64,
            e.stats().reserved_bytes.all.current
        );
    }
    // Freeing everything and emptying the cache gives all memory back.
    for addr in live.drain(..) {
        e.free(addr)
            .map_err(|err| TestCaseError::fail(err.to_string()))?;
    }
    e.empty_cache()
        .map_err(|err| TestCaseError::fail(err.to_string()))?;
    prop_assert_eq!(e.memory().used(), 0);
    prop_assert_eq!(e.stats().reserved_bytes.all.current, 0);
    if !e.expandable() {
        // Growable segments map in several steps but go back in one unmap.
        prop_assert_eq!(e.stats().num_device_alloc, e.stats().num_device_free);
    }
    e.assert_valid();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_policy_keeps_invariants(ops in proptest::collection::vec(op(), 1..120)) {
        for config in configs() {
            run(&config, 64 << 30, &ops)?;
        }
    }

    #[test]
    fn every_policy_survives_small_capacity(ops in proptest::collection::vec(op(), 1..120)) {
        for config in configs() {
            run(&config, 600 * MIB, &ops)?;
        }
    }
}
