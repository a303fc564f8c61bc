//! The engine's memory backend: segments from `cuMemAlloc` / `cuMemFree`.

use std::sync::Arc;

use alloc_core::{BackendError, DetachPages, MemoryBackend, PageLayout, VirtualMemory};
use cudarc::driver::CudaContext;
use rustc_hash::FxHashMap;

use crate::deferred_unmaps::UnmapFn;
use crate::device_limit::DeviceLimit;
use crate::driver;
use crate::error::CudaError;
use crate::observer::{ObserverSlot, SegmentAction, SegmentEvent};
use crate::vmm::{SharedPages, VmmMappings};

/// Segments of one device's primary context. Capacity is read once
/// (`cuMemGetInfo`'s total); free bytes are read on demand (OOM reports).
/// Growable ranges for expandable segments go through [`VmmMappings`].
///
/// The backend frees, unmaps and releases only memory it allocated, mapped
/// or reserved itself (anything else is an error before any driver call),
/// so driving it from safe code cannot free memory it does not own.
///
/// ```no_run
/// use alloc_core::{MemoryBackend, MIB};
/// use alloc_cuda::{cudarc::driver::CudaContext, CudaMemory};
///
/// let ctx = CudaContext::new(0)?;
/// let mut memory = CudaMemory::new(ctx)?;
/// let segment = memory.allocate(2 * MIB)?; // cuMemAlloc
/// assert!(memory.free(segment + 512, 2 * MIB).is_err()); // not a segment of it
/// memory.free(segment, 2 * MIB)?; // cuMemFree
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct CudaMemory {
    ctx: Arc<CudaContext>,
    capacity: u64,
    /// Segments from `cuMemAlloc`: address -> size.
    segments: FxHashMap<u64, u64>,
    vmm: VmmMappings,
    observer: ObserverSlot,
    /// The limit shared with the device's other engines, if any
    /// ([`CudaMemory::sharing_limit`]).
    limit: Option<Arc<DeviceLimit>>,
}

impl CudaMemory {
    /// The memory backend of `ctx`'s device (one `cuMemGetInfo` and the
    /// virtual-memory granularity are read now); moved pages are unmapped
    /// on the calling thread, as the default configuration's `unmap_worker`
    /// says.
    pub fn new(ctx: Arc<CudaContext>) -> Result<Self, CudaError> {
        Self::with_observer(ctx, ObserverSlot::default(), false)
    }

    /// [`CudaMemory::new`] reporting its segment events to `observer`;
    /// `unmap_worker`: moved pages' old addresses are unmapped on a worker
    /// thread (otherwise on the caller's).
    pub(crate) fn with_observer(
        ctx: Arc<CudaContext>,
        observer: ObserverSlot,
        unmap_worker: bool,
    ) -> Result<Self, CudaError> {
        driver::bind(&ctx)?;
        let (_, total) = driver::mem_get_info()?;
        let device = ctx.ordinal() as i32;
        // Pages are made exportable (for CUDA IPC) where the device can
        // export POSIX file descriptors, as PyTorch's expandable segments are.
        let mut shareable = driver::posix_fd_supported(&ctx);
        // A device without virtual-memory support reports an error here:
        // growable segments are then unavailable (granularity 0).
        let granularity = match driver::vmm_granularity(device, shareable) {
            Ok(g) => g,
            Err(_) if shareable => {
                shareable = false;
                driver::vmm_granularity(device, false).unwrap_or(0)
            }
            Err(_) => 0,
        };
        // With `unmap_worker`, idle pages' unmaps run on a worker thread, in
        // this context.
        let worker_ctx = Arc::clone(&ctx);
        let unmap = unmap_worker.then(|| -> UnmapFn {
            Arc::new(move |addr, size| {
                driver::bind(&worker_ctx)?;
                driver::mem_unmap(addr, size)
            })
        });
        Ok(CudaMemory {
            ctx,
            capacity: total,
            segments: FxHashMap::default(),
            vmm: VmmMappings::new(device, granularity, shareable, unmap),
            observer,
            limit: None,
        })
    }

    /// This backend with its segments and mappings counted against `limit`,
    /// shared with the device's other engines: growth that would pass it is
    /// refused as the device being full.
    pub(crate) fn sharing_limit(mut self, limit: Arc<DeviceLimit>) -> Self {
        self.limit = Some(limit);
        self
    }

    /// Takes `size` bytes from the shared limit, if there is one.
    fn take(&self, size: u64) -> Result<(), BackendError> {
        match &self.limit {
            Some(l) if !l.take(size) => Err(BackendError::OutOfMemory),
            _ => Ok(()),
        }
    }

    /// Gives `size` bytes back to the shared limit, if there is one.
    fn give(&self, size: u64) {
        if let Some(l) = &self.limit {
            l.give(size);
        }
    }

    /// After a driver call gave `size` bytes at `addr` back (a segment freed
    /// or pages unmapped): returns them to the shared limit and reports
    /// `action`.
    fn released(&self, action: SegmentAction, addr: u64, size: u64) {
        self.give(size);
        self.report(action, addr, size);
    }

    /// `grow` with `size` bytes taken from the shared limit first, and
    /// given back if it fails.
    fn growing(
        &mut self,
        size: u64,
        grow: impl FnOnce(&mut Self) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        self.take(size)?;
        let grown = grow(self);
        if grown.is_err() {
            self.give(size);
        }
        grown
    }

    /// Reports a segment event after a successful driver call.
    fn report(&self, action: SegmentAction, addr: u64, size: u64) {
        self.observer.notify(SegmentEvent {
            device: self.ctx.ordinal(),
            action,
            addr,
            size,
        });
    }

    /// `(free, total)` bytes of the device, from `cuMemGetInfo`.
    pub fn mem_get_info(&self) -> Result<(u64, u64), CudaError> {
        driver::bind(&self.ctx)?;
        driver::mem_get_info()
    }

    /// The growable ranges (expandable segments).
    pub fn vmm(&self) -> &VmmMappings {
        &self.vmm
    }

    /// [`VmmMappings::export_pages`] with this device's context current.
    pub fn export_pages(&self, addr: u64, size: u64) -> Result<SharedPages, CudaError> {
        driver::bind(&self.ctx)?;
        self.vmm.export_pages(addr, size)
    }

    /// The context segments are allocated in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl MemoryBackend for CudaMemory {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        let mut addr = 0;
        self.growing(size, |m| {
            driver::bind(&m.ctx)?;
            addr = driver::mem_alloc(size)?;
            Ok(())
        })?;
        self.segments.insert(addr, size);
        self.report(SegmentAction::Alloc, addr, size);
        Ok(addr)
    }

    fn free(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        if self.segments.get(&addr) != Some(&size) {
            return Err(BackendError::Other(format!(
                "free of {size} bytes at {addr:#x}: not a segment of this backend"
            )));
        }
        driver::bind(&self.ctx)?;
        driver::mem_free(addr)?;
        self.segments.remove(&addr);
        self.released(SegmentAction::Free, addr, size);
        Ok(())
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn free_bytes(&self) -> u64 {
        // Read for reports, and before each mapping under a memory budget
        // (another process may have taken memory): a failing query reads as
        // nothing free, so that free pages are reclaimed first. Under a
        // shared limit, no more than the limit leaves.
        let free = self.mem_get_info().map(|(free, _)| free).unwrap_or(0);
        match self.limit.as_ref().and_then(|l| l.room()) {
            Some(room) => free.min(room),
            None => free,
        }
    }

    fn virtual_memory(&mut self) -> Option<&mut dyn VirtualMemory> {
        // A device without virtual-memory support reports granularity 0.
        (self.vmm.granularity() > 0).then_some(self as &mut dyn VirtualMemory)
    }
}

impl VirtualMemory for CudaMemory {
    fn granularity(&self) -> u64 {
        self.vmm.granularity()
    }

    fn reserve(&mut self, size: u64, pages: PageLayout) -> Result<u64, BackendError> {
        driver::bind(&self.ctx)?;
        Ok(self.vmm.reserve(size, pages)?)
    }

    fn map(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.growing(size, |m| {
            driver::bind(&m.ctx)?;
            Ok(m.vmm.map(addr, size)?)
        })?;
        self.report(SegmentAction::Map, addr, size);
        Ok(())
    }

    fn unmap(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        driver::bind(&self.ctx)?;
        self.vmm.unmap(addr, size)?;
        self.released(SegmentAction::Unmap, addr, size);
        Ok(())
    }

    fn release(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        driver::bind(&self.ctx)?;
        Ok(self.vmm.release(addr, size)?)
    }

    fn unmap_idle(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        driver::bind(&self.ctx)?;
        self.vmm.unmap_idle(addr, size)?;
        self.released(SegmentAction::Unmap, addr, size);
        Ok(())
    }

    fn release_spare(&mut self) -> Result<(), BackendError> {
        if !self.vmm.has_spare() {
            return Ok(()); // the common case: no driver call at all
        }
        driver::bind(&self.ctx)?;
        Ok(self.vmm.release_spare()?)
    }

    fn detach_pages(&mut self) -> Option<&mut dyn DetachPages> {
        // The driver maps one physical allocation at several addresses.
        Some(self)
    }
}

impl DetachPages for CudaMemory {
    fn detach(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        Ok(self.vmm.detach(addr, size)?)
    }

    fn unmap_detached(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        driver::bind(&self.ctx)?;
        self.vmm.unmap_detached(addr, size)?;
        self.released(SegmentAction::Unmap, addr, size);
        Ok(())
    }
}
