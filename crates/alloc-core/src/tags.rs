//! Sleep tags: named private pools whose physical memory can be given back
//! (*paused*) and taken again at the same addresses (*resumed*), as
//! reinforcement-learning frameworks do when a trainer and an inference
//! engine take turns on one GPU. This module is `SleepTags`: the tag
//! names, their pools, what a paused tag gave back, and the decisions of a
//! pause and a resume; the engine's side (`engine/sleep.rs`) has the
//! streams waited for and the pages unmapped and mapped by its other parts.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::error::{AllocError, BackendError};
use crate::heap::{BlockState, Heap};
use crate::private_pool::{PoolId, PrivatePools};
use crate::snapshot::Snapshot;
use crate::types::{SegmentId, SegmentKey};

/// Pool ids the engine picks for tags it creates: `(0, TAG_POOL_BASE + n)`.
/// PyTorch numbers its own pools from 1 in one half of the pair, so these
/// never meet them.
pub const TAG_POOL_BASE: u64 = 1 << 62;

/// What a pause does with the contents of the tag's live blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backup {
    /// Thrown away: after resume the blocks hold undefined bytes (a KV
    /// cache to be rebuilt, weights to be reloaded).
    None,
    /// Copied to host memory before the pages go, and back after resume.
    Host,
}

impl Backup {
    /// Parses `"none"` or `"host"` (as the Python and C APIs name them).
    pub fn parse(text: &str) -> Option<Backup> {
        match text {
            "none" => Some(Backup::None),
            "host" | "cpu" => Some(Backup::Host),
            _ => None,
        }
    }

    /// `"none"` or `"host"`.
    pub fn name(self) -> &'static str {
        match self {
            Backup::None => "none",
            Backup::Host => "host",
        }
    }
}

/// What a paused tag gave back, to be taken again at resume.
#[derive(Debug, Clone)]
pub(crate) struct Paused {
    /// How the contents were kept.
    pub(crate) backup: Backup,
    /// Page runs `(segment, start, bytes)` that were mapped and were
    /// unmapped by the pause: resume maps exactly these again.
    pub(crate) runs: Vec<(SegmentKey, u64, u64)>,
    /// The live blocks `(addr, size)` whose contents were saved.
    pub(crate) saved: Vec<(u64, u64)>,
}

impl Paused {
    /// Bytes of physical memory the pause gave back.
    pub(crate) fn bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.2).sum()
    }

    /// Bytes whose contents were saved.
    pub(crate) fn saved_bytes(&self) -> u64 {
        self.saved.iter().map(|r| r.1).sum()
    }
}

/// One tag in the registry.
#[derive(Debug, Clone)]
struct Entry {
    pool: PoolId,
    paused: Option<Paused>,
}

/// Receives the live blocks `(addr, size)` of a tag to copy them somewhere
/// before a pause unmaps them (host backup), or to copy them back after a
/// resume mapped them again. The memory is mapped and no queued work uses
/// it while the callback runs.
pub type CopyBlocks<'a> = &'a mut dyn FnMut(&[(u64, u64)]) -> Result<(), BackendError>;

fn tag_error(tag: &str, reason: &'static str) -> AllocError {
    AllocError::Tag {
        tag: tag.to_string(),
        reason,
    }
}

/// The sleep tags of one engine: each tag's name and pool, what a paused
/// tag gave back, and the decisions that need no device: which pool a tag
/// gets, whether an allocation or a pause may go ahead, which blocks a
/// pause saves and a resume restores. Between those decisions the engine
/// has its other parts wait for streams and unmap and map pages
/// (`engine/sleep.rs`).
/// The pools' own rules (held, paused, releasable) are `PrivatePools`',
/// which the tags mark.
#[derive(Debug, Default)]
pub(crate) struct SleepTags {
    by_name: BTreeMap<String, Entry>,
    /// Tags created with a pool id of the engine's choosing.
    created: u64,
}

impl SleepTags {
    /// The pool of `tag`, if the tag exists.
    pub(crate) fn pool(&self, tag: &str) -> Option<PoolId> {
        self.by_name.get(tag).map(|e| e.pool)
    }

    /// The tag of `pool`, if it has one.
    pub(crate) fn tag_of(&self, pool: PoolId) -> Option<&str> {
        self.by_name
            .iter()
            .find(|(_, e)| e.pool == pool)
            .map(|(name, _)| name.as_str())
    }

    /// The pool of `tag`, created on first use with a pool id never handed
    /// out before (nor held or carried by a segment) and held for good.
    /// `growth` is whether the engine can grow segments, which a tag's pool
    /// needs (its error, if not).
    pub(crate) fn pool_for(
        &mut self,
        tag: &str,
        pools: &mut PrivatePools,
        heap: &Heap,
        growth: Result<(), AllocError>,
    ) -> Result<PoolId, AllocError> {
        if let Some(pool) = self.pool(tag) {
            return Ok(pool);
        }
        check_new(tag, growth)?;
        let mut pool = self.fresh_pool();
        while pools.use_count(pool) > 0 || !pools.segments(heap, pool).is_empty() {
            pool = self.fresh_pool();
        }
        self.register(tag, pool, pools);
        Ok(pool)
    }

    /// Makes the existing private pool `pool` the pool of the new tag
    /// `tag`. The pool must have no segment yet, no segment source of its
    /// own (`sourced`) and split blocks.
    pub(crate) fn bind(
        &mut self,
        tag: &str,
        pool: PoolId,
        pools: &mut PrivatePools,
        heap: &Heap,
        sourced: bool,
        growth: Result<(), AllocError>,
    ) -> Result<(), AllocError> {
        match self.pool(tag) {
            Some(p) if p == pool => return Ok(()),
            Some(_) => return Err(tag_error(tag, "already has another pool")),
            None => {}
        }
        check_new(tag, growth)?;
        if let Some(other) = self.tag_of(pool) {
            return Err(AllocError::InvalidArgument(format!(
                "private pool {pool:?} already belongs to the sleep tag \"{other}\""
            )));
        }
        if !pools.segments(heap, pool).is_empty() || sourced || pools.no_split(pool) {
            return Err(AllocError::InvalidArgument(format!(
                "private pool {pool:?} cannot become a sleep tag's pool: it already has \
                 segments, a segment source of its own, or hands out whole blocks"
            )));
        }
        self.register(tag, pool, pools);
        Ok(())
    }

    /// Every tag with its state and the memory of its segments, by name.
    pub(crate) fn infos(&self, heap: &Heap, pools: &PrivatePools) -> Vec<TagInfo> {
        self.by_name
            .iter()
            .map(|(name, e)| {
                let (mut reserved, mut allocated, mut segments) = (0, 0, 0);
                for id in pools.segments(heap, e.pool) {
                    let seg = heap.segment(id);
                    segments += 1;
                    reserved += seg.size - seg.unmapped;
                    allocated += heap
                        .segment_blocks(id)
                        .map(|b| heap.block(b))
                        .filter(|b| b.state == BlockState::Allocated)
                        .map(|b| b.size)
                        .sum::<u64>();
                }
                let paused = e.paused.as_ref();
                TagInfo {
                    name: name.clone(),
                    pool: e.pool,
                    paused: paused.is_some(),
                    backup: paused.map(|p| p.backup),
                    paused_bytes: paused.map_or(0, Paused::bytes),
                    backed_up_bytes: paused.map_or(0, Paused::saved_bytes),
                    reserved_bytes: reserved,
                    allocated_bytes: allocated,
                    segments,
                }
            })
            .collect()
    }

    /// Bytes given back by every paused tag.
    pub(crate) fn paused_bytes(&self) -> u64 {
        self.by_name
            .values()
            .filter_map(|e| e.paused.as_ref())
            .map(Paused::bytes)
            .sum()
    }

    /// An allocation from `pool`: refused while the pool's tag is paused.
    pub(crate) fn admit(&self, pool: PoolId, pools: &PrivatePools) -> Result<(), AllocError> {
        if !pools.is_paused(pool) {
            return Ok(());
        }
        Err(self.paused_error(pool))
    }

    /// The error of an allocation from the paused `pool`.
    #[cold]
    #[inline(never)]
    fn paused_error(&self, pool: PoolId) -> AllocError {
        tag_error(
            self.tag_of(pool).unwrap_or_default(),
            "is paused: its memory was given back; resume it before allocating from it",
        )
    }

    /// Names the tag and paused state of every tagged segment of `snap`.
    pub(crate) fn annotate(&self, snap: &mut Snapshot, pools: &PrivatePools) {
        if self.by_name.is_empty() {
            return;
        }
        for seg in &mut snap.segments {
            if let Some(pool) = seg.private_pool {
                seg.tag = self.tag_of(pool).map(str::to_string);
                seg.paused = pools.is_paused(pool);
            }
        }
    }

    /// The pool of `tag` for a pause: refused for an unknown or paused
    /// tag, and during a capture.
    pub(crate) fn for_pause(&self, tag: &str, pools: &PrivatePools) -> Result<PoolId, AllocError> {
        let pool = self.for_change(tag, pools)?;
        if self.paused(tag).is_some() {
            return Err(tag_error(tag, "is already paused"));
        }
        Ok(pool)
    }

    /// Starts the pause of `tag`, whose streams' work is done: hands the
    /// live blocks of `segments` to `save` when `backup` is
    /// [`Backup::Host`], then marks the tag and its pool paused, so that a
    /// failure while unmapping leaves what was unmapped on record for the
    /// resume (`note_unmapped`).
    pub(crate) fn begin_pause(
        &mut self,
        tag: &str,
        backup: Backup,
        heap: &Heap,
        pools: &mut PrivatePools,
        segments: &[SegmentId],
        save: CopyBlocks<'_>,
    ) -> Result<(), AllocError> {
        let Some(entry) = self.by_name.get_mut(tag) else {
            return Err(tag_error(
                tag,
                "is unknown: no allocation was tagged with it",
            ));
        };
        let live: Vec<(u64, u64)> = segments
            .iter()
            .flat_map(|&id| heap.segment_blocks(id))
            .map(|b| heap.block(b))
            .filter(|b| b.state == BlockState::Allocated)
            .map(|b| (b.addr, b.size))
            .collect();
        let saved = match backup {
            Backup::Host if !live.is_empty() => {
                save(&live)?;
                live
            }
            _ => Vec::new(),
        };
        pools.set_paused(entry.pool, true);
        entry.paused = Some(Paused {
            backup,
            runs: Vec::new(),
            saved,
        });
        Ok(())
    }

    /// The pause of `tag` unmapped the page `runs` `(start, bytes)` of the
    /// growable segment `key`.
    pub(crate) fn note_unmapped(&mut self, tag: &str, key: SegmentKey, runs: Vec<(u64, u64)>) {
        if let Some(paused) = self.by_name.get_mut(tag).and_then(|e| e.paused.as_mut()) {
            paused
                .runs
                .extend(runs.into_iter().map(|(start, bytes)| (key, start, bytes)));
        }
    }

    /// What the pause of `tag` did, having waited for `streams_waited`
    /// streams.
    pub(crate) fn pause_report(&self, tag: &str, streams_waited: usize) -> PauseReport {
        let paused = self.paused(tag);
        PauseReport {
            released_bytes: paused.map_or(0, Paused::bytes),
            saved_bytes: paused.map_or(0, Paused::saved_bytes),
            streams_waited,
        }
    }

    /// The pool of the paused `tag` for a resume, with what its pause gave
    /// back: refused for an unknown tag or one not paused, and during a
    /// capture.
    pub(crate) fn for_resume(
        &self,
        tag: &str,
        pools: &PrivatePools,
    ) -> Result<(PoolId, Paused), AllocError> {
        let pool = self.for_change(tag, pools)?;
        match self.paused(tag) {
            Some(paused) => Ok((pool, paused.clone())),
            None => Err(tag_error(tag, "is not paused")),
        }
    }

    /// Ends the resume of `tag`, whose pages `paused` recorded are mapped
    /// again (`mapped` bytes): the tag and its pool count as resumed, and
    /// the saved blocks `(addr, size)` still allocated at their size
    /// (`allocated`) go to `restore`.
    pub(crate) fn finish_resume(
        &mut self,
        tag: &str,
        paused: &Paused,
        mapped: u64,
        pools: &mut PrivatePools,
        allocated: impl Fn(u64, u64) -> bool,
        restore: CopyBlocks<'_>,
    ) -> Result<ResumeReport, AllocError> {
        if let Some(entry) = self.by_name.get_mut(tag) {
            entry.paused = None;
            pools.set_paused(entry.pool, false);
        }
        let restored: Vec<(u64, u64)> = paused
            .saved
            .iter()
            .copied()
            .filter(|&(addr, size)| allocated(addr, size))
            .collect();
        if !restored.is_empty() {
            restore(&restored)?;
        }
        Ok(ResumeReport {
            mapped_bytes: mapped,
            restored_bytes: restored.iter().map(|r| r.1).sum(),
        })
    }

    // ----- internals -----

    /// A pool id for a new tag, never handed out before.
    fn fresh_pool(&mut self) -> PoolId {
        self.created += 1;
        (0, TAG_POOL_BASE + self.created)
    }

    /// Registers `tag` with `pool`, held for good by the tag.
    fn register(&mut self, tag: &str, pool: PoolId, pools: &mut PrivatePools) {
        pools.tag(pool);
        self.by_name
            .insert(tag.to_string(), Entry { pool, paused: None });
    }

    /// What the paused `tag` gave back, or `None` if it is not paused.
    fn paused(&self, tag: &str) -> Option<&Paused> {
        self.by_name.get(tag)?.paused.as_ref()
    }

    /// The pool of `tag` for a pause or resume, refused during a capture.
    fn for_change(&self, tag: &str, pools: &PrivatePools) -> Result<PoolId, AllocError> {
        let pool = self
            .pool(tag)
            .ok_or_else(|| tag_error(tag, "is unknown: no allocation was tagged with it"))?;
        if pools.capture_underway() {
            return Err(tag_error(
                tag,
                "cannot pause or resume during a CUDA graph capture or while allocations are \
                 routed to a private pool",
            ));
        }
        Ok(pool)
    }
}

/// Whether a tag named `tag` can be created, on an engine that can grow
/// segments if `growth` is `Ok`.
fn check_new(tag: &str, growth: Result<(), AllocError>) -> Result<(), AllocError> {
    if tag.is_empty() {
        return Err(AllocError::InvalidArgument(
            "a sleep tag needs a name".into(),
        ));
    }
    growth
}

/// A tag as [`crate::Engine::tags`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TagInfo {
    /// The tag's name.
    pub name: String,
    /// Its private pool.
    pub pool: PoolId,
    /// Whether it is paused.
    pub paused: bool,
    /// How a paused tag kept its contents (`None` while resumed).
    pub backup: Option<Backup>,
    /// Bytes of physical memory given back by the pause (0 while resumed).
    pub paused_bytes: u64,
    /// Bytes of live blocks saved to host memory by the pause.
    pub backed_up_bytes: u64,
    /// Bytes of the tag's segments backed by memory now (0 once paused,
    /// unless pages were mapped under none of its blocks).
    pub reserved_bytes: u64,
    /// Bytes of its blocks handed out (kept while paused: the blocks stay
    /// allocated, their addresses valid for after the resume).
    pub allocated_bytes: u64,
    /// Number of its segments (one growable segment per stream and pool).
    pub segments: usize,
}

/// What [`crate::Engine::pause_tag`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct PauseReport {
    /// Bytes of physical memory given back.
    pub released_bytes: u64,
    /// Bytes of live blocks handed to the saver.
    pub saved_bytes: u64,
    /// Streams whose work the host waited for (through events).
    pub streams_waited: usize,
}

/// What [`crate::Engine::resume_tag`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct ResumeReport {
    /// Bytes of physical memory mapped again.
    pub mapped_bytes: u64,
    /// Bytes of saved contents handed to the restorer (blocks freed while
    /// paused are left out).
    pub restored_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::live_table::LiveTable;
    use crate::types::{CacheKey, Pool, StreamId, MIB};

    const GROWS: Result<(), AllocError> = Ok(());

    fn no_growth() -> Result<(), AllocError> {
        Err(AllocError::InvalidArgument("no virtual memory".into()))
    }

    /// A segment of `pool` at `addr` cut into blocks of `sizes`, the
    /// allocated ones entered in `live`.
    fn segment(
        heap: &mut Heap,
        pools: &mut PrivatePools,
        pool: PoolId,
        addr: u64,
        sizes: &[(u64, bool)],
        live: &mut LiveTable,
    ) -> SegmentId {
        let key = CacheKey {
            stream: StreamId(1),
            private_pool: Some(pools.number(pool).unwrap()),
        };
        let (seg, blocks) = heap.add_cut_segment(addr, key, sizes);
        pools.segment_added(key);
        for (id, _) in blocks.into_iter().zip(sizes).filter(|(_, s)| s.1) {
            live.insert(heap.block(id).addr, id);
        }
        seg
    }

    #[test]
    fn a_tag_gets_a_fresh_held_pool_once() {
        let (mut t, mut pools, heap) = (
            SleepTags::default(),
            PrivatePools::default(),
            Heap::new(u64::MAX),
        );
        pools.retain((0, TAG_POOL_BASE + 1)); // taken by someone else
        let kv = t.pool_for("kv", &mut pools, &heap, GROWS).unwrap();
        assert_eq!(kv, (0, TAG_POOL_BASE + 2), "a held id is skipped");
        assert_eq!(t.pool_for("kv", &mut pools, &heap, GROWS).unwrap(), kv);
        assert!(pools.is_tagged(kv) && pools.use_count(kv) == 1);
        assert_eq!(t.tag_of(kv), Some("kv"));
        assert!(t.pool_for("", &mut pools, &heap, GROWS).is_err());
        assert!(t.pool_for("w", &mut pools, &heap, no_growth()).is_err());
        assert_eq!(t.pool("w"), None, "nothing registered on failure");
    }

    #[test]
    fn binding_needs_an_empty_splitting_unsourced_pool_of_no_other_tag() {
        let (mut t, mut pools, mut heap) = (
            SleepTags::default(),
            PrivatePools::default(),
            Heap::new(u64::MAX),
        );
        let mut live = LiveTable::default();
        let (a, b, c) = ((1, 0), (2, 0), (3, 0));
        for p in [a, b, c] {
            pools.retain(p);
        }
        segment(
            &mut heap,
            &mut pools,
            b,
            0x1000_0000,
            &[(MIB, false)],
            &mut live,
        );
        assert!(
            t.bind("x", b, &mut pools, &heap, false, GROWS).is_err(),
            "has segments"
        );
        assert!(
            t.bind("x", c, &mut pools, &heap, true, GROWS).is_err(),
            "sourced"
        );
        assert!(pools.set_no_split(c));
        assert!(
            t.bind("x", c, &mut pools, &heap, false, GROWS).is_err(),
            "no split"
        );
        t.bind("x", a, &mut pools, &heap, false, GROWS).unwrap();
        t.bind("x", a, &mut pools, &heap, false, GROWS).unwrap();
        assert_eq!(pools.use_count(a), 2, "the MemPool's hold and the tag's");
        assert!(
            t.bind("x", c, &mut pools, &heap, false, GROWS).is_err(),
            "another pool"
        );
        assert!(
            t.bind("y", a, &mut pools, &heap, false, GROWS).is_err(),
            "another tag"
        );
    }

    #[test]
    fn a_pause_saves_live_blocks_refuses_allocations_and_a_resume_restores_the_survivors() {
        let (mut t, mut pools, mut heap) = (
            SleepTags::default(),
            PrivatePools::default(),
            Heap::new(u64::MAX),
        );
        let mut live = LiveTable::default();
        let kv = t.pool_for("kv", &mut pools, &heap, GROWS).unwrap();
        let base = 0x1000_0000;
        let seg = segment(
            &mut heap,
            &mut pools,
            kv,
            base,
            &[(MIB, true), (2 * MIB, false), (4 * MIB, true)],
            &mut live,
        );
        assert_eq!(t.infos(&heap, &pools)[0].allocated_bytes, 5 * MIB);
        assert!(t.admit(kv, &pools).is_ok());
        let mut saved = Vec::new();
        t.begin_pause("kv", Backup::Host, &heap, &mut pools, &[seg], &mut |b| {
            saved.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(saved, vec![(base, MIB), (base + 3 * MIB, 4 * MIB)]);
        let key = heap.segment(seg).key();
        t.note_unmapped("kv", (key, Pool::Large), vec![(base, 8 * MIB)]);
        let report = t.pause_report("kv", 2);
        assert_eq!(
            (
                report.released_bytes,
                report.saved_bytes,
                report.streams_waited
            ),
            (8 * MIB, 5 * MIB, 2)
        );
        assert_eq!(t.paused_bytes(), 8 * MIB);
        assert!(matches!(t.admit(kv, &pools), Err(AllocError::Tag { .. })));
        assert!(!pools.releasable(key), "paused memory stays");
        assert!(t.for_pause("kv", &pools).is_err(), "already paused");
        let info = &t.infos(&heap, &pools)[0];
        assert!(info.paused && info.backup == Some(Backup::Host));

        // The first block is freed while paused: only the second comes back.
        live.remove(base);
        let still_live = |addr, size| live.get(addr).is_some_and(|id| heap.block(id).size == size);
        let (pool, paused) = t.for_resume("kv", &pools).unwrap();
        assert_eq!(pool, kv);
        let mut restored = Vec::new();
        let report = t
            .finish_resume("kv", &paused, 8 * MIB, &mut pools, still_live, &mut |b| {
                restored.extend_from_slice(b);
                Ok(())
            })
            .unwrap();
        assert_eq!(restored, vec![(base + 3 * MIB, 4 * MIB)]);
        assert_eq!(
            (report.mapped_bytes, report.restored_bytes),
            (8 * MIB, 4 * MIB)
        );
        assert!(t.admit(kv, &pools).is_ok() && t.paused_bytes() == 0);
        assert!(t.for_resume("kv", &pools).is_err(), "resumed once");
    }

    #[test]
    fn no_pause_or_resume_during_a_capture() {
        let (mut t, mut pools, heap) = (
            SleepTags::default(),
            PrivatePools::default(),
            Heap::new(u64::MAX),
        );
        t.pool_for("kv", &mut pools, &heap, GROWS).unwrap();
        assert!(t.for_pause("nope", &pools).is_err(), "unknown");
        pools.begin((5, 5));
        assert!(t.for_pause("kv", &pools).is_err());
        assert!(pools.end((5, 5)));
        assert!(t.for_pause("kv", &pools).is_ok());
    }

    #[test]
    fn backup_names_round_trip() {
        for b in [Backup::None, Backup::Host] {
            assert_eq!(Backup::parse(b.name()), Some(b));
        }
        assert_eq!(Backup::parse("cpu"), Some(Backup::Host));
        assert_eq!(Backup::parse("disk"), None);
    }
}
