//! What sharing a block with another process needs from the allocator
//! (CUDA IPC: PyTorch's `shareIpcHandle`, `getBaseAllocation`): the memory
//! that is shared for a live block, and for expandable segments the pages
//! under it exported as POSIX file descriptors.
//!
//! - A block of a `cuMemAlloc` segment is shared with its whole segment
//!   (`cuIpcGetMemHandle` of the segment's base; the receiver opens the whole
//!   allocation), at the block's offset from the base.
//! - A block of an expandable segment is shared as the whole pages that
//!   cover it (the driver maps a physical allocation only whole); every page
//!   of a segment has the same size, so one page size describes them, as
//!   PyTorch's `'e'` handle requires.
//!
//! Reached as `alloc.ipc()` ([`Ipc`]). The part keeps no state: it reads
//! the allocator's engine under its lock, and finds the block with
//! `locate`, which reads any engine's heap (so that it is tested on the
//! simulated device).

use alloc_core::{AllocError, BlockState, Engine, MemoryBackend, Policy, StreamBackend};

use crate::allocator::CudaAllocator;
use crate::error::CudaError;
use crate::vmm::SharedPages;

/// The memory shared with another process for one live block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedRange {
    /// The block's `cuMemAlloc` segment, shared whole.
    Segment {
        /// The segment's base (what `cuMemAlloc` returned).
        base: u64,
        /// Its size in bytes.
        size: u64,
    },
    /// The pages of an expandable segment that cover the block.
    Pages {
        /// Address of the first page.
        first: u64,
        /// Bytes of each page.
        page: u64,
        /// Number of pages.
        count: u64,
    },
}

impl SharedRange {
    /// The first shared byte's address.
    pub fn base(&self) -> u64 {
        match *self {
            SharedRange::Segment { base, .. } => base,
            SharedRange::Pages { first, .. } => first,
        }
    }

    /// Bytes shared.
    pub fn size(&self) -> u64 {
        match *self {
            SharedRange::Segment { size, .. } => size,
            SharedRange::Pages { page, count, .. } => page * count,
        }
    }

    /// Whether the block lies in an expandable segment.
    pub fn expandable(&self) -> bool {
        matches!(self, SharedRange::Pages { .. })
    }
}

/// Where the live block containing an address lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Located {
    /// In the `cuMemAlloc` segment at `base` of `size` bytes.
    Segment { base: u64, size: u64 },
    /// In an expandable segment: the block's address and size.
    Expandable { addr: u64, size: u64 },
}

/// The live block containing `ptr` in `engine`: `None` when no segment of
/// the engine contains `ptr`, an error when the memory there is not
/// allocated. Reads only the heap, so any backend will do.
fn locate<P: Policy, M: MemoryBackend, S: StreamBackend>(
    engine: &Engine<P, M, S>,
    ptr: u64,
) -> Result<Option<Located>, CudaError> {
    let heap = engine.heap();
    let Some(seg) = heap.segment_containing(ptr) else {
        return Ok(None);
    };
    let found = heap
        .segment_blocks(seg)
        .map(|id| heap.block(id))
        .find(|b| b.addr <= ptr && ptr < b.addr + b.size);
    match found {
        Some(b) if b.state == BlockState::Allocated => {
            let segment = heap.segment(seg);
            Ok(Some(if segment.expandable {
                Located::Expandable {
                    addr: b.addr,
                    size: b.size,
                }
            } else {
                Located::Segment {
                    base: segment.addr,
                    size: segment.size,
                }
            }))
        }
        _ => Err(CudaError::Alloc(AllocError::InvalidArgument(format!(
            "pointer {ptr:#x} lies in memory of gpualloc that is not allocated (a cached \
             free block): only live allocations can be shared"
        )))),
    }
}

/// Sharing the live blocks of a [`CudaAllocator`] with another process
/// (from [`CudaAllocator::ipc`]).
///
/// ```no_run
/// use alloc_cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::global(0)?;
/// let stream = alloc.context().new_stream()?;
/// let ptr = alloc.malloc(3 << 20, &stream)?;
/// let shared = alloc.ipc().shared_range(ptr)?.expect("a block of this allocator");
/// assert!(shared.base() <= ptr && ptr < shared.base() + shared.size());
/// # Ok::<(), alloc_cuda::CudaError>(())
/// ```
pub struct Ipc<'a, P: Policy> {
    alloc: &'a CudaAllocator<P>,
}

impl<P: Policy> CudaAllocator<P> {
    /// Sharing live blocks with another process (CUDA IPC).
    pub fn ipc(&self) -> Ipc<'_, P> {
        Ipc { alloc: self }
    }
}

impl<P: Policy> Ipc<'_, P> {
    /// The memory shared with another process for the live block that
    /// contains `ptr` (see [`SharedRange`]); `Ok(None)` when `ptr` is not
    /// in memory of this allocator.
    pub fn shared_range(&self, ptr: u64) -> Result<Option<SharedRange>, CudaError> {
        let engine = self.alloc.engine()?;
        match locate(&*engine, ptr)? {
            None => Ok(None),
            Some(Located::Segment { base, size }) => Ok(Some(SharedRange::Segment { base, size })),
            Some(Located::Expandable { addr, size }) => {
                let (first, page, count) = engine.memory().vmm().covering_pages(addr, size)?;
                Ok(Some(SharedRange::Pages { first, page, count }))
            }
        }
    }

    /// The pages of an expandable segment under the live block that
    /// contains `ptr`, exported as POSIX file descriptors of this process
    /// (each physical page once; the descriptors stay open, owned by the
    /// allocator, until the page's memory is released). `Ok(None)` when
    /// `ptr` is not in memory of this allocator; an error for a block of a
    /// `cuMemAlloc` segment (shared with `cuIpcGetMemHandle` instead).
    pub fn export_pages(&self, ptr: u64) -> Result<Option<SharedPages>, CudaError> {
        let engine = self.alloc.engine()?;
        match locate(&*engine, ptr)? {
            None => Ok(None),
            Some(Located::Segment { .. }) => Err(CudaError::Unsupported(
                "the block lies in a cuMemAlloc segment, not an expandable one: share \
                 its segment with cuIpcGetMemHandle (see shared_range)",
            )),
            Some(Located::Expandable { addr, size }) => {
                engine.memory().export_pages(addr, size).map(Some)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc_core::sim::{SimMemory, SimStreams};
    use alloc_core::{AllocatorConfig, StreamId};
    use alloc_policy::AnyPolicy;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_live_block_is_located_in_its_segment() {
        let cfg = AllocatorConfig::default();
        let mut engine =
            AnyPolicy::engine(&cfg, SimMemory::new(1 << 30), SimStreams::new()).unwrap();
        let a = engine.malloc(3 * MIB, StreamId(7)).unwrap();
        let b = engine.malloc(3 * MIB, StreamId(7)).unwrap();
        let seg = engine.heap().segment_containing(a.addr).unwrap();
        let (base, size) = (
            engine.heap().segment(seg).addr,
            engine.heap().segment(seg).size,
        );
        assert!(size >= 6 * MIB, "both blocks in one segment");
        let whole = Some(Located::Segment { base, size });
        assert_eq!(locate(&engine, a.addr).unwrap(), whole);
        assert_eq!(
            locate(&engine, b.addr + b.size - 1).unwrap(),
            whole,
            "an inner address"
        );
        assert_eq!(
            locate(&engine, base + size).unwrap(),
            None,
            "past the segment"
        );
        engine.free(b.addr).unwrap();
        let e = locate(&engine, b.addr).unwrap_err();
        assert!(e.to_string().contains("not allocated"), "{e}");
        assert_eq!(
            locate(&engine, a.addr).unwrap(),
            whole,
            "its neighbour lives on"
        );
    }

    #[test]
    fn a_block_of_a_growable_segment_is_located_as_itself() {
        let cfg = AllocatorConfig::parse("expandable_segments:True").unwrap();
        let mut engine =
            AnyPolicy::engine(&cfg, SimMemory::new(1 << 30), SimStreams::new()).unwrap();
        let a = engine.malloc(3 * MIB, StreamId(7)).unwrap();
        let b = engine.malloc(5 * MIB, StreamId(7)).unwrap();
        let seg = engine.heap().segment_containing(b.addr).unwrap();
        assert!(engine.heap().segment(seg).expandable);
        assert_eq!(
            locate(&engine, b.addr + 1).unwrap(),
            Some(Located::Expandable {
                addr: b.addr,
                size: b.size
            }),
            "the block, not its segment"
        );
        engine.free(a.addr).unwrap();
        assert!(locate(&engine, a.addr).is_err(), "a cached block");
    }
}

/// Over a driver: the null driver (`crates/alloc-cuda/null-driver/run.sh
/// --tests`, no GPU) or a GPU.
#[cfg(test)]
mod null_driver_tests {
    use super::*;

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn a_block_of_a_segment_is_shared_with_its_segment() {
        let alloc = CudaAllocator::with_config_str(0, "").unwrap();
        let stream = alloc.context().new_stream().unwrap();
        let ptr = alloc.malloc(3 << 20, &stream).unwrap();
        let range = alloc.ipc().shared_range(ptr + 1).unwrap().unwrap();
        assert!(!range.expandable());
        assert!(range.base() <= ptr && ptr + (3 << 20) <= range.base() + range.size());
        let e = alloc.ipc().export_pages(ptr).unwrap_err();
        assert!(matches!(e, CudaError::Unsupported(_)), "{e}");
        assert_eq!(
            alloc
                .ipc()
                .shared_range(range.base() + range.size())
                .unwrap(),
            None,
            "past every segment"
        );
        alloc.free(ptr).unwrap();
        assert!(alloc.ipc().shared_range(ptr).is_err(), "a cached block");
    }
}
