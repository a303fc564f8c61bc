//! Property tests over every compiled-in policy and engine setting
//! ([`configs`]): random sequences of the operations of
//! `alloc_policy::testing::ops` (allocations log-uniform from 1 B to 256 MiB
//! on several streams, frees, record_stream with event completion,
//! empty_cache, memory fractions, CUDA-graph style captures into private
//! pools with streams forking from the captured one and joining back,
//! snapshots), with every invariant checked after every step and a
//! shadow of what was handed out checking that no block is reused while
//! another stream may still use it, that live blocks never overlap, that
//! their memory stays mapped, that every block is aligned to 512 bytes, and,
//! by data, that the pattern written into each block at its malloc is intact
//! at its free and no block is handed out over a live block's pattern. The
//! fuzz targets (`fuzz/`) drive the same model with operations decoded from
//! their input.

use alloc_core::{StreamId, MAX_REQUEST, MIB};
use alloc_policy::testing::configs;
use alloc_policy::testing::ops::{log_size, run, Op, POOLS, STREAMS};
use proptest::prelude::*;

fn stream() -> impl Strategy<Value = StreamId> {
    (0..STREAMS.len()).prop_map(|i| STREAMS[i])
}

fn op() -> impl Strategy<Value = Op> {
    let pool = 1..=POOLS;
    prop_oneof![
        5 => (0.0f64..28.0, stream())
            .prop_map(|(log2, stream)| Op::Alloc { size: log_size(log2), stream }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (any::<usize>(), any::<u64>())
            .prop_map(|(pick, offset)| Op::FreeInterior { pick, offset }),
        1 => (any::<usize>(), stream())
            .prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => stream().prop_map(|stream| Op::CompleteStream { stream }),
        1 => Just(Op::ProcessEvents),
        1 => Just(Op::EmptyCache),
        1 => pool.clone().prop_map(|pool| Op::BeginCapture { pool }),
        1 => Just(Op::EndCapture),
        2 => stream().prop_map(|stream| Op::Launch { stream }),
        2 => (stream(), stream()).prop_map(|(waiter, on)| Op::WaitStream { waiter, on }),
        1 => pool.prop_map(|pool| Op::ReleasePool { pool }),
        1 => (0u8..=10).prop_map(|tenths| Op::SetFraction { fraction: f64::from(tenths) / 10.0 }),
        1 => Just(Op::Snapshot),
    ]
}

/// Runs `ops` under every configuration on a device of `capacity` bytes.
fn every_config(capacity: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    for config in configs() {
        run(&config, capacity, ops).map_err(TestCaseError::fail)?;
    }
    Ok(())
}

/// Sequences per configuration: `PROPTEST_CASES` (48 by default, for CI; a
/// longer run: `PROPTEST_CASES=10000 cargo test --release -p alloc-policy
/// --test engine_props`).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn every_policy_keeps_invariants(ops in proptest::collection::vec(op(), 1..120)) {
        every_config(64 << 30, &ops)?;
    }

    #[test]
    fn every_policy_survives_small_capacity(ops in proptest::collection::vec(op(), 1..120)) {
        every_config(600 * MIB, &ops)?;
    }

    /// Sizes and capacities at the limits of `u64` (debug builds check every
    /// addition and product): a device that reports up to `u64::MAX` bytes,
    /// requests of 0, of 1 PiB and one byte more, and near `u64::MAX`, among
    /// ordinary ones, under every configuration. Refusals are typed errors;
    /// nothing overflows.
    #[test]
    fn sizes_and_capacities_near_the_limits_do_not_overflow(
        capacity in limit_capacity(),
        ops in proptest::collection::vec(limit_op(), 1..40),
    ) {
        every_config(capacity, &ops)?;
    }

    /// A random step repeated: the layout plan learns it, plans it and
    /// places later steps by the plan, under the same checks.
    #[cfg(feature = "pytorch-bfc")]
    #[test]
    fn a_planned_layout_keeps_invariants(step in proptest::collection::vec(step_op(), 4..60)) {
        let ops: Vec<Op> = (0..12).flat_map(|_| step.clone()).collect();
        for config in PLANNED {
            run(config, 64 << 30, &ops).map_err(TestCaseError::fail)?;
        }
    }
}

/// Device capacities near the top of `u64`.
fn limit_capacity() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(u64::MAX),
        (0u64..1 << 32).prop_map(|below| u64::MAX - below),
        Just(1 << 63),
        Just(MAX_REQUEST),
        Just(MAX_REQUEST + 1),
    ]
}

/// Allocations of sizes at the limits, frees, memory fractions (of a
/// capacity near `u64::MAX`) and emptying the cache. Sizes that would be
/// served stay at most 16 GiB: the simulated device keeps a set entry per
/// mapped 2 MiB.
fn limit_op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        3 => (0.0f64..34.0).prop_map(log_size),
        1 => Just(0u64),
        1 => Just(MAX_REQUEST + 1),
        1 => (0u64..1 << 20).prop_map(|below| u64::MAX - below),
        1 => MAX_REQUEST + 1..=u64::MAX,
    ];
    prop_oneof![
        5 => (size, stream()).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => stream().prop_map(|stream| Op::CompleteStream { stream }),
        1 => Just(Op::EmptyCache),
        1 => (0u8..=10).prop_map(|tenths| Op::SetFraction { fraction: f64::from(tenths) / 10.0 }),
    ]
}

/// The operations of a training step: allocations (mostly in the large
/// pool), frees, other streams' use and their completion.
#[cfg(feature = "pytorch-bfc")]
fn step_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (20.0f64..28.0, stream())
            .prop_map(|(log2, stream)| Op::Alloc { size: log_size(log2), stream }),
        1 => (0.0f64..20.0).prop_map(|log2| Op::Alloc { size: log_size(log2), stream: STREAMS[0] }),
        5 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (any::<usize>(), stream())
            .prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => stream().prop_map(|stream| Op::CompleteStream { stream }),
        1 => Just(Op::ProcessEvents),
        1 => stream().prop_map(|stream| Op::Launch { stream }),
    ]
}

/// The `plan_layout` settings the repeated steps run under.
#[cfg(feature = "pytorch-bfc")]
const PLANNED: [&str; 2] = [
    "policy:pytorch-bfc,expandable_segments:true,plan_layout:true",
    "policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true,unmap_page_mb:2,\
     plan_layout:true",
];
