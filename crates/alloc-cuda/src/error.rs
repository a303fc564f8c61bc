//! Typed errors of the CUDA layer.

use std::fmt;

use alloc_core::{AllocError, BackendError, ConfigError};
use cudarc::driver::sys::CUresult;
use cudarc::driver::DriverError;
use thiserror::Error;

/// What [`CudaError::Driver`] names as the call when the error came from a
/// cudarc call through `?` (cudarc's error does not say which call failed).
pub const CUDARC_CALL: &str = "a cudarc driver call";

/// Everything that can go wrong in this crate; never a panic.
///
/// Its `Debug` form is its message (below), so that a `main` returning
/// `Result<(), CudaError>` or `Result<(), Box<dyn Error>>` prints what went
/// wrong and what to do, not a variant's name; match on the variants to tell
/// errors apart.
#[derive(Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum CudaError {
    /// `libcuda` could not be loaded (no NVIDIA driver on this machine).
    #[error(
        "the CUDA driver library (libcuda.so) could not be loaded: this machine has no NVIDIA \
         driver, or the loader does not find it (install the driver, or add the folder that \
         holds libcuda.so.1 to LD_LIBRARY_PATH)"
    )]
    DriverNotFound,
    /// A driver call failed.
    #[error("{call} failed: {code:?} ({})", *code as u32)]
    Driver {
        /// The driver function ([`CUDARC_CALL`] for errors converted from
        /// cudarc's [`DriverError`]).
        call: &'static str,
        /// What it returned.
        code: CUresult,
    },
    /// No device with this ordinal.
    #[error("CUDA device {ordinal} does not exist ({count} device(s) present)")]
    InvalidDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A stream of another context (device) was passed to this allocator.
    #[error("the stream belongs to another CUDA context than device {ordinal}'s primary context")]
    WrongContext {
        /// The allocator's device.
        ordinal: usize,
    },
    /// A stream id given to the engine that was never registered with its
    /// stream backend (see [`crate::StreamHandle`]): it never reaches the
    /// driver.
    #[error(
        "stream {stream:#x} is not registered with this allocator: streams reach the driver \
         only through a StreamHandle (a cudarc stream, or StreamHandle::from_raw)"
    )]
    UnregisteredStream {
        /// The raw id.
        stream: alloc_core::StreamId,
    },
    /// `free` of a block that a live [`crate::DeviceBuffer`] owns.
    #[error("pointer {addr:#x} is owned by a DeviceBuffer: drop the buffer to free it")]
    OwnedByBuffer {
        /// The block's address.
        addr: u64,
    },
    /// The policy handed out a block overlapping a live
    /// [`crate::DeviceBuffer`]'s (a broken policy); the block stays
    /// allocated, out of use.
    #[error(
        "the policy handed out {size} bytes at {addr:#x}, overlapping a live DeviceBuffer: \
         the policy gives a block out twice"
    )]
    OverlappingBlock {
        /// The block's address.
        addr: u64,
        /// Its size.
        size: u64,
    },
    /// A typed buffer whose byte size does not fit in 64 bits.
    #[error("a buffer of {len} elements of {elem_size} bytes is too large")]
    SizeOverflow {
        /// Elements asked for.
        len: usize,
        /// Bytes per element.
        elem_size: usize,
    },
    /// A host slice whose length differs from the device buffer's.
    #[error("length mismatch: device buffer has {device} elements, host slice {host}")]
    LengthMismatch {
        /// Elements of the device buffer.
        device: usize,
        /// Elements of the host slice.
        host: usize,
    },
    /// A feature this crate does not provide (yet).
    #[error("unsupported: {0}")]
    Unsupported(&'static str),
    /// A host range to page-lock overlaps one registered already.
    #[error(
        "host memory {addr:#x}..{end:#x} overlaps {registered:#x}..{registered_end:#x}, which is \
         registered already: unregister that range first"
    )]
    HostRangeRegistered {
        /// Start of the range asked for.
        addr: u64,
        /// End (exclusive) of the range asked for.
        end: u64,
        /// Start of the registered range.
        registered: u64,
        /// End (exclusive) of the registered range.
        registered_end: u64,
    },
    /// An unregister of an address where no registered range starts.
    #[error(
        "host memory at {addr:#x} is not the start of a range registered with the allocator \
         (or was unregistered already)"
    )]
    HostNotRegistered {
        /// The address given.
        addr: u64,
    },
    /// The process-wide allocator of a device was already created.
    #[error(
        "the global allocator of device {ordinal} already exists: configure it before first use"
    )]
    AlreadyInitialized {
        /// The device whose allocator exists.
        ordinal: usize,
    },
    /// A thread panicked while holding the allocator's lock (no lock of
    /// this crate reports it any more: see [`crate::lock`]).
    #[error("allocator lock poisoned: a thread panicked while holding it")]
    Poisoned,
    /// A thread panicked while holding a lock and left the state behind it
    /// failing its own check (see [`crate::lock`]): the operation is refused
    /// rather than run on it.
    #[error("internal state damaged by a panic: {0}")]
    Damaged(String),
    /// The loaded driver library lacks a function this build calls (a
    /// driver older than the CUDA version the library was built for).
    #[error(
        "the loaded CUDA driver has no {call}: it is older than the CUDA version \
         this library was built for (or not a complete driver)"
    )]
    MissingFunction {
        /// The missing entry point.
        call: &'static str,
    },
    /// The engine refused the operation (out of memory, bad pointer, ...).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A configuration string was not accepted.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// The message, as `Display` writes it (see [`CudaError`]).
impl fmt::Debug for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl CudaError {
    /// The engine's out-of-memory report, when this is an out-of-memory error.
    pub fn oom_report(&self) -> Option<&alloc_core::OomReport> {
        match self {
            CudaError::Alloc(AllocError::OutOfMemory(r)) => Some(r),
            _ => None,
        }
    }

    /// The `CUresult` of the failed driver call, as a number, when a driver
    /// call failed: directly, or inside the engine (a segment allocation, an
    /// event). A driver's out of memory seen by the engine is an
    /// out-of-memory error instead, with its report.
    ///
    /// ```
    /// use alloc_cuda::cudarc::driver::{sys::CUresult, DriverError};
    /// use alloc_cuda::CudaError;
    ///
    /// let e = CudaError::from(DriverError(CUresult::CUDA_ERROR_INVALID_VALUE));
    /// assert_eq!(e.driver_code(), Some(1));
    /// assert_eq!(CudaError::DriverNotFound.driver_code(), None);
    /// ```
    pub fn driver_code(&self) -> Option<i32> {
        match self {
            CudaError::Driver { code, .. } => Some(*code as i32),
            CudaError::Alloc(AllocError::Backend(e)) => e.code(),
            _ => None,
        }
    }
}

/// A failed cudarc call, so that `?` works on cudarc's results in functions
/// returning [`CudaError`]; the call is named [`CUDARC_CALL`].
impl From<DriverError> for CudaError {
    fn from(e: DriverError) -> Self {
        driver_error(CUDARC_CALL, e.0)
    }
}

/// A failed driver call as a [`CudaError`]. Formats the code with its `Debug`
/// name, never through the driver (so it works without `libcuda`).
pub(crate) fn driver_error(call: &'static str, code: CUresult) -> CudaError {
    CudaError::Driver { call, code }
}

/// A CUDA-layer failure as the engine's [`BackendError`]: a driver's out of
/// memory stays recognisable so that the engine frees its cache and retries,
/// and other driver failures keep their `CUresult` code.
impl From<CudaError> for BackendError {
    fn from(e: CudaError) -> Self {
        if let CudaError::Driver {
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            ..
        } = e
        {
            return BackendError::OutOfMemory;
        }
        match e.driver_code() {
            Some(code) => BackendError::Driver {
                message: e.to_string(),
                code,
            },
            None => BackendError::Other(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_maps_to_the_engines_oom() {
        let e: BackendError =
            driver_error("cuMemAlloc_v2", CUresult::CUDA_ERROR_OUT_OF_MEMORY).into();
        assert_eq!(e, BackendError::OutOfMemory);
    }

    #[test]
    fn other_driver_errors_name_call_and_code() {
        let e: BackendError =
            driver_error("cuEventRecord", CUresult::CUDA_ERROR_INVALID_HANDLE).into();
        assert_eq!(e.code(), Some(400));
        let msg = e.to_string();
        assert!(msg.contains("cuEventRecord"), "{msg}");
        assert!(msg.contains("CUDA_ERROR_INVALID_HANDLE"), "{msg}");
        assert!(msg.contains("(400)"), "{msg}");
        // Through the engine, the code is still there.
        let e = CudaError::Alloc(AllocError::Backend(e));
        assert_eq!(e.driver_code(), Some(400));
    }

    #[test]
    fn cudarc_errors_convert_with_question_mark() {
        fn failing() -> Result<(), CudaError> {
            Err(DriverError(CUresult::CUDA_ERROR_NOT_INITIALIZED))?;
            Ok(())
        }
        let e = failing().unwrap_err();
        assert_eq!(e.driver_code(), Some(3));
        assert!(e.to_string().starts_with(CUDARC_CALL), "{e}");
        let other: BackendError = CudaError::Unsupported("x").into();
        assert_eq!(other.code(), None);
    }

    #[test]
    fn engine_errors_pass_through_with_their_message() {
        let e: CudaError = AllocError::DoubleFree { addr: 0x1000 }.into();
        assert_eq!(e.to_string(), "double free of pointer 0x1000");
        assert!(e.oom_report().is_none());
        let report = alloc_core::OomReport {
            requested: 1 << 30,
            capacity: 80 << 30,
            device_free: 1 << 20,
            allocated: 0,
            reserved: 0,
            limit: Some(4 << 30),
        };
        let e: CudaError = AllocError::OutOfMemory(Box::new(report.clone())).into();
        assert_eq!(e.oom_report(), Some(&report));
        let msg = e.to_string();
        assert!(msg.contains("80.00 GiB"), "{msg}");
        assert!(msg.contains("memory fraction"), "{msg}");
    }

    #[test]
    fn messages_of_local_errors() {
        assert!(CudaError::InvalidDevice {
            ordinal: 3,
            count: 1
        }
        .to_string()
        .contains("device 3"));
        assert!(CudaError::DriverNotFound.to_string().contains("libcuda"));
    }

    #[test]
    fn a_main_returning_the_error_prints_its_message() {
        // What `fn main() -> Result<(), E>` prints is `Error: {:?}`.
        let message = CudaError::DriverNotFound.to_string();
        assert!(message.contains("install the driver"), "{message}");
        assert_eq!(format!("{:?}", CudaError::DriverNotFound), message);
        let boxed: Box<dyn std::error::Error> = CudaError::DriverNotFound.into();
        assert_eq!(format!("{boxed:?}"), message);
        let engine: CudaError = AllocError::DoubleFree { addr: 0x1000 }.into();
        assert_eq!(format!("{engine:?}"), "double free of pointer 0x1000");
    }
}
