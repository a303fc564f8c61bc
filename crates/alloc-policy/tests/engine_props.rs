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

use alloc_core::{
    DeviceTotals, Levels, PageMoves, SimStreams, StatArray, Stats, StreamId, MAX_REQUEST, MIB,
};
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
        for config in publishing_configs() {
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
        for config in publishing_configs() {
            two_engine_totals(&config, [&a, &b]).map_err(TestCaseError::fail)?;
        }
    }

    /// The statistics' peaks reset after every operation (as a loop that
    /// logs each step's peak resets them) change none of the allocator's
    /// decisions, under every configuration: the same blocks and segments,
    /// operation by operation, and the same pages moved.
    #[test]
    fn resetting_the_peaks_changes_no_decision(ops in proptest::collection::vec(op(), 1..120)) {
        for config in configs() {
            same_decisions_with_resets(&config, &ops).map_err(TestCaseError::fail)?;
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

/// Runs `ops` on two engines for `config`, the second with its peaks reset
/// after every operation, and compares their snapshots and page moves
/// after each one.
fn same_decisions_with_resets(config: &str, ops: &[Op]) -> Result<(), String> {
    let mut plain = Run::new(config, 64 << 30, SimStreams::new())?;
    let mut reset = Run::new(config, 64 << 30, SimStreams::new())?;
    // The counts of page moves; the host time they took is measured, not
    // counted (as in `one_engine_totals`).
    let moves = |r: &Run| PageMoves {
        host_ns: 0,
        ..r.engine().stats().page_moves
    };
    for (i, op) in ops.iter().enumerate() {
        plain.step(op)?;
        reset.step(op)?;
        reset.engine_mut().reset_peak_stats();
        if plain.engine().snapshot() != reset.engine().snapshot() || moves(&plain) != moves(&reset)
        {
            return Err(format!(
                "{config}: after operation {i} ({op:?}) the engine whose peaks were reset \
                 decided otherwise: moves {:?} against {:?}",
                moves(&reset),
                moves(&plain)
            ));
        }
    }
    plain.finish()?;
    reset.finish()
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

/// The configurations an engine that publishes to device totals may run:
/// all but a level over the allocated peak, which only an engine alone on
/// its device keeps (a publish starts its peaks again: `LiveStats`'
/// `allocated_mark`), and which an engine per stream refuses with the other
/// settings whose decisions span streams.
fn publishing_configs() -> Vec<String> {
    configs()
        .into_iter()
        .filter(|c| {
            let parsed = alloc_core::AllocatorConfig::parse(c).expect("test configs parse");
            !matches!(
                parsed.memory_budget,
                Some(alloc_core::MemoryBudget::OverAllocated(_))
            )
        })
        .collect()
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
    for (i, op) in ops.iter().enumerate() {
        run.step(op)?;
        alone.step(op)?;
        run.engine_mut().publish_to(&totals);
        let mut own = alone.engine().stats();
        if Levels::of(&own) != alone.engine().levels() {
            return Err(format!(
                "{config}: op {i} ({op:?}): the engine's levels are not its statistics'"
            ));
        }
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

/// The statistic arrays of `s` in [`Levels::pools`]' order.
fn arrays(s: &Stats) -> [&StatArray; 9] {
    [
        &s.allocation,
        &s.allocated_bytes,
        &s.requested_bytes,
        &s.inactive_split,
        &s.inactive_split_bytes,
        &s.active,
        &s.active_bytes,
        &s.segment,
        &s.reserved_bytes,
    ]
}

/// [`device_totals_of_two_engines_peak_at_the_highest_sum`] for one
/// configuration: the engines take turns, an operation each. Between two
/// publishes an engine's own peaks are how high its values went, so the
/// device held at most those plus the other engine's values.
fn two_engine_totals(config: &str, ops: [&[Op]; 2]) -> Result<(), String> {
    let mut runs = [
        Run::new(config, 64 << 30, SimStreams::new())?,
        Run::new(config, 64 << 30, SimStreams::new())?,
    ];
    let totals = DeviceTotals::new();
    // The highest sums: per statistic, the small pool, the large pool, both.
    let mut highest = [[0i64; 3]; 9];
    let mut highest_oversize = [0i64; 2];
    for k in 0..ops[0].len().max(ops[1].len()) {
        for e in 0..2 {
            let Some(op) = ops[e].get(k) else { continue };
            runs[e].step(op)?;
            let (mine, other) = (runs[e].engine().stats(), runs[1 - e].engine().levels());
            runs[e].engine_mut().publish_to(&totals);
            for ((most, array), theirs) in highest.iter_mut().zip(arrays(&mine)).zip(&other.pools) {
                most[0] = most[0].max(array.small_pool.peak + theirs[0]);
                most[1] = most[1].max(array.large_pool.peak + theirs[1]);
                most[2] = most[2].max(array.all.peak + theirs[0] + theirs[1]);
            }
            let peaks = [mine.oversize_allocations.peak, mine.oversize_segments.peak];
            for ((most, peak), theirs) in highest_oversize.iter_mut().zip(peaks).zip(other.oversize)
            {
                *most = (*most).max(peak + theirs);
            }
        }
    }
    let device = totals.combine(&[runs[0].engine().stats(), runs[1].engine().stats()]);
    let got: Vec<[i64; 3]> = arrays(&device)
        .iter()
        .map(|a| [a.small_pool.peak, a.large_pool.peak, a.all.peak])
        .collect();
    let got_oversize = [
        device.oversize_allocations.peak,
        device.oversize_segments.peak,
    ];
    if got != highest || got_oversize != highest_oversize {
        return Err(format!(
            "{config}: peaks {got:?} {got_oversize:?}, highest sums {highest:?} {highest_oversize:?}"
        ));
    }
    for run in runs {
        run.finish()?;
    }
    Ok(())
}
