//! GPU tests of sleep tags (pause / resume) and of the pinned host pool.
//! `#[ignore]`d: run with `cargo xtask test-gpu` (or its bundle's run.sh,
//! which runs them again under compute-sanitizer memcheck).

mod common;

use std::time::{Duration, Instant};

use alloc_core::{human_bytes, AllocError, MIB};
use alloc_cuda::cudarc::driver::sys;
use alloc_cuda::{Backup, CudaAllocator, CudaError, PinnedAllocator};
use common::{
    allocator, launch_spin_copy, new_stream, spin_copy_kernel, under_sanitizer, word_pattern,
};

/// Device memory the driver reports free.
fn device_free(alloc: &CudaAllocator) -> u64 {
    alloc.diagnostics().mem_get_info().unwrap().0
}

/// Every setting a tag must work beside.
const CONFIGS: &[&str] = &[
    "",
    "expandable_segments:True",
    "expandable_segments:True,unmap_free_pages:True",
];

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn host_backup_keeps_contents_and_addresses_and_gives_memory_back() {
    for config in CONFIGS {
        let alloc = allocator(config);
        let stream = new_stream(&alloc);
        let kv = alloc.sleep().tag("kv_cache").unwrap();
        let words = [1usize, 700, 300 * 1024, 5 << 20, 64 << 20];
        let patterns: Vec<Vec<u32>> = words
            .iter()
            .enumerate()
            .map(|(i, &n)| word_pattern(n, i as u32 * 77 + 1))
            .collect();
        let bufs: Vec<_> = patterns
            .iter()
            .map(|p| kv.alloc_from_host(p, &stream).unwrap())
            .collect();
        let untagged = alloc.alloc_from_host(&patterns[3], &stream).unwrap();
        let freed_while_paused = kv.alloc::<u8>(3 * MIB as usize, &stream).unwrap();
        let addrs: Vec<u64> = bufs.iter().map(|b| b.device_address()).collect();
        stream.synchronize().unwrap();
        let free0 = device_free(&alloc);

        let report = kv.pause(Backup::Host).unwrap();
        let free1 = device_free(&alloc);
        let info = kv.info().unwrap();
        println!(
            "[{config}] paused: {} given back ({} saved, {} streams waited); cuMemGetInfo free \
             {} -> {}",
            human_bytes(report.released_bytes),
            human_bytes(report.saved_bytes),
            report.streams_waited,
            human_bytes(free0),
            human_bytes(free1)
        );
        assert!(info.paused && info.paused_bytes == report.released_bytes);
        assert!(
            report.released_bytes >= 4 * 64 * MIB,
            "[{config}] the 256 MiB block's pages"
        );
        assert!(
            free1 >= free0 + report.released_bytes - 2 * MIB,
            "[{config}] cuMemGetInfo shows the memory given back"
        );
        let err = kv.alloc::<u8>(1024, &stream).unwrap_err();
        assert!(
            matches!(err, CudaError::Alloc(AllocError::Tag { .. })),
            "{err}"
        );
        drop(freed_while_paused); // a free into a paused tag: bookkeeping only
        assert_eq!(
            untagged.copy_to_host().unwrap(),
            patterns[3],
            "untagged memory untouched"
        );

        let resumed = kv.resume().unwrap();
        let free2 = device_free(&alloc);
        println!(
            "[{config}] resumed: {} mapped, {} restored; cuMemGetInfo free {}",
            human_bytes(resumed.mapped_bytes),
            human_bytes(resumed.restored_bytes),
            human_bytes(free2)
        );
        assert_eq!(resumed.mapped_bytes, report.released_bytes);
        assert!(
            free2 + resumed.mapped_bytes <= free1 + 2 * MIB,
            "memory taken again"
        );
        for ((buf, want), addr) in bufs.iter().zip(&patterns).zip(&addrs) {
            assert_eq!(buf.device_address(), *addr, "[{config}] same address");
            assert!(
                buf.copy_to_host().unwrap() == *want,
                "[{config}] contents intact"
            );
        }
        drop((bufs, untagged));
        alloc.diagnostics().validate().unwrap().unwrap();
        alloc.empty_cache().unwrap();
        assert_eq!(
            alloc.reserved_bytes().unwrap(),
            0,
            "[{config}] all memory back"
        );
        let pinned = alloc.sleep().pinned_allocator().unwrap().stats().unwrap();
        assert_eq!(
            pinned.allocated_bytes, 0,
            "backups went back to the pinned cache"
        );
        assert!(pinned.cached_bytes >= report.saved_bytes);
        if !config.is_empty() {
            // The same blocks paused again (a new allocator, the same
            // process-wide pinned allocator): nothing new is pinned.
            assert!(pinned.cache_hits > 0, "[{config}] {pinned:?}");
        }
    }
    PinnedAllocator::global().unwrap().empty_cache().unwrap();
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn backup_none_gives_memory_back_and_blocks_are_usable_after_resume() {
    let alloc = allocator("expandable_segments:True");
    let stream = new_stream(&alloc);
    let kv = alloc.sleep().tag("kv").unwrap();
    let mut buf = kv.alloc_zeros::<u32>(32 << 20, &stream).unwrap(); // 128 MiB
    stream.synchronize().unwrap();
    let free0 = device_free(&alloc);
    let report = kv.pause(Backup::None).unwrap();
    assert_eq!(report.saved_bytes, 0);
    assert!(device_free(&alloc) >= free0 + 128 * MIB - 2 * MIB);
    assert_eq!(
        alloc
            .sleep()
            .pinned_allocator()
            .unwrap()
            .stats()
            .unwrap()
            .allocated_bytes,
        0
    );
    kv.resume().unwrap();
    // The contents are undefined; the block is mapped and writable again.
    let fresh = word_pattern(32 << 20, 5);
    buf.copy_from_host(&fresh).unwrap();
    assert!(buf.copy_to_host().unwrap() == fresh);
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn pause_waits_for_a_kernel_still_reading_a_tagged_block_and_no_other_stream() {
    const WORDS: usize = 16 << 20; // 64 MiB
    let alloc = allocator("");
    let (a, b, c) = (new_stream(&alloc), new_stream(&alloc), new_stream(&alloc));
    let kernel = spin_copy_kernel(&alloc);
    let kv = alloc.sleep().tag("weights").unwrap();
    let original = word_pattern(WORDS, 0xC0FF_EE00);
    let src = kv.alloc_from_host(&original, &a).unwrap();
    let mut dst = alloc.alloc_zeros::<u32>(WORDS, &b).unwrap();
    // An unrelated stream busy for longer: a device-wide wait would wait for it.
    let long_src = alloc.alloc_zeros::<u32>(1024, &c).unwrap();
    let mut long_dst = alloc.alloc_zeros::<u32>(1024, &c).unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    c.synchronize().unwrap();
    let mut src = src;
    src.record_stream(&b).unwrap(); // B reads the tagged block
    let spin = Duration::from_millis(500);
    launch_spin_copy(&c, &kernel, &long_src, &mut long_dst, 4 * spin);
    launch_spin_copy(&b, &kernel, &src, &mut dst, spin);

    let t0 = Instant::now();
    let report = kv.pause(Backup::None).unwrap();
    let waited = t0.elapsed();
    let b_done = b.record_event(None).unwrap().is_complete();
    let c_running = !c.record_event(None).unwrap().is_complete();
    println!(
        "pause took {:.0} ms while B's kernel read the tagged block ({} streams waited); B done \
         after it: {b_done}; unrelated stream C still running: {c_running}",
        waited.as_secs_f64() * 1e3,
        report.streams_waited
    );
    assert!(
        b_done,
        "the pause returned before the kernel reading the block finished"
    );
    if !under_sanitizer() {
        assert!(waited >= spin / 2, "the pause did not wait for the kernel");
        assert!(c_running, "the pause waited for an unrelated stream");
    }
    b.synchronize().unwrap();
    assert!(
        dst.copy_to_host().unwrap() == original,
        "the kernel read intact memory"
    );
    kv.resume().unwrap();
    c.synchronize().unwrap();
    drop((src, dst, long_src, long_dst));
    alloc.diagnostics().validate().unwrap().unwrap();
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn a_cuda_graph_over_a_tagged_pool_replays_after_pause_and_resume() {
    const WORDS: usize = 8 << 20; // 32 MiB
    for config in CONFIGS {
        let alloc = allocator(config);
        let stream = new_stream(&alloc);
        let kernel = spin_copy_kernel(&alloc);
        let tag = alloc.sleep().tag("graph").unwrap();
        let input = word_pattern(WORDS, 0x0600_0D00);
        let src = tag.alloc_from_host(&input, &stream).unwrap();
        let mut dst = tag.alloc_zeros::<u32>(WORDS, &stream).unwrap();
        stream.synchronize().unwrap();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        launch_spin_copy(&stream, &kernel, &src, &mut dst, Duration::ZERO);
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("a graph was captured");

        // Host backup: the input survives, the graph's addresses stay valid.
        dst.fill_bytes(0).unwrap();
        tag.pause(Backup::Host).unwrap();
        tag.resume().unwrap();
        graph.launch().unwrap();
        stream.synchronize().unwrap();
        assert!(
            dst.copy_to_host().unwrap() == input,
            "[{config}] replay after resume"
        );

        // No backup: contents undefined; re-initialised, the graph replays.
        tag.pause(Backup::None).unwrap();
        tag.resume().unwrap();
        let again = word_pattern(WORDS, 0x0600_0D01);
        let mut src = src;
        src.copy_from_host(&again).unwrap();
        graph.launch().unwrap();
        stream.synchronize().unwrap();
        assert!(
            dst.copy_to_host().unwrap() == again,
            "[{config}] replay, backup none"
        );
        drop(graph);
        drop((src, dst));
        alloc.diagnostics().validate().unwrap().unwrap();
    }
    PinnedAllocator::global().unwrap().empty_cache().unwrap();
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn double_pause_unknown_tag_and_allocation_while_paused_are_clear_errors() {
    let alloc = allocator("");
    let stream = new_stream(&alloc);
    let kv = alloc.sleep().tag("kv").unwrap();
    let buf = kv.alloc::<u8>(MIB as usize, &stream).unwrap();
    let e = alloc.sleep().resume("kv").unwrap_err();
    assert!(
        e.to_string().contains("sleep tag \"kv\" is not paused"),
        "{e}"
    );
    let e = alloc.sleep().pause("nope", Backup::Host).unwrap_err();
    assert!(
        e.to_string().contains("sleep tag \"nope\" is unknown"),
        "{e}"
    );
    let e = alloc.sleep().resume("nope").unwrap_err();
    assert!(e.to_string().contains("unknown"), "{e}");
    kv.pause(Backup::Host).unwrap();
    let e = kv.pause(Backup::Host).unwrap_err();
    assert!(e.to_string().contains("already paused"), "{e}");
    let e = kv.malloc(4096, &stream).unwrap_err();
    assert!(e.to_string().contains("is paused"), "{e}");
    println!("errors: {e}");
    kv.resume().unwrap();
    drop(buf);
    let buf = kv.alloc::<u8>(MIB as usize, &stream).unwrap(); // allowed again
    drop(buf);
    PinnedAllocator::global().unwrap().empty_cache().unwrap();
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn pinned_pool_caches_blocks_and_waits_for_streams_that_used_them() {
    let pool = PinnedAllocator::new(allocator("").context().clone());
    let mut a = pool.alloc(10 * MIB as usize).unwrap();
    assert!(
        a.as_slice().iter().all(|&b| b == 0),
        "a new block is zeroed"
    );
    a.as_mut_slice().fill(9);
    let ptr = a.as_ptr();
    drop(a);
    let b = pool.alloc(9 * MIB as usize).unwrap();
    assert_eq!(b.as_ptr(), ptr, "served from the cache");
    let s = pool.stats().unwrap();
    assert_eq!((s.host_allocs, s.cache_hits, s.requests), (1, 1, 2));
    drop(b);

    // A buffer an async copy reads is not reused before the copy ran.
    let alloc = allocator("");
    let stream = new_stream(&alloc);
    let kernel = spin_copy_kernel(&alloc);
    let busy_src = alloc.alloc_zeros::<u32>(1024, &stream).unwrap();
    let mut busy_dst = alloc.alloc_zeros::<u32>(1024, &stream).unwrap();
    let mut host = pool.alloc(10 * MIB as usize).unwrap();
    let mut dev = alloc.alloc::<u8>(10 * MIB as usize, &stream).unwrap();
    launch_spin_copy(
        &stream,
        &kernel,
        &busy_src,
        &mut busy_dst,
        Duration::from_millis(300),
    );
    host.as_mut_slice().fill(3);
    // SAFETY: a copy of the pinned bytes into the device buffer, queued on
    // `stream`; `host` records the stream, so its block is not reused
    // before the copy has run, and `dev` outlives the synchronize below.
    unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            dev.device_address(),
            host.as_ptr().cast(),
            host.len(),
            stream.cu_stream(),
        )
        .result()
        .unwrap();
    }
    host.record_stream(&stream);
    drop(host);
    let other = pool.alloc(10 * MIB as usize).unwrap();
    let pending = pool.stats().unwrap().pending_bytes;
    if !under_sanitizer() {
        assert_eq!(pending, 10 * MIB, "the block waits for the copy's stream");
        assert_ne!(other.as_ptr(), ptr, "not reused while the copy may run");
    }
    stream.synchronize().unwrap();
    assert!(dev.copy_to_host().unwrap().iter().all(|&b| b == 3));
    dev.fill_bytes(0).unwrap();
    drop((other, busy_src, busy_dst, dev));
    let _ = pool.alloc(MIB as usize).unwrap(); // polls: the pending block is cached
    assert_eq!(pool.stats().unwrap().pending_bytes, 0);
    pool.empty_cache().unwrap();
    assert_eq!(pool.stats().unwrap().cached_bytes, 0);
}
