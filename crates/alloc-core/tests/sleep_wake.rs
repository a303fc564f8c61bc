//! Sleep tags on the simulated device: pause gives a tag's pages back and
//! keeps its addresses, resume maps them again at the same addresses; the
//! waits, backups, errors and statistics around them.

use std::cell::RefCell;

use alloc_core::{
    AllocError, AllocatorConfig, Backup, Engine, SimMemory, SimStreams, StreamBackend, StreamId,
    GIB, MIB,
};
use alloc_policy::AnyPolicy;

type SimEngine = Engine<AnyPolicy, SimMemory, SimStreams>;

fn engine(config: &str, capacity: u64) -> SimEngine {
    let cfg = AllocatorConfig::parse(config).expect("test config parses");
    AnyPolicy::engine(&cfg, SimMemory::new(capacity), SimStreams::new()).expect("policy builds")
}

/// A saver or restorer that records the ranges it was given.
fn recorder(
    log: &RefCell<Vec<(u64, u64)>>,
) -> impl FnMut(&[(u64, u64)]) -> Result<(), alloc_core::BackendError> + '_ {
    move |ranges| {
        log.borrow_mut().extend_from_slice(ranges);
        Ok(())
    }
}

fn nothing(_: &[(u64, u64)]) -> Result<(), alloc_core::BackendError> {
    Ok(())
}

fn reserved(e: &SimEngine) -> i64 {
    e.stats().reserved_bytes.all.current
}

const CONFIGS: &[&str] = &[
    "",
    "expandable_segments:True",
    "expandable_segments:True,unmap_free_pages:True",
    "expandable_segments:True,unmap_free_pages:True,stream_wait_reuse:true",
];

#[test]
fn resume_keeps_every_address_and_paused_pages_are_not_reserved() {
    for config in CONFIGS {
        let mut e = engine(config, 8 * GIB);
        let kv = e.tag_pool("kv_cache").unwrap();
        assert_eq!(e.tag_pool("kv_cache").unwrap(), kv, "one pool per tag");
        let untagged = e.malloc(100 * MIB, StreamId(1)).unwrap();
        let sizes = [4 * MIB, 3 * MIB + 17, 512, 700 * 1024, 64 * MIB];
        let blocks: Vec<_> = sizes
            .iter()
            .map(|&s| e.malloc_in(s, StreamId(1), Some(kv)).unwrap())
            .collect();
        let on_other_stream = e.malloc_in(8 * MIB, StreamId(2), Some(kv)).unwrap();
        e.assert_valid();
        let (used, res) = (e.memory().used(), reserved(&e));
        let before = e.tags()[0].clone();
        assert!(!before.paused && before.reserved_bytes > 0);
        assert_eq!(
            before.segments, 3,
            "[{config}] small and large on stream 1, large on 2"
        );

        let report = e.pause_tag("kv_cache", Backup::None, &mut nothing).unwrap();
        e.assert_valid();
        assert_eq!(report.released_bytes, before.reserved_bytes, "[{config}]");
        assert_eq!(report.saved_bytes, 0);
        assert_eq!(
            e.memory().used(),
            used - report.released_bytes,
            "[{config}] device"
        );
        assert_eq!(
            reserved(&e),
            res - report.released_bytes as i64,
            "[{config}] stats"
        );
        let info = e.tags()[0].clone();
        assert!(info.paused && info.backup == Some(Backup::None));
        assert_eq!(info.paused_bytes, report.released_bytes);
        assert_eq!(info.reserved_bytes, 0);
        assert_eq!(
            info.allocated_bytes, before.allocated_bytes,
            "blocks stay allocated"
        );
        assert_eq!(e.paused_bytes(), report.released_bytes);
        assert_eq!(e.allocation(untagged.addr).unwrap().addr, untagged.addr);

        let report = e.resume_tag("kv_cache", &mut nothing).unwrap();
        e.assert_valid();
        assert_eq!(report.mapped_bytes, info.paused_bytes);
        assert_eq!(
            e.memory().used(),
            used,
            "[{config}] the same memory is taken again"
        );
        assert_eq!(reserved(&e), res);
        for b in blocks.iter().chain([&on_other_stream]) {
            let now = e
                .allocation(b.addr)
                .expect("still allocated at its address");
            assert_eq!((now.addr, now.size), (b.addr, b.size));
            assert!(e.memory().is_accessible(b.addr, b.size), "mapped again");
        }
        assert_eq!(e.tags()[0].paused_bytes, 0);
        for b in blocks.iter().chain([&on_other_stream, &untagged]) {
            e.free(b.addr).unwrap();
        }
        e.empty_cache().unwrap();
        assert_eq!(
            e.memory().used(),
            0,
            "[{config}] a resumed tag's cache goes back"
        );
        e.assert_valid();
    }
}

#[test]
fn paused_tags_refuse_allocations_accept_frees_and_state_errors_are_clear() {
    let mut e = engine("", 4 * GIB);
    let kv = e.tag_pool("kv").unwrap();
    let a = e.malloc_in(10 * MIB, StreamId(0), Some(kv)).unwrap();
    let b = e.malloc_in(10 * MIB, StreamId(0), Some(kv)).unwrap();
    let err = e.resume_tag("kv", &mut nothing).unwrap_err();
    assert!(err.to_string().contains("\"kv\" is not paused"), "{err}");
    let err = e
        .pause_tag("weights", Backup::None, &mut nothing)
        .unwrap_err();
    assert!(
        matches!(&err, AllocError::Tag { tag, .. } if tag == "weights"),
        "{err}"
    );
    assert!(err.to_string().contains("unknown"), "{err}");
    let err = e.resume_tag("weights", &mut nothing).unwrap_err();
    assert!(err.to_string().contains("unknown"), "{err}");

    e.pause_tag("kv", Backup::None, &mut nothing).unwrap();
    let err = e.pause_tag("kv", Backup::None, &mut nothing).unwrap_err();
    assert!(err.to_string().contains("already paused"), "{err}");
    let err = e.malloc_in(MIB, StreamId(0), Some(kv)).unwrap_err();
    assert!(matches!(err, AllocError::Tag { .. }), "{err}");
    assert!(
        err.to_string().contains("resume it before allocating"),
        "{err}"
    );
    let used = e.memory().used();
    e.free(a.addr).unwrap(); // bookkeeping only
    assert_eq!(
        e.memory().used(),
        used,
        "a free into a paused tag maps nothing"
    );
    assert_eq!(
        e.free(a.addr).unwrap_err(),
        AllocError::DoubleFree { addr: a.addr }
    );
    e.empty_cache().unwrap(); // never releases a paused tag's ranges
    e.assert_valid();
    let c = e.malloc(10 * MIB, StreamId(0)).unwrap(); // untagged memory is unaffected
    e.resume_tag("kv", &mut nothing).unwrap();
    e.assert_valid();
    assert_eq!(e.allocation(b.addr).unwrap().addr, b.addr);
    let again = e.malloc_in(10 * MIB, StreamId(0), Some(kv)).unwrap();
    assert_eq!(
        again.addr, a.addr,
        "the freed block is cached at its address"
    );
    for x in [b.addr, again.addr, c.addr] {
        e.free(x).unwrap();
    }
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0);
}

#[test]
fn pause_waits_for_the_tags_streams_only() {
    let mut e = engine("expandable_segments:True,unmap_free_pages:True", 4 * GIB);
    let kv = e.tag_pool("kv").unwrap();
    let (compute, copy, unrelated) = (StreamId(1), StreamId(2), StreamId(3));
    let x = e.malloc_in(32 * MIB, compute, Some(kv)).unwrap();
    let y = e.malloc_in(32 * MIB, compute, Some(kv)).unwrap();
    e.record_stream(x.addr, copy).unwrap();
    let z = e.malloc_in(4 * MIB, compute, Some(kv)).unwrap();
    e.record_stream(z.addr, StreamId(4)).unwrap();
    e.free(z.addr).unwrap(); // awaits an event on stream 4
    assert_eq!(e.awaiting_events(), 1);
    let other = e.malloc(16 * MIB, unrelated).unwrap();
    e.record_stream(other.addr, StreamId(5)).unwrap();
    e.free(other.addr).unwrap(); // awaits an event on stream 5: not the tag's
    let pending = e.streams_mut().record(unrelated).unwrap();

    let report = e.pause_tag("kv", Backup::None, &mut nothing).unwrap();
    assert_eq!(
        report.streams_waited, 3,
        "compute, copy (record_stream) and 4 (a pending free)"
    );
    assert_eq!(
        e.awaiting_events(),
        1,
        "the tag's awaiting block went back to its cache"
    );
    assert!(
        !e.streams_mut().is_complete(&pending).unwrap(),
        "the unrelated stream was not waited for"
    );
    e.streams_mut().release(pending);
    e.assert_valid();
    e.resume_tag("kv", &mut nothing).unwrap();
    for a in [x.addr, y.addr] {
        e.free(a).unwrap();
    }
    e.streams_mut().complete_all();
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0);
    e.assert_valid();
}

#[test]
fn pause_waits_for_a_stream_up_to_now_not_only_to_an_earlier_free() {
    // A block of the segment of stream 1, used and freed on stream 2, leaves
    // an event on stream 2 from the time of the free; stream 2 also has a
    // segment of its own whose blocks later work still uses.
    let mut e = engine("", 4 * GIB);
    let kv = e.tag_pool("kv").unwrap();
    let (one, two) = (StreamId(1), StreamId(2));
    let a = e.malloc_in(8 * MIB, one, Some(kv)).unwrap();
    let b = e.malloc_in(8 * MIB, two, Some(kv)).unwrap();
    e.record_stream(a.addr, two).unwrap();
    e.free(a.addr).unwrap();
    let later_work = e.streams_mut().record(two).unwrap(); // reads b after the free
    e.pause_tag("kv", Backup::None, &mut nothing).unwrap();
    assert!(
        e.streams_mut().is_complete(&later_work).unwrap(),
        "the pause waited only for the free's event on stream 2"
    );
    e.streams_mut().release(later_work);
    e.resume_tag("kv", &mut nothing).unwrap();
    e.free(b.addr).unwrap();
    e.assert_valid();
}

#[test]
fn host_backup_saves_live_blocks_and_restores_those_still_allocated() {
    let mut e = engine("", 4 * GIB);
    let w = e.tag_pool("weights").unwrap();
    let a = e.malloc_in(3 * MIB, StreamId(0), Some(w)).unwrap();
    let b = e.malloc_in(1000, StreamId(0), Some(w)).unwrap();
    let c = e.malloc_in(40 * MIB, StreamId(0), Some(w)).unwrap();
    let freed = e.malloc_in(5 * MIB, StreamId(0), Some(w)).unwrap();
    e.free(freed.addr).unwrap();
    let saved = RefCell::new(Vec::new());
    let report = e
        .pause_tag("weights", Backup::Host, &mut recorder(&saved))
        .unwrap();
    let mut want = vec![(a.addr, a.size), (b.addr, b.size), (c.addr, c.size)];
    want.sort();
    let mut got = saved.borrow().clone();
    got.sort();
    assert_eq!(got, want, "exactly the live blocks, whole");
    assert_eq!(report.saved_bytes, a.size + b.size + c.size);
    assert_eq!(e.tags()[0].backed_up_bytes, report.saved_bytes);
    assert_eq!(e.tags()[0].backup, Some(Backup::Host));

    e.free(b.addr).unwrap(); // freed while paused: nothing to restore
    let restored = RefCell::new(Vec::new());
    let report = e.resume_tag("weights", &mut recorder(&restored)).unwrap();
    let mut got = restored.borrow().clone();
    got.sort();
    let mut want = vec![(a.addr, a.size), (c.addr, c.size)];
    want.sort();
    assert_eq!(got, want);
    assert_eq!(report.restored_bytes, a.size + c.size);
    for (addr, size) in want {
        assert!(e.memory().is_accessible(addr, size));
    }
    e.assert_valid();
}

#[test]
fn resume_frees_other_cache_when_the_device_is_full_and_fails_cleanly_otherwise() {
    let mut e = engine("", GIB);
    let kv = e.tag_pool("kv").unwrap();
    let a = e.malloc_in(600 * MIB, StreamId(0), Some(kv)).unwrap();
    e.pause_tag("kv", Backup::None, &mut nothing).unwrap();
    // The trainer's turn: its memory is freed but stays cached.
    let t = e.malloc(700 * MIB, StreamId(0)).unwrap();
    e.free(t.addr).unwrap();
    assert!(e.memory().used() >= 700 * MIB);
    e.resume_tag("kv", &mut nothing).unwrap();
    assert!(e.memory().is_accessible(a.addr, a.size));
    e.assert_valid();

    // Live memory that cannot go: the resume fails and the tag stays paused.
    e.pause_tag("kv", Backup::None, &mut nothing).unwrap();
    let live = e.malloc(700 * MIB, StreamId(0)).unwrap();
    let used = e.memory().used();
    let err = e.resume_tag("kv", &mut nothing).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err}");
    assert!(e.tags()[0].paused, "still paused");
    assert_eq!(e.memory().used(), used, "nothing stays mapped");
    e.assert_valid();
    e.free(live.addr).unwrap();
    e.resume_tag("kv", &mut nothing).unwrap();
    assert_eq!(e.allocation(a.addr).unwrap().addr, a.addr);
    e.assert_valid();
}

#[test]
fn tags_bind_existing_pools_and_show_in_snapshots() {
    let mut e = engine("expandable_segments:True", 4 * GIB);
    let pool = (0, 5); // a MemPool made by PyTorch, held once
    e.retain_pool(pool);
    e.bind_tag("rollout", pool).unwrap();
    e.bind_tag("rollout", pool).unwrap(); // the same binding again
    assert!(e.bind_tag("rollout", (0, 6)).is_err());
    assert!(e.bind_tag("other", pool).is_err(), "a pool has one tag");
    assert_eq!(e.tag_of_pool(pool), Some("rollout"));
    e.begin_allocate_to_pool(pool); // the region's routing
    let a = e.malloc_in(30 * MIB, StreamId(0), Some(pool)).unwrap();
    e.end_allocate_to_pool(pool).unwrap();
    e.release_pool(pool).unwrap();
    assert!(e.set_pool_no_split(pool).is_err());
    let with_segments = (0, 8);
    e.begin_allocate_to_pool(with_segments);
    e.malloc_in(MIB, StreamId(0), Some(with_segments)).unwrap();
    e.end_allocate_to_pool(with_segments).unwrap();
    assert!(
        e.bind_tag("late", with_segments).is_err(),
        "its segments may not be growable"
    );

    e.pause_tag("rollout", Backup::None, &mut nothing).unwrap();
    let snap = e.snapshot();
    let tagged: Vec<_> = snap
        .segments
        .iter()
        .filter(|s| s.tag.as_deref() == Some("rollout"))
        .collect();
    assert_eq!(tagged.len(), 1);
    assert!(tagged[0].paused && tagged[0].private_pool == Some(pool));
    assert!(snap
        .segments
        .iter()
        .filter(|s| s.tag.is_none())
        .all(|s| !s.paused));
    assert_eq!(tagged[0].blocks[0].address, a.addr);
    let json = serde_json::to_string(&snap).unwrap();
    assert!(json.contains("\"tag\":\"rollout\"") && json.contains("\"paused\":true"));
    e.resume_tag("rollout", &mut nothing).unwrap();
    assert!(!e.snapshot().segments.iter().any(|s| s.paused));
}

#[test]
fn a_resumed_tags_idle_memory_follows_the_ordinary_rules() {
    // Free pages of a tag's pool are unmapped like any other's, and an idle
    // tag's segments go back on empty_cache; a graph held pool's are kept.
    let mut e = engine("expandable_segments:True,unmap_free_pages:True", 4 * GIB);
    let kv = e.tag_pool("kv").unwrap();
    let a = e.malloc_in(64 * MIB, StreamId(0), Some(kv)).unwrap();
    e.free(a.addr).unwrap();
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0, "an idle tag's cache goes back");
    e.begin_allocate_to_pool(kv); // a graph captured into the tag's pool
    let b = e.malloc_in(64 * MIB, StreamId(0), Some(kv)).unwrap();
    e.free(b.addr).unwrap(); // an intermediate the graph replays into
    e.end_allocate_to_pool(kv).unwrap();
    e.empty_cache().unwrap();
    assert!(
        e.memory().used() >= 64 * MIB,
        "the graph's pool keeps its memory"
    );
    e.pause_tag("kv", Backup::None, &mut nothing).unwrap();
    assert_eq!(e.memory().used(), 0, "pause gives it back all the same");
    e.resume_tag("kv", &mut nothing).unwrap();
    assert!(
        e.memory().is_accessible(b.addr, b.size),
        "where the graph expects it"
    );
    e.release_pool(kv).unwrap(); // the graph is gone
    e.empty_cache().unwrap();
    assert_eq!(e.memory().used(), 0);
    e.assert_valid();
}

#[test]
fn tags_need_growable_segments() {
    let mut e = engine("policy:buddy", GIB);
    let err = e.tag_pool("kv").unwrap_err();
    assert!(err.to_string().contains("growable segments"), "{err}");
    let mut e = engine("", GIB);
    assert!(e.tag_pool("").is_err(), "a tag needs a name");
}

/// A small xorshift generator: the random test below needs no crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn random_operations_keep_tagged_blocks_at_their_addresses_and_the_invariants() {
    for (seed, config) in CONFIGS.iter().enumerate() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ seed as u64);
        let mut e = engine(config, 16 * GIB);
        let tags = ["kv", "weights"];
        let pools: Vec<_> = tags.iter().map(|t| e.tag_pool(t).unwrap()).collect();
        // Live blocks: (addr, size, tag index or None).
        let mut live: Vec<(u64, u64, Option<usize>)> = Vec::new();
        let mut paused = [false; 2];
        for step in 0..2000 {
            let stream = StreamId(rng.below(3));
            match rng.below(10) {
                0..=3 => {
                    let max = if rng.below(4) == 0 { 64 * MIB } else { 2 * MIB };
                    let size = 1 + rng.below(max);
                    let tag = match rng.below(3) {
                        2 => None,
                        t => Some(t as usize),
                    };
                    match e.malloc_in(size, stream, tag.map(|t| pools[t])) {
                        Ok(a) => {
                            assert!(tag.is_none_or(|t| !paused[t]), "allocated while paused");
                            live.push((a.addr, a.size, tag));
                        }
                        Err(AllocError::Tag { .. }) => assert!(tag.is_some_and(|t| paused[t])),
                        Err(err) => panic!("[{config}] step {step}: {err}"),
                    }
                }
                4..=6 if !live.is_empty() => {
                    let (addr, _, _) = live.swap_remove(rng.below(live.len() as u64) as usize);
                    if rng.below(4) == 0 {
                        e.record_stream(addr, StreamId(7)).unwrap();
                    }
                    e.free(addr).unwrap();
                }
                7 => {
                    let t = rng.below(2) as usize;
                    let backup = if rng.below(2) == 0 {
                        Backup::None
                    } else {
                        Backup::Host
                    };
                    let saved = RefCell::new(Vec::new());
                    let r = e.pause_tag(tags[t], backup, &mut recorder(&saved));
                    assert_eq!(r.is_ok(), !paused[t], "[{config}] step {step}: {r:?}");
                    if r.is_ok() && backup == Backup::Host {
                        let mut want: Vec<(u64, u64)> = live
                            .iter()
                            .filter(|b| b.2 == Some(t))
                            .map(|b| (b.0, b.1))
                            .collect();
                        want.sort();
                        let mut got = saved.into_inner();
                        got.sort();
                        assert_eq!(got, want, "[{config}] step {step}: saved blocks");
                    }
                    paused[t] = true;
                }
                8 => {
                    let t = rng.below(2) as usize;
                    let r = e.resume_tag(tags[t], &mut nothing);
                    assert_eq!(r.is_ok(), paused[t], "[{config}] step {step}: {r:?}");
                    paused[t] = false;
                }
                _ => e.streams_mut().complete_stream(StreamId(rng.below(3))),
            }
            e.assert_valid();
            for &(addr, size, tag) in &live {
                let block = e.allocation(addr).expect("a live block stays allocated");
                assert_eq!(block.size, size, "[{config}] step {step}");
                let mapped = e.memory().is_accessible(addr, size);
                assert_eq!(
                    mapped,
                    !tag.is_some_and(|t| paused[t]),
                    "[{config}] step {step}"
                );
            }
        }
        e.streams_mut().complete_all();
        for t in 0..2 {
            if paused[t] {
                e.resume_tag(tags[t], &mut nothing).unwrap();
            }
        }
        for (addr, _, _) in live {
            e.free(addr).unwrap();
        }
        e.streams_mut().complete_all();
        e.empty_cache().unwrap();
        assert_eq!(e.memory().used(), 0, "[{config}] everything goes back");
        e.assert_valid();
    }
}
