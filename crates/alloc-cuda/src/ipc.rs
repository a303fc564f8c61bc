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

use alloc_core::{AllocError, BlockState, Policy};

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

/// The live block containing `ptr` in `engine`: `(address, size)`, `None`
/// when no segment of this allocator contains `ptr`, an error when the
/// memory there is not allocated.
fn live_block<P: Policy>(
    engine: &crate::CudaEngine<P>,
    ptr: u64,
) -> Result<Option<(u64, u64, bool)>, CudaError> {
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
            Ok(Some((b.addr, b.size, heap.segment(seg).expandable)))
        }
        _ => Err(CudaError::Alloc(AllocError::InvalidArgument(format!(
            "pointer {ptr:#x} lies in memory of gpualloc that is not allocated (a cached \
             free block): only live allocations can be shared"
        )))),
    }
}

impl<P: Policy> CudaAllocator<P> {
    /// The memory shared with another process for the live block that
    /// contains `ptr` (see [`SharedRange`]); `Ok(None)` when `ptr` is not
    /// in memory of this allocator.
    pub fn shared_range(&self, ptr: u64) -> Result<Option<SharedRange>, CudaError> {
        self.inspect(|e| {
            let Some((addr, size, expandable)) = live_block(e, ptr)? else {
                return Ok(None);
            };
            if !expandable {
                let seg = e
                    .heap()
                    .segment_containing(ptr)
                    .map(|s| e.heap().segment(s));
                return Ok(seg.map(|s| SharedRange::Segment {
                    base: s.addr,
                    size: s.size,
                }));
            }
            let (first, page, count) = e.memory().vmm().covering_pages(addr, size)?;
            Ok(Some(SharedRange::Pages { first, page, count }))
        })?
    }

    /// The pages of an expandable segment under the live block that
    /// contains `ptr`, exported as POSIX file descriptors of this process
    /// (each physical page once; the descriptors stay open, owned by the
    /// allocator, until the page's memory is released). `Ok(None)` when
    /// `ptr` is not in memory of this allocator; an error for a block of a
    /// `cuMemAlloc` segment (shared with `cuIpcGetMemHandle` instead).
    pub fn export_pages(&self, ptr: u64) -> Result<Option<SharedPages>, CudaError> {
        self.inspect(|e| {
            let Some((addr, size, expandable)) = live_block(e, ptr)? else {
                return Ok(None);
            };
            if !expandable {
                return Err(CudaError::Unsupported(
                    "the block lies in a cuMemAlloc segment, not an expandable one: share \
                     its segment with cuIpcGetMemHandle (see shared_range)",
                ));
            }
            e.memory().export_pages(addr, size).map(Some)
        })?
    }
}
