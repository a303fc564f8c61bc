//! The shadow's own checks (`alloc_policy::testing::shadow`): each is shown
//! failing on a fault made by hand, which the engine itself never makes,
//! so that the property tests' silence means something.
#![cfg(feature = "pytorch-bfc")]

mod common;

use alloc_core::{Allocation, StreamId, VirtualMemory, MIB};
use alloc_policy::testing::shadow::{Shadow, BLOCK_ALIGN};
use common::{engine, SimEngine};

const GIB: u64 = 1 << 30;

/// A block of `size` bytes at `addr` on the default stream, as the engine
/// would hand it out.
fn block(addr: u64, size: u64) -> Allocation {
    Allocation {
        addr,
        size,
        requested: size,
        stream: StreamId(0),
    }
}

/// A 4 MiB block from `e`, recorded by `shadow`.
fn allocated(e: &mut SimEngine, shadow: &mut Shadow) -> Allocation {
    let a = e.malloc(4 * MIB, StreamId(0)).unwrap();
    shadow.allocated(e, a).unwrap();
    a
}

#[test]
fn every_block_handed_out_is_aligned() {
    let mut e = engine("", GIB);
    let mut shadow = Shadow::default();
    let a = e.malloc(4 * MIB, StreamId(0)).unwrap();
    let err = shadow
        .allocated(&mut e, block(a.addr + BLOCK_ALIGN / 2, 512))
        .unwrap_err();
    assert!(err.contains("not aligned to 512 bytes"), "{err}");
    shadow
        .allocated(&mut e, block(a.addr + BLOCK_ALIGN, 512))
        .unwrap();
}

#[test]
fn a_block_over_a_live_blocks_bytes_is_caught_by_its_data() {
    let mut e = engine("", GIB);
    let mut shadow = Shadow::default();
    let a = allocated(&mut e, &mut shadow);
    // Its last 1 MiB, which holds the end of the live block's pattern.
    let err = shadow
        .allocated(&mut e, block(a.addr + 3 * MIB, MIB))
        .unwrap_err();
    assert!(
        err.contains("holds the pattern of allocation #1"),
        "caught by the data, before the addresses: {err}"
    );
}

#[test]
fn a_block_whose_pattern_was_overwritten_fails_at_its_free() {
    let mut e = engine("", GIB);
    let mut shadow = Shadow::default();
    let a = allocated(&mut e, &mut shadow);
    let b = allocated(&mut e, &mut shadow);
    // A stray write of `b`'s pattern word into `a`'s first word.
    let stray = e.memory().read(b.addr).unwrap().unwrap();
    e.memory_mut().write(a.addr, stray).unwrap();
    let err = shadow.freeing(&mut e, a.addr, false).unwrap_err();
    assert!(
        err.contains("overwritten with data no block wrote there"),
        "{err}"
    );
    shadow.freeing(&mut e, b.addr, false).unwrap();
}

#[test]
fn a_block_whose_memory_was_mapped_again_fails_at_its_free() {
    let mut e = engine("expandable_segments:true", GIB);
    let mut shadow = Shadow::default();
    let a = allocated(&mut e, &mut shadow);
    // Its first page goes back to the device and comes back, behind the
    // engine: mapped as before, but with its content gone.
    e.memory_mut().unmap(a.addr, 2 * MIB).unwrap();
    e.memory_mut().map(a.addr, 2 * MIB).unwrap();
    shadow.check_mapped(&e).unwrap();
    let err = shadow.freeing(&mut e, a.addr, false).unwrap_err();
    assert!(err.contains("was lost"), "{err}");
    common::drain(&mut e, [a.addr]);
}

#[test]
fn a_freed_blocks_bytes_may_be_handed_out_again() {
    let mut e = engine("", GIB);
    let mut shadow = Shadow::default();
    let a = allocated(&mut e, &mut shadow);
    shadow.freeing(&mut e, a.addr, false).unwrap();
    e.free(a.addr).unwrap();
    let again = allocated(&mut e, &mut shadow);
    assert_eq!(
        again.addr, a.addr,
        "the cached block, its old pattern in it"
    );
    shadow.freeing(&mut e, again.addr, false).unwrap();
    common::drain(&mut e, [again.addr]);
}
