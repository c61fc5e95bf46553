//! Convolutions on CUDA devices through cuDNN, as candle custom ops on candle's own device and
//! stream (the `cudnn` feature).
//!
//! [`conv2d`] is the forward pass, differentiable through candle's autograd (its backward runs
//! the other two); [`conv2d_input_grad`] and [`conv2d_kernel_grad`] are the gradients, for a
//! caller that runs its own backward pass. All take candle [`Tensor`]s on one CUDA device, in
//! `f32` or `f64`, or `f16` or `bf16` with `f32` accumulation, `NCHW`, and a [`Conv2dParams`]:
//! strides, `(top, bottom, left, right)` padding as the CPU kernel ([`crate::conv2d`]) takes
//! it, dilation, groups and how the algorithm is chosen ([`Algorithms`]).
//!
//! What candle's own cuDNN path does on every call is done once here, per device
//! ([`cache_stats`]): one cuDNN handle on the device's stream; the algorithm of each operation,
//! dtype, shape, window and setting searched once (measured, or by cuDNN's heuristics: see
//! [`AlgoSearch`]) and kept with its descriptors; one workspace that only grows.
//! [`Algorithms::deterministic`] keeps to algorithms that give the same bits on every call;
//! `f32` runs with FMA math (no TF32) unless [`Algorithms::allow_tf32`].
//!
//! cuDNN pads both sides of a dimension alike; a padding with more on one side (Keras's
//! `"same"` at stride 2 on an even size) is cut into the symmetric part cuDNN applies and the
//! rest, which is added to the input as zeros first (one copy of the input).
//!
//! Shapes, dtypes and devices the ops cannot take are errors ([`Error::InvalidInput`]) naming
//! the op and what it got, as are failures inside cuDNN (as candle errors with the call that
//! failed); nothing here panics on a bad input.
//!
//! ```no_run
//! # fn main() -> kandle_kernels::Result<()> {
//! use candle_core::{DType, Device, Tensor};
//! use kandle_kernels::cuda::{self, Conv2dParams};
//!
//! let dev = Device::new_cuda(0)?;
//! let x = Tensor::randn(0f32, 1., (8, 16, 32, 32), &dev)?;
//! let w = Tensor::randn(0f32, 1., (32, 16, 3, 3), &dev)?;
//! let params = Conv2dParams { padding: (1, 1, 1, 1), ..Default::default() };
//! let y = cuda::conv2d(&x, &w, params)?;
//! let dy = y.ones_like()?;
//! let dx = cuda::conv2d_input_grad(&dy, &w, x.dims(), params)?;
//! let dw = cuda::conv2d_kernel_grad(&x, &dy, w.dims(), params)?;
//! assert_eq!((dx.dims(), dw.dims()), (x.dims(), w.dims()));
//! # Ok(()) }
//! ```

mod algorithms;
mod cache;
mod descriptors;
mod ops;
mod params;

use candle_core::Tensor;

pub use cache::{cache_stats, clear_caches, CacheStats};
pub use params::{AlgoSearch, Algorithms, Conv2dParams};

use crate::{Error, Result};
use ops::{Forward, InputGrad, KernelGrad, FORWARD, INPUT_GRAD, KERNEL_GRAD};
use params::{dims4, supported_dtype, Excess, Geometry};

/// The correlation of `x (N, C, H, W)` with `w (O, C / groups, kh, kw)` through cuDNN: an
/// `(N, O, Ho, Wo)` tensor, as candle's `conv2d` computes it, with `params`' window.
/// Differentiable in `x` and `w` through candle's autograd.
///
/// Errors when the tensors are not on one CUDA device in one dtype among `f32`, `f64`, `f16`
/// and `bf16`, or their shapes do not fit `params`.
pub fn conv2d(x: &Tensor, w: &Tensor, params: Conv2dParams) -> Result<Tensor> {
    check_tensors(FORWARD, &[("input", x), ("kernel", w)])?;
    let (window, excess) = params.split();
    let x_dims = dims4(FORWARD, "input", x.dims()).map_err(Error::invalid)?;
    Geometry::new(FORWARD, &excess.padded(x_dims), w.dims(), &window).map_err(Error::invalid)?;
    let x = pad(x, excess)?;
    Ok(x.apply_op2(&w.contiguous()?, Forward { window })?)
}

/// The gradient of [`conv2d`]'s input: from the output gradient `dy (N, O, Ho, Wo)` and the
/// kernel `w (O, C / groups, kh, kw)`, the `(N, C, H, W)` gradient of an input of dimensions
/// `x_dims`. Not differentiable.
///
/// Errors as [`conv2d`], and when `dy` is not the output of an `x_dims` input.
pub fn conv2d_input_grad(
    dy: &Tensor,
    w: &Tensor,
    x_dims: &[usize],
    params: Conv2dParams,
) -> Result<Tensor> {
    check_tensors(INPUT_GRAD, &[("output gradient", dy), ("kernel", w)])?;
    let [n, c, h, wd] = dims4(INPUT_GRAD, "input", x_dims).map_err(Error::invalid)?;
    let (window, excess) = params.split();
    let padded = excess.padded([n, c, h, wd]);
    Geometry::new(INPUT_GRAD, &padded, w.dims(), &window)
        .and_then(|g| g.check_output(INPUT_GRAD, dy.dims()))
        .map_err(Error::invalid)?;
    let op = InputGrad {
        window,
        x_dims: padded,
    };
    let dx = dy.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &op)?;
    if excess.is_none() {
        return Ok(dx);
    }
    // The gradient of the zeros added to the input is dropped.
    Ok(dx
        .narrow(2, excess.top, h)?
        .narrow(3, excess.left, wd)?
        .contiguous()?)
}

/// The gradient of [`conv2d`]'s kernel: from the input `x (N, C, H, W)` and the output
/// gradient `dy (N, O, Ho, Wo)`, the `(O, C / groups, kh, kw)` gradient, summed over the
/// batch, of a kernel of dimensions `w_dims`. Not differentiable.
///
/// Errors as [`conv2d`], and when `dy` is not the output of `x` with a `w_dims` kernel.
pub fn conv2d_kernel_grad(
    x: &Tensor,
    dy: &Tensor,
    w_dims: &[usize],
    params: Conv2dParams,
) -> Result<Tensor> {
    check_tensors(KERNEL_GRAD, &[("input", x), ("output gradient", dy)])?;
    let w_dims = dims4(KERNEL_GRAD, "kernel", w_dims).map_err(Error::invalid)?;
    let x_dims = dims4(KERNEL_GRAD, "input", x.dims()).map_err(Error::invalid)?;
    let (window, excess) = params.split();
    Geometry::new(KERNEL_GRAD, &excess.padded(x_dims), &w_dims, &window)
        .and_then(|g| g.check_output(KERNEL_GRAD, dy.dims()))
        .map_err(Error::invalid)?;
    let x = pad(x, excess)?;
    let op = KernelGrad { window, w_dims };
    Ok(x.apply_op2_no_bwd(&dy.contiguous()?, &op)?)
}

/// `x` contiguous, with `excess` zeros added around its planes.
fn pad(x: &Tensor, excess: Excess) -> Result<Tensor> {
    if excess.is_none() {
        return Ok(x.contiguous()?);
    }
    let x = x
        .pad_with_zeros(2, excess.top, excess.bottom)?
        .pad_with_zeros(3, excess.left, excess.right)?;
    Ok(x.contiguous()?)
}

/// An error unless every tensor is on the first one's CUDA device, in the first one's dtype,
/// one that cuDNN's convolutions take.
fn check_tensors(op: &str, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let Some((_, first)) = tensors.first() else {
        return Ok(());
    };
    for (what, t) in tensors {
        if !t.device().is_cuda() {
            return Err(Error::invalid(format!(
                "{op}: the cuDNN convolution takes tensors on a CUDA device, but the {what} {:?} \
                 is on {:?} (on the CPU, kandle_kernels::conv2d is the convolution kernel)",
                t.dims(),
                t.device()
            )));
        }
        if !t.device().same_device(first.device()) {
            return Err(Error::invalid(format!(
                "{op}: the {what} is on {:?}, another device than {:?}",
                t.device(),
                first.device()
            )));
        }
        if t.dtype() != first.dtype() || !supported_dtype(t.dtype()) {
            return Err(Error::invalid(format!(
                "{op}: the cuDNN convolution takes tensors of one dtype among f32, f64, f16 and \
                 bf16, but the {what} {:?} is {:?} (the first tensor {:?})",
                t.dims(),
                t.dtype(),
                first.dtype()
            )));
        }
    }
    Ok(())
}
