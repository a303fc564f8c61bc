//! A no-split private pool (`MemPool(no_split=True)`): every block is a
//! whole segment or a whole cached block, while an ordinary pool splits.
#![cfg(feature = "pytorch-bfc")]

mod common;

use alloc_core::{AllocError, StreamId, MIB};
use common::{engine, SimEngine};

const SPLIT: (u64, u64) = (0, 1);
const WHOLE: (u64, u64) = (0, 2);

fn malloc_in(e: &mut SimEngine, pool: (u64, u64), size: u64) -> u64 {
    common::malloc_in_pool(e, pool, StreamId(0), size)
}

/// (segments, blocks) of the pool in a snapshot.
fn layout(e: &SimEngine, pool: (u64, u64)) -> (usize, usize) {
    let snap = e.snapshot();
    let segs: Vec<_> = snap
        .segments
        .iter()
        .filter(|s| s.private_pool == Some(pool))
        .collect();
    (segs.len(), segs.iter().map(|s| s.blocks.len()).sum())
}

#[test]
fn a_no_split_pool_hands_out_whole_segments() {
    let mut e = engine("", 8 << 30);
    e.retain_pool(SPLIT);
    e.retain_pool(WHOLE);
    e.set_pool_no_split(WHOLE).unwrap();
    let mut live = Vec::new();
    for _ in 0..2 {
        live.push(malloc_in(&mut e, SPLIT, 4 * MIB));
        live.push(malloc_in(&mut e, WHOLE, 4 * MIB));
    }
    // 4 MiB requests take a 20 MiB segment: split and shared in one pool,
    // a segment each, unsplit, in the other.
    assert_eq!(layout(&e, SPLIT), (1, 3));
    assert_eq!(layout(&e, WHOLE), (2, 2));
    assert_eq!(e.allocation(live[1]).unwrap().size, 20 * MIB);
    e.assert_valid();
    // A freed whole block is reused whole.
    e.free(live[3]).unwrap();
    live[3] = malloc_in(&mut e, WHOLE, 2 * MIB);
    assert_eq!(layout(&e, WHOLE), (2, 2));
    for a in live {
        e.free(a).unwrap();
    }
    common::release_all(&mut e, SPLIT);
    common::release_all(&mut e, WHOLE);
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0);
    e.assert_valid();
}

#[test]
fn no_split_is_refused_where_it_cannot_hold() {
    let mut e = engine("", 8 << 30);
    assert_eq!(
        e.set_pool_no_split((5, 5)),
        Err(AllocError::UnknownPool { pool: (5, 5) })
    );
    let mut grow = engine("expandable_segments:True", 8 << 30);
    grow.retain_pool(WHOLE);
    let err = grow.set_pool_no_split(WHOLE).unwrap_err();
    assert!(err.to_string().contains("expandable"), "{err}");
}
