//! `BatchNormalization` with Keras's defaults (momentum 0.99, epsilon 1e-3), over the channel
//! axis of `(C, H, W)` images or the feature axis of `(F,)` vectors.
//!
//! In training it normalises with the batch's mean and (biased) variance and moves the running
//! statistics: `moving = momentum * moving + (1 - momentum) * batch`. In inference, and always
//! when the layer is frozen (Keras's rule for `trainable = false`) or built in inference mode
//! (`.inference_mode()`, Keras's `training=False`), it uses the running statistics and leaves
//! them as they are; a frozen layer computes no gradient for its scale and offset, one in
//! inference mode that is not frozen still trains them. The running statistics are non-trainable variables named `running_mean` and
//! `running_var`; the scale and offset are `weight` and `bias`, as in PyTorch.
//!
//! For `f32` tensors on the CPU the layer runs the fused kernels of
//! [`crate::kernels::batch_norm`]: one op for training (statistics, normalisation and their
//! backward pass) and a per-channel affine map for inference. With the `cuda` feature, tensors
//! on a CUDA device in `f32`, `f16` or `bf16` run the same two ops of `kandle_kernels::cuda`
//! (half precision computing, and keeping the statistics, in `f32`). Under `SyncBatchNorm`, on
//! other devices and dtypes, and when built for
//! [`ComputePath::DeviceGeneric`](crate::ComputePath::DeviceGeneric), it composes candle ops. A
//! [`Sequential`](super::Sequential) lets the layer absorb a ReLU that follows it, which the
//! kernels apply in the same pass.

use candle_core::{DType, Tensor, Var};

use super::{
    record_into_by_copy, record_with_candle, relu, shape_error, Backward, BuildContext, Built,
    ChannelAffine, ChannelPart, FastPath, Layer, LayerSpec, ParamGrads, RecordRequest, Recorded,
    ReluRecord,
};
use crate::cross_replica::{all_reduce_sum, ReplicaHandle};
use crate::kernels::batch_norm::{self as kernels, BatchStats};
use crate::kernels::replay::Replay3;
use crate::params::Init;
use crate::Result;

/// Batch normalisation.
#[derive(Debug, Clone)]
pub struct BatchNormalization {
    momentum: f64,
    epsilon: f64,
    center: bool,
    scale: bool,
}

impl Default for BatchNormalization {
    fn default() -> Self {
        Self {
            momentum: 0.99,
            epsilon: 1e-3,
            center: true,
            scale: true,
        }
    }
}

impl BatchNormalization {
    /// Keras's defaults: momentum 0.99, epsilon 1e-3, with scale and offset.
    pub fn new() -> Self {
        Self::default()
    }

    /// How much of the old running statistics to keep at each step (Keras convention: 0.99).
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Added to the variance before the square root.
    pub fn epsilon(mut self, epsilon: f64) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// Whether to learn an offset (`bias`).
    pub fn center(mut self, center: bool) -> Self {
        self.center = center;
        self
    }

    /// Whether to learn a scale (`weight`).
    pub fn scale(mut self, scale: bool) -> Self {
        self.scale = scale;
        self
    }
}

impl LayerSpec for BatchNormalization {
    fn kind(&self) -> &'static str {
        "batch_normalization"
    }

    fn class_name(&self) -> &'static str {
        "BatchNormalization"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        if !(input_shape.len() == 1 || input_shape.len() == 3) {
            return Err(shape_error(
                ctx,
                "(batch, features) or (batch, channels, height, width)",
                input_shape,
            ));
        }
        if !(0.0..=1.0).contains(&self.momentum) || self.epsilon <= 0.0 {
            return Err(crate::Error::invalid(format!(
                "layer `{}`: momentum must be in [0, 1] and epsilon positive",
                ctx.path()
            )));
        }
        let channels = input_shape[0];
        let weight = if self.scale {
            Some(ctx.variable("weight", &[channels], Init::Ones)?)
        } else {
            None
        };
        let bias = if self.center {
            Some(ctx.variable("bias", &[channels], Init::Zeros)?)
        } else {
            None
        };
        let running_mean = ctx.non_trainable_variable("running_mean", &[channels], Init::Zeros)?;
        let running_var = ctx.non_trainable_variable("running_var", &[channels], Init::Ones)?;
        let layer = BatchNormLayer {
            weight: weight.map(|v| ctx.tensor_of(&v)),
            bias: bias.map(|v| ctx.tensor_of(&v)),
            running_mean,
            running_var,
            momentum: self.momentum,
            epsilon: self.epsilon,
            inference: ctx.inference(),
            trainable: ctx.trainable(),
            sync: ctx.replica_group().cloned(),
            rank: input_shape.len() + 1,
            relu: false,
            kernels: ctx.compute_path().uses_kernels(),
        };
        Ok(Built::fast(layer, input_shape.to_vec(), Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct BatchNormLayer {
    weight: Option<Tensor>,
    bias: Option<Tensor>,
    running_mean: Var,
    running_var: Var,
    momentum: f64,
    epsilon: f64,
    /// Normalises with the running statistics, in training too (frozen or in inference mode).
    inference: bool,
    /// Whether the scale and offset train.
    trainable: bool,
    rank: usize,
    /// Set under `SyncBatchNorm`: statistics are summed over the replica group.
    sync: Option<ReplicaHandle>,
    /// Whether the ReLU that follows the layer is applied here (see [`FastPath::fuse_relu`]).
    relu: bool,
    /// Whether the layer may call the kernels (see [`crate::ComputePath::uses_kernels`]).
    kernels: bool,
}

/// The fused kernels of one device, which take the same arguments and keep the same semantics:
/// kandle's CPU kernels ([`crate::kernels::batch_norm`]) or, with the `cuda` feature, its CUDA
/// kernels (`kandle_kernels::cuda`).
#[derive(Debug, Clone, Copy)]
enum BnKernels {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda,
}

impl BnKernels {
    /// The kernels that take `x`, if any: `f32` on the CPU; `f32`, `f16` or `bf16` on a CUDA
    /// device. (The CUDA kernels would keep an `f64` input's statistics in `f64`, which the
    /// `f32` moving statistics do not take: the layer casts it to `f32` first, as on the CPU.)
    fn of(x: &Tensor) -> Option<Self> {
        if kernels::supported(x) {
            return Some(BnKernels::Cpu);
        }
        #[cfg(feature = "cuda")]
        if crate::kernels::cuda::supported(x) && x.rank() >= 2 && x.dtype() != DType::F64 {
            return Some(BnKernels::Cuda);
        }
        None
    }

    /// Training's normalisation with the batch statistics, kept for calling its backward pass
    /// directly (`batch_norm_train_replay`; `batch_norm_train` is its output).
    fn batch_norm_train_replay(
        self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        epsilon: f64,
        relu: bool,
    ) -> Result<(Replay3, BatchStats)> {
        Ok(match self {
            BnKernels::Cpu => kernels::batch_norm_train_replay(x, weight, bias, epsilon, relu)?,
            #[cfg(feature = "cuda")]
            BnKernels::Cuda => {
                crate::kernels::cuda::batch_norm_train_replay(x, weight, bias, epsilon, relu)?
            }
        })
    }

    /// Inference's per-channel affine map (`channel_affine`).
    fn channel_affine(
        self,
        x: &Tensor,
        scale: &Tensor,
        shift: &Tensor,
        relu: bool,
    ) -> Result<Tensor> {
        Ok(match self {
            BnKernels::Cpu => kernels::channel_affine(x, scale, shift, relu)?,
            #[cfg(feature = "cuda")]
            BnKernels::Cuda => crate::kernels::cuda::channel_affine(x, scale, shift, relu)?,
        })
    }
}

impl BatchNormLayer {
    /// The fused kernels that take `x`, where the layer may call kernels.
    fn fused(&self, x: &Tensor) -> Option<BnKernels> {
        self.kernels.then(|| BnKernels::of(x)).flatten()
    }

    /// Reshapes a per-channel vector so it broadcasts against the input.
    fn per_channel(&self, v: &Tensor) -> Result<Tensor> {
        per_channel(v, self.rank)
    }

    /// The sum of each channel of `x`, flattened to `(channels,)`: each row of each plane
    /// summed first, then the rows, then the planes. Summing over the batch and the plane in
    /// one reduction makes candle's CPU backend add a channel's values one after another into
    /// one float32 accumulator, which loses about 2e-6 of the mean of 16k values; in stages,
    /// no accumulator takes more than a row, a column or a batch of values.
    fn channel_sums(&self, x: &Tensor) -> Result<Tensor> {
        let sums = if self.rank == 4 {
            x.sum_keepdim(3)?.sum_keepdim(2)?.sum_keepdim(0)?
        } else {
            x.sum_keepdim(0)?
        };
        Ok(sums.flatten_all()?)
    }

    /// The recorded pass in inference mode: the running statistics' affine map (and ReLU),
    /// whose backward pass scales the output's gradient per channel and, when the layer trains,
    /// sums its scale's and offset's gradients.
    fn record_inference(&self, x: &Tensor) -> Result<Recorded> {
        let y = self.forward_t(x, false)?.detach();
        let (scale, _) = self.running_affine()?;
        let scale = scale.detach();
        let rank = self.rank;
        let params = match self.trainable {
            true => {
                let mean = self.running_mean.as_tensor().detach();
                let var = self.running_var.as_tensor().detach();
                let inv_std = (var + self.epsilon)?.sqrt()?.recip()?;
                Some((
                    x.clone(),
                    mean,
                    inv_std,
                    self.weight.clone(),
                    self.bias.clone(),
                ))
            }
            false => None,
        };
        // The ReLU's gradient passes where its output is above zero or NaN.
        let relu = self.relu.then(|| ReluRecord::of_output(&y)).transpose()?;
        Ok(Recorded::new(
            y,
            move |dy: Tensor, grads: &mut ParamGrads, input_grad: bool| {
                let dy = match relu {
                    Some(relu) => relu.backward(&dy)?,
                    None => dy,
                };
                if let Some((x, mean, inv_std, weight, bias)) = params {
                    let reduce = reduce_dims(rank);
                    if let Some(weight) = weight {
                        let x_hat = x
                            .broadcast_sub(&per_channel(&mean, rank)?)?
                            .broadcast_mul(&per_channel(&inv_std, rank)?)?;
                        grads.add(&weight, dy.mul(&x_hat)?.sum(reduce)?)?;
                    }
                    if let Some(bias) = bias {
                        grads.add(&bias, dy.sum(reduce)?)?;
                    }
                }
                Ok(match input_grad {
                    true => Some(dy.broadcast_mul(&per_channel(&scale, rank)?)?),
                    false => None,
                })
            },
        ))
    }

    /// Mean and biased variance per channel of this replica's batch.
    fn batch_stats(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let count = (x.elem_count() / x.dim(1)?.max(1)) as f64;
        let mean = (self.channel_sums(x)? / count)?;
        let centered = x.broadcast_sub(&self.per_channel(&mean)?)?;
        let var = (self.channel_sums(&centered.sqr()?)? / count)?;
        Ok((mean, var))
    }

    /// Mean and biased variance per channel over the whole replica group's batch, from one
    /// exchange of the vector the CUDA kernels exchange (`kandle_kernels::cuda::
    /// sync_batch_norm_sums`): each channel's sums of `x - shift` and of their squares, then the
    /// count, `shift` the moving mean (the same on every replica, and near the data's mean once
    /// training has run a while, which keeps the squares' sum from cancelling). Differentiable:
    /// the backward pass sums the vector's gradient over the group in one exchange too, so every
    /// replica, on any device, runs the same exchanges.
    fn global_batch_stats(&self, x: &Tensor, group: &ReplicaHandle) -> Result<(Tensor, Tensor)> {
        let channels = x.dim(1)?;
        let count = (x.elem_count() / channels.max(1)) as f64;
        let shift = self.running_mean.as_tensor().detach().to_dtype(x.dtype())?;
        let centered = x.broadcast_sub(&self.per_channel(&shift)?)?;
        let sums = self.channel_sums(&centered)?;
        let squares = self.channel_sums(&centered.sqr()?)?;
        let pairs = Tensor::stack(&[&sums, &squares], 1)?.flatten_all()?;
        let count = Tensor::full(count, 1, x.device())?.to_dtype(x.dtype())?;
        let total = all_reduce_sum(&Tensor::cat(&[&pairs, &count], 0)?, group)?;
        let pairs = total.narrow(0, 0, 2 * channels)?.reshape((channels, 2))?;
        let count = total.narrow(0, 2 * channels, 1)?;
        let shifted_mean = pairs
            .narrow(1, 0, 1)?
            .flatten_all()?
            .broadcast_div(&count)?;
        let var = (pairs
            .narrow(1, 1, 1)?
            .flatten_all()?
            .broadcast_div(&count)?
            - shifted_mean.sqr()?)?;
        // A variance below zero from rounding is zero; a NaN stays NaN.
        let var = var.lt(0.0)?.where_cond(&var.zeros_like()?, &var)?;
        Ok(((shifted_mean + shift)?, var))
    }

    fn normalize(&self, x: &Tensor, mean: &Tensor, var: &Tensor) -> Result<Tensor> {
        let inv_std = (var + self.epsilon)?.sqrt()?.recip()?;
        let mut y = x
            .broadcast_sub(&self.per_channel(mean)?)?
            .broadcast_mul(&self.per_channel(&inv_std)?)?;
        if let Some(w) = &self.weight {
            y = y.broadcast_mul(&self.per_channel(w)?)?;
        }
        if let Some(b) = &self.bias {
            y = y.broadcast_add(&self.per_channel(b)?)?;
        }
        Ok(y)
    }

    /// Inference with the fused kernel: the running statistics folded into a per-channel
    /// scale and shift, which stay differentiable in `weight` and `bias`.
    fn affine_with_running_stats(&self, fused: BnKernels, x: &Tensor) -> Result<Tensor> {
        let (scale, shift) = self.running_affine()?;
        fused.channel_affine(x, &scale, &shift, self.relu)
    }

    /// The per-channel scale and shift of inference: the running statistics, then `weight`
    /// and `bias`.
    fn running_affine(&self) -> Result<(Tensor, Tensor)> {
        let mean = self.running_mean.as_tensor().detach();
        let var = self.running_var.as_tensor().detach();
        let inv_std = (var + self.epsilon)?.sqrt()?.recip()?;
        let scale = match &self.weight {
            Some(w) => (w * inv_std)?,
            None => inv_std,
        };
        let shift = (mean * &scale)?.neg()?;
        let shift = match &self.bias {
            Some(b) => (b + shift)?,
            None => shift,
        };
        Ok((scale, shift))
    }

    /// Moves the running statistics towards this batch's.
    fn update_moving(&self, mean: &Tensor, var: &Tensor) -> Result<()> {
        let m = self.momentum;
        let update = |moving: &Var, batch: &Tensor| -> Result<()> {
            let next = ((moving.as_tensor().detach() * m)? + (batch.detach() * (1.0 - m))?)?;
            Ok(moving.set(&next)?)
        };
        update(&self.running_mean, mean)?;
        update(&self.running_var, var)
    }
}

/// Reshapes a per-channel vector so it broadcasts against an input of `rank` dimensions.
fn per_channel(v: &Tensor, rank: usize) -> Result<Tensor> {
    let c = v.dim(0)?;
    Ok(if rank == 4 {
        v.reshape((1, c, 1, 1))?
    } else {
        v.reshape((1, c))?
    })
}

/// The axes a statistic of an input of `rank` dimensions sums over: all but the channels'.
fn reduce_dims(rank: usize) -> &'static [usize] {
    if rank == 4 {
        &[0, 2, 3]
    } else {
        &[0]
    }
}

impl Layer for BatchNormLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        // The kernels run inference, and training unless the statistics are the replica
        // group's.
        let fused = self
            .fused(x)
            .filter(|_| !train || self.inference || self.sync.is_none());
        if fused.is_none() && x.dtype() != DType::F32 {
            // Mixed precision: statistics and normalisation in float32, the output in the
            // input's dtype. (The CUDA kernels take half precision as it is, computing in
            // float32.)
            let y = self.forward_t(&x.to_dtype(DType::F32)?, train)?;
            return Ok(y.to_dtype(x.dtype())?);
        }
        let y = if !train || self.inference {
            if let Some(fused) = fused {
                return self.affine_with_running_stats(fused, x);
            }
            let mean = self.running_mean.as_tensor().detach();
            let var = self.running_var.as_tensor().detach();
            self.normalize(x, &mean, &var)?
        } else if let Some(fused) = fused {
            let (replay, stats) = fused.batch_norm_train_replay(
                x,
                self.weight.as_ref(),
                self.bias.as_ref(),
                self.epsilon,
                self.relu,
            )?;
            self.update_moving(&stats.mean, &stats.var)?;
            return Ok(replay.output().clone());
        } else {
            let (mean, var) = match &self.sync {
                Some(group) => self.global_batch_stats(x, group)?,
                None => self.batch_stats(x)?,
            };
            self.update_moving(&mean, &var)?;
            self.normalize(x, &mean, &var)?
        };
        Ok(if self.relu {
            relu(&y, self.kernels)?
        } else {
            y
        })
    }
}

/// What the backward pass of a training pass through kandle's kernels runs.
enum KernelPass {
    /// The kept op of `batch_norm_train_replay` (CPU or CUDA).
    Replay(Replay3),
    /// The CUDA kernels' pass that wrote its output into a concatenation's channels.
    #[cfg(feature = "cuda")]
    Into(crate::kernels::cuda::BatchNormBackward),
    /// The CUDA kernels' SyncBatchNorm pass, whose backward sums go over the group.
    #[cfg(feature = "cuda")]
    Synced(crate::kernels::cuda::SyncBatchNormBackward, ReplicaHandle),
}

/// The training pass's backward through kandle's kernels: the input's gradient and the
/// weight's and bias's, from an output gradient the kernels (CPU and CUDA) read in place even
/// when it is a range of a concatenation's gradient.
struct KernelBackward {
    pass: KernelPass,
    weight: Option<Tensor>,
    bias: Option<Tensor>,
}

impl Backward for KernelBackward {
    fn backward(
        self: Box<Self>,
        dy: Tensor,
        grads: &mut ParamGrads,
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        let (dx, dweight, dbias) = match &self.pass {
            KernelPass::Replay(replay) => replay.backward(&dy)?,
            #[cfg(feature = "cuda")]
            KernelPass::Into(pass) => {
                let (dx, dweight, dbias) = pass.backward(&dy)?;
                (Some(dx), Some(dweight), Some(dbias))
            }
            #[cfg(feature = "cuda")]
            KernelPass::Synced(pass, group) => {
                let local = pass.grad_sums(&dy)?;
                let total = all_reduce_sum(&local, group)?;
                let (dx, dweight, dbias) = pass.backward(&dy, &local, &total)?;
                (Some(dx), Some(dweight), Some(dbias))
            }
        };
        for (param, grad) in [(self.weight, dweight), (self.bias, dbias)] {
            if let (Some(param), Some(grad)) = (param, grad) {
                grads.add(&param, grad)?;
            }
        }
        Ok(dx.filter(|_| input_grad))
    }

    fn takes_channel_views(&self) -> bool {
        true
    }
}

impl BatchNormLayer {
    /// The recorded training pass on a CUDA device with its output written into `part` by the
    /// CUDA kernels, or `None` where they do not train on `x` (or `part` has another dtype).
    #[cfg(feature = "cuda")]
    fn record_into_on_cuda(&self, x: &Tensor, part: &ChannelPart<'_>) -> Result<Option<Recorded>> {
        let cuda = matches!(self.fused(x), Some(BnKernels::Cuda));
        if !cuda || self.inference || self.sync.is_some() {
            return Ok(None);
        }
        let out = part.view()?;
        if out.dtype() != x.dtype() {
            return Ok(None);
        }
        let (pass, stats) = crate::kernels::cuda::batch_norm_train_into(
            x,
            self.weight.as_ref().map(Tensor::detach).as_ref(),
            self.bias.as_ref().map(Tensor::detach).as_ref(),
            self.epsilon,
            self.relu,
            &out,
        )?;
        self.update_moving(&stats.mean, &stats.var)?;
        let backward = self.kernel_backward(KernelPass::Into(pass));
        Ok(Some(Recorded::new(out, backward)))
    }
}

impl BatchNormLayer {
    /// The backward pass of a training pass through the kernels, `pass`, with the variables
    /// its gradients go to.
    fn kernel_backward(&self, pass: KernelPass) -> KernelBackward {
        KernelBackward {
            pass,
            weight: self.weight.clone(),
            bias: self.bias.clone(),
        }
    }

    /// The recorded training pass under SyncBatchNorm on the CUDA kernels: this replica's sums
    /// summed over the group where they lie, in one exchange each way (as
    /// [`Self::global_batch_stats`] exchanges them).
    #[cfg(feature = "cuda")]
    fn record_synced_on_cuda(&self, x: &Tensor, group: &ReplicaHandle) -> Result<Recorded> {
        use crate::kernels::cuda::{sync_batch_norm_apply, sync_batch_norm_sums};
        let shift = self.running_mean.as_tensor().detach();
        let total = all_reduce_sum(&sync_batch_norm_sums(x, &shift)?, group)?;
        let (y, stats, pass) = sync_batch_norm_apply(
            x,
            &total,
            &shift,
            self.weight.as_ref().map(Tensor::detach).as_ref(),
            self.bias.as_ref().map(Tensor::detach).as_ref(),
            self.epsilon,
            self.relu,
        )?;
        self.update_moving(&stats.mean, &stats.var)?;
        let backward = self.kernel_backward(KernelPass::Synced(pass, group.clone()));
        Ok(Recorded::new(y, backward))
    }
}

impl FastPath for BatchNormLayer {
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        if request.logits {
            return record_with_candle(self, x, true);
        }
        if self.inference {
            // The explicit backward computes in `float32`, the running statistics' dtype; a
            // half-precision input (mixed precision) is recorded through candle's autograd.
            return match x.dtype() {
                DType::F32 => self.record_inference(x),
                _ => record_with_candle(self, x, false),
            };
        }
        #[cfg(feature = "cuda")]
        if let (Some(group), Some(BnKernels::Cuda)) = (&self.sync, self.fused(x)) {
            return self.record_synced_on_cuda(x, group);
        }
        let Some(fused) = self.fused(x).filter(|_| self.sync.is_none()) else {
            return record_with_candle(self, x, false);
        };
        let (replay, stats) = fused.batch_norm_train_replay(
            x,
            self.weight.as_ref().map(Tensor::detach).as_ref(),
            self.bias.as_ref().map(Tensor::detach).as_ref(),
            self.epsilon,
            self.relu,
        )?;
        self.update_moving(&stats.mean, &stats.var)?;
        let y = replay.output().clone();
        let backward = self.kernel_backward(KernelPass::Replay(replay));
        Ok(Recorded::new(y, backward))
    }

    fn forward_inference_into(&self, x: &Tensor, part: &ChannelPart<'_>) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if matches!(self.fused(x), Some(BnKernels::Cuda)) {
            let out = part.view()?;
            if out.dtype() == x.dtype() {
                let (scale, shift) = self.running_affine()?;
                crate::kernels::cuda::channel_affine_into(x, &scale, &shift, self.relu, &out)?;
                return Ok(Some(out));
            }
        }
        let _ = (x, part);
        Ok(None)
    }

    fn forward_recorded_into(&self, x: &Tensor, part: &ChannelPart<'_>) -> Result<Recorded> {
        #[cfg(feature = "cuda")]
        if let Some(recorded) = self.record_into_on_cuda(x, part)? {
            return Ok(recorded);
        }
        record_into_by_copy(self, x, part)
    }

    fn fuse_relu(&mut self) -> bool {
        self.relu = true;
        true
    }

    fn frozen_affine(&self, like: &Tensor) -> Result<Option<ChannelAffine>> {
        // Frozen (or built in inference mode), training normalises with the running statistics
        // too: the same map.
        match self.inference {
            true => self.inference_affine(like),
            false => Ok(None),
        }
    }

    fn inference_affine(&self, like: &Tensor) -> Result<Option<ChannelAffine>> {
        // Offered to the CPU kernels alone, which fold it into the layer before's output.
        if !self.kernels || !kernels::supported(like) || self.rank != 4 {
            return Ok(None);
        }
        let (scale, shift) = self.running_affine()?;
        Ok(Some(ChannelAffine {
            scale,
            shift,
            relu: self.relu,
        }))
    }
}

#[cfg(test)]
mod tests;
