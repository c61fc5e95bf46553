//! Sums across the replicas of one step from inside the forward pass, for `SyncBatchNorm`.
//!
//! A strategy that wants global batch statistics gives every replica a [`ReplicaHandle`] on a
//! shared [`ReplicaGroup`]. Batch normalisation then sums its per-channel statistics over the
//! group with [`all_reduce_sum`], which is differentiable: its backward pass sums the incoming
//! gradients over the group too, so the gradients equal those of one device on the global batch.
//!
//! A group sums either vectors on the host ([`ReplicaGroup::all_reduce_sum`]) or, where it can,
//! tensors where they lie ([`ReplicaGroup::all_reduce_sum_tensor`]: NCCL between GPUs, or a sum
//! on the device that replicas share), so that a CUDA step does not wait for a copy to the host
//! and back at every exchange.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Storage, Tensor};

use crate::Result;

/// A set of replicas that can sum vectors together during a step.
pub trait ReplicaGroup: Send + Sync {
    /// Sums `values` element-wise over the replicas taking part in the current step and returns
    /// the total to each of them. Blocks until all have contributed. Within a step, every
    /// participating replica calls it the same number of times with vectors of the same length.
    fn all_reduce_sum(&self, replica: usize, values: Vec<f32>) -> Result<Vec<f32>>;

    /// Whether the group sums tensors where they lie, with
    /// [`all_reduce_sum_tensor`](Self::all_reduce_sum_tensor); default `false`, and batch
    /// normalisation then sums on the host with [`all_reduce_sum`](Self::all_reduce_sum).
    fn sums_tensors(&self) -> bool {
        false
    }

    /// Sums `x` (a contiguous `f32` tensor on the replica's device) element-wise over the
    /// replicas taking part in the current step, like
    /// [`all_reduce_sum`](Self::all_reduce_sum), and returns the total as a new contiguous
    /// tensor of `x`'s shape on `x`'s device. Called only when
    /// [`sums_tensors`](Self::sums_tensors) is `true`; the default is an error.
    fn all_reduce_sum_tensor(&self, replica: usize, x: &Tensor) -> Result<Tensor> {
        let _ = (replica, x);
        Err(crate::Error::invalid(
            "this replica group sums vectors on the host only",
        ))
    }
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

    fn sum_tensor(&self, x: &Tensor) -> Result<Tensor> {
        let total = self.group.all_reduce_sum_tensor(self.index, x)?;
        if total.dims() != x.dims() || !total.device().same_device(x.device()) {
            return Err(crate::Error::invalid(format!(
                "replica {}: the group's sum of a {:?} tensor on {:?} is {:?} on {:?}",
                self.index,
                x.dims(),
                x.device(),
                total.dims(),
                total.device()
            )));
        }
        Ok(total)
    }
}

impl std::fmt::Debug for ReplicaHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReplicaHandle({})", self.index)
    }
}

/// The sum of `x` over the group, differentiable, in `f32`. Where the group sums tensors, they
/// stay on their devices; otherwise the exchange happens on the host, which suits small tensors
/// such as per-channel statistics.
pub fn all_reduce_sum(x: &Tensor, handle: &ReplicaHandle) -> Result<Tensor> {
    if handle.group.sums_tensors() {
        let local = x.to_dtype(DType::F32)?.contiguous()?;
        let total = handle.sum_tensor(&local.detach())?;
        let summed = local.apply_op1(Summed {
            handle: handle.clone(),
            total,
        })?;
        return Ok(summed.to_dtype(x.dtype())?);
    }
    let cpu = x
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .contiguous()?;
    let summed = cpu.apply_op1(AllReduceSum(handle.clone()))?;
    Ok(summed.to_dtype(x.dtype())?.to_device(x.device())?)
}

/// The backward pass of a sum over the group: d(sum over replicas)/d(local) is the identity,
/// and each replica's output feeds every replica's loss, so the local gradient is the sum of
/// all replicas' output gradients.
fn sum_gradient(grad: &Tensor, handle: &ReplicaHandle) -> candle_core::Result<Option<Tensor>> {
    all_reduce_sum(grad, handle)
        .map(Some)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))
}

struct AllReduceSum(ReplicaHandle);

impl CustomOp1 for AllReduceSum {
    fn name(&self) -> &'static str {
        "cross-replica-sum"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
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

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        sum_gradient(grad_res, &self.0)
    }
}

/// The group's sum of a tensor, found before the op ran: its forward pass gives `total`, its
/// backward pass sums the output's gradient over the group, as [`AllReduceSum`]'s does.
struct Summed {
    handle: ReplicaHandle,
    total: Tensor,
}

impl Summed {
    /// The span of `total` in its storage.
    fn span(&self, layout: &Layout) -> candle_core::Result<(usize, usize)> {
        let span = layout.contiguous_offsets();
        match span {
            Some(span) if layout.shape() == self.total.shape() => Ok(span),
            _ => candle_core::bail!(
                "cross-replica sum: the total {:?} does not match the input {:?}",
                self.total.dims(),
                layout.dims()
            ),
        }
    }
}

impl CustomOp1 for Summed {
    fn name(&self) -> &'static str {
        "cross-replica-sum"
    }

    fn cpu_fwd(&self, _: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (storage, total) = self.total.storage_and_layout();
        let (start, end) = self.span(total)?;
        match &*storage {
            Storage::Cpu(CpuStorage::F32(values)) => Ok((
                CpuStorage::F32(values[start..end].to_vec()),
                layout.shape().clone(),
            )),
            _ => candle_core::bail!("cross-replica sum: the total is not f32 on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (storage, total) = self.total.storage_and_layout();
        let (start, end) = self.span(total)?;
        match &*storage {
            Storage::Cuda(cuda) => {
                let values = cuda.as_cuda_slice::<f32>()?.slice(start..end);
                let copy = cuda
                    .device
                    .cuda_stream()
                    .clone_dtod(&values)
                    .map_err(|e| candle_core::Error::Cuda(Box::new(e)))?;
                Ok((
                    candle_core::CudaStorage::wrap_cuda_slice(copy, cuda.device.clone()),
                    layout.shape().clone(),
                ))
            }
            _ => candle_core::bail!("cross-replica sum: the total is not on a CUDA device"),
        }
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        sum_gradient(grad_res, &self.handle)
    }
}
