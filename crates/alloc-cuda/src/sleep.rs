//! Sleep and wake on the GPU, the host side: a sleep tag's pool gives its
//! physical memory back (`SleepWake::pause`) and takes it again at the
//! same addresses (`SleepWake::resume`), so that pointers and CUDA
//! graphs captured over them stay valid. The engine decides what is paused
//! and waits for the tag's streams through events
//! (`alloc_core::Engine::pause_tag`); [`HostBackups`] copies live blocks to
//! pinned host memory from the [`PinnedAllocator`] and back, on a stream of its
//! own, and keeps the copies of paused tags.
//!
//! The part knows nothing of the allocator handle: it is given the device's
//! context and a way to lock the engine, so that the allocator (and the
//! [`crate::Tag`] handle over it) can hold it without a circle of files.

use std::collections::HashMap;
use std::ops::DerefMut;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use alloc_core::{BackendError, Backup, PauseReport, Policy, ResumeReport};
use cudarc::driver::{CudaContext, CudaStream};

use crate::driver;
use crate::error::{driver_error, CudaError};
use crate::lock::lock_consistent;
use crate::pinned::{PinnedAllocator, PinnedBuffer};
use crate::CudaEngine;

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

/// Where each block `(address, size)` goes in one host buffer: its offset
/// by address, and the buffer's size (every block starts at a multiple of
/// [`HOST_ALIGN`]).
fn host_layout(blocks: &[(u64, u64)]) -> (HashMap<u64, usize>, u64) {
    let mut offsets = HashMap::with_capacity(blocks.len());
    let mut total = 0u64;
    for &(addr, size) in blocks {
        offsets.insert(addr, total as usize);
        total += size.div_ceil(HOST_ALIGN) * HOST_ALIGN;
    }
    (offsets, total)
}

/// A failure of a copy, in the engine's terms (it stops the pause or
/// resume that asked for it).
fn copy_failed(e: CudaError) -> BackendError {
    BackendError::Other(format!("backup copy: {e}"))
}

/// Whether the engine holds `tag` paused.
fn is_paused<P: Policy>(engine: &CudaEngine<P>, tag: &str) -> bool {
    engine.tags().iter().any(|t| t.name == tag && t.paused)
}

/// The host side of an allocator's sleep tags: the host copies of the
/// paused tags, by name, and the stream they are copied on.
#[derive(Default)]
pub(crate) struct HostBackups {
    copies: Mutex<HashMap<String, HostCopy>>,
    /// The stream backups are copied on (made at the first copy).
    copy_stream: OnceLock<Arc<CudaStream>>,
}

impl HostBackups {
    /// Pauses the sleep tag `tag` of the engine that `lock` locks, on the
    /// device of `ctx`: with [`Backup::Host`] its live blocks are copied to
    /// pinned host memory first and kept until the tag's resume.
    pub(crate) fn pause<P: Policy, G: DerefMut<Target = CudaEngine<P>>>(
        &self,
        ctx: &Arc<CudaContext>,
        lock: impl FnOnce() -> Result<G, CudaError>,
        tag: &str,
        backup: Backup,
    ) -> Result<PauseReport, CudaError> {
        let pinned = match backup {
            Backup::Host => Some(PinnedAllocator::global()?),
            Backup::None => None,
        };
        let copy_stream = self.copy_stream(ctx)?;
        let mut saved: Option<HostCopy> = None;
        let mut engine = lock()?;
        let report = engine.pause_tag(tag, backup, &mut |blocks| {
            let pool = pinned
                .as_ref()
                .expect("host backups have a pinned allocator");
            let (offsets, total) = host_layout(blocks);
            let mut host = pool.alloc(total as usize).map_err(copy_failed)?;
            // The pinned allocator may have bound another device's context.
            driver::bind(ctx).map_err(copy_failed)?;
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
        let paused = is_paused(&engine, tag);
        drop(engine);
        if let Some(copy) = saved.filter(|_| paused) {
            self.copies().insert(tag.to_string(), copy);
        }
        Ok(report?)
    }

    /// Resumes the paused sleep tag `tag` of the engine that `lock` locks
    /// (once for the resume, once after it), copying its host backup back
    /// before returning; a tag left paused keeps its backup.
    pub(crate) fn resume<P: Policy, G: DerefMut<Target = CudaEngine<P>>>(
        &self,
        ctx: &Arc<CudaContext>,
        lock: impl Fn() -> Result<G, CudaError>,
        tag: &str,
    ) -> Result<ResumeReport, CudaError> {
        let saved = self.copies().remove(tag);
        let copy_stream = self.copy_stream(ctx)?;
        let report = lock()?.resume_tag(tag, &mut |blocks| {
            let copy = saved
                .as_ref()
                .ok_or_else(|| BackendError::Other(format!("no host backup of tag {tag}")))?;
            driver::bind(ctx).map_err(copy_failed)?;
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
        let still_paused = is_paused(&*lock()?, tag);
        if let Some(copy) = saved.filter(|_| still_paused) {
            self.copies().insert(tag.to_string(), copy);
        }
        Ok(report?)
    }

    fn copies(&self) -> MutexGuard<'_, HashMap<String, HostCopy>> {
        // A map of whole host copies: each insert or removal leaves it sound.
        lock_consistent(&self.copies)
    }

    /// The stream backups are copied on, made in `ctx` at the first use.
    fn copy_stream(&self, ctx: &Arc<CudaContext>) -> Result<&Arc<CudaStream>, CudaError> {
        if let Some(s) = self.copy_stream.get() {
            return Ok(s);
        }
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("cuStreamCreate", e.0))?;
        Ok(self.copy_stream.get_or_init(|| stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_laid_out_aligned_in_one_host_buffer() {
        let (offsets, total) = host_layout(&[(0x9000, 1), (0x1000, 256), (0x5000, 257)]);
        assert_eq!(offsets[&0x9000], 0);
        assert_eq!(offsets[&0x1000], 256, "one byte takes one aligned slot");
        assert_eq!(offsets[&0x5000], 512);
        assert_eq!(total, 512 + 512, "257 bytes take two slots");
        let (offsets, total) = host_layout(&[]);
        assert!(offsets.is_empty());
        assert_eq!(total, 0);
    }
}
