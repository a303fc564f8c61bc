//! A policy of one's own on the GPU: first fit with coalescing, written
//! here against `alloc_core`'s `Policy` trait (not one of alloc-policy's),
//! run by a `CudaAllocator` on device 0. The engine keeps streams, events,
//! statistics and the out-of-memory path; the policy only rounds requests,
//! picks a free block and splits and merges.
//!
//! The example checks what it claims and exits nonzero otherwise: first fit
//! takes the lowest-addressed hole where best fit would take the tightest,
//! every buffer reads back what was written, the engine's invariants hold,
//! and everything goes back to the driver at the end.
//!
//! `cargo run --release -p alloc-cuda --example custom_policy` (needs a GPU).

use std::collections::BTreeMap;
use std::error::Error;

use alloc_cuda::alloc_core::{
    coalesce, Audit, BlockId, CacheKey, Capabilities, Heap, Policy, Pool, Reclaim, Request, KIB,
    MIB,
};
use alloc_cuda::{AllocatorConfig, CudaAllocator, DeviceBuffer};

#[path = "../../../examples/failure.rs"]
mod failure;
use failure::Failure;

/// Sizes are multiples of this (CUDA's alignment for any type).
const ALIGN: u64 = 512;
/// Requests up to this size share small segments.
const SMALL_REQUEST: u64 = MIB;
/// The size of a small segment, and the unit large segments are made of.
const SEGMENT_UNIT: u64 = 2 * MIB;

/// First fit: the free block at the lowest address, among those of the
/// request's cache (its stream, in its private pool if any) and pool that
/// are large enough.
#[derive(Debug, Default)]
struct FirstFit {
    /// Free blocks by (cache, pool, address).
    free: BTreeMap<(CacheKey, Pool, u64), BlockId>,
}

/// A free block's place in the index.
fn key(heap: &Heap, id: BlockId) -> (CacheKey, Pool, u64) {
    let b = heap.block(id);
    (b.key(), b.pool, b.addr)
}

impl Policy for FirstFit {
    fn name(&self) -> &str {
        "first-fit"
    }

    fn round_request(&self, requested: u64, key: CacheKey) -> Request {
        let size = requested.div_ceil(ALIGN) * ALIGN;
        Request::new(requested, size, key, SMALL_REQUEST)
    }

    fn segment_size(&self, req: &Request) -> u64 {
        req.size.div_ceil(SEGMENT_UNIT) * SEGMENT_UNIT
    }

    fn take_free(&mut self, heap: &Heap, req: &Request) -> Option<BlockId> {
        let (k, p) = (req.key, req.pool);
        let key = self
            .free
            .range((k, p, 0)..=(k, p, u64::MAX))
            .find(|(_, &id)| heap.block(id).size >= req.size)
            .map(|(k, _)| *k)?;
        self.free.remove(&key)
    }

    fn carve(&mut self, heap: &mut Heap, block: BlockId, req: &Request) -> BlockId {
        if heap.block(block).size - req.size >= ALIGN {
            let rest = heap.split(block, req.size);
            self.free.insert(key(heap, rest), rest);
        }
        block
    }

    fn insert_free(&mut self, heap: &mut Heap, block: BlockId) {
        let free = &mut self.free;
        let merged = coalesce(heap, block, |h, neighbour| {
            free.remove(&key(h, neighbour));
        });
        self.free.insert(key(heap, merged), merged);
    }

    fn remove_free(&mut self, heap: &Heap, block: BlockId) {
        self.free.remove(&key(heap, block));
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            coalesces: true,
            ..Capabilities::default()
        }
    }
}

/// No collector of its own: the engine's out-of-memory path releases idle
/// segments.
impl Reclaim for FirstFit {}

impl Audit for FirstFit {
    fn indexed_blocks(&self) -> Vec<BlockId> {
        self.free.values().copied().collect()
    }
}

/// A buffer with the bytes written to it.
type Written = (DeviceBuffer<u8, FirstFit>, Vec<u8>);

/// An error (a nonzero exit) unless `holds`.
fn check(holds: bool, what: &str) -> Result<(), Box<dyn Error>> {
    if holds {
        println!("ok: {what}");
        Ok(())
    } else {
        Err(format!("FAILED: {what}").into())
    }
}

/// `len` bytes of a pattern told apart by `seed`.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn main() -> Result<(), Failure> {
    let alloc = CudaAllocator::with_policy(0, FirstFit::default(), &AllocatorConfig::default())?;
    check(
        alloc.diagnostics().policy_name()? == "first-fit",
        "the allocator runs the policy",
    )?;
    let stream = alloc.context().new_stream()?;

    // One small segment: a 512 KiB, b 256 KiB, c 128 KiB, d 256 KiB, the
    // rest of the 2 MiB free, in address order.
    let sizes = [512 * KIB, 256 * KIB, 128 * KIB, 256 * KIB];
    let mut live: Vec<Written> = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let data = pattern(size as usize, i as u8);
        live.push((alloc.alloc_from_host(&data, &stream)?, data));
    }
    let addrs: Vec<u64> = live.iter().map(|(b, _)| b.device_address()).collect();
    let tiled = (1..4).all(|i| addrs[i] == addrs[i - 1] + sizes[i - 1]);
    check(tiled, "four buffers side by side in one segment")?;
    check(
        alloc.stats()?.num_device_alloc == 1,
        "one cuMemAlloc for all four",
    )?;

    // Two holes: a's 512 KiB at the start, c's 128 KiB further on. A
    // 128 KiB request takes the first (best fit would take c's).
    live.remove(2);
    live.remove(0);
    let data = pattern(128 * KIB as usize, 9);
    let e = alloc.alloc_from_host(&data, &stream)?;
    println!(
        "holes at {:#x} (512 KiB) and {:#x} (128 KiB); 128 KiB went to {:#x}",
        addrs[0],
        addrs[2],
        e.device_address()
    );
    check(
        e.device_address() == addrs[0],
        "first fit: the lowest hole, not the tightest",
    )?;
    live.push((e, data));

    // Every live buffer holds its own bytes.
    for (buf, data) in &live {
        check(
            &buf.copy_to_host()? == data,
            &format!(
                "{} bytes at {:#x} read back",
                data.len(),
                buf.device_address()
            ),
        )?;
    }
    if let Err(e) = alloc.diagnostics().validate()? {
        return Err(format!("FAILED: engine invariants: {e}").into());
    }
    println!("ok: engine invariants hold");

    drop(live);
    alloc.empty_cache()?;
    check(
        alloc.reserved_bytes()? == 0 && alloc.allocated_bytes()? == 0,
        "everything back to the driver",
    )?;
    println!("custom_policy: all checks passed");
    Ok(())
}
