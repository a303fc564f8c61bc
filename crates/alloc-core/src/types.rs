//! Small identifier and classification types shared by every layer.

use std::num::NonZeroU32;

use serde::Serialize;

/// An opaque stream handle. `0` is the default (legacy) stream; the CUDA layer
/// stores the raw `CUstream` pointer value here.
pub type StreamId = u64;

/// Which of the two block pools a request or segment belongs to.
///
/// PyTorch keeps small (<= 1 MiB) and large requests apart so that small
/// tensors never fragment large segments; every policy reports its statistics
/// split the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolKind {
    /// Requests of at most 1 MiB (after rounding).
    Small,
    /// Everything larger.
    Large,
}

impl PoolKind {
    /// Index of this pool in per-pool arrays (`0` is reserved for "all").
    #[inline]
    pub fn stat_index(self) -> usize {
        match self {
            PoolKind::Small => 1,
            PoolKind::Large => 2,
        }
    }

    /// Dense index `0..2` for arrays holding one entry per pool.
    #[inline]
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Index of a block in the engine's arena.
///
/// Never zero (the arena's slot 0 is never handed out), so that
/// `Option<BlockId>` takes four bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub(crate) NonZeroU32);

impl BlockId {
    /// The smallest id, for range bounds in ordered indexes.
    pub const MIN: BlockId = BlockId(NonZeroU32::MIN);
    /// The largest id, for range bounds in ordered indexes.
    pub const MAX: BlockId = BlockId(NonZeroU32::MAX);

    /// The id of arena slot `index` (not 0).
    #[inline]
    pub(crate) fn from_index(index: usize) -> BlockId {
        let index = u32::try_from(index).expect("block arena exceeds u32 ids");
        BlockId(NonZeroU32::new(index).expect("block slot 0 is reserved"))
    }

    /// The arena slot of this block.
    #[inline]
    pub fn index(self) -> usize {
        self.0.get() as usize
    }
}

/// Index of a segment (one device allocation) in the engine's arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentId(pub(crate) u32);

impl SegmentId {
    /// The arena slot of this segment.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// One kibibyte.
pub const KIB: u64 = 1 << 10;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;
