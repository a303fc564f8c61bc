//! Property tests over every compiled-in policy: random sequences of
//! allocations (log-uniform 1 B .. 256 MiB, several streams), frees,
//! record_stream with event completion, empty_cache and allocation under a
//! small capacity, and CUDA-graph style captures into private pools (with
//! streams forking from the captured one and joining back), with
//! every invariant checked after every step and a shadow of what was handed
//! out (`common/shadow.rs`) checking that no block is reused while another
//! stream may still use it, that live blocks never overlap, and that their
//! memory stays mapped.

mod common;

use std::collections::HashMap;

use common::shadow::Shadow;

use alloc_core::{AllocError, PoolId, StreamId, MIB};
use alloc_policy::policy_names;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// Allocate 2^(log2_size) bytes (fractional exponent) on a stream.
    Alloc {
        log2_size: f64,
        stream: StreamId,
    },
    /// Free the n-th live allocation (modulo the count).
    Free {
        pick: usize,
    },
    /// Mark the n-th live allocation as used on a stream.
    RecordStream {
        pick: usize,
        stream: StreamId,
    },
    /// Complete all events of a stream.
    CompleteStream {
        stream: StreamId,
    },
    EmptyCache,
    /// Start routing stream 0's allocations to a private pool (a capture
    /// of stream 0).
    BeginCapture {
        pool: u64,
    },
    /// A kernel on a stream (a node of the graph when it is capturing).
    Launch {
        stream: StreamId,
    },
    /// `waiter.wait_stream(on)`: in a capture, a fork or a join.
    WaitStream {
        waiter: StreamId,
        on: StreamId,
    },
    /// End the open capture.
    EndCapture,
    /// Drop one holder of a private pool (a graph is deleted).
    ReleasePool {
        pool: u64,
    },
    /// Limit reserved memory to `tenths` / 10 of the device (garbage
    /// collection and the out-of-memory path then run on a roomy device).
    SetFraction {
        tenths: u8,
    },
}

/// The streams the operations use: the default stream, another, and one
/// with the top bit set (every value is a stream; pools are keyed apart).
const STREAMS: [StreamId; 3] = [StreamId(0), StreamId(1), StreamId(1 << 63)];

fn stream() -> impl Strategy<Value = StreamId> {
    (0..STREAMS.len()).prop_map(|i| STREAMS[i])
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0.0f64..28.0, stream()).prop_map(|(log2_size, stream)| Op::Alloc { log2_size, stream }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (any::<usize>(), stream()).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => stream().prop_map(|stream| Op::CompleteStream { stream }),
        1 => Just(Op::EmptyCache),
        1 => (1u64..3).prop_map(|pool| Op::BeginCapture { pool }),
        1 => Just(Op::EndCapture),
        2 => stream().prop_map(|stream| Op::Launch { stream }),
        2 => (stream(), stream()).prop_map(|(waiter, on)| Op::WaitStream { waiter, on }),
        1 => (1u64..3).prop_map(|pool| Op::ReleasePool { pool }),
        1 => (1u8..=10).prop_map(|tenths| Op::SetFraction { tenths }),
    ]
}

/// Every compiled-in policy, plus PyTorch's with expandable segments and
/// the other modes with settings of their own.
fn configs() -> Vec<String> {
    let mut all: Vec<String> = policy_names()
        .iter()
        .map(|p| format!("policy:{p}"))
        .collect();
    if cfg!(feature = "pytorch-bfc") {
        all.push("policy:pytorch-bfc,expandable_segments:true".into());
        all.push("policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true".into());
        all.push(
            "policy:pytorch-bfc,expandable_segments:true,unmap_free_pages:true,unmap_page_mb:2"
                .into(),
        );
        all.push("policy:pytorch-bfc,stream_wait_reuse:true,max_split_size_mb:64".into());
        // The setting recommended for FSDP, and growth with a split limit.
        all.push(
            "policy:pytorch-bfc,stream_wait_reuse:true,expandable_segments:true,\
             unmap_free_pages:true"
                .into(),
        );
        all.push("policy:pytorch-bfc,expandable_segments:true,max_split_size_mb:64".into());
        // Reuse during captures once the graph joins the other streams.
        all.push("policy:pytorch-bfc,graph_capture_record_stream_reuse:true".into());
    }
    // Garbage collection by age under the memory fraction.
    if cfg!(all(feature = "pytorch-bfc", feature = "gc-age")) {
        all.push("policy:pytorch-bfc+gc-age,garbage_collection_threshold:0.6".into());
    }
    // Size-class's bounded mode (class-pure idle slabs, released past 0 MiB).
    if cfg!(feature = "size-class") {
        all.push("policy:size-class,idle_slab_limit_mb:0".into());
    }
    all
}

fn run(policy: &str, capacity: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut e = common::engine(policy, capacity);
    let mut live: Vec<u64> = Vec::new();
    let mut capture: Option<PoolId> = None;
    let mut holders: HashMap<PoolId, u32> = HashMap::new();
    let mut shadow = Shadow::default();
    let mut limited = false;
    for op in ops {
        let events_before = e.streams().pending();
        match *op {
            Op::Alloc { log2_size, stream } => {
                let size = (2f64.powf(log2_size) as u64).max(1);
                let pool = capture.filter(|_| stream == StreamId(0));
                match e.malloc_in(size, stream, pool) {
                    Ok(a) => {
                        prop_assert!(a.size >= size, "block smaller than request");
                        shadow
                            .allocated(&mut e, a)
                            .map_err(|msg| TestCaseError::fail(format!("{policy}: {msg}")))?;
                        prop_assert_eq!(
                            owning_pool(&e, a.addr),
                            pool,
                            "served from the wrong pool"
                        );
                        live.push(a.addr);
                    }
                    Err(AllocError::OutOfMemory(report)) => {
                        prop_assert_eq!(report.requested, size);
                        prop_assert!(limited || capacity < 8 << 30, "OOM on a roomy device");
                    }
                    Err(other) => return Err(TestCaseError::fail(format!("malloc: {other}"))),
                }
            }
            Op::Free { pick } if !live.is_empty() => {
                let addr = live.swap_remove(pick % live.len());
                shadow.freeing(&mut e, addr, capture.is_some());
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
                let addr = live[pick % live.len()];
                e.record_stream(addr, stream)
                    .map_err(|err| TestCaseError::fail(err.to_string()))?;
                shadow.recorded(&mut e, addr, stream);
            }
            Op::CompleteStream { stream } => e.streams_mut().complete_stream(stream),
            Op::SetFraction { tenths } => {
                e.set_memory_fraction(f64::from(tenths) / 10.0)
                    .map_err(|err| TestCaseError::fail(err.to_string()))?;
                limited = tenths < 10;
            }
            Op::EmptyCache if capture.is_some() => {
                prop_assert!(e.empty_cache().is_err(), "empty_cache during a capture");
            }
            Op::EmptyCache => {
                let held = pool_bytes(&e, &holders);
                e.empty_cache()
                    .map_err(|err| TestCaseError::fail(err.to_string()))?;
                prop_assert_eq!(e.awaiting_events(), 0);
                prop_assert_eq!(pool_bytes(&e, &holders), held, "a held pool lost memory");
            }
            Op::BeginCapture { pool } if capture.is_none() => {
                let pool = (pool, 0);
                e.begin_allocate_to_pool(pool);
                e.streams_mut().capture().begin(StreamId(0));
                *holders.entry(pool).or_default() += 1;
                capture = Some(pool);
            }
            Op::Launch { stream } => {
                e.streams_mut().capture().launch(stream);
            }
            Op::WaitStream { waiter, on } if waiter != on => {
                e.streams_mut().capture().wait_stream(waiter, on);
            }
            Op::EndCapture => {
                if let Some(pool) = capture.take() {
                    shadow.capture_ending(&mut e);
                    e.streams_mut().capture().end(StreamId(0));
                    e.end_allocate_to_pool(pool)
                        .map_err(|err| TestCaseError::fail(err.to_string()))?;
                } else {
                    prop_assert!(e.end_allocate_to_pool((1, 0)).is_err());
                }
            }
            Op::ReleasePool { pool } if capture.is_none() => {
                let pool = (pool, 0);
                match holders.get_mut(&pool) {
                    Some(n) if *n > 0 => {
                        *n -= 1;
                        e.release_pool(pool)
                            .map_err(|err| TestCaseError::fail(err.to_string()))?;
                    }
                    _ => prop_assert!(e.release_pool(pool).is_err(), "released twice"),
                }
                prop_assert_eq!(
                    e.pool_use_count(pool),
                    holders.get(&pool).copied().unwrap_or(0)
                );
            }
            _ => {}
        }
        if capture.is_some() {
            prop_assert!(
                e.streams().pending() <= events_before,
                "an event was recorded during a capture"
            );
        }
        shadow
            .check_mapped(&e)
            .map_err(|msg| TestCaseError::fail(format!("{policy}: after {op:?}: {msg}")))?;
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
    // Freeing everything, ending captures, releasing pools and emptying the
    // cache gives all memory back.
    for addr in live.drain(..) {
        e.free(addr)
            .map_err(|err| TestCaseError::fail(err.to_string()))?;
    }
    if let Some(pool) = capture {
        e.end_allocate_to_pool(pool)
            .map_err(|err| TestCaseError::fail(err.to_string()))?;
    }
    for (pool, n) in holders {
        for _ in 0..n {
            e.release_pool(pool)
                .map_err(|err| TestCaseError::fail(err.to_string()))?;
        }
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

/// The private pool whose segment holds `addr`, if any.
fn owning_pool(e: &common::SimEngine, addr: u64) -> Option<PoolId> {
    let snap = e.snapshot();
    let seg = snap
        .segments
        .iter()
        .find(|s| (s.address..s.address + s.total_size).contains(&addr))
        .expect("allocated address lies in a segment");
    seg.private_pool
}

/// Bytes reserved by segments of the pools that still have holders.
fn pool_bytes(e: &common::SimEngine, holders: &HashMap<PoolId, u32>) -> u64 {
    e.snapshot()
        .segments
        .iter()
        .filter(|s| {
            s.private_pool
                .is_some_and(|p| holders.get(&p).copied().unwrap_or(0) > 0)
        })
        .map(|s| s.total_size)
        .sum()
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
