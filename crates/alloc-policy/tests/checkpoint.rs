//! Checkpoint and restore of private pools (CUDA graph trees of
//! `torch.compile`): the restored pool has exactly the checkpoint's live
//! blocks at their addresses, reports what it freed and allocated, and keeps
//! every invariant.
#![cfg(feature = "pytorch-bfc")]

mod common;

use alloc_core::{AllocError, PoolCheckpoint, StreamId, MIB};
use common::{engine, SimEngine};
use std::collections::HashSet as FxHashSet;

const POOL: (u64, u64) = (1, 7);
const STREAM: StreamId = StreamId(0x10);

fn malloc_in_pool(e: &mut SimEngine, size: u64) -> u64 {
    common::malloc_in_pool(e, POOL, STREAM, size)
}

fn release_all(e: &mut SimEngine) {
    common::release_all(e, POOL);
}

fn live_set(cp: &PoolCheckpoint) -> FxHashSet<u64> {
    cp.live_addresses().collect()
}

/// Checks the restored pool against its checkpoint: same live blocks at the
/// same addresses and sizes, same layout, valid engine.
fn assert_restored(e: &mut SimEngine, cp: &PoolCheckpoint) {
    e.assert_valid();
    assert!(e.pool_live_allocations_are(POOL, &live_set(cp)));
    let again = e.checkpoint_pool(POOL).unwrap();
    let live = |c: &PoolCheckpoint| -> Vec<(u64, u64, u64)> {
        c.segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.allocated)
            .map(|b| (b.addr, b.size, b.requested))
            .collect()
    };
    assert_eq!(live(&again), live(cp));
}

#[test]
fn restore_recreates_the_live_blocks_and_reports_the_change() {
    let mut e = engine("", 8 << 30);
    let a = malloc_in_pool(&mut e, MIB);
    let b = malloc_in_pool(&mut e, 3 * MIB);
    let c = malloc_in_pool(&mut e, 5 * MIB + 100);
    e.free(b).unwrap();
    let cp = e.checkpoint_pool(POOL).unwrap();
    assert_eq!(live_set(&cp), FxHashSet::from_iter([a, c]));
    let allocated_at_checkpoint = e.stats().allocated_bytes.all.current;

    // A sibling graph: a's tensor dies, others are allocated over the space.
    e.free(a).unwrap();
    let d = malloc_in_pool(&mut e, 2 * MIB);
    let f = malloc_in_pool(&mut e, 700 << 10);
    assert!(!e.pool_live_allocations_are(POOL, &live_set(&cp)));

    let out = e.restore_pool(&cp).unwrap();
    let freed: FxHashSet<u64> = out.freed.iter().copied().collect();
    assert_eq!(freed, FxHashSet::from_iter([c, d, f]));
    let made: Vec<(u64, u64)> = out
        .allocated
        .iter()
        .map(|x| (x.addr, x.requested))
        .collect();
    assert_eq!(made, vec![(a, MIB), (c, 5 * MIB + 100)]);
    assert!(out.allocated.iter().all(|x| x.stream == STREAM));
    assert_restored(&mut e, &cp);
    assert_eq!(
        e.stats().allocated_bytes.all.current,
        allocated_at_checkpoint
    );

    // The restored blocks are the caller's: freeing them and releasing the
    // pool gives every byte back.
    e.free(a).unwrap();
    e.free(c).unwrap();
    release_all(&mut e);
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0);
    e.assert_valid();
}

#[test]
fn restore_fails_cleanly_on_bad_input() {
    let mut e = engine("", 8 << 30);
    assert!(matches!(
        e.checkpoint_pool((9, 9)),
        Err(AllocError::InvalidArgument(_))
    ));
    let a = malloc_in_pool(&mut e, MIB);
    let cp = e.checkpoint_pool(POOL).unwrap();
    // A block used by another stream cannot be freed behind its back.
    e.record_stream(a, StreamId(0x20)).unwrap();
    let err = e.restore_pool(&cp).unwrap_err();
    assert!(err.to_string().contains("another stream"), "{err}");
    assert!(e.allocation(a).is_some(), "nothing changed");
    e.assert_valid();
    // A released pool cannot be restored.
    release_all(&mut e);
    assert!(e.restore_pool(&cp).is_err());
    e.free(a).unwrap();
    e.assert_valid();
}

/// Tiny deterministic generator for the random sequences below.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// Random pool histories on every policy and on expandable segments:
/// checkpoint at a random point, keep going, restore, compare.
#[test]
fn random_histories_restore_exactly() {
    let configs = [
        "",
        "expandable_segments:True",
        "max_split_size_mb:40",
        #[cfg(feature = "gc-age")]
        "policy:pytorch-bfc+gc-age",
        #[cfg(feature = "buddy")]
        "policy:buddy",
        #[cfg(feature = "size-class")]
        "policy:size-class",
    ];
    for config in configs {
        let mut restored = 0;
        for seed in 0..60u64 {
            let mut rng = Lcg(seed * 7919 + 1);
            let mut e = engine(config, 8 << 30);
            let mut live: Vec<u64> = Vec::new();
            let mut cp = None;
            for step in 0..80 {
                if step == 40 {
                    cp = Some(e.checkpoint_pool(POOL).unwrap());
                }
                if live.is_empty() || !rng.next().is_multiple_of(3) {
                    let size = match rng.next() % 4 {
                        0 => 1 + rng.next() % (64 << 10),
                        1 => 1 + rng.next() % (2 * MIB),
                        _ => 1 + rng.next() % (24 * MIB),
                    };
                    live.push(malloc_in_pool(&mut e, size));
                } else {
                    let i = (rng.next() as usize) % live.len();
                    e.free(live.swap_remove(i)).unwrap();
                }
            }
            let cp = cp.expect("checkpoint taken");
            match e.restore_pool(&cp) {
                Ok(out) => {
                    restored += 1;
                    let before: FxHashSet<u64> = live.iter().copied().collect();
                    let freed: FxHashSet<u64> = out.freed.iter().copied().collect();
                    assert_eq!(
                        freed, before,
                        "{config} seed {seed}: freed = the live blocks"
                    );
                    assert_restored(&mut e, &cp);
                    live = cp.live_addresses().collect();
                }
                Err(err) => {
                    // A policy that cannot recreate the layout says so and
                    // leaves the pool valid.
                    assert!(
                        err.to_string().contains("cannot recreate"),
                        "{config}: {err}"
                    );
                    e.assert_valid();
                }
            }
            for a in live {
                e.free(a).unwrap();
            }
            release_all(&mut e);
            e.empty_cache().unwrap();
            assert_eq!(e.memory().used(), 0, "{config} seed {seed}");
        }
        if !config.contains("size-class") {
            assert_eq!(restored, 60, "{config}: every history restores");
        }
    }
}
