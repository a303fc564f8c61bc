//! GPU tests of several allocators in one process: two per device (on a
//! machine with one GPU, the second instance on device 0 stands in for a
//! second device), used at once from their own threads, each refusing the
//! others' pointers and streams; device ordinals out of range; streams of
//! another context. `#[ignore]`d like the rest of the GPU suite:
//! `cargo xtask test-gpu` runs them (`--ignored --test-threads=1`).

mod common;

use std::sync::Arc;

use alloc_core::{AllocError, AllocatorConfig, KIB, MIB};
use alloc_cuda::cudarc::driver::{CudaContext, CudaStream};
use alloc_cuda::{AnyPolicy, CudaAllocator, CudaError, DeviceBuffer, MAX_DEVICES};
use common::{assert_drained, new_stream, pattern};

fn device_count() -> usize {
    CudaContext::device_count().expect("cuDeviceGetCount") as usize
}

/// Whether `e` is the engine's unknown-pointer error.
fn unknown_pointer(e: &CudaError) -> bool {
    matches!(e, CudaError::Alloc(AllocError::UnknownPointer { .. }))
}

/// One allocator with its stream, a typed buffer holding `data` and a raw
/// block.
struct Instance {
    alloc: CudaAllocator,
    stream: Arc<CudaStream>,
    buf: DeviceBuffer<u8>,
    data: Vec<u8>,
    raw: u64,
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn allocators_of_one_process_keep_their_blocks_apart() {
    let count = device_count();
    // Two independent allocators per device.
    let allocs: Vec<CudaAllocator> = (0..count)
        .flat_map(|d| [d, d])
        .map(|d| CudaAllocator::new(d, &AllocatorConfig::default()).unwrap())
        .collect();
    println!("{count} device(s): {} allocators", allocs.len());
    assert!(!allocs[0].same_allocator(&allocs[1]));

    // All at once, each from its own thread: allocate, fill, check, free.
    std::thread::scope(|scope| {
        for (i, alloc) in allocs.iter().enumerate() {
            scope.spawn(move || {
                let stream = new_stream(alloc);
                for k in 0..100usize {
                    let data = pattern(64 * KIB as usize * (1 + k % 8) + k, (i * 1000 + k) as u64);
                    let buf = alloc.alloc_from_host(&data, &stream).unwrap();
                    assert_eq!(
                        buf.copy_to_host().unwrap(),
                        data,
                        "allocator {i}, round {k}"
                    );
                }
            });
        }
    });

    // Then side by side: a buffer and a raw block in each.
    let instances: Vec<Instance> = allocs
        .iter()
        .enumerate()
        .map(|(i, alloc)| {
            let stream = new_stream(alloc);
            let data = pattern(3 * MIB as usize, 77 + i as u64);
            let buf = alloc.alloc_from_host(&data, &stream).unwrap();
            let raw = alloc.malloc(MIB, &stream).unwrap();
            Instance {
                alloc: alloc.clone(),
                stream,
                buf,
                data,
                raw,
            }
        })
        .collect();
    for (i, a) in instances.iter().enumerate() {
        let own = a.buf.device_address();
        // Its own buffer's block: only dropping the buffer frees it.
        let e = a.alloc.free(own).unwrap_err();
        assert!(matches!(e, CudaError::OwnedByBuffer { .. }), "{e}");
        for (j, b) in instances.iter().enumerate() {
            if i == j {
                continue;
            }
            // Unified addressing: no two allocators' blocks overlap.
            let (b_lo, b_hi) = (b.buf.device_address(), b.buf.device_address() + 3 * MIB);
            assert!(
                own + 3 * MIB <= b_lo || b_hi <= own,
                "allocators {i} and {j} overlap"
            );
            // The other allocator knows none of this one's pointers.
            for ptr in [own, a.raw] {
                assert!(b.alloc.diagnostics().allocation(ptr).unwrap().is_none());
                assert!(unknown_pointer(&b.alloc.free(ptr).unwrap_err()));
                let e = b.alloc.record_stream(ptr, &b.stream).unwrap_err();
                assert!(unknown_pointer(&e), "{e}");
            }
            // A stream of another device is refused (none on one GPU).
            if a.alloc.ordinal() != b.alloc.ordinal() {
                let e = b.alloc.malloc(MIB, &a.stream).unwrap_err();
                assert!(matches!(e, CudaError::WrongContext { .. }), "{e}");
                let e = b.alloc.record_stream(b.raw, &a.stream).unwrap_err();
                assert!(matches!(e, CudaError::WrongContext { .. }), "{e}");
            }
        }
        assert!(a.alloc.diagnostics().allocation(a.raw).unwrap().is_some());
        assert_eq!(
            a.buf.copy_to_host().unwrap(),
            a.data,
            "allocator {i}'s data"
        );
        assert_eq!(
            a.alloc.allocated_bytes().unwrap(),
            4 * MIB,
            "allocator {i} counts its own blocks only"
        );
    }
    println!("cross-allocator frees and record_stream refused; every buffer intact");
    for Instance {
        alloc, buf, raw, ..
    } in instances
    {
        drop(buf);
        alloc.free(raw).unwrap();
        assert_drained(&alloc);
    }
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn device_ordinals_out_of_range_are_errors() {
    let count = device_count();
    let default = AllocatorConfig::default();
    let out_of_range = |e: CudaError, ordinal: usize| {
        assert!(
            matches!(e, CudaError::InvalidDevice { ordinal: o, count: c } if o == ordinal && c == count),
            "device {ordinal}: {e}"
        );
    };
    out_of_range(CudaAllocator::new(count, &default).unwrap_err(), count);
    out_of_range(
        CudaAllocator::with_config_str(count + 7, "expandable_segments:True").unwrap_err(),
        count + 7,
    );
    let policy = AnyPolicy::from_config(&default).unwrap();
    out_of_range(
        CudaAllocator::with_policy(count, policy, &default).unwrap_err(),
        count,
    );
    if count < MAX_DEVICES {
        out_of_range(CudaAllocator::global(count).unwrap_err(), count);
    }
    out_of_range(CudaAllocator::global(MAX_DEVICES).unwrap_err(), MAX_DEVICES);
    out_of_range(CudaAllocator::global(usize::MAX).unwrap_err(), usize::MAX);
    println!(
        "{count} device(s): ordinals {count}, {}, {MAX_DEVICES} and usize::MAX refused",
        count + 7
    );
}

/// cudarc binds `cuCtxCreate` (non-primary contexts) up to CUDA 13.1.
#[cfg(not(any(
    feature = "cuda-13020",
    feature = "cuda-13030",
    feature = "cuda-13040",
    feature = "cuda-version-from-build-system"
)))]
#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn streams_of_another_context_are_refused() {
    use alloc_cuda::{CudaStreams, StreamHandle};

    let alloc = CudaAllocator::with_config_str(0, "").unwrap();
    let stream = new_stream(&alloc);
    let mut buf = alloc.alloc::<u8>(4096, &stream).unwrap();
    buf.fill_bytes(9).unwrap();
    let raw = alloc.malloc(MIB, &stream).unwrap();

    let foreign_ctx = CudaContext::new_non_primary(0, 0).unwrap();
    let foreign = foreign_ctx.new_stream().unwrap();
    let wrong = |e: CudaError| {
        assert!(
            matches!(e, CudaError::WrongContext { ordinal: 0 }),
            "expected WrongContext, got {e}"
        );
    };
    wrong(alloc.malloc(MIB, &foreign).unwrap_err());
    wrong(alloc.alloc::<u8>(16, &foreign).unwrap_err());
    wrong(buf.record_stream(&foreign).unwrap_err());
    wrong(
        alloc
            .record_stream(raw, &StreamHandle::new(&foreign))
            .unwrap_err(),
    );
    let mut streams = CudaStreams::new(alloc.context().clone());
    wrong(streams.register(&foreign).unwrap_err());
    assert_eq!(streams.registered(), 0);
    assert_eq!(
        alloc.allocated_bytes().unwrap(),
        MIB + 4096,
        "nothing allocated by the refused calls"
    );
    drop((foreign, foreign_ctx));

    // The allocator is unharmed.
    assert!(buf.copy_to_host().unwrap().iter().all(|&b| b == 9));
    drop(buf);
    alloc.free(raw).unwrap();
    println!("a stream of a non-primary context on device 0: WrongContext on every path");
    assert_drained(&alloc);
}

/// The allocator checks a cudarc stream's context once and then knows it by
/// the address of its `CudaStream`, while it holds the stream. Once the
/// stream is let go (`empty_cache`) and destroyed, a stream of another
/// context made in its place (at the same address, as the heap mostly
/// hands it out) is checked again and refused. (Needs `cuCtxCreate`, which
/// cudarc binds up to CUDA 13.1, as above.)
#[cfg(not(any(
    feature = "cuda-13020",
    feature = "cuda-13030",
    feature = "cuda-13040",
    feature = "cuda-version-from-build-system"
)))]
#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn a_stream_in_the_place_of_one_let_go_is_checked_again() {
    let alloc = CudaAllocator::with_config_str(0, "").unwrap();
    let foreign_ctx = CudaContext::new_non_primary(0, 0).unwrap();
    let rounds = 16;
    let mut same_place = 0;
    for _ in 0..rounds {
        let stream = new_stream(&alloc);
        let place = Arc::as_ptr(&stream) as usize;
        let p = alloc.malloc(MIB, &stream).unwrap();
        alloc.free(alloc.malloc(MIB, &stream).unwrap()).unwrap(); // known now
        alloc.free(p).unwrap();
        drop(stream);
        alloc.empty_cache().unwrap(); // lets the stream go: destroyed here
        let foreign = foreign_ctx.new_stream().unwrap();
        same_place += usize::from(Arc::as_ptr(&foreign) as usize == place);
        let e = alloc.malloc(MIB, &foreign).unwrap_err();
        assert!(
            matches!(e, CudaError::WrongContext { ordinal: 0 }),
            "expected WrongContext, got {e}"
        );
    }
    println!(
        "{same_place} of {rounds} streams of another context took the place of a stream let go: \
         all refused"
    );
    assert_drained(&alloc);
}

/// `expandable_segments:True` (here through the name `bound`) where the
/// device lacks virtual memory management gives ordinary segments, as
/// PyTorch does, never an allocator that fails every call. Over the null
/// driver, which has none (`null-driver/run.sh --tests`), the fallback is
/// taken; on a GPU with it, segments grow.
#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn expandable_segments_fall_back_to_ordinary_segments_without_virtual_memory() {
    let alloc = CudaAllocator::with_config_str(0, "bound").unwrap();
    let (grows, fallback) = alloc
        .diagnostics()
        .inspect(|e| (e.expandable(), e.expandable_fallback()))
        .unwrap();
    assert_ne!(grows, fallback);
    let stream = new_stream(&alloc);
    let a = alloc.malloc(3 * MIB, &stream).unwrap();
    let b = alloc.malloc(30 * MIB, &stream).unwrap();
    if fallback {
        // PyTorch's plain rules: a 20 MiB segment for the small request,
        // one of its own size for the large.
        assert_eq!(alloc.reserved_bytes().unwrap(), 50 * MIB);
    }
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    // Asked for again at run time: accepted, the same segments.
    alloc.update_settings("expandable_segments:True").unwrap();
    alloc.free(alloc.malloc(5 * MIB, &stream).unwrap()).unwrap();
    println!(
        "device {}: {}",
        0,
        if fallback {
            "no virtual memory management, ordinary segments"
        } else {
            "segments grow"
        }
    );
    assert_drained(&alloc);
}
