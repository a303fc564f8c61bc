//! GPU test of `graph_capture_record_stream_reuse`: a CUDA graph captured
//! on two streams (fork, join) as PyTorch's
//! `TestMemPool.test_graph_capture_reclaim_2_streams` does. A block that the
//! forked stream reads is freed during the capture; allocated before the
//! join, its address is not reused; after the join it is. The replayed
//! graph shows the forked stream read intact data even though it spun
//! before reading while the first stream wrote the block allocated before
//! the join. With the option off the block waits for the end of the capture.
//! `#[ignore]`d: run with `cargo xtask test-gpu` (or its bundle's run.sh,
//! which runs it again under compute-sanitizer memcheck).

mod common;

use std::sync::Arc;
use std::time::Duration;

use alloc_core::PoolId;
use alloc_cuda::cudarc::driver::{result, sys, CudaFunction, CudaStream};
use alloc_cuda::CudaAllocator;
use common::{allocator, launch_spin_copy_raw, new_stream, spin_copy_kernel, word_pattern};

/// Words of each tensor (256 KiB: the small pool, as PyTorch's 8 floats).
const WORDS: usize = 64 << 10;
const BYTES: u64 = (WORDS * 4) as u64;
const GRAPH: PoolId = (41, 0);

/// Allocates a block for `stream` in the graph's pool.
fn empty(alloc: &CudaAllocator, stream: &Arc<CudaStream>) -> u64 {
    alloc.malloc_in_pool(BYTES, stream, Some(GRAPH)).unwrap()
}

/// Copies `src` to `dst` on `stream`, after spinning for `spin`.
fn copy(stream: &CudaStream, kernel: &CudaFunction, src: u64, dst: u64, spin: Duration) {
    // SAFETY: every address is a block of WORDS words that stays allocated
    // until the graph has run (the test frees them after synchronizing).
    unsafe { launch_spin_copy_raw(stream, kernel, src, dst, WORDS, spin) }
}

/// Writes `words` (WORDS of them) to the block at `addr`.
fn write(alloc: &CudaAllocator, addr: u64, words: &[u32]) {
    assert_eq!(words.len(), WORDS);
    alloc.context().bind_to_thread().unwrap();
    // SAFETY: `addr` is an allocated block of WORDS words, idle (the
    // caller synchronized its stream).
    unsafe { result::memcpy_htod_sync(addr, words) }.unwrap();
}

/// The WORDS words of the block at `addr`, once `stream` is done.
fn read(alloc: &CudaAllocator, stream: &CudaStream, addr: u64) -> Vec<u32> {
    let mut host = vec![0u32; WORDS];
    stream.synchronize().unwrap();
    alloc.context().bind_to_thread().unwrap();
    // SAFETY: `addr` is an allocated block of WORDS words, and the work
    // writing it is done.
    unsafe { result::memcpy_dtoh_sync(&mut host, addr) }.unwrap();
    host
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn a_block_freed_during_a_capture_is_reused_after_the_join_never_before() {
    for reuse in [true, false] {
        let alloc = allocator(&format!("graph_capture_record_stream_reuse:{reuse}"));
        let kernel = spin_copy_kernel(&alloc);
        let (s1, s2) = (new_stream(&alloc), new_stream(&alloc));
        let input = word_pattern(WORDS, 0x2057);
        let other = word_pattern(WORDS, 0x0DD);
        let src = alloc.malloc(BYTES, &s1).unwrap();
        let src_other = alloc.malloc(BYTES, &s1).unwrap();
        s1.synchronize().unwrap();
        write(&alloc, src, &input);
        write(&alloc, src_other, &other);

        alloc.pools().begin_allocate_to(GRAPH).unwrap();
        s1.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .unwrap();
        let sink1 = empty(&alloc, &s1);
        let data1 = empty(&alloc, &s1);
        copy(&s1, &kernel, src, data1, Duration::ZERO);
        // Fork: s2 spins, then reads data1 into a buffer of its own.
        s2.join(&s1).unwrap();
        let buf2 = empty(&alloc, &s2);
        copy(&s2, &kernel, data1, buf2, Duration::from_millis(20));
        alloc.record_stream(data1, &s2).unwrap();
        alloc.free(data1).unwrap();
        // Before the join: written on s1 while s2 may still read data1.
        let data2 = empty(&alloc, &s1);
        copy(&s1, &kernel, src_other, data2, Duration::ZERO);
        // Join s2 into s1, and a kernel on s1.
        s1.join(&s2).unwrap();
        copy(&s1, &kernel, buf2, sink1, Duration::ZERO);
        let data3 = empty(&alloc, &s1);
        copy(&s1, &kernel, src_other, data3, Duration::ZERO);
        let graph = s1
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("a graph was captured");
        alloc.pools().end_allocate_to(GRAPH).unwrap();

        println!(
            "graph_capture_record_stream_reuse:{reuse}: data1 {data1:#x}, data2 {data2:#x} \
             (before the join), data3 {data3:#x} (after it); blocks awaiting events after \
             the capture: {}",
            alloc.diagnostics().awaiting_events().unwrap()
        );
        assert_ne!(data2, data1, "[{reuse}] reused before the join");
        if reuse {
            assert_eq!(data3, data1, "not reused after the join");
            assert_eq!(alloc.diagnostics().awaiting_events().unwrap(), 0);
        } else {
            assert_ne!(
                data3, data1,
                "reused during the capture with the option off"
            );
            assert_eq!(alloc.diagnostics().awaiting_events().unwrap(), 1);
        }

        graph.launch().unwrap();
        assert!(
            read(&alloc, &s1, buf2) == input,
            "[{reuse}] s2 read intact data"
        );
        assert!(
            read(&alloc, &s1, sink1) == input,
            "[{reuse}] the join ordered s1"
        );
        assert!(
            read(&alloc, &s1, data3) == other,
            "[{reuse}] data3 written after"
        );
        drop(graph);
        for addr in [sink1, data2, data3, buf2, src, src_other] {
            alloc.free(addr).unwrap();
        }
        if !reuse {
            alloc.free(data1).unwrap_err(); // freed during the capture already
        }
        alloc.pools().release(GRAPH).unwrap();
        alloc.empty_cache().unwrap();
        alloc.diagnostics().validate().unwrap().unwrap();
        assert_eq!(alloc.reserved_bytes().unwrap(), 0);
    }
}
