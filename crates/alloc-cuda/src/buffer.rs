//! Typed device buffers owning one allocator block, usable with cudarc.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchArgs, PushKernelArg,
    SyncOnDrop, ValidAsZeroBits,
};

use alloc_core::{Policy, PoolId};
use alloc_policy::AnyPolicy;

use crate::allocator::CudaAllocator;
use crate::driver;
use crate::error::{driver_error, CudaError};

mod sealed {
    pub trait Sealed {}
}

/// Element types for which every bit pattern is a valid value: a buffer of
/// them may be handed out uninitialised and filled byte-wise.
pub trait Plain: DeviceRepr + Copy + sealed::Sealed {}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Plain for $t {}
    )*};
}
plain!(u8, i8, u16, i16, u32, i32, u64, i64, u128, i128, usize, isize, f32, f64);

/// `len` elements of `T` in device memory, owning one block of a
/// [`CudaAllocator`]; the block goes back to the allocator when the buffer
/// is dropped (stream-ordered: reusable at once by later work on the
/// buffer's stream, by other streams only once the streams recorded with
/// [`DeviceBuffer::record_stream`] are done).
///
/// Works with cudarc: `stream.memcpy_htod(&host, &mut buf)`,
/// `stream.memcpy_dtoh(&buf, &mut host)`, and `launch_builder(..).arg(&buf)`.
/// Using the buffer on a stream other than its own is ordered by the caller
/// (as in PyTorch) and must be declared with [`DeviceBuffer::record_stream`]
/// before the buffer is dropped.
///
/// ```no_run
/// use alloc_cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::global(0)?;
/// let producer = alloc.context().new_stream()?;
/// let consumer = alloc.context().new_stream()?;
/// let mut buf = alloc.alloc_from_host(&[1.0f32, 2.0, 3.0], &producer)?;
/// consumer.join(&producer)?; // the consumer runs after the copy
/// buf.record_stream(&consumer)?; // and the allocator knows it uses the block
/// let mut out = [0f32; 3];
/// consumer.memcpy_dtoh(&buf, &mut out)?;
/// drop(buf); // reusable once the consumer's copy is done
/// consumer.synchronize()?;
/// assert_eq!(out, [1.0, 2.0, 3.0]);
/// # Ok::<(), alloc_cuda::CudaError>(())
/// ```
pub struct DeviceBuffer<T, P: Policy = AnyPolicy> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    alloc: CudaAllocator<P>,
    _elem: PhantomData<T>,
}

impl<T, P: Policy> std::fmt::Debug for DeviceBuffer<T, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field(
                "stream",
                &format_args!("{:#x}", crate::stream_id(&self.stream)),
            )
            .finish()
    }
}

impl<P: Policy> CudaAllocator<P> {
    /// A buffer of `len` elements on `stream` from the private `pool` if
    /// one is given (a sleep tag's), contents unspecified.
    pub(crate) fn alloc_block<T>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
        pool: Option<PoolId>,
    ) -> Result<DeviceBuffer<T, P>, CudaError> {
        let elem_size = std::mem::size_of::<T>();
        let bytes = len
            .checked_mul(elem_size)
            .and_then(|b| u64::try_from(b).ok())
            .ok_or(CudaError::SizeOverflow { len, elem_size })?;
        let ptr = self.malloc_buffer(bytes, stream, pool)?;
        Ok(DeviceBuffer {
            ptr,
            len,
            stream: stream.clone(),
            alloc: self.clone(),
            _elem: PhantomData,
        })
    }

    /// [`CudaAllocator::alloc_zeros`] from `pool`.
    pub(crate) fn alloc_zeros_in<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
        pool: Option<PoolId>,
    ) -> Result<DeviceBuffer<T, P>, CudaError> {
        let buf = self.alloc_block::<T>(len, stream, pool)?;
        buf.memset_own_stream(0)?;
        Ok(buf)
    }

    /// [`CudaAllocator::alloc_from_host`] from `pool`.
    pub(crate) fn alloc_from_host_in<T: DeviceRepr>(
        &self,
        data: &[T],
        stream: &Arc<CudaStream>,
        pool: Option<PoolId>,
    ) -> Result<DeviceBuffer<T, P>, CudaError> {
        let mut buf = self.alloc_block::<T>(data.len(), stream, pool)?;
        buf.copy_from_host(data)?;
        Ok(buf)
    }

    /// A buffer of `len` elements for use on `stream`, contents unspecified
    /// (whatever the block held before).
    pub fn alloc<T: Plain>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceBuffer<T, P>, CudaError> {
        self.alloc_block(len, stream, None)
    }

    /// A buffer of `len` zeroed elements (a `cuMemsetD8Async` on `stream`).
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceBuffer<T, P>, CudaError> {
        self.alloc_zeros_in(len, stream, None)
    }

    /// A buffer holding a copy of `data` (copied on `stream`).
    pub fn alloc_from_host<T: DeviceRepr>(
        &self,
        data: &[T],
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceBuffer<T, P>, CudaError> {
        self.alloc_from_host_in(data, stream, None)
    }
}

impl<T, P: Policy> DeviceBuffer<T, P> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer has no elements (never: zero-sized requests are
    /// refused by the allocator).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device address (`CUdeviceptr`).
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// The stream the buffer was allocated on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The allocator owning the block.
    pub fn allocator(&self) -> &CudaAllocator<P> {
        &self.alloc
    }

    /// Declares that work on `stream` uses the buffer: when the buffer is
    /// dropped, an event is recorded on `stream` and the block is reused
    /// only after that work (PyTorch's `Tensor.record_stream`). The
    /// allocator keeps the stream alive until then.
    pub fn record_stream(&mut self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        self.alloc.record_stream(self.ptr, stream)
    }

    /// Copies `data` into the buffer on its stream (lengths must match).
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<(), CudaError>
    where
        T: DeviceRepr,
    {
        if data.len() != self.len {
            return Err(CudaError::LengthMismatch {
                device: self.len,
                host: data.len(),
            });
        }
        let stream = self.stream.clone();
        stream
            .memcpy_htod(data, self)
            .map_err(|e| driver_error("cuMemcpyHtoDAsync", e.0))
    }

    /// Copies the buffer to a new vector (waits for the buffer's stream).
    pub fn copy_to_host(&self) -> Result<Vec<T>, CudaError>
    where
        T: DeviceRepr,
    {
        let out = self
            .stream
            .clone_dtoh(self)
            .map_err(|e| driver_error("cuMemcpyDtoHAsync", e.0))?;
        self.stream
            .synchronize()
            .map_err(|e| driver_error("cuStreamSynchronize", e.0))?;
        Ok(out)
    }

    fn memset_own_stream(&self, value: u8) -> Result<(), CudaError> {
        driver::bind(self.alloc.context())?;
        // SAFETY: the range is exactly this buffer's block, which stays
        // allocated until the buffer is dropped (the allocator refuses to
        // free it otherwise) and overlaps no other live buffer; it is then
        // reused only in stream order after this memset (same stream) or
        // after events; the stream is alive (held by `self`). Callers ensure `value`
        // repeated is valid for `T` (zero for `ValidAsZeroBits`, any byte
        // for `Plain`).
        unsafe {
            driver::memset_d8_async(self.ptr, value, self.num_bytes(), self.stream.cu_stream())
        }
    }
}

impl<T: Plain, P: Policy> DeviceBuffer<T, P> {
    /// Sets every byte to `value` (`cuMemsetD8Async` on the buffer's stream).
    pub fn fill_bytes(&mut self, value: u8) -> Result<(), CudaError> {
        self.memset_own_stream(value)
    }
}

impl<T, P: Policy> Drop for DeviceBuffer<T, P> {
    fn drop(&mut self) {
        // Cannot fail for a block this buffer owns, except on a driver error
        // while recording events; the engine then keeps the block out of
        // reuse (a leak, never a hazard).
        let _ = self.alloc.free_buffer(self.ptr);
    }
}

impl<T, P: Policy> DeviceSlice<T> for DeviceBuffer<T, P> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T, P: Policy> DevicePtr<T> for DeviceBuffer<T, P> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T, P: Policy> DevicePtrMut<T> for DeviceBuffer<T, P> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

// SAFETY: the kernel receives the buffer's `CUdeviceptr` (a `DeviceRepr`
// u64) by reference to the field, which lives as long as the `'b` borrow of
// the buffer, itself outliving the launch arguments (`'b: 'a`).
unsafe impl<'a, 'b: 'a, T, P: Policy> PushKernelArg<&'b DeviceBuffer<T, P>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuffer<T, P>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

// SAFETY: as for the shared reference above.
unsafe impl<'a, 'b: 'a, T, P: Policy> PushKernelArg<&'b mut DeviceBuffer<T, P>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuffer<T, P>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn buffer_is_send_and_sync() {
        assert_send_sync::<DeviceBuffer<f32>>();
    }
}
