//! NCCL all-reduce between CUDA replicas of one process (the `nccl` feature).

use candle_core::{Device, Tensor};
use kandle::{Error, Result};

/// Sums `buffers` with NCCL and returns the total on each device.
#[cfg(not(feature = "nccl"))]
pub fn all_reduce(_buffers: Vec<Tensor>, _devices: &[Device]) -> Result<Vec<Tensor>> {
    Err(Error::Device(
        "CrossDeviceOps::NcclAllReduce needs kandle-strategies built with the `nccl` feature".into(),
    ))
}

/// Sums `buffers` with NCCL and returns the total on each device.
#[cfg(feature = "nccl")]
pub fn all_reduce(buffers: Vec<Tensor>, devices: &[Device]) -> Result<Vec<Tensor>> {
    imp::all_reduce(buffers, devices)
}

#[cfg(feature = "nccl")]
mod imp {
    use super::*;
    use candle_core::cuda_backend::cudarc::nccl::safe::{group_end, group_start, Comm, ReduceOp};
    use candle_core::{backend::BackendStorage, Storage};

    pub fn all_reduce(buffers: Vec<Tensor>, devices: &[Device]) -> Result<Vec<Tensor>> {
        let streams = devices
            .iter()
            .map(|d| match d {
                Device::Cuda(c) => Ok(c.cuda_stream()),
                other => Err(Error::Device(format!(
                    "NCCL all-reduce needs CUDA replicas, got {}",
                    kandle::devices::label(other)
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        let comms = Comm::from_devices(streams)
            .map_err(|e| Error::Device(format!("NCCL init failed: {e:?}")))?;
        let outputs: Vec<Tensor> = buffers
            .iter()
            .map(|b| Ok(b.zeros_like()?))
            .collect::<Result<_>>()?;
        group_start().map_err(|e| Error::Device(format!("NCCL: {e:?}")))?;
        for ((comm, input), output) in comms.iter().zip(&buffers).zip(&outputs) {
            let (in_storage, _) = input.storage_and_layout();
            let (out_storage, _) = output.storage_and_layout();
            let (Storage::Cuda(src), Storage::Cuda(dst)) = (&*in_storage, &*out_storage) else {
                return Err(Error::Device("NCCL all-reduce needs CUDA tensors".into()));
            };
            let src = src.as_cuda_slice::<f32>()?;
            let dst = dst.as_cuda_slice::<f32>()?;
            // cudarc takes the output mutably; the tensor was just created for this call.
            let mut dst = dst.clone();
            comm.all_reduce(src, &mut dst, &ReduceOp::Sum)
                .map_err(|e| Error::Device(format!("NCCL all-reduce failed: {e:?}")))?;
            let _ = in_storage.device();
        }
        group_end().map_err(|e| Error::Device(format!("NCCL: {e:?}")))?;
        Ok(outputs)
    }
}
