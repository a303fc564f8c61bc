//! Memory snapshots: every segment with its blocks, serialisable to JSON.
//! Field and state names follow `torch.cuda.memory._snapshot()`.

use serde::Serialize;

use crate::heap::{BlockState, Heap};
use crate::private_pool::{PoolId, PrivatePools};
use crate::types::{Pool, StreamId};

/// State of a block as PyTorch names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotState {
    /// Handed out.
    ActiveAllocated,
    /// Freed, waiting for other streams' events.
    ActivePendingFree,
    /// Cached.
    Inactive,
}

impl From<BlockState> for SnapshotState {
    fn from(s: BlockState) -> Self {
        match s {
            BlockState::Allocated => SnapshotState::ActiveAllocated,
            BlockState::AwaitingEvents => SnapshotState::ActivePendingFree,
            BlockState::Free => SnapshotState::Inactive,
        }
    }
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockSnapshot {
    /// Device address.
    pub address: u64,
    /// Size in bytes.
    pub size: u64,
    /// Bytes requested by the caller (0 when inactive).
    pub requested_size: u64,
    /// State.
    pub state: SnapshotState,
    /// Stream of the block.
    pub stream: StreamId,
}

/// One segment (device allocation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SegmentSnapshot {
    /// Device address.
    pub address: u64,
    /// Size in bytes.
    pub total_size: u64,
    /// Stream it serves.
    pub stream: StreamId,
    /// `small` or `large`.
    pub segment_type: Pool,
    /// Bytes of allocated blocks.
    pub allocated_size: u64,
    /// Bytes of allocated or pending blocks.
    pub active_size: u64,
    /// Bytes requested over active blocks.
    pub requested_size: u64,
    /// Blocks in address order.
    pub blocks: Vec<BlockSnapshot>,
    /// Whether the segment grows on the virtual-memory API (expandable
    /// segments, a sleep tag's pool); a segment from a pool's own source or
    /// from before expandable segments were turned on does not.
    pub is_expandable: bool,
    /// The private pool (CUDA graph, `MemPool`) owning the segment, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub private_pool: Option<PoolId>,
    /// The sleep tag of that pool, if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Whether its tag is paused: no page of the segment is mapped, its
    /// blocks keep their addresses and states.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
}

/// The whole allocator state.
///
/// ```
/// use alloc_core::{AllocatorConfig, SimMemory, SimStreams, SnapshotState, StreamId, GIB, MIB};
/// use alloc_policy::AnyPolicy;
///
/// let cfg = AllocatorConfig::default();
/// let mut engine = AnyPolicy::engine(&cfg, SimMemory::new(GIB), SimStreams::new())?;
/// let a = engine.malloc(3 * MIB, StreamId(0))?;
///
/// let snap = engine.snapshot();
/// let segment = &snap.segments[0];
/// assert_eq!(segment.total_size, 20 * MIB);
/// assert_eq!(segment.blocks[0].address, a.addr);
/// assert_eq!(segment.blocks[0].state, SnapshotState::ActiveAllocated);
/// assert_eq!(segment.blocks[1].state, SnapshotState::Inactive); // the rest, free
/// assert!(snap.to_json().contains("\"total_size\""));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Snapshot {
    /// Segments in address order.
    pub segments: Vec<SegmentSnapshot>,
}

impl Snapshot {
    /// Captures the state of a heap whose private pools are `pools`.
    pub(crate) fn of(heap: &Heap, pools: &PrivatePools) -> Self {
        let segments = heap
            .segments()
            .map(|(seg_id, seg)| {
                let blocks: Vec<BlockSnapshot> = heap
                    .segment_blocks(seg_id)
                    .map(|id| {
                        let b = heap.block(id);
                        BlockSnapshot {
                            address: b.addr,
                            size: b.size,
                            requested_size: b.requested,
                            state: b.state.into(),
                            stream: b.stream,
                        }
                    })
                    .collect();
                let sum = |f: fn(&BlockSnapshot) -> bool, v: fn(&BlockSnapshot) -> u64| {
                    blocks.iter().filter(|b| f(b)).map(v).sum()
                };
                SegmentSnapshot {
                    address: seg.addr,
                    total_size: seg.size,
                    stream: seg.stream,
                    segment_type: seg.pool,
                    allocated_size: sum(|b| b.state == SnapshotState::ActiveAllocated, |b| b.size),
                    active_size: sum(|b| b.state != SnapshotState::Inactive, |b| b.size),
                    requested_size: sum(
                        |b| b.state != SnapshotState::Inactive,
                        |b| b.requested_size,
                    ),
                    blocks,
                    is_expandable: seg.expandable,
                    private_pool: pools.pool_of(seg.key()),
                    tag: None,
                    paused: false,
                }
            })
            .collect();
        Snapshot { segments }
    }

    /// Addresses of the segments, in address order.
    pub fn segment_addresses(&self) -> Vec<u64> {
        self.segments.iter().map(|s| s.address).collect()
    }

    /// The snapshot as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("snapshot serialises")
    }
}
