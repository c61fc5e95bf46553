//! The convolutions' public functions on cuDNN (the `cudnn` feature): their checks of shapes,
//! dtypes and devices, and the padding with more on one side, added to the input as zeros
//! before cuDNN's symmetric padding; the ops themselves are in `ops`.

use candle_core::Tensor;

use super::ops::{Forward, InputGrad, KernelGrad, FORWARD, INPUT_GRAD, KERNEL_GRAD};
use super::params::{dims4, supported_dtype, Conv2dParams, Excess, Geometry};
use crate::{Error, Result};

/// The correlation of `x (N, C, H, W)` with `w (O, C / groups, kh, kw)` through cuDNN: an
/// `(N, O, Ho, Wo)` tensor, as candle's `conv2d` computes it, with `params`' window.
/// Differentiable in `x` and `w` through candle's autograd.
///
/// Errors when the tensors are not on one CUDA device in one dtype among `f32`, `f64`, `f16`
/// and `bf16`, or their shapes do not fit `params`.
///
/// ```no_run
/// # fn main() -> kandle_kernels::Result<()> {
/// use candle_core::{DType, Device, Tensor};
/// use kandle_kernels::cuda::{self, Conv2dParams};
///
/// let dev = Device::new_cuda(0)?;
/// let x = Tensor::randn(0f32, 1., (8, 16, 32, 32), &dev)?;
/// let w = Tensor::randn(0f32, 1., (32, 16, 3, 3), &dev)?;
/// let params = Conv2dParams { padding: (1, 1, 1, 1), ..Default::default() };
/// let y = cuda::conv2d(&x, &w, params)?;
/// let dy = y.ones_like()?;
/// let dx = cuda::conv2d_input_grad(&dy, &w, x.dims(), params)?;
/// let dw = cuda::conv2d_kernel_grad(&x, &dy, w.dims(), params)?;
/// assert_eq!((dx.dims(), dw.dims()), (x.dims(), w.dims()));
/// # Ok(()) }
/// ```
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
