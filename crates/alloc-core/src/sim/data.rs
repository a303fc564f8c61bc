//! A simulated device that keeps what is written into it: [`SimDataMemory`]
//! is [`SimMemory`] with a sparse store of 8-byte words, so that a test can
//! write a pattern into each block it is handed and read it back later. The
//! store follows the memory: words go when their memory goes back to the
//! device (a segment freed, pages unmapped or detached to another mapping),
//! and fresh memory reads as never written. Two blocks that share bytes, or
//! a block whose memory was taken away and mapped again, then show in the
//! data, not only in the addresses.
//!
//! A type of its own rather than a store inside [`SimMemory`]: replay and
//! the benchmarks run on [`SimMemory`], which stays free of it.

use std::collections::BTreeMap;
use std::ops::Deref;

use super::SimMemory;
use crate::backend::{DetachPages, MemoryBackend, VirtualMemory};
use crate::error::BackendError;
use crate::page_layout::PageLayout;

/// [`SimMemory`] with a store of the words written into its memory (see
/// the module docs). It reads as the [`SimMemory`] it wraps.
#[derive(Debug, Clone)]
pub struct SimDataMemory {
    sim: SimMemory,
    /// Words written and still backed by the memory they were written to:
    /// address (a multiple of [`SimDataMemory::WORD`]) -> value.
    words: BTreeMap<u64, u64>,
}

impl SimDataMemory {
    /// Bytes of one stored word; words lie at multiples of it.
    pub const WORD: u64 = 8;

    /// A device with `capacity` bytes, nothing written.
    pub fn new(capacity: u64) -> Self {
        SimDataMemory {
            sim: SimMemory::new(capacity),
            words: BTreeMap::new(),
        }
    }

    /// Stores `value` in the word at `addr`: refused unless `addr` is a
    /// multiple of [`SimDataMemory::WORD`] in memory the device can use now.
    pub fn write(&mut self, addr: u64, value: u64) -> Result<(), BackendError> {
        self.check_word(addr)?;
        self.words.insert(addr, value);
        Ok(())
    }

    /// The word at `addr` (`None`: nothing written there since its memory
    /// was mapped); refused as [`SimDataMemory::write`] is.
    pub fn read(&self, addr: u64) -> Result<Option<u64>, BackendError> {
        self.check_word(addr)?;
        Ok(self.words.get(&addr).copied())
    }

    /// The words written in `[start, end)`, in address order.
    pub fn written(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.words
            .range(start..end.max(start))
            .map(|(&a, &v)| (a, v))
    }

    /// Another process now holds `bytes` of the device
    /// ([`SimMemory::set_used_elsewhere`]); what was written stays.
    pub fn set_used_elsewhere(&mut self, bytes: u64) {
        self.sim.set_used_elsewhere(bytes);
    }

    /// Words held in the store.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// True when nothing written is held.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    fn check_word(&self, addr: u64) -> Result<(), BackendError> {
        if !addr.is_multiple_of(Self::WORD) || !self.sim.is_accessible(addr, Self::WORD) {
            return Err(BackendError::Other(format!(
                "access to the word at {addr:#x}: not an aligned word of usable memory"
            )));
        }
        Ok(())
    }

    /// The memory of `[addr, addr + size)` went back: what was written
    /// there is gone.
    fn forget(&mut self, addr: u64, size: u64) {
        let end = addr.saturating_add(size);
        let gone: Vec<u64> = self.words.range(addr..end).map(|(&a, _)| a).collect();
        for a in gone {
            self.words.remove(&a);
        }
    }
}

impl Deref for SimDataMemory {
    type Target = SimMemory;

    fn deref(&self) -> &SimMemory {
        &self.sim
    }
}

impl MemoryBackend for SimDataMemory {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        let addr = self.sim.allocate(size)?;
        // Fresh memory: nothing written (the store never outlives memory,
        // so this finds nothing unless a free was missed).
        self.forget(addr, size);
        Ok(addr)
    }

    fn free(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.sim.free(addr, size)?;
        self.forget(addr, size);
        Ok(())
    }

    fn capacity(&self) -> u64 {
        self.sim.capacity()
    }

    fn free_bytes(&self) -> u64 {
        self.sim.free_bytes()
    }

    fn virtual_memory(&mut self) -> Option<&mut dyn VirtualMemory> {
        Some(self)
    }
}

impl VirtualMemory for SimDataMemory {
    fn granularity(&self) -> u64 {
        self.sim.granularity()
    }

    fn reserve(&mut self, size: u64, pages: PageLayout) -> Result<u64, BackendError> {
        self.sim.reserve(size, pages)
    }

    fn map(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.sim.map(addr, size)?;
        self.forget(addr, size);
        Ok(())
    }

    fn unmap(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.sim.unmap(addr, size)?;
        self.forget(addr, size);
        Ok(())
    }

    fn release(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.sim.release(addr, size)
    }

    fn detach_pages(&mut self) -> Option<&mut dyn DetachPages> {
        Some(self)
    }
}

impl DetachPages for SimDataMemory {
    fn detach(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.sim.detach(addr, size)?;
        // The memory belongs to the next mapping now: for anyone reading
        // at the old address, its content is no longer theirs.
        self.forget(addr, size);
        Ok(())
    }

    fn unmap_detached(&mut self, addr: u64, size: u64) -> Result<(), BackendError> {
        self.sim.unmap_detached(addr, size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORD: u64 = SimDataMemory::WORD;

    const MIB: u64 = 1 << 20;

    #[test]
    fn words_live_as_long_as_their_segment() {
        let mut m = SimDataMemory::new(64 * MIB);
        let a = m.allocate(4 * MIB).unwrap();
        assert_eq!(m.read(a).unwrap(), None, "fresh memory");
        m.write(a, 7).unwrap();
        m.write(a + 4 * MIB - WORD, 9).unwrap();
        assert!(m.write(a + 4, 1).is_err(), "unaligned");
        assert!(m.write(a + 4 * MIB, 1).is_err(), "past the segment");
        assert_eq!(m.read(a).unwrap(), Some(7));
        let all: Vec<_> = m.written(a, a + 4 * MIB).collect();
        assert_eq!(all, [(a, 7), (a + 4 * MIB - WORD, 9)]);
        m.free(a, 4 * MIB).unwrap();
        assert!(m.is_empty() && m.read(a).is_err(), "gone with the segment");
        assert_eq!(
            (m.used(), m.allocs, m.frees),
            (0, 1, 1),
            "reads as SimMemory"
        );
    }

    #[test]
    fn words_go_with_unmapped_and_detached_pages() {
        let mut m = SimDataMemory::new(64 * MIB);
        let vm = m.virtual_memory().unwrap();
        let r = vm.reserve(16 * MIB, PageLayout::uniform(2 * MIB)).unwrap();
        vm.map(r, 8 * MIB).unwrap();
        for page in 0..4 {
            m.write(r + page * 2 * MIB, page).unwrap();
        }
        m.unmap(r, 2 * MIB).unwrap();
        m.detach(r + 2 * MIB, 2 * MIB).unwrap();
        assert_eq!(m.len(), 2);
        m.map(r, 2 * MIB).unwrap();
        assert_eq!(m.read(r).unwrap(), None, "mapped again: fresh memory");
        assert!(m.read(r + 2 * MIB).is_err(), "detached: not usable here");
        assert_eq!(m.read(r + 4 * MIB).unwrap(), Some(2));
        m.unmap_detached(r + 2 * MIB, 2 * MIB).unwrap();
        m.unmap(r, 2 * MIB).unwrap();
        m.unmap(r + 4 * MIB, 4 * MIB).unwrap();
        assert!(m.is_empty());
        m.release(r, 16 * MIB).unwrap();
    }
}
