//! The setting a CUDA device gets when kandle opens it ([`super::cuda`]), at no cost: **the
//! memory pool keeps what is freed.** Candle allocates with `cuMemAllocAsync` from the device's
//! default memory pool, whose release threshold is zero: at every synchronisation (each step
//! reads its loss) the pool hands its unused memory back to the driver, and the next step maps
//! it again. With the threshold raised to "never", freed blocks stay in the pool for the next
//! step, as PyTorch's caching allocator keeps them.
//!
//! cudarc's per-buffer event tracking (an event recorded at each use of a buffer, two driver
//! calls per operand of every op, since candle runs each device on a stream of its own) stays
//! on: candle copies a tensor between two CUDA devices on the destination's stream
//! (`clone_dtod`), and only those events make that copy wait for the source's stream, which
//! Mirrored's replicas rely on.
//!
//! `KANDLE_CUDA_SETTINGS=default` leaves the pool at the driver's default, to compare.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::Device;

use crate::{Error, Result};

/// The environment variable that, set to `default`, leaves a device's pool alone.
pub const SETTINGS_VAR: &str = "KANDLE_CUDA_SETTINGS";

/// Applies kandle's setting to the CUDA device `device` just opened, unless [`SETTINGS_VAR`] is
/// `default`. Does nothing to other devices.
pub(super) fn apply(device: &Device) -> Result<()> {
    let Device::Cuda(cuda) = device else {
        return Ok(());
    };
    if std::env::var(SETTINGS_VAR).is_ok_and(|v| v.trim().eq_ignore_ascii_case("default")) {
        return Ok(());
    }
    keep_freed_memory(cuda.cuda_stream().context().cu_device())
}

/// Raises the release threshold of `device`'s default memory pool to the largest value, so
/// freed memory stays in the pool across synchronisations.
#[allow(unsafe_code)]
fn keep_freed_memory(device: sys::CUdevice) -> Result<()> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid place for the driver to write the handle of `device`'s default
    // pool; `device` is a device handle of an opened context.
    let got = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, device) };
    check(got, "cuDeviceGetDefaultMemPool")?;
    let mut threshold = u64::MAX;
    // SAFETY: `pool` is the handle just returned; the release threshold attribute takes a
    // `cuuint64_t`, which `threshold` is, and the driver only reads it during the call.
    let set = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    };
    check(set, "cuMemPoolSetAttribute(RELEASE_THRESHOLD)")
}

/// The release threshold of `device`'s default memory pool.
#[cfg(test)]
pub(super) fn release_threshold(device: &Device) -> Result<u64> {
    pool_attribute(
        device,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
    )
}

/// The memory `device`'s default pool holds from the driver, in bytes.
#[cfg(test)]
pub(super) fn reserved_bytes(device: &Device) -> Result<u64> {
    pool_attribute(
        device,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
    )
}

/// A `cuuint64_t` attribute of `device`'s default memory pool.
#[cfg(test)]
#[allow(unsafe_code)]
fn pool_attribute(device: &Device, attribute: sys::CUmemPool_attribute) -> Result<u64> {
    let cuda = device.as_cuda_device()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: as in `keep_freed_memory`.
    let got = unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, cuda.cuda_stream().context().cu_device())
    };
    check(got, "cuDeviceGetDefaultMemPool")?;
    let mut value = 0u64;
    // SAFETY: `pool` is the handle just returned; both attributes read here are `cuuint64_t`,
    // written into `value` during the call.
    let read =
        unsafe { sys::cuMemPoolGetAttribute(pool, attribute, (&mut value as *mut u64).cast()) };
    check(read, "cuMemPoolGetAttribute")?;
    Ok(value)
}

/// `Ok` for `CUDA_SUCCESS`, otherwise an error naming the driver call.
fn check(result: sys::CUresult, call: &str) -> Result<()> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(Error::Device(format!(
            "{call} failed while setting up a CUDA device: {other:?}"
        ))),
    }
}
