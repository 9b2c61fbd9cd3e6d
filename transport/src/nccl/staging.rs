//! The host path's staging buffers on the GPU (grown on demand, kept between calls) and the
//! copies through them.

use super::device::NcclComm;
use super::error::NcclError;
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::sys;
use tessera_kernels::cuda::{Buf, DPtr};

/// An element type NCCL moves for us.
pub(super) trait Elem: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    const DT: sys::ncclDataType_t;
    const BYTES: u64;
    fn slots(s: &mut Staging) -> &mut Slots<Self>;
}

/// A pair of staging buffers, grown on demand and kept between calls.
pub(super) struct Slots<T: DeviceRepr> {
    a: Option<Buf<T>>,
    b: Option<Buf<T>>,
}

impl<T: DeviceRepr> Default for Slots<T> {
    fn default() -> Self {
        Slots { a: None, b: None }
    }
}

#[derive(Default)]
pub(super) struct Staging {
    f32s: Slots<f32>,
    f64s: Slots<f64>,
    u64s: Slots<u64>,
}

impl Elem for f32 {
    const DT: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
    const BYTES: u64 = 4;
    fn slots(s: &mut Staging) -> &mut Slots<Self> {
        &mut s.f32s
    }
}

impl Elem for f64 {
    const DT: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat64;
    const BYTES: u64 = 8;
    fn slots(s: &mut Staging) -> &mut Slots<Self> {
        &mut s.f64s
    }
}

impl Elem for u64 {
    const DT: sys::ncclDataType_t = sys::ncclDataType_t::ncclUint64;
    const BYTES: u64 = 8;
    fn slots(s: &mut Staging) -> &mut Slots<Self> {
        &mut s.u64s
    }
}

impl NcclComm {
    /// A staging buffer of `n` elements (slot `b` when `second`).
    pub(super) fn stage<T: Elem>(&mut self, n: usize, second: bool) -> Result<DPtr<T>, NcclError> {
        let slots = T::slots(&mut self.staging);
        let slot = if second { &mut slots.b } else { &mut slots.a };
        if slot.as_ref().is_none_or(|b| b.len() < n) {
            *slot = None;
            *slot = Some(self.gpu.alloc::<T>(n)?);
        }
        Ok(slot.as_ref().expect("allocated above").slice(0..n))
    }

    /// Host → device on the compute stream (the host slice may be reused on return: pageable
    /// copies are staged by the driver).
    pub(super) fn htod<T: Elem>(&self, dst: DPtr<T>, src: &[T]) -> Result<(), NcclError> {
        assert_eq!(dst.len, src.len(), "staging copy of {} elements into {}", src.len(), dst.len);
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` covers `src.len()` elements of a live staging buffer.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.raw, src, self.gpu.stream.cu_stream()) }
            .map_err(tessera_kernels::cuda::drv("copying host → device for NCCL"))?;
        Ok(())
    }

    /// Device → host once the stream has been waited for.
    pub(super) fn dtoh<T: Elem>(&self, dst: &mut [T], src: DPtr<T>) -> Result<(), NcclError> {
        assert_eq!(dst.len(), src.len, "staging copy of {} elements into {}", src.len, dst.len());
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` covers `dst.len()` elements; the stream that wrote it has completed.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, src.raw) }
            .map_err(tessera_kernels::cuda::drv("copying device → host for NCCL"))?;
        Ok(())
    }
}
