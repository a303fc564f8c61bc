//! Growable address ranges for expandable segments (`expandable_segments:True`)
//! on the driver's virtual-memory API, following PyTorch's
//! `ExpandableSegment`: the engine reserves a range the size of the device per
//! (stream, pool) with `cuMemAddressReserve`, maps physical memory at its end
//! as it grows (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`), and unmaps
//! free tails on `empty_cache` and the out-of-memory retry (`cuMemUnmap` +
//! `cuMemRelease`).
//!
//! Each granule (2 MiB on an H100) is its own physical allocation, because
//! the driver cannot unmap part of one: that lets a segment shrink by any
//! number of granules.

use std::collections::BTreeMap;

use crate::driver::{self, PhysicalHandle};
use crate::error::CudaError;

/// Reserved ranges and the physical granules mapped into them.
#[derive(Debug, Default)]
pub struct VmmMappings {
    granularity: u64,
    device: i32,
    /// Reserved ranges: start -> size.
    ranges: BTreeMap<u64, u64>,
    /// Mapped granules by address.
    granules: BTreeMap<u64, PhysicalHandle>,
    /// Physical granules unmapped by [`VmmMappings::unmap_idle`], kept for
    /// the next mapping: moving a granule costs an unmap and a map, not a
    /// release and a create too.
    spare: Vec<PhysicalHandle>,
}

impl VmmMappings {
    /// Mappings for `device` at the driver's minimum granularity; a
    /// granularity of 0 means the device has no virtual-memory support.
    pub(crate) fn new(device: i32, granularity: u64) -> Self {
        VmmMappings {
            granularity,
            device,
            ..VmmMappings::default()
        }
    }

    /// Physical granule size (0 when unsupported).
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Bytes mapped now.
    pub fn mapped_bytes(&self) -> u64 {
        self.granules.len() as u64 * self.granularity
    }

    fn granules_of(&self, addr: u64, size: u64) -> Result<impl Iterator<Item = u64>, CudaError> {
        let g = self.granularity;
        let inside = self
            .ranges
            .range(..=addr)
            .next_back()
            .is_some_and(|(&start, &len)| {
                addr.checked_add(size).is_some_and(|end| end <= start + len)
            });
        if g == 0 || size == 0 || !addr.is_multiple_of(g) || !size.is_multiple_of(g) || !inside {
            return Err(CudaError::Unsupported(
                "mapping is not granule-aligned or not inside a reserved range",
            ));
        }
        Ok((addr..addr + size).step_by(g as usize))
    }

    pub(crate) fn reserve(&mut self, size: u64) -> Result<u64, CudaError> {
        let addr = driver::address_reserve(size, self.granularity)?;
        self.ranges.insert(addr, size);
        Ok(addr)
    }

    /// Maps fresh physical granules over `[addr, addr + size)`; on failure
    /// nothing stays mapped.
    pub(crate) fn map(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        let granules: Vec<u64> = self.granules_of(addr, size)?.collect();
        if granules.iter().any(|a| self.granules.contains_key(a)) {
            return Err(CudaError::Unsupported("mapping over mapped memory"));
        }
        for (i, &at) in granules.iter().enumerate() {
            let handle = match self.spare.pop() {
                Some(h) => Ok(h),
                None => driver::mem_create(self.granularity, self.device),
            };
            let mapped =
                handle.and_then(
                    |handle| match driver::mem_map(at, self.granularity, &handle) {
                        Ok(()) => Ok(handle),
                        Err(e) => {
                            let _ = driver::mem_release(handle);
                            Err(e)
                        }
                    },
                );
            match mapped {
                Ok(handle) => {
                    self.granules.insert(at, handle);
                }
                Err(e) => {
                    // Roll back what this call mapped.
                    let _ = self.unmap_granules(&granules[..i]);
                    return Err(e);
                }
            }
        }
        // One access call for the whole run instead of one per granule.
        if let Err(e) = driver::mem_set_access(addr, size, self.device) {
            let _ = self.unmap_granules(&granules);
            return Err(e);
        }
        Ok(())
    }

    /// Unmaps and releases the granules over `[addr, addr + size)`, after
    /// waiting for the context's work (unmapping does not synchronize).
    pub(crate) fn unmap(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        let granules = self.mapped_granules(addr, size)?;
        driver::ctx_synchronize()?;
        self.unmap_granules(&granules)
    }

    /// [`VmmMappings::unmap`] without the context-wide wait (the caller knows
    /// the work that used the range is done), keeping the physical granules
    /// for the next [`VmmMappings::map`] until [`VmmMappings::release_spare`].
    pub(crate) fn unmap_idle(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        for at in self.mapped_granules(addr, size)? {
            driver::mem_unmap(at, self.granularity)?;
            let handle = self.granules.remove(&at).expect("mapped granule");
            self.spare.push(handle);
        }
        Ok(())
    }

    /// Whether granules unmapped by [`VmmMappings::unmap_idle`] are kept.
    pub(crate) fn has_spare(&self) -> bool {
        !self.spare.is_empty()
    }

    /// Releases the granules [`VmmMappings::unmap_idle`] kept and no mapping
    /// took.
    pub(crate) fn release_spare(&mut self) -> Result<(), CudaError> {
        while let Some(handle) = self.spare.pop() {
            driver::mem_release(handle)?;
        }
        Ok(())
    }

    /// The granules over `[addr, addr + size)`, which must all be mapped.
    fn mapped_granules(&self, addr: u64, size: u64) -> Result<Vec<u64>, CudaError> {
        let granules: Vec<u64> = self.granules_of(addr, size)?.collect();
        if !granules.iter().all(|a| self.granules.contains_key(a)) {
            return Err(CudaError::Unsupported("unmap of memory that is not mapped"));
        }
        Ok(granules)
    }

    fn unmap_granules(&mut self, granules: &[u64]) -> Result<(), CudaError> {
        for at in granules {
            if let Some(handle) = self.granules.remove(at) {
                driver::mem_unmap(*at, self.granularity)?;
                driver::mem_release(handle)?;
            }
        }
        Ok(())
    }

    /// Frees a reserved range with nothing mapped in it.
    pub(crate) fn release(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        if self.ranges.get(&addr) != Some(&size) {
            return Err(CudaError::Unsupported(
                "release of a range that was not reserved",
            ));
        }
        if self.granules.range(addr..addr + size).next().is_some() {
            return Err(CudaError::Unsupported(
                "release of a range with memory mapped",
            ));
        }
        driver::address_free(addr, size)?;
        self.ranges.remove(&addr);
        Ok(())
    }
}
