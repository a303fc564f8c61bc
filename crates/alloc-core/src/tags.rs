//! Sleep tags: named private pools whose physical memory can be given back
//! (*paused*) and taken again at the same addresses (*resumed*), as
//! reinforcement-learning frameworks do when a trainer and an inference
//! engine take turns on one GPU. This module is the registry (tag names,
//! their pools, what a paused tag gave back); the engine's side is in
//! `engine/sleep.rs`.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::private_pool::PoolId;
use crate::types::SegmentKey;

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

/// Every tag of one engine, by name.
#[derive(Debug, Default)]
pub(crate) struct Tags {
    by_name: BTreeMap<String, Entry>,
    /// Tags created with a pool id of the engine's choosing.
    created: u64,
}

impl Tags {
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

    /// A pool id for a new tag, never handed out before.
    pub(crate) fn fresh_pool(&mut self) -> PoolId {
        self.created += 1;
        (0, TAG_POOL_BASE + self.created)
    }

    /// Registers `tag` with `pool`; the caller checked that neither exists.
    pub(crate) fn insert(&mut self, tag: &str, pool: PoolId) {
        self.by_name
            .insert(tag.to_string(), Entry { pool, paused: None });
    }

    /// What the paused `tag` gave back, or `None` if it is not paused.
    pub(crate) fn paused(&self, tag: &str) -> Option<&Paused> {
        self.by_name.get(tag)?.paused.as_ref()
    }

    /// The paused state of `tag`, for the pause in progress to fill in.
    pub(crate) fn paused_mut(&mut self, tag: &str) -> Option<&mut Paused> {
        self.by_name.get_mut(tag)?.paused.as_mut()
    }

    /// Marks `tag` paused with `paused` (replacing any earlier state).
    pub(crate) fn set_paused(&mut self, tag: &str, paused: Paused) {
        if let Some(e) = self.by_name.get_mut(tag) {
            e.paused = Some(paused);
        }
    }

    /// Marks `tag` resumed; returns what it had given back.
    pub(crate) fn take_paused(&mut self, tag: &str) -> Option<Paused> {
        self.by_name.get_mut(tag)?.paused.take()
    }

    /// Every tag with its pool, by name.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, PoolId, Option<&Paused>)> + '_ {
        self.by_name
            .iter()
            .map(|(name, e)| (name.as_str(), e.pool, e.paused.as_ref()))
    }

    /// Whether there is no tag at all (the engine's hooks skip work then).
    pub(crate) fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
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
    use crate::types::{CacheKey, PoolKind};

    #[test]
    fn registry_names_pools_and_paused_state() {
        let mut t = Tags::default();
        assert!(t.is_empty());
        let a = t.fresh_pool();
        let b = t.fresh_pool();
        assert_ne!(a, b);
        assert_eq!(
            a.0, 0,
            "one half of the pair is zero, as PyTorch's pool ids"
        );
        assert!(a.1 > TAG_POOL_BASE);
        t.insert("kv_cache", a);
        t.insert("weights", (0, 7));
        assert_eq!(t.pool("kv_cache"), Some(a));
        assert_eq!(t.tag_of((0, 7)), Some("weights"));
        assert_eq!(t.tag_of(b), None);
        assert!(t.paused("kv_cache").is_none());
        t.set_paused(
            "kv_cache",
            Paused {
                backup: Backup::Host,
                runs: vec![((CacheKey::default(), PoolKind::Large), 0x1000, 4096)],
                saved: vec![(0x1000, 512), (0x1200, 1024)],
            },
        );
        let p = t.paused("kv_cache").expect("paused");
        assert_eq!((p.bytes(), p.saved_bytes()), (4096, 1536));
        let names: Vec<_> = t.iter().map(|(n, _, p)| (n, p.is_some())).collect();
        assert_eq!(names, vec![("kv_cache", true), ("weights", false)]);
        assert!(t.take_paused("kv_cache").is_some());
        assert!(t.take_paused("kv_cache").is_none(), "resumed once");
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
