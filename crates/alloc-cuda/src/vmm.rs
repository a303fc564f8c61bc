//! Growable address ranges for expandable segments (`expandable_segments:True`)
//! on the driver's virtual-memory API, following PyTorch's
//! `ExpandableSegment`: the engine reserves a range the size of the device per
//! (stream, pool) with `cuMemAddressReserve`, maps physical memory at its end
//! as it grows (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`), and unmaps
//! free tails on `empty_cache` and the out-of-memory retry (`cuMemUnmap` +
//! `cuMemRelease`).
//!
//! Each page of a range is its own physical allocation, because the driver
//! cannot unmap part of one: that lets a segment shrink, or a hole be
//! unmapped, by whole pages. Pages are the driver's granularity (2 MiB on an
//! H100) unless the engine asks for larger ones at reservation: moving a
//! page costs about the same host time whatever its size
//! (`benchmarks/vmm_cost`).
//!
//! A page the GPU may still be using can be *detached*: its physical
//! allocation goes to the next mapping (the driver allows one allocation to be
//! mapped at two addresses) while the old address stays mapped for the queued
//! work, until the engine knows that work is done and drops it.
//!
//! With `unmap_worker:true`, the unmap of an idle or detached page's old
//! address is left to a worker thread (`deferred_unmaps.rs`): its physical
//! memory is already mapped at the new address, so the allocating thread
//! pays for the new mapping only. An address whose unmap is still queued is
//! not mapped again, and its range not freed, before the queue is through.
//! Without it (the default) every unmap runs on the calling thread.
//!
//! Pages are created exportable as POSIX file descriptors where the device
//! supports it (as PyTorch's expandable segments are), so that a block can be
//! shared with another process: [`VmmMappings::export_pages`] exports the
//! pages under it, each once, and keeps the descriptor open until the
//! page's physical memory is released. The driver maps a physical
//! allocation only whole, so what is shared is always whole pages.

use std::collections::BTreeMap;
use std::os::fd::RawFd;

use cudarc::driver::sys::CUresult;

use alloc_core::{PageLayout, RangePages};

use crate::deferred_unmaps::{DeferredUnmaps, UnmapFn};
use crate::driver::{self, PhysicalHandle};
use crate::error::CudaError;

/// Pages of an expandable segment exported for another process
/// ([`VmmMappings::export_pages`]): PyTorch's `'e'` IPC handle carries the
/// page size and the descriptors, and its offset is counted from `first`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPages {
    /// Address of the first page.
    pub first: u64,
    /// Bytes of every page.
    pub page: u64,
    /// One POSIX file descriptor of this process per page, in address
    /// order; owned by the allocator (open until the page's memory is
    /// released), never to be closed by the caller.
    pub fds: Vec<RawFd>,
}

/// Reserved ranges and the physical pages mapped into them.
#[derive(Debug, Default)]
pub struct VmmMappings {
    granularity: u64,
    device: i32,
    /// Pages are created exportable as POSIX file descriptors.
    shareable: bool,
    /// Reserved ranges: start -> (size, pages).
    ranges: BTreeMap<u64, (u64, PageLayout)>,
    /// Mapped pages by address, with their size.
    pages: BTreeMap<u64, (PhysicalHandle, u64)>,
    /// Physical pages unmapped by [`VmmMappings::unmap_idle`], by size, kept
    /// for the next [`VmmMappings::map`]: moving a page costs an unmap and a
    /// map, not a release and a create too.
    spare: BTreeMap<u64, Vec<PhysicalHandle>>,
    /// Pages whose physical memory [`VmmMappings::detach`] handed on while
    /// they stay mapped, by address, with their size: the GPU may still use
    /// them there until [`VmmMappings::unmap_detached`].
    detached: BTreeMap<u64, u64>,
    /// Unmaps of idle and detached pages' old addresses: on a worker thread
    /// with `unmap_worker`, at once otherwise.
    deferred: DeferredUnmaps,
}

impl VmmMappings {
    /// Mappings for `device` at the driver's minimum granularity; a
    /// granularity of 0 means the device has no virtual-memory support.
    /// `shareable`: create pages exportable as POSIX file descriptors.
    /// `unmap` unmaps a range from a worker thread (binding the device's
    /// context there); without it, every unmap runs on the caller.
    pub(crate) fn new(
        device: i32,
        granularity: u64,
        shareable: bool,
        unmap: Option<UnmapFn>,
    ) -> Self {
        VmmMappings {
            granularity,
            device,
            shareable,
            deferred: unmap.map(DeferredUnmaps::new).unwrap_or_default(),
            ..VmmMappings::default()
        }
    }

    /// Whether pages can be shared with other processes
    /// ([`VmmMappings::export_pages`]).
    pub fn shareable(&self) -> bool {
        self.shareable
    }

    /// The whole pages that cover `[addr, addr + size)`, which must lie in
    /// one reserved range and on pages of one size (PyTorch's handle of
    /// shared expandable memory names one page size): `(first page address,
    /// page size, page count)`.
    pub fn covering_pages(&self, addr: u64, size: u64) -> Result<(u64, u64, u64), CudaError> {
        let outside = CudaError::Unsupported(
            "the memory is not inside one reserved range of an expandable segment",
        );
        let end = addr.checked_add(size.max(1)).ok_or(outside.clone())?;
        let (&base, &(len, layout)) = self
            .ranges
            .range(..=addr)
            .next_back()
            .ok_or(outside.clone())?;
        if end > base + len {
            return Err(outside);
        }
        let pages = RangePages { base, layout };
        let (first, last) = (pages.floor(addr), pages.ceil(end));
        let page = pages.size_at(first);
        if pages.size_at(last - 1) != page {
            return Err(CudaError::Unsupported(
                "the memory lies on pages of two sizes (unmap_page_mb:auto), which a CUDA IPC \
                 handle cannot describe: share tensors allocated with a uniform unmap_page_mb",
            ));
        }
        Ok((first, page, (last - first) / page))
    }

    /// The pages covering `[addr, addr + size)` ([`VmmMappings::covering_pages`])
    /// as POSIX file descriptors of this process, one per page in address
    /// order. Each page's physical allocation is exported once; its
    /// descriptor stays open, owned here, until that memory is released
    /// (callers must not close it). Every page must be mapped.
    pub fn export_pages(&self, addr: u64, size: u64) -> Result<SharedPages, CudaError> {
        if !self.shareable {
            return Err(CudaError::Unsupported(
                "memory of this device is not exportable as POSIX file descriptors (the \
                 device lacks CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, \
                 or cuMemCreate refused such memory): share tensors allocated with \
                 expandable_segments:False",
            ));
        }
        let (first, page, count) = self.covering_pages(addr, size)?;
        let mut fds = Vec::with_capacity(count as usize);
        for i in 0..count {
            let Some((handle, _)) = self.pages.get(&(first + i * page)) else {
                return Err(CudaError::Unsupported(
                    "a page under the memory to share is not mapped",
                ));
            };
            fds.push(driver::export_fd(handle)?);
        }
        Ok(SharedPages { first, page, fds })
    }

    /// The driver's minimum page size (0 when unsupported).
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Bytes mapped now.
    pub fn mapped_bytes(&self) -> u64 {
        self.pages.values().map(|&(_, page)| page).sum()
    }

    /// The pages `(start address, size)` of `[addr, addr + size)`: the span
    /// must cover whole pages of one reserved range.
    fn pages_of(&self, addr: u64, size: u64) -> Result<Vec<(u64, u64)>, CudaError> {
        let pages = self
            .ranges
            .range(..=addr)
            .next_back()
            .filter(|(&start, &(len, _))| {
                addr.checked_add(size).is_some_and(|end| end <= start + len)
            })
            .map(|(&base, &(_, layout))| RangePages { base, layout });
        match pages {
            Some(p) if p.is_whole(addr, size) => Ok(p.pages(addr, addr + size).collect()),
            _ => Err(CudaError::Unsupported(
                "mapping is not whole pages of a reserved range",
            )),
        }
    }

    /// The start addresses of [`VmmMappings::pages_of`].
    fn page_addrs(&self, addr: u64, size: u64) -> Result<Vec<u64>, CudaError> {
        Ok(self
            .pages_of(addr, size)?
            .into_iter()
            .map(|p| p.0)
            .collect())
    }

    /// Reserves `size` bytes of address space, aligned to the largest page
    /// of `pages` and mapped in its pages (each a power-of-two multiple of
    /// the granularity).
    pub(crate) fn reserve(&mut self, size: u64, pages: PageLayout) -> Result<u64, CudaError> {
        let g = self.granularity;
        let page = pages.largest();
        if g == 0
            || !pages.smallest().is_power_of_two()
            || !pages.smallest().is_multiple_of(g)
            || size == 0
        {
            return Err(CudaError::Unsupported(
                "page size is not a power-of-two multiple of the granularity",
            ));
        }
        if !size.is_multiple_of(page) {
            return Err(CudaError::Unsupported("range is not whole pages"));
        }
        let addr = driver::address_reserve(size, page)?;
        self.ranges.insert(addr, (size, pages));
        Ok(addr)
    }

    /// Maps physical pages (kept spares first, else new ones) over
    /// `[addr, addr + size)`, with one access call for the run; on failure
    /// nothing stays mapped.
    pub(crate) fn map(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        let pages = self.pages_of(addr, size)?;
        if pages
            .iter()
            .any(|(a, _)| self.pages.contains_key(a) || self.detached.contains_key(a))
        {
            return Err(CudaError::Unsupported("mapping over mapped memory"));
        }
        self.deferred.settle_over(addr, size)?;
        for (i, &(at, page)) in pages.iter().enumerate() {
            let handle = match self.spare.get_mut(&page).and_then(Vec::pop) {
                Some(h) => Ok(h),
                None => self.create(page),
            };
            let mapped = handle.and_then(|handle| match driver::mem_map(at, page, &handle) {
                Ok(()) => Ok(handle),
                Err(e) => {
                    self.release_after_queue(handle);
                    Err(e)
                }
            });
            match mapped {
                Ok(handle) => {
                    self.pages.insert(at, (handle, page));
                }
                Err(e) => {
                    self.roll_back(&pages[..i]);
                    return Err(e);
                }
            }
        }
        if let Err(e) = driver::mem_set_access(addr, size, self.device) {
            self.roll_back(&pages);
            return Err(e);
        }
        Ok(())
    }

    /// Unmaps and releases what a failed [`VmmMappings::map`] mapped. Its
    /// pages may be spares whose old mapping's unmap is queued: the release
    /// waits for the queue (see [`VmmMappings::release_spare`]).
    fn roll_back(&mut self, mapped: &[(u64, u64)]) {
        let _ = self.deferred.settle();
        let _ = self.unmap_pages(mapped.iter().map(|p| p.0));
    }

    /// Releases a page that could not be mapped, after the queued unmaps.
    fn release_after_queue(&mut self, handle: PhysicalHandle) {
        let _ = self.deferred.settle();
        let _ = driver::mem_release(handle);
    }

    /// A new physical page. Should the driver refuse exportable memory
    /// (anything but out of memory), pages are made without it from then
    /// on: allocation must not fail for the sake of sharing.
    fn create(&mut self, page: u64) -> Result<PhysicalHandle, CudaError> {
        match driver::mem_create(page, self.device, self.shareable) {
            Err(CudaError::Driver { code, .. })
                if self.shareable && code != CUresult::CUDA_ERROR_OUT_OF_MEMORY =>
            {
                self.shareable = false;
                driver::mem_create(page, self.device, false)
            }
            created => created,
        }
    }

    /// Unmaps and releases the pages over `[addr, addr + size)`, after
    /// waiting for the context's work (unmapping does not synchronize).
    pub(crate) fn unmap(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        let pages = self.mapped_pages(addr, size)?;
        driver::ctx_synchronize()?;
        // The cache is emptied: what was queued goes too, and its errors
        // are reported here.
        self.deferred.settle()?;
        self.unmap_pages(pages.into_iter())
    }

    /// [`VmmMappings::unmap`] without the context-wide wait (the caller knows
    /// the work that used the range is done), keeping the physical pages
    /// for the next [`VmmMappings::map`] until [`VmmMappings::release_spare`].
    /// With a worker the unmap itself is queued to it: the pages' physical
    /// memory may be mapped elsewhere at once.
    pub(crate) fn unmap_idle(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        self.deferred.take_error()?;
        for at in self.mapped_pages(addr, size)? {
            let page = self.pages[&at].1;
            self.deferred.unmap(at, page, driver::mem_unmap)?;
            let (handle, page) = self.pages.remove(&at).expect("mapped page");
            self.spare.entry(page).or_default().push(handle);
        }
        Ok(())
    }

    /// Hands the physical pages over `[addr, addr + size)` to the next
    /// [`VmmMappings::map`] (as spares) while they stay mapped here, for
    /// work still queued on them: the driver lets one physical allocation
    /// be mapped at two addresses. No driver call.
    pub(crate) fn detach(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        for at in self.mapped_pages(addr, size)? {
            let (handle, page) = self.pages.remove(&at).expect("mapped page");
            self.spare.entry(page).or_default().push(handle);
            self.detached.insert(at, page);
        }
        Ok(())
    }

    /// Unmaps the pages over `[addr, addr + size)` that
    /// [`VmmMappings::detach`] left mapped (their memory lives on at its new
    /// address, or is released once unmapped here).
    pub(crate) fn unmap_detached(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        let pages = self.page_addrs(addr, size)?;
        if !pages.iter().all(|a| self.detached.contains_key(a)) {
            return Err(CudaError::Unsupported(
                "unmap_detached of memory that is not detached",
            ));
        }
        self.deferred.take_error()?;
        for at in pages {
            self.deferred
                .unmap(at, self.detached[&at], driver::mem_unmap)?;
            self.detached.remove(&at);
        }
        Ok(())
    }

    /// Whether pages unmapped by [`VmmMappings::unmap_idle`] are kept.
    pub(crate) fn has_spare(&self) -> bool {
        self.spare.values().any(|v| !v.is_empty())
    }

    /// Releases the pages [`VmmMappings::unmap_idle`] and
    /// [`VmmMappings::detach`] kept and no mapping took (a detached one is
    /// freed by the driver when its old mapping is dropped).
    /// A spare page may still be mapped at an address whose unmap is
    /// queued: the queue is waited for first, so that the release and that
    /// unmap never run at once on two threads (in a test run on the H100
    /// they did, and the driver's host heap was corrupted) and the memory
    /// is the device's again when this returns.
    pub(crate) fn release_spare(&mut self) -> Result<(), CudaError> {
        self.deferred.settle()?;
        for handles in self.spare.values_mut() {
            while let Some(handle) = handles.pop() {
                driver::mem_release(handle)?;
            }
        }
        Ok(())
    }

    /// The pages over `[addr, addr + size)`, which must all be mapped.
    fn mapped_pages(&self, addr: u64, size: u64) -> Result<Vec<u64>, CudaError> {
        let pages = self.page_addrs(addr, size)?;
        if !pages.iter().all(|a| self.pages.contains_key(a)) {
            return Err(CudaError::Unsupported("unmap of memory that is not mapped"));
        }
        Ok(pages)
    }

    fn unmap_pages(&mut self, pages: impl Iterator<Item = u64>) -> Result<(), CudaError> {
        for at in pages {
            if let Some((handle, page)) = self.pages.remove(&at) {
                driver::mem_unmap(at, page)?;
                driver::mem_release(handle)?;
            }
        }
        Ok(())
    }

    /// Frees a reserved range with nothing mapped in it.
    pub(crate) fn release(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        if self.ranges.get(&addr).map(|r| r.0) != Some(size) {
            return Err(CudaError::Unsupported(
                "release of a range that was not reserved",
            ));
        }
        if self.pages.range(addr..addr + size).next().is_some()
            || self.detached.range(addr..addr + size).next().is_some()
        {
            return Err(CudaError::Unsupported(
                "release of a range with memory mapped",
            ));
        }
        self.deferred.settle_over(addr, size)?;
        driver::address_free(addr, size)?;
        self.ranges.remove(&addr);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Mappings with one reserved range of 64 MiB at 1 GiB in `page`-byte
    /// pages (no driver call: the range is entered directly).
    fn with_range(page: u64, shareable: bool) -> VmmMappings {
        let mut m = VmmMappings::new(0, 2 * MIB, shareable, None);
        m.ranges
            .insert(1 << 30, (64 * MIB, PageLayout::uniform(page)));
        m
    }

    #[test]
    fn covering_pages_are_the_whole_pages_under_a_span() {
        let m = with_range(2 * MIB, true);
        let base = 1u64 << 30;
        assert_eq!(m.covering_pages(base, 512), Ok((base, 2 * MIB, 1)));
        assert_eq!(m.covering_pages(base, 2 * MIB), Ok((base, 2 * MIB, 1)));
        assert_eq!(m.covering_pages(base, 2 * MIB + 1), Ok((base, 2 * MIB, 2)));
        // A block starting inside a page, ending inside another.
        let at = base + 3 * MIB + 512;
        assert_eq!(
            m.covering_pages(at, 11 * MIB),
            Ok((base + 2 * MIB, 2 * MIB, 7))
        );
        let m = with_range(8 * MIB, true);
        assert_eq!(m.covering_pages(at, 11 * MIB), Ok((base, 8 * MIB, 2)));
        // Outside the range, or past its end.
        assert!(m.covering_pages(base - 1, 16).is_err());
        assert!(m.covering_pages(base + 64 * MIB - 16, 32).is_err());
        assert!(m.covering_pages(u64::MAX - 4, 16).is_err());
        // Scaled pages: 2 MiB below 32 MiB into the range, 4 MiB above.
        let mut m = VmmMappings::new(0, 2 * MIB, true, None);
        let scaled = PageLayout::scaled(2 * MIB, 4 * MIB, 8).unwrap();
        m.ranges.insert(base, (64 * MIB, scaled));
        assert_eq!(
            m.covering_pages(base + 40 * MIB, MIB),
            Ok((base + 40 * MIB, 4 * MIB, 1))
        );
        let e = m.covering_pages(base + 30 * MIB, 4 * MIB).unwrap_err();
        assert!(e.to_string().contains("two sizes"), "{e}");
    }

    #[test]
    fn export_needs_exportable_and_mapped_pages() {
        let base = 1u64 << 30;
        let e = with_range(2 * MIB, false)
            .export_pages(base, 4096)
            .unwrap_err();
        assert!(e.to_string().contains("expandable_segments:False"), "{e}");
        // Nothing mapped: an error before any driver call.
        let e = with_range(2 * MIB, true)
            .export_pages(base, 4096)
            .unwrap_err();
        assert!(e.to_string().contains("not mapped"), "{e}");
    }
}
