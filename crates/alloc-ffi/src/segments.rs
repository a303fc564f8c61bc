//! Segment events across the C ABI: a C callback told of every segment
//! allocation, free, mapping and unmapping of every device's allocator (the
//! bridge turns them into PyTorch's `segment_*` trace entries and calls the
//! allocator trace trackers with them).

use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use alloc_cuda::{CudaAllocator, SegmentAction, SegmentEvent};

use crate::api::{
    GPUALLOC_SEGMENT_ALLOC, GPUALLOC_SEGMENT_FREE, GPUALLOC_SEGMENT_MAP, GPUALLOC_SEGMENT_UNMAP,
};
use crate::call_int;

/// `gpualloc_segment_callback`: `(device, action, address, size)`, where
/// action is one of the `GPUALLOC_SEGMENT_*` codes.
pub type SegmentCallback = Option<extern "C" fn(c_int, c_int, u64, u64)>;

/// The callback's address (0: none), read at every event.
static CALLBACK: AtomicUsize = AtomicUsize::new(0);

fn action_code(action: SegmentAction) -> c_int {
    match action {
        SegmentAction::Alloc => GPUALLOC_SEGMENT_ALLOC,
        SegmentAction::Free => GPUALLOC_SEGMENT_FREE,
        SegmentAction::Map => GPUALLOC_SEGMENT_MAP,
        SegmentAction::Unmap => GPUALLOC_SEGMENT_UNMAP,
        _ => -1,
    }
}

fn forward(event: SegmentEvent) {
    let f = CALLBACK.load(Ordering::Acquire);
    if f == 0 {
        return;
    }
    // SAFETY: a non-zero value was stored from a `extern "C" fn(c_int,
    // c_int, u64, u64)` in gpualloc_set_segment_callback.
    let callback: extern "C" fn(c_int, c_int, u64, u64) = unsafe { std::mem::transmute(f) };
    callback(
        event.device as c_int,
        action_code(event.action),
        event.addr,
        event.size,
    );
}

/// Makes `alloc` report its segment events to the registered callback (if
/// any, now or later).
pub(crate) fn observe(alloc: &CudaAllocator) {
    alloc
        .diagnostics()
        .set_segment_observer(Some(Arc::new(forward)));
}

/// Registers the callback told of every later segment event of every device
/// (NULL: none). It runs with the device's allocator lock held: it must not
/// call back into this library, and must not unwind.
#[no_mangle]
pub extern "C" fn gpualloc_set_segment_callback(callback: SegmentCallback) -> c_int {
    call_int(|| {
        CALLBACK.store(callback.map_or(0, |f| f as usize), Ordering::Release);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    static SEEN: Mutex<Vec<(c_int, c_int, u64, u64)>> = Mutex::new(Vec::new());

    extern "C" fn record(device: c_int, action: c_int, addr: u64, size: u64) {
        SEEN.lock().unwrap().push((device, action, addr, size));
    }

    #[test]
    fn events_reach_the_registered_callback_only() {
        let event = SegmentEvent {
            device: 2,
            action: SegmentAction::Unmap,
            addr: 0x200000,
            size: 4 << 20,
        };
        forward(event); // none registered
        assert_eq!(gpualloc_set_segment_callback(Some(record)), 0);
        forward(event);
        assert_eq!(gpualloc_set_segment_callback(None), 0);
        forward(event);
        assert_eq!(
            *SEEN.lock().unwrap(),
            vec![(2, GPUALLOC_SEGMENT_UNMAP, 0x200000, 4 << 20)]
        );
    }
}
