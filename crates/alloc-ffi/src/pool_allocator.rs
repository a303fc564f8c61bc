//! Private pools whose segments come from another allocator (PyTorch's
//! `MemPool(allocator)` while gpualloc is PyTorch's allocator): the C caller
//! gives an allocate and a free function; the engine caches and splits
//! their segments like its own.

use std::ffi::{c_int, c_void};

use alloc_core::{BackendError, SegmentSource};

use crate::state::{self, CtxGuard, FfiError};
use crate::{call_int, named_pool};

/// `gpualloc_pool_alloc_fn`: a segment of `size` bytes on `device`, or NULL.
pub type PoolAllocFn = Option<extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void>;
/// `gpualloc_pool_free_fn`: gives back a segment from the allocate function.
pub type PoolFreeFn = Option<extern "C" fn(*mut c_void, usize, c_int, *mut c_void)>;

/// The C functions and their context, as a segment source.
struct CSource {
    alloc: extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void,
    free: extern "C" fn(*mut c_void, usize, c_int, *mut c_void),
    device: c_int,
    /// The caller's context pointer, passed back untouched.
    ctx: usize,
}

impl SegmentSource for CSource {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        let size = usize::try_from(size).map_err(|_| BackendError::OutOfMemory)?;
        let p = (self.alloc)(size, self.device, self.ctx as *mut c_void);
        if p.is_null() {
            return Err(BackendError::OutOfMemory);
        }
        Ok(p as usize as u64)
    }

    fn free(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        (self.free)(
            addr as usize as *mut c_void,
            size as usize,
            self.device,
            self.ctx as *mut c_void,
        );
        Ok(())
    }
}

/// Makes a held private pool take its segments from `alloc` and give them
/// back through `free` (both called with the device's allocator lock held,
/// and with `ctx`); see `include/gpualloc.h`.
///
/// # Safety
/// `alloc` returns NULL or device memory of `device` of the size asked
/// for, used by nothing else until passed to `free`; both stay callable,
/// and `ctx` valid for them, until the pool's last segment was given back.
#[no_mangle]
pub unsafe extern "C" fn gpualloc_set_pool_allocator(
    device: c_int,
    first: u64,
    second: u64,
    alloc: PoolAllocFn,
    free: PoolFreeFn,
    ctx: *mut c_void,
) -> c_int {
    call_int(|| {
        let pool = named_pool(first, second)?;
        let (Some(alloc), Some(free)) = (alloc, free) else {
            return Err(FfiError::invalid(
                "gpualloc_set_pool_allocator: NULL allocate or free function",
            ));
        };
        let source = CSource {
            alloc,
            free,
            device,
            ctx: ctx as usize,
        };
        let _ctx = CtxGuard::save_if_driver_loaded();
        let a = state::allocator(device)?;
        // SAFETY: the caller's contract: the functions hand out device
        // memory of `device`, exclusively, until it is given back.
        Ok(unsafe { a.pools().set_source(pool, Box::new(source)) }?)
    })
}
