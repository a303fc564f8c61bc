//! Sleep and wake on the GPU: a sleep tag's pool gives its physical memory
//! back ([`CudaAllocator::pause`]) and takes it again at the same addresses
//! ([`CudaAllocator::resume`]), so that pointers and CUDA graphs captured
//! over them stay valid. The engine decides what is paused and waits for
//! the tag's streams through events (`alloc_core::Engine::pause_tag`); this
//! module copies live blocks to pinned host memory from the
//! [`PinnedPool`] and back, on a stream of its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use alloc_core::{BackendError, Backup, PauseReport, Policy, PoolId, ResumeReport, TagInfo};
use alloc_policy::AnyPolicy;
use cudarc::driver::{CudaStream, DeviceRepr, ValidAsZeroBits};

use crate::allocator::CudaAllocator;
use crate::buffer::{DeviceBuffer, Plain};
use crate::driver;
use crate::error::{driver_error, CudaError};
use crate::pinned::{PinnedBuffer, PinnedPool};
use crate::stream::AsStream;

/// The host copy of a paused tag: one pinned buffer with every saved block
/// at its offset (one host allocation per pause, reused from the pinned
/// pool's cache by the next pause of a tag about as large).
struct HostCopy {
    host: PinnedBuffer,
    /// Device address -> offset in `host`.
    offsets: HashMap<u64, usize>,
}

/// Saved blocks start at multiples of this in the host buffer.
const HOST_ALIGN: u64 = 256;

/// The host copies of the paused tags, by name.
type Backups = HashMap<String, HostCopy>;

/// The host side of an allocator's sleep tags.
#[derive(Default)]
pub(crate) struct SleepState {
    backups: Mutex<Backups>,
    /// The stream backups are copied on (made at the first copy).
    copy_stream: OnceLock<Arc<CudaStream>>,
}

/// A sleep tag of a [`CudaAllocator`]: a handle (cheap to clone) whose
/// allocations go to the tag's pool, and that pauses and resumes it.
///
/// ```no_run
/// use alloc_cuda::{Backup, CudaAllocator};
///
/// let alloc = CudaAllocator::global(0)?;
/// let stream = alloc.context().new_stream()?;
/// let kv = alloc.tag("kv_cache")?;
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

    /// [`CudaAllocator::pause`] of this tag.
    pub fn pause(&self, backup: Backup) -> Result<PauseReport, CudaError> {
        self.alloc.pause(&self.name, backup)
    }

    /// [`CudaAllocator::resume`] of this tag.
    pub fn resume(&self) -> Result<ResumeReport, CudaError> {
        self.alloc.resume(&self.name)
    }

    /// The tag's state and memory.
    pub fn info(&self) -> Result<TagInfo, CudaError> {
        let tags = self.alloc.tags()?;
        tags.into_iter()
            .find(|t| t.name == *self.name)
            .ok_or(CudaError::Unsupported("the tag vanished"))
    }
}

/// A failure of a copy, in the engine's terms (it stops the pause or
/// resume that asked for it).
fn copy_failed(e: CudaError) -> BackendError {
    BackendError::Other(format!("backup copy: {e}"))
}

impl<P: Policy> CudaAllocator<P> {
    /// The sleep tag `name`, created on first use: allocations through the
    /// returned handle go to its private pool (growable segments on the
    /// driver's virtual-memory API, whatever `expandable_segments` says).
    pub fn tag(&self, name: &str) -> Result<Tag<P>, CudaError> {
        let pool = self.engine()?.tag_pool(name)?;
        Ok(Tag {
            alloc: self.clone(),
            name: name.into(),
            pool,
        })
    }

    /// Makes the existing private pool `pool` (a PyTorch `MemPool` with no
    /// segment yet) the pool of the new sleep tag `name`.
    pub fn bind_tag(&self, name: &str, pool: PoolId) -> Result<(), CudaError> {
        Ok(self.engine()?.bind_tag(name, pool)?)
    }

    /// Every sleep tag with its state and memory.
    pub fn tags(&self) -> Result<Vec<TagInfo>, CudaError> {
        Ok(self.engine()?.tags())
    }

    /// The process-wide pinned host pool that backups go to.
    pub fn pinned_pool(&self) -> Result<Arc<PinnedPool>, CudaError> {
        PinnedPool::global()
    }

    /// Pauses the sleep tag `tag`: waits (host, through events) for the
    /// streams that used its blocks, never the whole device; with
    /// [`Backup::Host`] copies its live blocks to pinned host memory; then
    /// unmaps and releases every page of its segments (`cuMemUnmap`,
    /// `cuMemRelease`), keeping the address ranges. `cuMemGetInfo` shows
    /// the memory given back. Allocating from the tag fails until
    /// [`CudaAllocator::resume`]; freeing its blocks is fine.
    pub fn pause(&self, tag: &str, backup: Backup) -> Result<PauseReport, CudaError> {
        let pinned = match backup {
            Backup::Host => Some(self.pinned_pool()?),
            Backup::None => None,
        };
        let copy_stream = self.copy_stream()?;
        let mut saved: Option<HostCopy> = None;
        let mut engine = self.engine()?;
        let report = engine.pause_tag(tag, backup, &mut |blocks| {
            let pool = pinned.as_ref().expect("host backups have a pinned pool");
            let mut offsets = HashMap::with_capacity(blocks.len());
            let mut total = 0u64;
            for &(addr, size) in blocks {
                offsets.insert(addr, total as usize);
                total += size.div_ceil(HOST_ALIGN) * HOST_ALIGN;
            }
            let mut host = pool.alloc(total as usize).map_err(copy_failed)?;
            // The pinned pool may have bound another device's context.
            driver::bind(self.context()).map_err(copy_failed)?;
            for &(addr, size) in blocks {
                // SAFETY: the host buffer holds `total` pinned bytes, the
                // block's `size` among them at its offset, and lives until
                // the stream is synchronized below; `addr..addr + size` is a
                // live block, mapped, that no queued work uses any more (the
                // engine waited for its streams).
                unsafe {
                    driver::copy_to_host_async(
                        host.as_mut_ptr().add(offsets[&addr]),
                        addr,
                        size as usize,
                        copy_stream.cu_stream(),
                    )
                }
                .map_err(copy_failed)?;
            }
            let synced = copy_stream
                .synchronize()
                .map_err(|e| copy_failed(driver_error("cuStreamSynchronize", e.0)));
            saved = Some(HostCopy { host, offsets });
            synced
        });
        // A pause that failed after saving may still have paused the tag
        // (pages unmapped midway): keep the backup for its resume then.
        let paused = engine.tags().iter().any(|t| t.name == tag && t.paused);
        drop(engine);
        if let Some(copy) = saved.filter(|_| paused) {
            self.backups()?.insert(tag.to_string(), copy);
        }
        Ok(report?)
    }

    /// Resumes the paused sleep tag `tag`: maps fresh memory at the same
    /// addresses (freeing this allocator's other idle cache first if the
    /// device is full) and copies host backups back before returning.
    /// Out of memory leaves the tag paused, its backup kept.
    pub fn resume(&self, tag: &str) -> Result<ResumeReport, CudaError> {
        let saved = self.backups()?.remove(tag);
        let copy_stream = self.copy_stream()?;
        let report = self.engine()?.resume_tag(tag, &mut |blocks| {
            let copy = saved
                .as_ref()
                .ok_or_else(|| BackendError::Other(format!("no host backup of tag {tag}")))?;
            driver::bind(self.context()).map_err(copy_failed)?;
            for &(addr, size) in blocks {
                let offset = *copy
                    .offsets
                    .get(&addr)
                    .ok_or_else(|| BackendError::Other(format!("no backup of {addr:#x}")))?;
                // SAFETY: the host buffer holds the block's saved bytes at
                // `offset` and lives until the stream is synchronized below;
                // the block was just mapped again and nothing uses it yet.
                unsafe {
                    driver::copy_to_device_async(
                        addr,
                        copy.host.as_ptr().add(offset),
                        size as usize,
                        copy_stream.cu_stream(),
                    )
                }
                .map_err(copy_failed)?;
            }
            copy_stream
                .synchronize()
                .map_err(|e| copy_failed(driver_error("cuStreamSynchronize", e.0)))
        });
        let still_paused = self
            .engine()?
            .tags()
            .iter()
            .any(|t| t.name == tag && t.paused);
        if let Some(copy) = saved.filter(|_| still_paused) {
            self.backups()?.insert(tag.to_string(), copy);
        }
        Ok(report?)
    }

    fn backups(&self) -> Result<std::sync::MutexGuard<'_, Backups>, CudaError> {
        // A map of whole host copies: each insert or removal leaves it sound.
        Ok(crate::lock::lock_consistent(&self.inner.sleep.backups))
    }

    /// The stream backups are copied on.
    fn copy_stream(&self) -> Result<&Arc<CudaStream>, CudaError> {
        if let Some(s) = self.inner.sleep.copy_stream.get() {
            return Ok(s);
        }
        let stream = self
            .context()
            .new_stream()
            .map_err(|e| driver_error("cuStreamCreate", e.0))?;
        Ok(self.inner.sleep.copy_stream.get_or_init(|| stream))
    }
}
