//! Sleep and wake, reached as `alloc.sleep()`: the allocator's sleep tags
//! (each a private pool on growable segments), which give their physical
//! memory back ([`SleepWake::pause`]) and take fresh memory at the same
//! addresses ([`SleepWake::resume`]). The engine decides what is paused;
//! the host copies of live blocks are [`crate::sleep`]'s `HostBackups`,
//! which the allocator holds. The [`crate::Tag`] handle of one tag is made
//! by [`SleepWake::tag`] (in `tag.rs`, above this file).

use std::sync::Arc;

use alloc_core::{Backup, PauseReport, Policy, PoolId, ResumeReport, TagInfo};

use crate::allocator::CudaAllocator;
use crate::error::CudaError;
use crate::pinned::PinnedAllocator;

/// The sleep tags of a [`CudaAllocator`] (from [`CudaAllocator::sleep`]).
///
/// ```no_run
/// use alloc_cuda::{Backup, CudaAllocator};
///
/// let alloc = CudaAllocator::global(0)?;
/// let stream = alloc.context().new_stream()?;
/// let kv = alloc.sleep().tag("kv_cache")?;
/// let ptr = kv.malloc(1 << 30, &stream)?;
/// alloc.sleep().pause("kv_cache", Backup::Host)?;
/// assert!(alloc.sleep().tags()?.iter().any(|t| t.name == "kv_cache" && t.paused));
/// alloc.sleep().resume("kv_cache")?; // same addresses, contents copied back
/// alloc.free(ptr)?;
/// # Ok::<(), alloc_cuda::CudaError>(())
/// ```
pub struct SleepWake<'a, P: Policy> {
    pub(crate) alloc: &'a CudaAllocator<P>,
}

impl<P: Policy> CudaAllocator<P> {
    /// The allocator's sleep tags: pause and resume them.
    pub fn sleep(&self) -> SleepWake<'_, P> {
        SleepWake { alloc: self }
    }
}

impl<P: Policy> SleepWake<'_, P> {
    /// Makes the existing private pool `pool` (a PyTorch `MemPool` with no
    /// segment yet) the pool of the new sleep tag `name`.
    pub fn bind_tag(&self, name: &str, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.alloc.engine()?.bind_tag(name, pool)?)
    }

    /// Every sleep tag with its state and memory.
    pub fn tags(&self) -> Result<Vec<TagInfo>, CudaError> {
        Ok(self.alloc.engine()?.tags())
    }

    /// The process-wide pinned host allocator that backups go to.
    pub fn pinned_allocator(&self) -> Result<Arc<PinnedAllocator>, CudaError> {
        PinnedAllocator::global()
    }

    /// Pauses the sleep tag `tag`: waits (host, through events) for the
    /// streams that used its blocks, never the whole device; with
    /// [`Backup::Host`] copies its live blocks to pinned host memory; then
    /// unmaps and releases every page of its segments (`cuMemUnmap`,
    /// `cuMemRelease`), keeping the address ranges. `cuMemGetInfo` shows
    /// the memory given back. Allocating from the tag fails until
    /// [`SleepWake::resume`]; freeing its blocks is fine.
    pub fn pause(&self, tag: &str, backup: Backup) -> Result<PauseReport, CudaError> {
        self.alloc
            .host_backups()
            .pause(self.alloc.context(), || self.alloc.engine(), tag, backup)
    }

    /// Resumes the paused sleep tag `tag`: maps fresh memory at the same
    /// addresses (freeing this allocator's other idle cache first if the
    /// device is full) and copies host backups back before returning.
    /// Out of memory leaves the tag paused, its backup kept.
    pub fn resume(&self, tag: &str) -> Result<ResumeReport, CudaError> {
        self.alloc
            .host_backups()
            .resume(self.alloc.context(), || self.alloc.engine(), tag)
    }
}

/// Over a driver: the null driver (`crates/alloc-cuda/null-driver/run.sh
/// --tests`, no GPU) or a GPU.
#[cfg(test)]
mod null_driver_tests {
    use super::*;

    #[test]
    #[ignore = "needs a driver: crates/alloc-cuda/null-driver/run.sh --tests"]
    fn tags_are_bound_by_name_where_the_device_has_virtual_memory() {
        let alloc = CudaAllocator::with_config_str(0, "").unwrap();
        let sleep = alloc.sleep();
        assert!(sleep.tags().unwrap().is_empty());
        let pool = (9, 1);
        alloc.pools().retain(pool).unwrap();
        match sleep.bind_tag("weights", pool) {
            // A GPU: the pool is the tag's now.
            Ok(()) => {
                let tags = sleep.tags().unwrap();
                assert_eq!(tags.len(), 1);
                assert_eq!((tags[0].name.as_str(), tags[0].pool), ("weights", pool));
                assert!(!tags[0].paused);
                assert!(sleep.bind_tag("weights", (9, 2)).is_err(), "bound twice");
                assert_eq!(sleep.tag("weights").unwrap().pool(), pool);
            }
            // The null driver, without virtual memory: no tag at all.
            Err(e) => {
                assert!(e.to_string().contains("growable segments"), "{e}");
                assert!(sleep.tag("kv").is_err());
                assert!(sleep.tags().unwrap().is_empty());
            }
        }
        assert!(sleep.pause("nobody", Backup::None).is_err());
        assert!(sleep.resume("nobody").is_err());
        alloc.diagnostics().validate().unwrap().unwrap();
    }
}
