//! Cross-device ops: how replicas on different devices sum their fused buffers, selectable as
//! in TensorFlow.

use candle_core::{Device, Tensor};
use kandle::Result;

/// The algorithm that sums one fused buffer per replica and gives every replica the total.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CrossDeviceOps {
    /// Copy every buffer to the first replica's device, sum there, copy the total back.
    /// The default for CPU replicas and for replicas sharing a GPU.
    #[default]
    ReductionToOneDevice,
    /// Sum pairwise in a tree (replica 1 into 0, 3 into 2, then 2 into 0, ...), each sum on the
    /// receiving replica's device, then copy the total back down the tree. Spreads the copies
    /// over devices instead of funnelling them through one.
    HierarchicalCopy,
    /// NCCL all-reduce between CUDA devices (the `nccl` feature). The default for replicas on
    /// distinct GPUs when kandle-strategies is built with `nccl`.
    NcclAllReduce,
}

impl CrossDeviceOps {
    /// The ops for replicas on `devices`: [`NcclAllReduce`](Self::NcclAllReduce) for several
    /// distinct CUDA devices when built with the `nccl` feature, otherwise
    /// [`ReductionToOneDevice`](Self::ReductionToOneDevice).
    ///
    /// ```
    /// use candle_core::Device;
    /// use kandle_strategies::CrossDeviceOps;
    ///
    /// let cpu = CrossDeviceOps::default_for(&[Device::Cpu, Device::Cpu]);
    /// assert_eq!(cpu, CrossDeviceOps::ReductionToOneDevice);
    /// ```
    pub fn default_for(devices: &[Device]) -> Self {
        let distinct_gpus = devices.len() > 1
            && devices.iter().enumerate().all(|(i, d)| {
                d.is_cuda() && devices[..i].iter().all(|e| e.location() != d.location())
            });
        if cfg!(feature = "nccl") && distinct_gpus {
            CrossDeviceOps::NcclAllReduce
        } else {
            CrossDeviceOps::ReductionToOneDevice
        }
    }

    /// Sums `buffers` (one per replica, each on its replica's device) and returns the total on
    /// each replica's device, in order.
    pub fn all_reduce(self, buffers: Vec<Tensor>, devices: &[Device]) -> Result<Vec<Tensor>> {
        match self {
            CrossDeviceOps::ReductionToOneDevice => reduce_to_one_device(buffers, devices),
            CrossDeviceOps::HierarchicalCopy => hierarchical_copy(buffers, devices),
            CrossDeviceOps::NcclAllReduce => crate::nccl::all_reduce(buffers, devices),
        }
    }
}

fn broadcast(total: &Tensor, devices: &[Device]) -> Result<Vec<Tensor>> {
    devices.iter().map(|d| Ok(total.to_device(d)?)).collect()
}

fn reduce_to_one_device(buffers: Vec<Tensor>, devices: &[Device]) -> Result<Vec<Tensor>> {
    let Some(first) = buffers.first() else {
        return Ok(Vec::new());
    };
    let target = first.device().clone();
    let mut total = first.clone();
    for b in &buffers[1..] {
        total = (total + b.to_device(&target)?)?;
    }
    broadcast(&total, devices)
}

fn hierarchical_copy(mut buffers: Vec<Tensor>, devices: &[Device]) -> Result<Vec<Tensor>> {
    let n = buffers.len();
    let mut stride = 1;
    while stride < n {
        for i in (0..n).step_by(2 * stride) {
            let j = i + stride;
            if j < n {
                let incoming = buffers[j].to_device(buffers[i].device())?;
                buffers[i] = (&buffers[i] + incoming)?;
            }
        }
        stride *= 2;
    }
    // Copy the total back down the same tree.
    while stride > 1 {
        stride /= 2;
        for i in (0..n).step_by(2 * stride) {
            let j = i + stride;
            if j < n {
                buffers[j] = buffers[i].to_device(&devices[j])?;
            }
        }
    }
    Ok(buffers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_algorithm_sums_for_every_replica() -> Result<()> {
        for n in 1..=5 {
            let devices = vec![Device::Cpu; n];
            let buffers: Vec<Tensor> = (0..n)
                .map(|i| Tensor::new(&[i as f32, 1.0], &Device::Cpu))
                .collect::<candle_core::Result<_>>()?;
            let want = vec![(0..n).sum::<usize>() as f32, n as f32];
            for ops in [
                CrossDeviceOps::ReductionToOneDevice,
                CrossDeviceOps::HierarchicalCopy,
            ] {
                let out = ops.all_reduce(buffers.clone(), &devices)?;
                assert_eq!(out.len(), n);
                for t in out {
                    assert_eq!(t.to_vec1::<f32>()?, want, "{ops:?} with {n} replicas");
                }
            }
        }
        Ok(())
    }
}
