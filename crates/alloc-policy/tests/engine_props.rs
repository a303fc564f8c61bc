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

use alloc_core::{DeviceTotals, Levels, SimStreams, StreamId, MAX_REQUEST, MIB};
use alloc_policy::testing::configs;
use alloc_policy::testing::ops::{log_size, run, Op, Run, POOLS, STREAMS};
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

    /// One engine publishing to device totals after every operation: the
    /// device's statistics are the engine's own, peaks included. So no
    /// operation raises a statistic and lowers it again before it returns,
    /// and net changes lose no peak (alloc_core's `device_totals`).
    #[test]
    fn device_totals_of_one_engine_are_its_own_statistics(
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        for config in configs() {
            one_engine_totals(&config, &ops).map_err(TestCaseError::fail)?;
        }
    }

    /// Two engines of one device, their operations interleaved: the
    /// device totals' peaks are the highest sums of the two engines' values
    /// after any operation.
    #[test]
    fn device_totals_of_two_engines_peak_at_the_highest_sum(
        a in proptest::collection::vec(op(), 1..60),
        b in proptest::collection::vec(op(), 1..60),
    ) {
        for config in configs() {
            two_engine_totals(&config, [&a, &b]).map_err(TestCaseError::fail)?;
        }
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

/// [`device_totals_of_one_engine_are_its_own_statistics`] for one
/// configuration: the same operations on two engines, one publishing (and
/// so handing its peaks over to the totals), one left alone to compare.
fn one_engine_totals(config: &str, ops: &[Op]) -> Result<(), String> {
    let mut run = Run::new(config, 64 << 30, SimStreams::new())?;
    let mut alone = Run::new(config, 64 << 30, SimStreams::new())?;
    let totals = DeviceTotals::new();
    let mut seen = Levels::default();
    for (i, op) in ops.iter().enumerate() {
        run.step(op)?;
        alone.step(op)?;
        totals.publish(&mut seen, &run.engine_mut().take_levels());
        let mut own = alone.engine().stats();
        let mut device = totals.combine(&[run.engine().stats()]);
        // Host time the two engines' page moves took: measured, not counted.
        (own.page_moves.host_ns, device.page_moves.host_ns) = (0, 0);
        if device != own {
            return Err(format!(
                "{config}: op {i} ({op:?}): device totals {device:?} are not the engine's {own:?}"
            ));
        }
    }
    run.finish()?;
    alone.finish()
}

/// [`device_totals_of_two_engines_peak_at_the_highest_sum`] for one
/// configuration: the engines take turns, an operation each.
fn two_engine_totals(config: &str, ops: [&[Op]; 2]) -> Result<(), String> {
    let mut runs = [
        Run::new(config, 64 << 30, SimStreams::new())?,
        Run::new(config, 64 << 30, SimStreams::new())?,
    ];
    let totals = DeviceTotals::new();
    let mut seen = [Levels::default(); 2];
    // The highest sums seen after any operation: per pool, and of both pools.
    let mut highest = Levels::default();
    let mut highest_all = [0i64; 9];
    for k in 0..ops[0].len().max(ops[1].len()) {
        for e in 0..2 {
            let Some(op) = ops[e].get(k) else { continue };
            runs[e].step(op)?;
            let levels = runs[e].engine_mut().take_levels();
            totals.publish(&mut seen[e], &levels);
            // The other engine's values, and this one's highest during the
            // operation: what the device held at this operation's highest.
            let other = runs[1 - e].engine().levels();
            let arrays = highest.pools.iter_mut().zip(&mut highest_all);
            for ((most, most_all), (high, theirs)) in
                arrays.zip(levels.highs.iter().zip(&other.pools))
            {
                for p in 0..2 {
                    most[p] = most[p].max(high[p] + theirs[p]);
                }
                *most_all = (*most_all).max(high[2] + theirs[0] + theirs[1]);
            }
            let oversize = levels.oversize_highs.iter().zip(&other.oversize);
            for (most, (high, theirs)) in highest.oversize.iter_mut().zip(oversize) {
                *most = (*most).max(high + theirs);
            }
        }
    }
    if (totals.peaks().pools, totals.peaks().oversize) != (highest.pools, highest.oversize) {
        return Err(format!(
            "{config}: peaks {:?}, highest sums {highest:?}",
            totals.peaks()
        ));
    }
    let device = totals.combine(&[runs[0].engine().stats(), runs[1].engine().stats()]);
    let all_peaks = [
        device.allocation.all.peak,
        device.allocated_bytes.all.peak,
        device.requested_bytes.all.peak,
        device.inactive_split.all.peak,
        device.inactive_split_bytes.all.peak,
        device.active.all.peak,
        device.active_bytes.all.peak,
        device.segment.all.peak,
        device.reserved_bytes.all.peak,
    ];
    if all_peaks != highest_all {
        return Err(format!(
            "{config}: all-pool peaks {all_peaks:?}, highest sums {highest_all:?}"
        ));
    }
    for run in runs {
        run.finish()?;
    }
    Ok(())
}
