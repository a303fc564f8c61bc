//! Typed errors: every failure a caller can cause or meet is a value, never a panic.

use thiserror::Error;

use crate::stats::human_bytes;

/// What went wrong in a memory or stream backend.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The device has no room for the requested segment.
    #[error("device out of memory")]
    OutOfMemory,
    /// A driver call failed with a status code (a `CUresult` for CUDA).
    #[error("{message}")]
    Driver {
        /// The call and its status, as text.
        message: String,
        /// The driver's numeric status code.
        code: i32,
    },
    /// Any other failure, with its description.
    #[error("{0}")]
    Other(String),
}

impl BackendError {
    /// The driver's status code, when a driver call failed.
    ///
    /// ```
    /// use alloc_core::BackendError;
    ///
    /// let e = BackendError::Driver { message: "cuMemAlloc_v2 failed".into(), code: 2 };
    /// assert_eq!(e.code(), Some(2));
    /// assert_eq!(BackendError::OutOfMemory.code(), None);
    /// ```
    pub fn code(&self) -> Option<i32> {
        match self {
            BackendError::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// The figures reported with an out-of-memory error, like PyTorch's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomReport {
    /// Bytes the caller asked for.
    pub requested: u64,
    /// Total memory of the device.
    pub capacity: u64,
    /// Bytes the device reports free.
    pub device_free: u64,
    /// Bytes handed out to callers by this allocator.
    pub allocated: u64,
    /// Bytes reserved from the device by this allocator.
    pub reserved: u64,
    /// The reserved-bytes limit set by a memory fraction, if any.
    pub limit: Option<u64>,
}

impl std::fmt::Display for OomReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tried to allocate {}; device has a total capacity of {} of which {} is free; \
             {} is allocated by this allocator and {} is reserved but unallocated",
            human_bytes(self.requested),
            human_bytes(self.capacity),
            human_bytes(self.device_free),
            human_bytes(self.allocated),
            human_bytes(self.reserved.saturating_sub(self.allocated)),
        )?;
        if let Some(limit) = self.limit {
            write!(
                f,
                "; the memory fraction limits reserved memory to {}",
                human_bytes(limit)
            )?;
        }
        Ok(())
    }
}

/// Errors of the allocator's public operations.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum AllocError {
    /// No memory could be found even after freeing the cache.
    #[error("out of memory: {0}")]
    OutOfMemory(Box<OomReport>),
    /// The pointer was never handed out by this allocator (or not at a block start).
    #[error("pointer {addr:#x} was not allocated by this allocator")]
    UnknownPointer {
        /// The offending address.
        addr: u64,
    },
    /// The pointer belongs to a block that is already free.
    #[error("double free of pointer {addr:#x}")]
    DoubleFree {
        /// The offending address.
        addr: u64,
    },
    /// A size of zero, or larger than any device could hold.
    #[error("invalid allocation size {size}: {reason}")]
    InvalidSize {
        /// The requested size.
        size: u64,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A private pool that nothing holds: allocations may name a pool only
    /// between its creation (a holder: `retain_pool`, a routing begun with
    /// `begin_allocate_to_pool`, a sleep tag) and its last release.
    #[error(
        "unknown private pool {pool:?}: create it first (retain_pool or \
         begin_allocate_to_pool); a pool released by its last holder is gone"
    )]
    UnknownPool {
        /// The pool's id.
        pool: crate::types::PoolId,
    },
    /// An argument other than a size was out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A sleep tag's state forbids the operation: allocating from a paused
    /// tag, pausing it twice, resuming one that is not paused, an unknown
    /// tag.
    #[error("sleep tag \"{tag}\" {reason}")]
    Tag {
        /// The tag's name.
        tag: String,
        /// What is wrong, as the end of a sentence.
        reason: &'static str,
    },
    /// The memory or stream backend failed.
    #[error("backend failure: {0}")]
    Backend(#[from] BackendError),
    /// A configuration string could not be parsed.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}
