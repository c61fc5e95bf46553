//! Devices: the CPU and CUDA GPUs, with clear errors for devices that do not exist; a CUDA
//! device kandle opens keeps its freed memory in its pool (`cuda_settings`); training steps on
//! CUDA devices captured as CUDA graphs when asked for ([`set_cuda_graphs`]); batches copied to
//! a CUDA device from pinned memory on a stream of their own (`batch_upload`).

pub(crate) mod batch_upload;
mod cuda_graphs;
#[cfg(feature = "cuda")]
mod cuda_settings;
pub(crate) mod stream_capture;
pub use cuda_graphs::{cuda_graphs, set_cuda_graphs, GRAPHS_VAR};
#[cfg(feature = "cuda")]
pub use cuda_settings::SETTINGS_VAR;

use candle_core::Device;

use crate::{Error, Result};

/// CUDA device `index`. Indices follow `CUDA_VISIBLE_DEVICES`, as the CUDA driver numbers them.
///
/// Fails with [`Error::Device`] when kandle was built without the `cuda` feature, when the CUDA
/// driver cannot be initialised, or when there is no GPU `index`. The device's memory pool keeps
/// the memory freed on it for later allocations instead of handing it back to the driver at
/// each synchronisation (unless `KANDLE_CUDA_SETTINGS=default`).
pub fn cuda(index: usize) -> Result<Device> {
    if !cfg!(feature = "cuda") {
        return Err(Error::Device(format!(
            "cuda:{index} requested, but kandle was built without the `cuda` feature"
        )));
    }
    let count = gpu_count()?;
    if index >= count {
        return Err(Error::Device(format!(
            "cuda:{index} does not exist: {count} GPU(s) visible{}",
            visible_devices_note()
        )));
    }
    let device = Device::new_cuda(index)
        .map_err(|e| Error::Device(format!("cannot open cuda:{index}: {e}")))?;
    #[cfg(feature = "cuda")]
    cuda_settings::apply(&device)?;
    Ok(device)
}

/// All visible CUDA GPUs (honouring `CUDA_VISIBLE_DEVICES`); empty without the `cuda` feature
/// or without GPUs. Fails as [`gpu_count`] does, or when a GPU cannot be opened.
pub fn gpus() -> Result<Vec<Device>> {
    (0..gpu_count()?).map(cuda).collect()
}

/// Number of visible CUDA GPUs, as the CUDA driver counts them (honouring
/// `CUDA_VISIBLE_DEVICES`): 0 without the `cuda` feature, or when the driver reports no device.
///
/// Fails with [`Error::Device`], naming the driver's reason, when the CUDA driver cannot be
/// initialised (for example a driver older than the CUDA version kandle was built for). A
/// missing driver library (`libcuda.so.1`) stops the process at load time, before this runs.
pub fn gpu_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::{sys::CUresult, CudaContext};
        // `device_count` runs `cuInit` first, so this also works before any device is opened.
        match CudaContext::device_count() {
            Ok(n) => Ok(usize::try_from(n).unwrap_or_default()),
            Err(e) if e.0 == CUresult::CUDA_ERROR_NO_DEVICE => Ok(0),
            Err(e) => Err(Error::Device(format!(
                "cannot count CUDA GPUs: the CUDA driver failed to initialise: {e}{}",
                visible_devices_note()
            ))),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        Ok(0)
    }
}

fn visible_devices_note() -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => format!(" (CUDA_VISIBLE_DEVICES={v})"),
        Err(_) => String::new(),
    }
}

/// A short label for a device: `cpu` or `cuda:0`.
pub fn label(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_feature_is_a_clear_error() {
        let err = cuda(0).expect_err("no cuda in this build").to_string();
        assert!(err.contains("without the `cuda` feature"), "{err}");
        assert!(gpus().is_ok_and(|g| g.is_empty()));
        assert!(gpu_count().is_ok_and(|n| n == 0));
    }

    /// Runs anywhere the binary loads: with GPUs, without (count 0), or with a driver that
    /// cannot initialise (an error, never a panic).
    #[cfg(feature = "cuda")]
    #[test]
    fn gpu_count_is_a_count_or_a_device_error() {
        match gpu_count() {
            Ok(n) => {
                let err = cuda(n).expect_err("one past the last GPU").to_string();
                assert!(err.contains("does not exist"), "{err}");
            }
            Err(Error::Device(reason)) => assert!(reason.contains("CUDA driver"), "{reason}"),
            Err(other) => panic!("expected Error::Device, got {other}"),
        }
    }

    /// A device kandle opens keeps freed memory in its pool: the release threshold is the
    /// largest value, a freed buffer's memory is still the pool's after a synchronisation
    /// (where the driver's default threshold, zero, hands it back), and made again it takes no
    /// new memory from the driver.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_cuda_device_keeps_freed_memory_in_its_pool() -> Result<()> {
        let gpu = cuda(0)?;
        assert_eq!(cuda_settings::release_threshold(&gpu)?, u64::MAX);
        let make = || -> Result<()> {
            let t = candle_core::Tensor::zeros((64, 1 << 20), candle_core::DType::F32, &gpu)?;
            t.sum_all()?.to_scalar::<f32>()?;
            Ok(())
        };
        make()?;
        gpu.synchronize()?;
        let reserved = cuda_settings::reserved_bytes(&gpu)?;
        assert!(
            reserved >= 256 << 20,
            "{reserved} bytes reserved after a 256 MiB buffer"
        );
        make()?;
        gpu.synchronize()?;
        assert_eq!(cuda_settings::reserved_bytes(&gpu)?, reserved);
        Ok(())
    }
}
