//! GPU tests of what sharing a block with another process needs (CUDA IPC):
//! the shared range of a live block and the export of expandable pages as
//! POSIX file descriptors. `#[ignore]`d like the rest of the GPU suite: run
//! with `cargo xtask test-gpu` (`--ignored --test-threads=1`). The
//! cross-process part (another process opening the handle, with gpualloc or
//! PyTorch's allocator) is python/tests/gpu_scenarios/ipc_share.py.

use alloc_core::MIB;
use alloc_cuda::{CudaAllocator, CudaError, SharedRange};

fn allocator(config: &str) -> CudaAllocator {
    CudaAllocator::with_config_str(0, config).expect("a CUDA device")
}

/// Open descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_cumemalloc_block_is_shared_with_its_whole_segment() {
    let alloc = allocator("");
    let stream = alloc.context().new_stream().expect("cuStreamCreate");
    let a = alloc.malloc(3 * MIB, &stream).unwrap();
    let b = alloc.malloc(3 * MIB, &stream).unwrap();
    for (ptr, at) in [(a, a), (b, b), (b + 100, b)] {
        let range = alloc
            .ipc()
            .shared_range(ptr)
            .unwrap()
            .expect("a live block");
        let SharedRange::Segment { base, size } = range else {
            panic!("expected a cuMemAlloc segment, got {range:?}");
        };
        assert!(
            base <= at && at + 3 * MIB <= base + size,
            "{range:?} {at:#x}"
        );
        assert!(!range.expandable());
    }
    let e = alloc.ipc().export_pages(a).unwrap_err();
    assert!(matches!(e, CudaError::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("cuIpcGetMemHandle"), "{e}");
    alloc.free(b).unwrap();
    let e = alloc.ipc().shared_range(b).unwrap_err();
    assert!(e.to_string().contains("not allocated"), "{e}");
    assert_eq!(alloc.ipc().shared_range(0x10).unwrap(), None);
    alloc.free(a).unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn expandable_pages_export_once_and_close_on_release() {
    let alloc = allocator("expandable_segments:True");
    let stream = alloc.context().new_stream().expect("cuStreamCreate");
    // Two blocks of the large pool: the second starts inside a page of the
    // first's and spans several pages.
    let a = alloc.malloc(3 * MIB, &stream).unwrap();
    let b = alloc.malloc(5 * MIB, &stream).unwrap();
    let baseline = open_fds();
    let range = alloc.ipc().shared_range(b).unwrap().expect("a live block");
    let SharedRange::Pages { first, page, count } = range else {
        panic!("expected expandable pages, got {range:?}");
    };
    assert!(page >= 2 * MIB && page.is_power_of_two(), "{range:?}");
    assert!(
        first <= b && b + 5 * MIB <= first + count * page,
        "{range:?}"
    );
    assert_eq!(first % page, 0);
    let pages = alloc.ipc().export_pages(b).unwrap().expect("pages");
    assert_eq!((pages.first, pages.page), (first, page));
    assert_eq!(pages.fds.len() as u64, count);
    for fd in &pages.fds {
        assert!(
            std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok(),
            "fd {fd} is not open"
        );
    }
    assert_eq!(
        open_fds(),
        baseline + pages.fds.len(),
        "one descriptor per page"
    );
    // Exported once: the same descriptors again, also for an interior pointer
    // and for the neighbour sharing the first page.
    assert_eq!(alloc.ipc().export_pages(b + 4096).unwrap().unwrap(), pages);
    let pa = alloc.ipc().export_pages(a).unwrap().unwrap();
    assert_eq!(
        pa.fds.last(),
        pages.fds.first(),
        "the shared page, one descriptor"
    );
    assert_eq!(open_fds(), baseline + pages.fds.len() + pa.fds.len() - 1);
    // Freed and given back: the descriptors are closed with the pages.
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    assert!(
        alloc.ipc().export_pages(b).is_err(),
        "a freed block cannot be shared"
    );
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.reserved_bytes().unwrap(), 0);
    assert_eq!(open_fds(), baseline, "descriptors closed with their pages");
}

#[test]
#[ignore = "needs a CUDA device"]
fn large_unmap_pages_share_in_their_own_page_size() {
    let alloc = allocator("expandable_segments:True,unmap_free_pages:True,unmap_page_mb:8");
    let stream = alloc.context().new_stream().expect("cuStreamCreate");
    let a = alloc.malloc(12 * MIB, &stream).unwrap();
    let pages = alloc.ipc().export_pages(a).unwrap().expect("pages");
    assert_eq!(pages.page, 8 * MIB);
    assert!(pages.first <= a && a + 12 * MIB <= pages.first + pages.fds.len() as u64 * 8 * MIB);
    // A small-pool block of the same allocator: the granularity's pages.
    let s = alloc.malloc(4096, &stream).unwrap();
    let small = alloc.ipc().export_pages(s).unwrap().expect("pages");
    assert_eq!(small.fds.len(), 1);
    assert!(small.page < 8 * MIB, "{small:?}");
    alloc.free(a).unwrap();
    alloc.free(s).unwrap();
    alloc.empty_cache().unwrap();
}
