//! Devices: the CPU and CUDA GPUs, with clear errors for devices that do not exist.

use candle_core::Device;

use crate::{Error, Result};

/// CUDA device `index`. Indices follow `CUDA_VISIBLE_DEVICES`, as the CUDA driver numbers them.
pub fn cuda(index: usize) -> Result<Device> {
    if !cfg!(feature = "cuda") {
        return Err(Error::Device(format!(
            "cuda:{index} requested, but kandle was built without the `cuda` feature"
        )));
    }
    let count = gpu_count();
    if index >= count {
        return Err(Error::Device(format!(
            "cuda:{index} does not exist: {count} GPU(s) visible{}",
            visible_devices_note()
        )));
    }
    Device::new_cuda(index).map_err(|e| Error::Device(format!("cannot open cuda:{index}: {e}")))
}

/// All visible CUDA GPUs (honouring `CUDA_VISIBLE_DEVICES`); empty without the `cuda` feature
/// or without GPUs.
pub fn gpus() -> Result<Vec<Device>> {
    (0..gpu_count()).map(cuda).collect()
}

/// Number of visible CUDA GPUs (0 without the `cuda` feature).
pub fn gpu_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        // Opening devices until one fails counts them without a direct driver call.
        (0..64).take_while(|&i| Device::new_cuda(i).is_ok()).count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
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
    }
}
