//! Sums across the replicas of one step from inside the forward pass, for `SyncBatchNorm`.
//!
//! A strategy that wants global batch statistics gives every replica a [`ReplicaHandle`] on a
//! shared [`ReplicaGroup`]. Batch normalisation then sums its per-channel statistics over the
//! group with [`all_reduce_sum`], which is differentiable: its backward pass sums the incoming
//! gradients over the group too, so the gradients equal those of one device on the global batch.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

use crate::Result;

/// A set of replicas that can sum vectors together during a step.
pub trait ReplicaGroup: Send + Sync {
    /// Sums `values` element-wise over the replicas taking part in the current step and returns
    /// the total to each of them. Blocks until all have contributed. Within a step, every
    /// participating replica calls it the same number of times with vectors of the same length.
    fn all_reduce_sum(&self, replica: usize, values: Vec<f32>) -> Result<Vec<f32>>;
}

/// One replica's place in a [`ReplicaGroup`].
#[derive(Clone)]
pub struct ReplicaHandle {
    group: Arc<dyn ReplicaGroup>,
    index: usize,
}

impl ReplicaHandle {
    /// Replica `index` of `group`.
    pub fn new(group: Arc<dyn ReplicaGroup>, index: usize) -> Self {
        Self { group, index }
    }

    /// This replica's index in the group.
    pub fn index(&self) -> usize {
        self.index
    }

    fn sum(&self, values: Vec<f32>) -> Result<Vec<f32>> {
        self.group.all_reduce_sum(self.index, values)
    }
}

impl std::fmt::Debug for ReplicaHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReplicaHandle({})", self.index)
    }
}

/// The sum of `x` over the group, differentiable. The exchange happens on the CPU, so it suits
/// small tensors such as per-channel statistics.
pub fn all_reduce_sum(x: &Tensor, handle: &ReplicaHandle) -> Result<Tensor> {
    let cpu = x.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.contiguous()?;
    let summed = cpu.apply_op1(AllReduceSum(handle.clone()))?;
    Ok(summed.to_dtype(x.dtype())?.to_device(x.device())?)
}

struct AllReduceSum(ReplicaHandle);

impl CustomOp1 for AllReduceSum {
    fn name(&self) -> &'static str {
        "cross-replica-sum"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(values), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("cross-replica sum takes a contiguous f32 tensor");
        };
        let total = self
            .0
            .sum(values[start..end].to_vec())
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok((CpuStorage::F32(total), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        // d(sum over replicas)/d(local) is the identity; each replica's output feeds every
        // replica's loss, so the local gradient is the sum of all replicas' output gradients.
        all_reduce_sum(grad_res, &self.0)
            .map(Some)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}
