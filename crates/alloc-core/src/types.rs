//! Small identifier and classification types shared by every layer.

use std::fmt;
use std::num::NonZeroU32;

use serde::Serialize;

/// A caller's stream: an opaque handle value. `StreamId(0)` is the default
/// (legacy) stream; the CUDA layer stores the raw `CUstream` pointer value
/// here. Every value is a valid stream id: private pools are keyed apart
/// ([`CacheKey`]), never by stream values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The default (legacy) stream.
    pub const DEFAULT: StreamId = StreamId(0);
}

impl fmt::Display for StreamId {
    /// The handle value in hexadecimal (`0x0` for the default stream).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

impl fmt::LowerHex for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::LowerHex::fmt(&self.0, f)
    }
}

/// A private pool as blocks and segments carry it: a small number the engine
/// gives each [`PoolId`] in use (four bytes, so that a
/// [`Block`](crate::Block) stays one cache line), handed to a new pool once
/// its pool is released and its last segment gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PrivatePool(NonZeroU32);

impl PrivatePool {
    /// The `index`-th private pool (0-based).
    #[inline]
    pub(crate) fn from_index(index: usize) -> PrivatePool {
        let n = u32::try_from(index + 1).expect("fewer than 2^32 private pools");
        PrivatePool(NonZeroU32::new(n).expect("index + 1 is not zero"))
    }

    /// Its 0-based index (below the most pools in use at once).
    #[inline]
    pub fn index(self) -> usize {
        self.0.get() as usize - 1
    }
}

/// Which cached blocks a request may reuse: those of its stream, either in
/// the device-wide cache (`private_pool: None`) or in one private pool (a
/// CUDA graph's, a `MemPool`'s). Policies index their free blocks by it, so
/// a private pool's blocks never serve another private pool or the shared
/// cache, whatever the stream values.
#[derive(Clone, Copy, Debug, Default, Eq, PartialOrd, Ord)]
pub struct CacheKey {
    /// The stream the blocks belong to.
    pub stream: StreamId,
    /// The private pool holding them, if any.
    pub private_pool: Option<PrivatePool>,
}

impl CacheKey {
    /// The device-wide cache of `stream`.
    #[inline]
    pub const fn shared(stream: StreamId) -> CacheKey {
        CacheKey {
            stream,
            private_pool: None,
        }
    }

    /// The private pool as one number: 0 for none, else its index + 1.
    #[inline(always)]
    fn pool_number(self) -> u32 {
        self.private_pool.map_or(0, |p| p.0.get())
    }
}

// By hand: the derived comparison branches on whether each side has a
// private pool; every free-index operation compares keys, and comparing
// the pools as plain numbers takes a few instructions fewer.
impl PartialEq for CacheKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        (self.stream == other.stream) & (self.pool_number() == other.pool_number())
    }
}

// Hashes what `eq` compares (a derived `Hash` may not go with a manual `eq`).
impl std::hash::Hash for CacheKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.stream.hash(state);
        self.pool_number().hash(state);
    }
}

impl fmt::Display for CacheKey {
    /// `stream 0x…`, with `in private pool N` when it names one.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream {}", self.stream)?;
        match self.private_pool {
            Some(p) => write!(f, " in private pool {}", p.index()),
            None => Ok(()),
        }
    }
}

impl From<StreamId> for CacheKey {
    #[inline]
    fn from(stream: StreamId) -> CacheKey {
        CacheKey::shared(stream)
    }
}

/// The small or the large pool, PyTorch's two: which one a request,
/// block or segment belongs to. (A private pool, PyTorch's `MemPool`, is
/// a [`PoolId`] and is never called just "pool".)
///
/// PyTorch keeps small (<= 1 MiB) and large requests apart so that small
/// tensors never fragment large segments; every policy reports its statistics
/// split the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    /// Requests of at most 1 MiB (after rounding).
    Small,
    /// Everything larger.
    Large,
}

/// The former name of [`Pool`], for code written before the rename.
#[deprecated(since = "0.1.0", note = "renamed to `Pool`")]
pub type PoolKind = Pool;

impl Pool {
    /// Index of this pool in per-pool arrays (`0` is reserved for "all").
    #[inline]
    pub fn stat_index(self) -> usize {
        match self {
            Pool::Small => 1,
            Pool::Large => 2,
        }
    }

    /// Dense index `0..2` for arrays holding one entry per pool.
    #[inline]
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Names a growable segment: its cache key and pool. (Here rather than in
/// `engine/growable.rs` because sleep tags keep such keys too.)
pub(crate) type SegmentKey = (CacheKey, Pool);

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

    /// The id of arena slot `index` (not 0). Outside the engine, for
    /// tables indexed by [`BlockId::index`] and their tests.
    #[inline]
    pub fn from_index(index: usize) -> BlockId {
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
/// A block handed out by [`Engine::malloc`](crate::Engine::malloc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Device address.
    pub addr: u64,
    /// Usable size of the block (the request rounded up by the policy).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// The allocating stream.
    pub stream: StreamId,
}

/// Life-cycle state of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// Cached: available for reuse, indexed by the policy.
    Free,
    /// Handed out to a caller.
    Allocated,
    /// Freed by the caller, but other streams may still use it: reusable only
    /// once the events recorded on those streams complete.
    AwaitingEvents,
}

/// Identifies a private pool: PyTorch's `MempoolId_t` pair.
pub type PoolId = (u64, u64);

/// One kibibyte.
pub const KIB: u64 = 1 << 10;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;

/// Largest request the engine accepts (1 PiB): anything larger is a caller
/// bug, refused before any arithmetic could overflow.
pub const MAX_REQUEST: u64 = 1 << 50;
