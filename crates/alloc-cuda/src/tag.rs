//! The [`Tag`] handle: a sleep tag of an allocator, whose allocations go
//! to the tag's pool and that pauses and resumes it. The handle holds the
//! allocator, so it sits above it and above the sleep part with its
//! constructor ([`SleepWake::tag`]); pausing and resuming are
//! `sleep_wake.rs`'s, the host copies `sleep.rs`'s.

use std::sync::Arc;

use alloc_core::{Backup, PauseReport, Policy, PoolId, ResumeReport, TagInfo};
use alloc_policy::AnyPolicy;
use cudarc::driver::{CudaStream, DeviceRepr, ValidAsZeroBits};

use crate::allocator::CudaAllocator;
use crate::buffer::{DeviceBuffer, Plain};
use crate::error::CudaError;
use crate::sleep_wake::SleepWake;
use crate::stream::AsStream;

/// A sleep tag of a [`CudaAllocator`]: a handle (cheap to clone) whose
/// allocations go to the tag's pool, and that pauses and resumes it.
///
/// ```no_run
/// use alloc_cuda::{Backup, CudaAllocator};
///
/// let alloc = CudaAllocator::global(0)?;
/// let stream = alloc.context().new_stream()?;
/// let kv = alloc.sleep().tag("kv_cache")?;
/// let cache = kv.alloc_zeros::<f32>(1 << 28, &stream)?; // 1 GiB, in the tag's pool
/// let addr = cache.device_address();
///
/// kv.pause(Backup::Host)?; // contents to pinned host memory, pages to the driver
/// // ... another model uses the GPU ...
/// kv.resume()?; // fresh pages at the same addresses, contents copied back
/// assert_eq!(cache.device_address(), addr);
/// # Ok::<(), alloc_cuda::CudaError>(())
/// ```
pub struct Tag<P: Policy = AnyPolicy> {
    alloc: CudaAllocator<P>,
    name: Arc<str>,
    pool: PoolId,
}

impl<P: Policy> Clone for Tag<P> {
    fn clone(&self) -> Self {
        Tag {
            alloc: self.alloc.clone(),
            name: self.name.clone(),
            pool: self.pool,
        }
    }
}

impl<P: Policy> std::fmt::Debug for Tag<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tag")
            .field("name", &self.name)
            .field("pool", &self.pool)
            .finish()
    }
}

impl<P: Policy> Tag<P> {
    /// The tag's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tag's private pool.
    pub fn pool(&self) -> PoolId {
        self.pool
    }

    /// The allocator.
    pub fn allocator(&self) -> &CudaAllocator<P> {
        &self.alloc
    }

    /// [`CudaAllocator::malloc`] from the tag's pool; fails while paused.
    pub fn malloc<S: AsStream + ?Sized>(&self, size: u64, stream: &S) -> Result<u64, CudaError> {
        self.alloc.malloc_in_pool(size, stream, Some(self.pool))
    }

    /// [`CudaAllocator::alloc`] from the tag's pool.
    pub fn alloc<T: Plain>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceBuffer<T, P>, CudaError> {
        self.alloc.alloc_block(len, stream, Some(self.pool))
    }

    /// [`CudaAllocator::alloc_zeros`] from the tag's pool.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceBuffer<T, P>, CudaError> {
        self.alloc.alloc_zeros_in(len, stream, Some(self.pool))
    }

    /// [`CudaAllocator::alloc_from_host`] from the tag's pool.
    pub fn alloc_from_host<T: DeviceRepr>(
        &self,
        data: &[T],
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceBuffer<T, P>, CudaError> {
        self.alloc.alloc_from_host_in(data, stream, Some(self.pool))
    }

    /// [`SleepWake::pause`] of this tag.
    pub fn pause(&self, backup: Backup) -> Result<PauseReport, CudaError> {
        self.alloc.sleep().pause(&self.name, backup)
    }

    /// [`SleepWake::resume`] of this tag.
    pub fn resume(&self) -> Result<ResumeReport, CudaError> {
        self.alloc.sleep().resume(&self.name)
    }

    /// The tag's state and memory.
    pub fn info(&self) -> Result<TagInfo, CudaError> {
        let tags = self.alloc.sleep().tags()?;
        tags.into_iter()
            .find(|t| t.name == *self.name)
            .ok_or(CudaError::Unsupported("the tag vanished"))
    }
}

impl<P: Policy> SleepWake<'_, P> {
    /// The sleep tag `name`, created on first use: allocations through the
    /// returned handle go to its private pool (growable segments on the
    /// driver's virtual-memory API, whatever `expandable_segments` says).
    pub fn tag(&self, name: &str) -> Result<Tag<P>, CudaError> {
        let pool = self.alloc.engine()?.tag_pool(name)?;
        Ok(Tag {
            alloc: self.alloc.clone(),
            name: name.into(),
            pool,
        })
    }
}
