//! Entry points for sharing a block with another process (CUDA IPC), used
//! by the C++ bridge to write PyTorch's IPC handles (`shareIpcHandle`,
//! `getBaseAllocation`):
//!
//! - [`gpualloc_block_segment`]: the memory shared for a live block: its
//!   `cuMemAlloc` segment (PyTorch's `'c'` handle: `cudaIpcGetMemHandle` of
//!   the base), or the whole pages of an expandable segment under it (`'e'`).
//! - [`gpualloc_export_pages`]: those pages as POSIX file descriptors of
//!   this process, which the receiver duplicates with `pidfd_getfd`. Each
//!   page is exported once and its descriptor stays open until the page's
//!   memory is released, as PyTorch keeps them.
//!
//! `device` is where to look first; the other devices in use are searched
//! too (-1: all of them), so a pointer of any device is found.

use std::ffi::{c_int, c_void};

use alloc_cuda::{AnyPolicy, CudaAllocator, CudaError, Ipc};

use crate::state::{self, CtxGuard, FfiError, FfiResult};

/// The allocators to search for a pointer: `device` first (when valid and
/// in use), then every other one in use.
fn search_order(device: c_int) -> FfiResult<Vec<(usize, &'static CudaAllocator)>> {
    if device != -1 {
        state::slot(device)?;
    }
    if crate::layout::decided_on() {
        return Err(FfiError::invalid(crate::layout::REFUSED));
    }
    let mut all: Vec<_> = state::existing_all().collect();
    all.sort_by_key(|&(d, _)| d as c_int != device);
    Ok(all)
}

/// Runs `f` on each allocator in [`search_order`] until one knows `ptr`.
fn find<T>(
    ptr: *mut c_void,
    device: c_int,
    what: &str,
    f: impl Fn(&Ipc<'static, AnyPolicy>, u64) -> Result<Option<T>, CudaError>,
) -> FfiResult<T> {
    if ptr.is_null() {
        return Err(FfiError::invalid(format!("{what} of a NULL pointer")));
    }
    let addr = ptr as usize as u64;
    let _ctx = CtxGuard::save_if_driver_loaded();
    for (_, alloc) in search_order(device)? {
        if let Some(found) = f(&alloc.ipc(), addr)? {
            return Ok(found);
        }
    }
    Err(FfiError::invalid(format!(
        "{what} of pointer {addr:#x} (device {device}): not memory of gpualloc on any \
         device in use (not allocated by gpualloc, or already freed)"
    )))
}

/// Stores `value` through an out-pointer that must not be NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-NULL and valid for writes per the caller's contract.
        unsafe { out.write(value) };
    }
}

/// The memory shared with another process for the live block containing
/// `ptr`; see `include/gpualloc.h`.
///
/// # Safety
/// `base`, `size` and `expandable` are NULL or valid for one write each.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_block_segment(
    ptr: *mut c_void,
    device: c_int,
    base: *mut u64,
    size: *mut u64,
    expandable: *mut c_int,
) -> c_int {
    crate::call_int(|| {
        crate::required(&[
            (base.is_null(), "base"),
            (size.is_null(), "size"),
            (expandable.is_null(), "expandable"),
        ])?;
        let range = find(ptr, device, "block_segment", Ipc::shared_range)?;
        // SAFETY: non-NULL (checked above), valid per the caller's contract.
        unsafe {
            put(base, range.base());
            put(size, range.size());
            put(expandable, c_int::from(range.expandable()));
        }
        Ok(())
    })
}

/// The pages of an expandable segment under the live block containing
/// `ptr`, as POSIX file descriptors; see `include/gpualloc.h`.
///
/// # Safety
/// `first_page_addr`, `page_size` and `n_fds` are NULL or valid for one
/// write each; `fds` is NULL or valid for `max_fds` writes.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_export_pages(
    ptr: *mut c_void,
    device: c_int,
    first_page_addr: *mut u64,
    page_size: *mut u64,
    fds: *mut c_int,
    max_fds: usize,
    n_fds: *mut usize,
) -> c_int {
    crate::call_int(|| {
        crate::required(&[
            (first_page_addr.is_null(), "first_page_addr"),
            (page_size.is_null(), "page_size"),
            (n_fds.is_null(), "n_fds"),
        ])?;
        if fds.is_null() && max_fds > 0 {
            return Err(FfiError::invalid("fds is NULL while max_fds > 0"));
        }
        let query = fds.is_null();
        let range = find(ptr, device, "export_pages", Ipc::shared_range)?;
        let SharedRangeParts { first, page, count } = pages_of(range, ptr)?;
        let count = usize::try_from(count).unwrap_or(usize::MAX);
        // SAFETY: non-NULL (checked above), valid per the caller's contract.
        unsafe {
            put(first_page_addr, first);
            put(page_size, page);
            put(n_fds, count);
        }
        if query {
            return Ok(());
        }
        if count > max_fds {
            return Err(FfiError::invalid(format!(
                "export_pages of pointer {ptr:p}: the block spans {count} pages, room for \
                 {max_fds} descriptors (pass max_fds >= n_fds; fds = NULL, max_fds = 0 \
                 asks for the count)"
            )));
        }
        let shared = find(ptr, device, "export_pages", Ipc::export_pages)?;
        if shared.fds.len() > max_fds || shared.first != first || shared.page != page {
            return Err(FfiError::internal(
                "export_pages: the pages changed between the query and the export",
            ));
        }
        for (i, &fd) in shared.fds.iter().enumerate() {
            // SAFETY: i < shared.fds.len() <= max_fds, and `fds` is valid for
            // `max_fds` writes per the caller's contract.
            unsafe { fds.add(i).write(fd) };
        }
        // SAFETY: as above.
        unsafe { put(n_fds, shared.fds.len()) };
        Ok(())
    })
}

/// The page run of a [`alloc_cuda::SharedRange`].
struct SharedRangeParts {
    first: u64,
    page: u64,
    count: u64,
}

/// The pages of `range`; an error for a `cuMemAlloc` segment.
fn pages_of(range: alloc_cuda::SharedRange, ptr: *mut c_void) -> FfiResult<SharedRangeParts> {
    match range {
        alloc_cuda::SharedRange::Pages { first, page, count } => {
            Ok(SharedRangeParts { first, page, count })
        }
        alloc_cuda::SharedRange::Segment { base, .. } => Err(FfiError::invalid(format!(
            "export_pages of pointer {ptr:p}: the block lies in a cuMemAlloc segment (base \
             {base:#x}), not an expandable one; share that segment with cudaIpcGetMemHandle \
             (gpualloc_block_segment gives its base)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;
    use std::ptr::null_mut;

    fn last() -> String {
        let p = crate::gpualloc_last_error();
        assert!(!p.is_null());
        // SAFETY: a NUL-terminated string valid until the next call.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn block_segment(ptr: usize, device: c_int) -> c_int {
        let (mut base, mut size, mut exp) = (7u64, 7u64, 7 as c_int);
        // SAFETY: valid out-pointers to locals.
        let code = unsafe {
            gpualloc_block_segment(ptr as *mut c_void, device, &mut base, &mut size, &mut exp)
        };
        if code != 0 {
            assert_eq!((base, size, exp), (7, 7, 7), "outputs untouched on error");
        }
        code
    }

    #[test]
    fn unknown_and_null_pointers_are_clear_errors() {
        let invalid = crate::api::GPUALLOC_ERR_INVALID;
        assert_eq!(block_segment(0, 0), invalid);
        assert!(last().contains("NULL pointer"), "{}", last());
        assert_eq!(block_segment(0xdead_0000, 0), invalid);
        assert!(
            last().contains("0xdead0000") && last().contains("not memory of gpualloc"),
            "{}",
            last()
        );
        assert_eq!(block_segment(0xdead_0000, -1), invalid);
        assert!(last().contains("not memory of gpualloc"), "{}", last());
        assert_eq!(block_segment(0x1000, 1000), invalid);
        assert!(last().contains("invalid device index 1000"), "{}", last());
        assert_eq!(block_segment(0x1000, -2), invalid);
        assert!(last().contains("invalid device index -2"), "{}", last());
    }

    #[test]
    fn null_out_pointers_are_named() {
        let invalid = crate::api::GPUALLOC_ERR_INVALID;
        let (mut base, mut size, mut exp) = (0u64, 0u64, 0 as c_int);
        let p = 0x1000 as *mut c_void;
        // SAFETY: NULL or valid out-pointers.
        unsafe {
            assert_eq!(
                gpualloc_block_segment(p, 0, null_mut(), &mut size, &mut exp),
                invalid
            );
            assert_eq!(last(), "base is NULL");
            assert_eq!(
                gpualloc_block_segment(p, 0, &mut base, null_mut(), &mut exp),
                invalid
            );
            assert_eq!(last(), "size is NULL");
            assert_eq!(
                gpualloc_block_segment(p, 0, &mut base, &mut size, null_mut()),
                invalid
            );
            assert_eq!(last(), "expandable is NULL");
        }
        let (mut first, mut page, mut n) = (0u64, 0u64, 0usize);
        let mut fds = [0 as c_int; 4];
        let f = fds.as_mut_ptr();
        // SAFETY: NULL or valid out-pointers; `fds` has room for 4.
        unsafe {
            let r = gpualloc_export_pages(p, 0, null_mut(), &mut page, f, 4, &mut n);
            assert_eq!((r, last()), (invalid, "first_page_addr is NULL".into()));
            let r = gpualloc_export_pages(p, 0, &mut first, null_mut(), f, 4, &mut n);
            assert_eq!((r, last()), (invalid, "page_size is NULL".into()));
            let r = gpualloc_export_pages(p, 0, &mut first, &mut page, f, 4, null_mut());
            assert_eq!((r, last()), (invalid, "n_fds is NULL".into()));
            let r = gpualloc_export_pages(p, 0, &mut first, &mut page, null_mut(), 4, &mut n);
            assert_eq!(
                (r, last()),
                (invalid, "fds is NULL while max_fds > 0".into())
            );
            let r = gpualloc_export_pages(p, 0, &mut first, &mut page, f, 4, &mut n);
            assert_eq!(r, invalid);
            assert!(last().contains("not memory of gpualloc"), "{}", last());
            let r = gpualloc_export_pages(null_mut(), 0, &mut first, &mut page, f, 4, &mut n);
            assert_eq!(r, invalid);
            assert!(last().contains("NULL pointer"), "{}", last());
        }
    }

    #[test]
    fn a_cumemalloc_segment_has_no_pages_to_export() {
        let e = pages_of(
            alloc_cuda::SharedRange::Segment {
                base: 0x7000_0000,
                size: 2 << 20,
            },
            0x7000_0200 as *mut c_void,
        )
        .err()
        .expect("an error");
        assert_eq!(e.code, crate::api::GPUALLOC_ERR_INVALID);
        assert!(
            e.message.contains("cuMemAlloc segment") && e.message.contains("0x70000000"),
            "{}",
            e.message
        );
        let p = pages_of(
            alloc_cuda::SharedRange::Pages {
                first: 0x7000_0000,
                page: 2 << 20,
                count: 3,
            },
            0x7000_0200 as *mut c_void,
        )
        .expect("pages");
        assert_eq!((p.first, p.page, p.count), (0x7000_0000, 2 << 20, 3));
    }
}
