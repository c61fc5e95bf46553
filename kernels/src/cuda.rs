//! kandle's operations on CUDA devices, as candle custom ops on candle's own device and stream:
//! batch normalisation, pooling, the softmax cross-entropy and the optimizers' updates on
//! kandle's own CUDA kernels (the `cuda` feature), and convolutions through cuDNN (the `cudnn`
//! feature).
//!
//! **Batch normalisation and pooling** ([`batch_norm_train`], [`channel_affine`],
//! [`max_pool2d`], [`avg_pool2d`], and the `_replay` forms that keep the op for calling its
//! backward pass directly) take the same arguments and keep the same semantics as the CPU
//! kernels of [`crate::batch_norm`] and [`crate::pooling`]: Keras's epsilon, the batch
//! statistics returned for the caller to move its running averages, an optional fused ReLU
//! whose gradient passes where the pre-activation is `>= 0` or NaN, the max pool's gradient to
//! the first maximum of a window, NaNs propagated as PyTorch does. Their backward passes are
//! kandle's kernels too, registered with candle's autograd. They take tensors of one CUDA
//! device in `f32` or `f64`, or `f16` or `bf16` computing (and keeping batch norm's statistics
//! and parameters) in `f32`. The kernels are CUDA C compiled at run time with NVRTC, once per
//! process, and loaded once per device.
//!
//! **The softmax cross-entropy** ([`sparse_softmax_cross_entropy`]) is `-log_softmax(x)[label]`
//! of each row of `(N, C)` logits with its gradient, registered with candle's autograd, in
//! two kernels; NaNs propagate as in PyTorch, and a label outside the classes is an error, as
//! on the CPU.
//!
//! **SyncBatchNorm** ([`sync_batch_norm_sums`], [`sync_batch_norm_apply`],
//! [`SyncBatchNormBackward`]) is the same training pass with the statistics, and the backward
//! pass's sums, of every replica's batch: each side computes this replica's per-channel sums as
//! one small `f32` vector, which the caller sums over the replicas on the devices (NCCL), and
//! the kernels go on from the total.
//!
//! **Dense layers' products** ([`dense`]) are `x W^T + b` in one cuBLASLt matmul, the bias in
//! its epilogue, its plan (descriptor, layouts, algorithm) made once per device and shape,
//! `f32` with FMA math (no TF32), `f16` and `bf16` accumulating in `f32`; its backward pass is
//! candle's GEMMs.
//!
//! **The optimizers' updates** ([`sgd_step`], [`adam_step`]) write every `f32` variable of a
//! device and its state in place in one launch, with the arithmetic of the CPU kernels of
//! [`crate::optimizer`], bit for bit.
//!
//! Shapes, dtypes and devices the ops cannot take are errors ([`Error::InvalidInput`]) naming
//! the op and what it got, as are failures inside cuDNN or NVRTC (as candle errors with the call
//! that failed); nothing here panics on a bad input.
//!
//! ```no_run
//! # fn main() -> kandle_kernels::Result<()> {
//! use candle_core::{Device, Tensor};
//! use kandle_kernels::cuda;
//! use kandle_kernels::pooling::PoolWindow;
//!
//! let dev = Device::new_cuda(0)?;
//! let x = Tensor::randn(0f32, 1., (8, 16, 32, 32), &dev)?;
//! let (y, stats) = cuda::batch_norm_train(&x, None, None, 1e-3, true)?;
//! let window = PoolWindow { window: (3, 3), stride: (2, 2), pad: (0, 1, 0, 1) };
//! let pooled = cuda::max_pool2d(&y, &window)?;
//! assert_eq!((stats.mean.dims(), pooled.dims()), (&[16][..], &[8, 16, 16, 16][..]));
//! # Ok(()) }
//! ```
//!
//! [`Error::InvalidInput`]: crate::Error::InvalidInput

#![cfg_attr(
    feature = "cudnn",
    doc = r#"**Convolutions** ([`conv2d`] is the forward pass, differentiable through candle's autograd,
its backward running the other two; [`conv2d_input_grad`] and [`conv2d_kernel_grad`] are the
gradients) take tensors on one CUDA device, in `f32` or `f64`, or `f16` or `bf16` with `f32`
accumulation, `NCHW`, and a [`Conv2dParams`]: strides, `(top, bottom, left, right)` padding
as the CPU kernel ([`crate::conv2d`]) takes it, dilation, groups and how the algorithm is
chosen ([`Algorithms`]). What candle's own cuDNN path does on every call is done once here,
per device ([`cache_stats`]): one cuDNN handle on the device's stream; the algorithm of each
operation, dtype, shape, window and setting searched once (measured, or by cuDNN's
heuristics: see [`AlgoSearch`]) and kept with its descriptors; one workspace that only
grows. [`Algorithms::deterministic`] keeps to algorithms that give the same bits on every
call; `f32` runs with FMA math (no TF32) unless [`Algorithms::allow_tf32`]. cuDNN pads both
sides of a dimension alike; a padding with more on one side (Keras's `"same"` at stride 2 on
an even size) is cut into the symmetric part cuDNN applies and the rest, which is added to
the input as zeros first (one copy of the input).

"#
)]

#[cfg(feature = "cudnn")]
mod algorithms;
mod batch_norm;
mod batch_norm_sync;
#[cfg(feature = "cudnn")]
mod cache;
mod channel_views;
#[cfg(feature = "cudnn")]
mod conv;
mod cross_entropy;
mod dense;
#[cfg(feature = "cudnn")]
mod descriptors;
pub(crate) mod dropout;
mod matmul_plans;
mod operands;
#[cfg(feature = "cudnn")]
mod ops;
mod optimizer;
#[cfg(feature = "cudnn")]
mod params;
mod pooling;
mod program;
mod stream_key;

use candle_core::Tensor;

pub use batch_norm::{
    batch_norm_train, batch_norm_train_into, batch_norm_train_replay, channel_affine,
    channel_affine_into, BatchNormBackward,
};
pub use batch_norm_sync::{sync_batch_norm_apply, sync_batch_norm_sums, SyncBatchNormBackward};
#[cfg(feature = "cudnn")]
pub use cache::{cache_stats, clear_caches, CacheStats};
pub use channel_views::channel_buffer;
#[cfg(feature = "cudnn")]
pub use conv::{conv2d, conv2d_input_grad, conv2d_kernel_grad};
pub use cross_entropy::{
    sparse_softmax_cross_entropy, sparse_softmax_cross_entropy_with, LabelCheck,
};
pub use dense::{dense, dense_supported};
pub use optimizer::{
    adam_step, adam_step_live, sgd_step, sgd_step_live, LiveRates, MomentumBuffers,
};
#[cfg(feature = "cudnn")]
pub use params::{AlgoSearch, Algorithms, Conv2dParams};
pub use pooling::{
    avg_pool2d, avg_pool2d_replay, max_pool2d, max_pool2d_into, max_pool2d_replay,
    max_pool2d_train_into, MaxPoolBackward,
};

/// Whether the batch normalisation and pooling kernels here take `x`'s device and dtype: a
/// CUDA device, and `f32`, `f64`, `f16` or `bf16`. (Each function checks the shape: `(N, C,
/// ...)` for batch normalisation, `(N, C, H, W)` for pooling.)
pub fn supported(x: &Tensor) -> bool {
    x.device().is_cuda() && operands::supported_dtype(x.dtype())
}
