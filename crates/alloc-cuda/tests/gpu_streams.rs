//! GPU tests of the streams the allocator hands to the driver: only
//! registered ones reach it, and a stream its owner drops while the cache
//! still holds its blocks lives on until they are gone. `#[ignore]`d like
//! the rest of the GPU suite: `cargo xtask test-gpu` runs them
//! (`--ignored --test-threads=1`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use alloc_core::{AllocatorConfig, GraphNode, MemoryBackend, StreamBackend, StreamId, MIB};
use alloc_cuda::cudarc::driver::{CudaContext, CudaStream};
use alloc_cuda::{stream_id, CudaAllocator, CudaMemory, CudaStreams, DeviceBuffer, StreamHandle};
use alloc_policy::AnyPolicy;
use common::{
    allocator, assert_drained, launch_spin_copy, new_stream, spin_copy_kernel, word_pattern,
    StreamGate,
};

/// A stream value no stream has.
const BOGUS: StreamId = StreamId(0xdead_beef);

/// Whether `alloc`'s stream backend holds stream `id`.
fn held(alloc: &CudaAllocator, id: StreamId) -> bool {
    alloc
        .diagnostics()
        .inspect(|e| e.streams().is_registered(id))
        .expect("lock")
}

/// X is allocated on stream S and read by a copy queued on S behind a
/// closed gate; X is freed and S dropped by its owner while the copy waits.
/// The allocator keeps S alive, so no new stream can take S's handle value
/// and be served X's cached block: eight new streams allocate X's size and
/// overwrite it at once, and the copy, once the gate opens, still reads
/// X's original contents. `empty_cache` then records on S where it needs
/// to; S goes only once the allocator holds nothing of it.
fn dropped_stream_keeps_its_cached_blocks_safe(config: &str) {
    const WORDS: usize = 5 << 20; // 20 MiB
    let alloc = allocator(config);
    let keep = new_stream(&alloc);
    let s = new_stream(&alloc);
    let s_id = stream_id(&s);
    let s_weak = Arc::downgrade(&s);
    let copy = spin_copy_kernel(&alloc);

    let original = word_pattern(WORDS, 0x5EED_0001);
    let x = alloc.alloc_from_host(&original, &s).unwrap();
    let mut y = alloc.alloc_zeros::<u32>(WORDS, &keep).unwrap();
    keep.synchronize().unwrap(); // Y is zeroed before S writes it
    y.record_stream(&s).unwrap(); // S's copy writes Y
    let gate = StreamGate::close(&s);
    launch_spin_copy(&s, &copy, &x, &mut y, Duration::ZERO);
    let copied = s.record_event(None).unwrap();
    let x_addr = x.device_address();
    drop(x); // cached for S; S's queued copy still reads it
    drop(s); // its owner's last reference
    assert!(held(&alloc, s_id), "[{config}] the allocator let S go");
    assert!(s_weak.upgrade().is_some(), "[{config}] S was destroyed");

    let mut others: Vec<(Arc<CudaStream>, DeviceBuffer<u32>, u8)> = Vec::new();
    for i in 0..8u8 {
        let t = new_stream(&alloc);
        assert_ne!(stream_id(&t), s_id, "[{config}] a new stream has S's value");
        let mut z = alloc.alloc::<u32>(WORDS, &t).unwrap();
        assert_ne!(
            z.device_address(),
            x_addr,
            "[{config}] a new stream got X's block"
        );
        z.fill_bytes(0xC0 + i).unwrap();
        others.push((t, z, 0xC0 + i));
    }
    assert!(!copied.is_complete(), "[{config}] the gate did not hold S");
    for (t, _, _) in &others {
        t.synchronize().unwrap(); // the fills are done before the copy runs
    }
    gate.open();
    copied.synchronize().unwrap();
    let out = y.copy_to_host().unwrap();
    if let Some(i) = out.iter().zip(&original).position(|(o, w)| o != w) {
        panic!(
            "[{config}] the copy differs from X's contents at word {i}: {:#x} != {:#x} \
             (X's block was reused under it)",
            out[i], original[i]
        );
    }
    for (_, z, value) in &others {
        let expected = u32::from_ne_bytes([*value; 4]);
        assert!(
            z.copy_to_host().unwrap().iter().all(|&w| w == expected),
            "[{config}] a new stream's buffer lost its fill"
        );
    }
    println!(
        "[{config}] S {s_id:#x} dropped with X cached at {x_addr:#x}: eight new streams \
         served elsewhere, the copy read X intact"
    );

    // X's segment goes back (recording on S where the engine needs to); S
    // stays held, since Y (alive) was recorded on it.
    alloc.empty_cache().unwrap();
    assert!(
        held(&alloc, s_id),
        "[{config}] S let go while Y is recorded on it"
    );
    drop(y); // records Y's event on S: the last use of S
    drop(others);
    alloc.empty_cache().unwrap();
    assert!(
        !held(&alloc, s_id),
        "[{config}] S still held with nothing of it"
    );
    assert!(
        s_weak.upgrade().is_none(),
        "[{config}] S not destroyed once let go"
    );
    assert_drained(&alloc);
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn a_dropped_stream_outlives_its_cached_blocks() {
    for config in [
        "",
        "expandable_segments:True",
        "expandable_segments:True,unmap_free_pages:True,unmap_page_mb:2",
    ] {
        dropped_stream_keeps_its_cached_blocks_safe(config);
    }
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn streams_created_and_dropped_by_the_hundred_are_let_go() {
    let alloc = allocator("");
    // 200 streams, each with a block cached: all held until empty_cache.
    let mut weak = Vec::new();
    for i in 0..200u64 {
        let s = new_stream(&alloc);
        weak.push(Arc::downgrade(&s));
        let p = alloc.malloc(4096 * (1 + i % 4), &s).unwrap();
        alloc.free(p).unwrap();
    }
    let alive = |weak: &[std::sync::Weak<CudaStream>]| {
        weak.iter().filter(|w| w.upgrade().is_some()).count()
    };
    let registered = || {
        alloc
            .diagnostics()
            .inspect(|e| e.streams().registered())
            .unwrap()
    };
    println!(
        "200 streams used once and dropped: {} held, {} alive",
        registered(),
        alive(&weak)
    );
    assert_eq!(registered(), 200);
    assert_eq!(alive(&weak), 200);
    alloc.empty_cache().unwrap();
    assert_eq!(registered(), 0);
    assert_eq!(alive(&weak), 0, "streams leaked");

    // 200 streams that only record a block of a long-lived stream: once the
    // block is freed nothing of them is left, and registrations let them go
    // as they come (the table stays small without an empty_cache).
    let main = new_stream(&alloc);
    weak.clear();
    let mut most = 0;
    for _ in 0..200 {
        let t = new_stream(&alloc);
        weak.push(Arc::downgrade(&t));
        let p = alloc.malloc(MIB, &main).unwrap();
        alloc.record_stream(p, &t).unwrap();
        alloc.free(p).unwrap(); // records the event on t: done with it
        most = most.max(registered());
    }
    println!(
        "200 recording streams: at most {most} held at once, {} of them still alive",
        alive(&weak)
    );
    assert!(most <= 17, "the stream table grew to {most}");
    assert!(alive(&weak) <= 17, "{} dropped streams alive", alive(&weak));
    main.synchronize().unwrap();
    drop(main);
    assert_drained(&alloc);
    assert_eq!(alive(&weak), 0);
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn only_registered_streams_reach_the_driver() {
    let ctx = CudaContext::new(0).unwrap();

    // The stream backend alone: a bogus id is refused before any driver call
    // (compute-sanitizer would report one that reached the driver).
    let mut streams = CudaStreams::new(ctx.clone());
    let e = streams.record(BOGUS).unwrap_err();
    assert!(e.to_string().contains("not registered"), "{e}");
    let s = ctx.new_stream().unwrap();
    let id = streams.register(&s).unwrap();
    assert_eq!(id, stream_id(&s));
    let event = streams.record(id).unwrap();
    let e = streams.make_stream_wait(BOGUS, &event).unwrap_err();
    assert!(e.to_string().contains("not registered"), "{e}");
    streams.make_stream_wait(id, &event).unwrap();
    streams.synchronize(&event).unwrap();
    streams.release(event);
    // Capture graphs: only registered streams, and only graph nodes read
    // from a capture still underway, reach the driver.
    let graph = streams
        .capture_graph()
        .expect("this driver reads capture graphs (CUDA 12.3 and later)");
    let e = graph.frontier(BOGUS).unwrap_err();
    assert!(e.to_string().contains("not registered"), "{e}");
    assert_eq!(graph.frontier(id).unwrap(), None, "S is not capturing");
    let e = graph
        .dependencies(GraphNode(0xdead_beef), &mut Vec::new())
        .unwrap_err();
    assert!(e.to_string().contains("was not read from a capture"), "{e}");

    // The memory backend frees only its own segments.
    let mut memory = CudaMemory::new(ctx.clone()).unwrap();
    let segment = memory.allocate(2 * MIB).unwrap();
    for (addr, size) in [(segment + 512, 2 * MIB), (segment, MIB), (BOGUS.0, 2 * MIB)] {
        let e = memory.free(addr, size).unwrap_err();
        assert!(e.to_string().contains("not a segment"), "{e}");
    }
    memory.free(segment, 2 * MIB).unwrap();
    assert!(memory.free(segment, 2 * MIB).is_err(), "freed twice");

    // An engine built from the public backends, driven with a bogus stream:
    // tagging blocks with it is harmless, making it wait is refused.
    let cfg = AllocatorConfig::parse("stream_wait_reuse:True").unwrap();
    let memory = CudaMemory::new(ctx.clone()).unwrap();
    let mut engine = AnyPolicy::engine(&cfg, memory, streams).unwrap();
    assert!(engine.streams_mut().record(BOGUS).is_err());
    // 12 MiB: a whole segment, so that only C's block can serve the next
    // request of the size on the bogus stream.
    let c = engine.malloc(12 * MIB, BOGUS).unwrap(); // a tag: no driver call
    engine.record_stream(c.addr, id).unwrap();
    // Hold S so that C's event is pending at the next malloc.
    let gate = StreamGate::close(&s);
    engine.free(c.addr).unwrap(); // C's event recorded on S (registered)
                                  // At the limit, so that the next request is served by a stream wait
                                  // rather than by a new segment.
    let reserved = engine.stats().reserved_bytes.all.current as f64;
    let capacity = engine.memory().capacity() as f64;
    engine.set_memory_fraction(reserved / capacity).unwrap();
    let e = engine.malloc(12 * MIB, BOGUS).unwrap_err();
    println!("stream wait on an unregistered stream: {e}");
    assert!(
        e.to_string()
            .contains("stream 0xdeadbeef is not registered"),
        "{e}"
    );
    assert_eq!(engine.awaiting_events(), 1, "C still awaits S's event");
    gate.open();
    s.synchronize().unwrap();
    engine.process_events().unwrap();
    assert_eq!(engine.awaiting_events(), 0);
    engine.empty_cache().unwrap();
    assert_eq!(engine.stats().reserved_bytes.all.current, 0);
    engine.validate().unwrap();
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn stream_handles_from_cudarc_and_from_raw_name_one_stream() {
    let alloc = allocator("");
    let s = new_stream(&alloc);
    let other = new_stream(&alloc);
    let handle = StreamHandle::new(&s);
    // SAFETY: `s` is a live stream of device 0's primary context, kept alive
    // (by `handle` and by `s`) past the allocator's last use of it: the
    // cache is emptied below before they go.
    let raw = unsafe { StreamHandle::from_raw(s.cu_stream()) };
    assert_eq!(handle.id(), raw.id());
    assert_eq!(handle.id(), stream_id(&s));
    assert!(handle.cudarc().is_some() && raw.cudarc().is_none());

    // The same stream through three argument kinds: one cache.
    let a = alloc.malloc(MIB, &s).unwrap();
    alloc.free(a).unwrap();
    let b = alloc.malloc(MIB, &handle).unwrap();
    assert_eq!(
        b, a,
        "the handle's request is served from the stream's cache"
    );
    alloc.free(b).unwrap();
    let c = alloc.malloc(MIB, &raw).unwrap();
    assert_eq!(c, a, "so is the raw handle's");
    assert_eq!(
        alloc.diagnostics().allocation(c).unwrap().unwrap().stream,
        handle.id()
    );
    // record_stream through a handle defers reuse as with a cudarc stream.
    alloc.record_stream(c, &StreamHandle::new(&other)).unwrap();
    let gate = StreamGate::close(&other);
    alloc.free(c).unwrap();
    assert_eq!(
        alloc.diagnostics().awaiting_events().unwrap(),
        1,
        "C waits for `other`"
    );
    let d = alloc.malloc(MIB, &raw).unwrap();
    assert_ne!(d, c, "C reused while `other` may use it");
    gate.open();
    other.synchronize().unwrap();
    alloc.process_events().unwrap();
    assert_eq!(alloc.diagnostics().awaiting_events().unwrap(), 0);
    alloc.free(d).unwrap();
    drop((handle, raw));
    assert_drained(&alloc);
}
