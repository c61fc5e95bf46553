//! Operands whose images lie apart: a range of a larger tensor's channels (`narrow` on axis 1),
//! what a concatenation hands each branch, read or written by the kernels in place.
//!
//! A concatenation of branches along channels allocates its output once
//! ([`channel_buffer`]); a branch whose last kernel can write a range of it does so, and in
//! the backward pass reads its range of the output gradient where it lies, with no copy either
//! way. Such a range is an `(N, C, ...)` tensor whose images are each contiguous and lie
//! [`image_stride`] values apart (more than `C * plane` when the range is a part of a larger
//! tensor); the kernels take that stride as an argument.

#![allow(unsafe_code)]

use candle_core::cuda_backend::cudarc::driver::{CudaStream, SyncOnDrop};
use candle_core::{CudaStorage, DType, Device, Layout, Tensor};

use super::operands::{read_span, supported_dtype, write_span};
use crate::{Error, Result};

/// The distance in values between the images of an `(N, C, ...)` operand laid out as `l`, when
/// each image is contiguous (a tensor of its own, or a range of a larger tensor's channels);
/// `None` otherwise.
pub(crate) fn image_stride(l: &Layout) -> Option<usize> {
    let (dims, strides) = (l.dims(), l.stride());
    let (&n, rest) = dims.split_first()?;
    if rest.is_empty() {
        return None;
    }
    let mut image = 1;
    for (&d, &s) in rest.iter().zip(&strides[1..]).rev() {
        // An axis of one value has a stride nothing reads.
        if d != 1 && s != image {
            return None;
        }
        image *= d;
    }
    match n {
        0 | 1 => Some(image),
        _ => (strides[0] >= image).then_some(strides[0]),
    }
}

/// Whether the kernels that take image strides read `t` where it lies.
pub(crate) fn images_contiguous(t: &Tensor) -> bool {
    image_stride(t.layout()).is_some()
}

/// The span of an operand laid out as `l` in its storage: its first value, one past its last,
/// and the distance between its images; an error when its images are not each contiguous.
fn span(op: &str, what: &str, l: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    let Some(stride) = image_stride(l) else {
        candle_core::bail!(
            "{op}: the {what} {:?} with strides {:?} does not hold each image contiguous",
            l.dims(),
            l.stride()
        )
    };
    let n = l.dims()[0];
    let image = l.shape().elem_count() / n.max(1);
    let start = l.start_offset();
    let end = match n {
        0 => start,
        _ => start + (n - 1) * stride + image,
    };
    Ok((start, end, stride))
}

/// The device address of the operand `what`, `(s, l)` (of one of the kernels' dtypes), whose
/// images lie apart ([`image_stride`]), the distance between its images in values, and the
/// guard to hold until the kernels that read it are queued.
pub(crate) fn strided_address<'a>(
    op: &str,
    what: &str,
    (s, l): (&'a CudaStorage, &Layout),
    stream: &'a CudaStream,
) -> candle_core::Result<(u64, u64, SyncOnDrop<'a>)> {
    let (start, end, stride) = span(op, what, l)?;
    let (ptr, guard) = read_span(op, what, s, l, (start, end), stream)?;
    Ok((ptr, stride as u64, guard))
}

/// [`strided_address`] of an operand the kernels write, with its write guard.
pub(crate) fn strided_address_mut<'a>(
    op: &str,
    what: &str,
    (s, l): (&'a mut CudaStorage, &Layout),
    stream: &'a CudaStream,
) -> candle_core::Result<(u64, u64, SyncOnDrop<'a>)> {
    let (start, end, stride) = span(op, what, l)?;
    let (ptr, guard) = write_span(op, what, s, l, (start, end), stream)?;
    Ok((ptr, stride as u64, guard))
}

/// A new tensor of `dims` and `dtype` on the CUDA device `device` for branches to write their
/// ranges of channels into ([`batch_norm_train_into`](super::batch_norm_train_into) and
/// [`channel_affine_into`](super::channel_affine_into), or candle's `slice_set`), without a
/// pass that fills it first. Its values are unspecified until written: the caller writes every
/// channel before anything reads it.
///
/// Errors for a device that is not CUDA or a dtype the kernels do not take (`f32`, `f64`,
/// `f16`, `bf16`).
pub fn channel_buffer(dims: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    if !device.is_cuda() || !supported_dtype(dtype) {
        return Err(Error::invalid(format!(
            "channel_buffer: a buffer of {dtype:?} {dims:?} on {device:?}, where a CUDA device \
             and f32, f64, f16 or bf16 are needed"
        )));
    }
    // SAFETY: every bit pattern of these dtypes is a value, so a read of a value not yet
    // written gives an arbitrary number, never undefined behaviour; the contract above makes
    // every value written before the tensor is read.
    Ok(unsafe { Tensor::empty(dims, dtype, device) }?)
}
