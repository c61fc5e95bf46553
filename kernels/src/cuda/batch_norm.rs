//! Batch normalisation on CUDA devices with kandle's own kernels (`batch_norm.cu`), as candle
//! custom ops with their backward passes: the same functions and semantics as the CPU kernels
//! of [`crate::batch_norm`].
//!
//! Training ([`batch_norm_train`]) takes three kernels: each channel's sums of the values less
//! its first value and of their squares, a block per slice of [`CHUNK`] values of a channel
//! (added in `f64` across the block); a thread per channel for the mean, the biased variance,
//! `invstd` and the affine map `scale = weight * invstd`, `shift = bias - mean * scale` (a
//! table of five rows, kept for the backward pass and returned as the batch statistics); and
//! `y = x * scale + shift` with the optional ReLU. The backward pass takes three more: the sums
//! of `dy'` and `dy' * (x - mean)` (`dy'` is `dy` where the ReLU passes it, its mask computed
//! again from `x` and the map), a thread per channel for the weight's and bias's gradients and
//! the input gradient's coefficients, and
//! `dx = weight * invstd * (dy' - mean(dy') - xhat * mean(dy' * xhat))`.
//!
//! [`channel_affine`] is inference's `y = x * scale + shift` (then the ReLU), differentiable in
//! all three, its backward pass the same three kernels without the centred term.
//!
//! A concatenation's branch writes its output into its range of the concatenation's channels
//! ([`batch_norm_train_into`], [`channel_affine_into`]: the last kernel writes there), and the
//! backward kernels read an output gradient that is such a range where it lies
//! (`channel_views`), so neither pass copies a branch's channels.
//!
//! NaNs propagate as in PyTorch and the CPU kernels: a NaN in a channel of a training batch
//! makes the channel's statistics and outputs NaN; in inference only its own output is NaN.

#![allow(unsafe_code)]

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, InplaceOp3, Layout, Shape, Tensor};

use super::channel_views::{images_contiguous, strided_address, strided_address_mut};
use super::operands::{
    address_mut, addresses, check_input, companion, kernel, on_cpu, stats_dtype, storage, tensor,
    uninit,
};
use super::program::{blocks_of, per_item, Arg, Program};
use crate::batch_norm::BatchStats;
use crate::replay::Replay3;
use crate::{Error, Result};

const TRAIN_OP: &str = "cuda_batch_norm";
const STATS_OP: &str = "cuda_batch_norm_statistics";
const APPLY_OP: &str = "cuda_channel_affine_into";
const AFFINE_OP: &str = "cuda_channel_affine";
const GRAD_SUMS_OP: &str = "cuda_batch_norm_grad_sums";
pub(super) const GRAD_OP: &str = "cuda_batch_norm_input_grad";
pub(super) const CPU_TRAIN: &str = "kandle_kernels::batch_norm::batch_norm_train";
const CPU_AFFINE: &str = "kandle_kernels::batch_norm::channel_affine";

pub(super) static PROGRAM: Program = Program::new(
    "kandle_batch_norm",
    concat!(include_str!("common.cuh"), include_str!("batch_norm.cu")),
);

/// Values of a channel that one block of the partial sums takes (16 per thread).
pub(super) const CHUNK: u32 = 4096;

/// The statistics table's rows (as `batch_norm.cu`'s `ROW_*`): mean, variance, `invstd`, the
/// map's scale and shift.
pub(super) const ROW_MEAN: usize = 0;
pub(super) const ROW_VAR: usize = 1;
pub(super) const ROW_SCALE: usize = 3;
pub(super) const ROW_SHIFT: usize = 4;
pub(super) const TABLE_ROWS: usize = 5;
/// The backward table's rows (as `batch_norm.cu`'s `GROW_*`): the bias's and the weight's
/// gradients first, then the input gradient's coefficients.
pub(super) const GROW_DBIAS: usize = 0;
pub(super) const GROW_DWEIGHT: usize = 1;
pub(super) const GRAD_ROWS: usize = 7;

/// Training-mode batch normalisation of the `(N, C, ...)` tensor `x` on a CUDA device over
/// every axis but the channels: `y = (x - mean) / sqrt(var + epsilon) * weight + bias`, then
/// `max(y, 0)` when `relu`, as [`crate::batch_norm::batch_norm_train`] on the CPU. A missing
/// `weight` is one and a missing `bias` zero. Gradients flow to `x`, `weight` and `bias`
/// through this module's backward kernels; the statistics are returned detached, for the
/// caller to move its running averages.
///
/// `x` is `f32`, `f64`, `f16` or `bf16`; `weight`, `bias` and the statistics are `f64` for an
/// `f64` input and `f32` otherwise. Errors ([`Error::InvalidInput`]) for a tensor on another
/// device, another dtype or shape, more than 65,535 channels or no values.
pub fn batch_norm_train(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    epsilon: f64,
    relu: bool,
) -> Result<(Tensor, BatchStats)> {
    let (replay, stats) = batch_norm_train_replay(x, weight, bias, epsilon, relu)?;
    Ok((replay.output().clone(), stats))
}

/// [`batch_norm_train`], kept for calling its backward pass directly; the backward gives the
/// gradients of `x`, the weight and the bias (of ones and zeros when those are missing).
pub fn batch_norm_train_replay(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    epsilon: f64,
    relu: bool,
) -> Result<(Replay3, BatchStats)> {
    let (weight, bias) = training_operands(TRAIN_OP, x, weight, bias, epsilon)?;
    let saved = Arc::new(OnceLock::new());
    let op = TrainOp {
        epsilon,
        output: TrainOutput::Normalized {
            relu,
            saved: Arc::clone(&saved),
        },
    };
    let replay = Replay3::apply((&x.contiguous()?, &weight, &bias), op)?;
    let table: &Tensor = saved
        .get()
        .ok_or_else(|| Error::invalid(format!("{TRAIN_OP}: the forward pass did not run")))?;
    let stats = BatchStats {
        mean: table.get(ROW_MEAN)?,
        var: table.get(ROW_VAR)?,
    };
    Ok((replay, stats))
}

/// [`batch_norm_train`] with its output written into `out`, a tensor of `x`'s shape and dtype
/// whose images are each contiguous: a range of a larger tensor's channels (`narrow` on axis 1
/// of a [`channel_buffer`](super::channel_buffer)), as a concatenation hands its branches.
/// Returns what the backward pass needs and the batch statistics; nothing is recorded for
/// candle's autograd.
///
/// Errors as [`batch_norm_train`], and for an `out` of another shape, dtype or device, or
/// whose images are not contiguous.
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use kandle_kernels::cuda::{batch_norm_train_into, channel_buffer};
///
/// let dev = Device::new_cuda(0)?;
/// let x = Tensor::randn(0f32, 1., (8, 3, 4, 4), &dev)?;
/// let joined = channel_buffer(&[8, 5, 4, 4], DType::F32, &dev)?;
/// let part = joined.narrow(1, 2, 3)?; // channels 2..5 of the joined tensor
/// let (backward, stats) = batch_norm_train_into(&x, None, None, 1e-3, true, &part)?;
/// let (dx, dweight, dbias) = backward.backward(&part.ones_like()?)?;
/// assert_eq!((dx.dims(), dweight.dims(), stats.mean.dims()), (x.dims(), &[3][..], &[3][..]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn batch_norm_train_into(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    epsilon: f64,
    relu: bool,
    out: &Tensor,
) -> Result<(BatchNormBackward, BatchStats)> {
    let (weight, bias) = training_operands(STATS_OP, x, weight, bias, epsilon)?;
    check_out(APPLY_OP, x, out)?;
    let x = x.contiguous()?;
    let stats_op = TrainOp {
        epsilon,
        output: TrainOutput::Statistics,
    };
    let table = x.apply_op3_no_bwd(&weight, &bias, &stats_op)?;
    let apply = ApplyInto {
        relu,
        rows: (TABLE_ROWS, ROW_SCALE, ROW_SHIFT),
    };
    out.inplace_op3(&x, &table, &apply)?;
    let stats = BatchStats {
        mean: table.get(ROW_MEAN)?,
        var: table.get(ROW_VAR)?,
    };
    let backward = BatchNormBackward {
        x,
        table,
        relu,
        centered: true,
    };
    Ok((backward, stats))
}

/// [`channel_affine`] with its output written into `out`, as [`batch_norm_train_into`] writes
/// its own; returns what the backward pass needs (the gradients of `x`, `scale` and `shift`).
///
/// Errors as [`channel_affine`], and for an `out` as [`batch_norm_train_into`]'s.
pub fn channel_affine_into(
    x: &Tensor,
    scale: &Tensor,
    shift: &Tensor,
    relu: bool,
    out: &Tensor,
) -> Result<BatchNormBackward> {
    let c = check_x(AFFINE_OP, CPU_AFFINE, x)?;
    check_out(APPLY_OP, x, out)?;
    let stats = stats_dtype(x.dtype());
    let scale = companion(AFFINE_OP, "scale", scale, x, stats, &[c])?.detach();
    let shift = companion(AFFINE_OP, "shift", shift, x, stats, &[c])?.detach();
    let x = x.contiguous()?;
    let table = affine_table(&scale, &shift)?;
    let apply = ApplyInto {
        relu,
        rows: (TABLE_ROWS, ROW_SCALE, ROW_SHIFT),
    };
    out.inplace_op3(&x, &table, &apply)?;
    Ok(BatchNormBackward {
        x,
        table,
        relu,
        centered: false,
    })
}

/// What the backward pass of [`batch_norm_train_into`] or [`channel_affine_into`] reads: the
/// input and the forward pass's statistics table.
#[derive(Debug, Clone)]
pub struct BatchNormBackward {
    x: Tensor,
    table: Tensor,
    relu: bool,
    centered: bool,
}

impl BatchNormBackward {
    /// The gradients of the input, the weight (or scale) and the bias (or shift) from the
    /// output gradient `dy`, which may be a range of a larger tensor's channels (read where it
    /// lies, as the output was written).
    pub fn backward(&self, dy: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (dx, dweight, dbias) = backward(&self.x, dy, &self.table, self.relu, self.centered)?;
        match (dx, dweight, dbias) {
            (Some(dx), Some(dweight), Some(dbias)) => Ok((dx, dweight, dbias)),
            _ => Err(Error::invalid(format!("{GRAD_OP}: a gradient is missing"))),
        }
    }
}

/// The checks of a training pass's operands, made by the op `op`: `x` the kernels take, and a
/// non-negative `epsilon`; returns the weight and bias (ones and zeros when missing) as the
/// kernels take them.
pub(super) fn training_operands(
    op: &str,
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    epsilon: f64,
) -> Result<(Tensor, Tensor)> {
    let c = check_x(op, CPU_TRAIN, x)?;
    if epsilon.is_nan() || epsilon < 0.0 {
        return Err(Error::invalid(format!(
            "{op}: epsilon must be non-negative, got {epsilon}"
        )));
    }
    let stats = stats_dtype(x.dtype());
    let weight = match weight {
        Some(w) => companion(op, "weight", w, x, stats, &[c])?,
        None => Tensor::ones(c, stats, x.device())?,
    };
    let bias = match bias {
        Some(b) => companion(op, "bias", b, x, stats, &[c])?,
        None => Tensor::zeros(c, stats, x.device())?,
    };
    Ok((weight, bias))
}

/// The statistics table (mean, variance, invstd, scale, shift) of the map `x * scale + shift`
/// of `x` itself: mean 0 (no centring), invstd 1.
fn affine_table(scale: &Tensor, shift: &Tensor) -> candle_core::Result<Tensor> {
    let (zeros, ones) = (scale.zeros_like()?, scale.ones_like()?);
    Tensor::stack(&[&zeros, &zeros, &ones, scale, shift], 0)
}

/// An error unless `out` can take the output for `x`: its shape, dtype and device, its images
/// each contiguous.
fn check_out(op: &str, x: &Tensor, out: &Tensor) -> Result<()> {
    let fits = out.dims() == x.dims()
        && out.dtype() == x.dtype()
        && out.device().same_device(x.device())
        && images_contiguous(out);
    if !fits {
        return Err(Error::invalid(format!(
            "{op}: the output {:?} {:?} with strides {:?} on {:?} cannot take the output for the              input {:?} {:?} on {:?} (same shape, dtype and device, each image contiguous)",
            out.dtype(),
            out.dims(),
            out.stride(),
            out.device(),
            x.dtype(),
            x.dims(),
            x.device()
        )));
    }
    Ok(())
}

/// `y = x * scale[c] + shift[c]` over the channels of the `(N, C, ...)` tensor `x` on a CUDA
/// device, then `max(y, 0)` when `relu`, as [`crate::batch_norm::channel_affine`] on the CPU;
/// differentiable in `x`, `scale` and `shift`. Inference-mode batch normalisation is this with
/// `scale = weight / sqrt(running_var + epsilon)` and `shift = bias - running_mean * scale`.
///
/// Dtypes and errors as [`batch_norm_train`]'s (`scale` and `shift` as its weight and bias).
pub fn channel_affine(x: &Tensor, scale: &Tensor, shift: &Tensor, relu: bool) -> Result<Tensor> {
    let c = check_x(AFFINE_OP, CPU_AFFINE, x)?;
    let stats = stats_dtype(x.dtype());
    let scale = companion(AFFINE_OP, "scale", scale, x, stats, &[c])?;
    let shift = companion(AFFINE_OP, "shift", shift, x, stats, &[c])?;
    Ok(x.contiguous()?
        .apply_op3(&scale, &shift, AffineOp { relu })?)
}

/// Checks that the kernels take `x` and returns its channel count.
pub(super) fn check_x(op: &str, cpu_kernel: &str, x: &Tensor) -> Result<usize> {
    check_input(op, x, cpu_kernel)?;
    let extent = Extent::of(op, x.dims()).map_err(Error::invalid)?;
    Ok(extent.channels as usize)
}

/// An `(N, C, ...)` input's extent, within the kernels' 32-bit indices.
#[derive(Debug, Clone, Copy)]
pub(super) struct Extent {
    pub(super) channels: u32,
    /// Values per image and channel.
    pub(super) plane: u32,
    /// Values per channel, `N * plane`.
    pub(super) count: u32,
    /// Values in all.
    pub(super) total: u32,
}

impl Extent {
    pub(super) fn of(op: &str, dims: &[usize]) -> std::result::Result<Self, String> {
        let [n, c, rest @ ..] = dims else {
            return Err(format!(
                "{op}: expected a tensor of shape (N, C, ...), got {dims:?}"
            ));
        };
        let plane: usize = rest.iter().product();
        let total = n * c * plane;
        if total == 0 {
            return Err(format!(
                "{op}: the input {dims:?} has no values to normalise"
            ));
        }
        if total > i32::MAX as usize || *c > u16::MAX as usize {
            return Err(format!(
                "{op}: the input {dims:?} is too large for the kernels (at most {} values and \
                 {} channels)",
                i32::MAX,
                u16::MAX
            ));
        }
        // Bounded by `total` above.
        let narrow = |v: usize| v as u32;
        Ok(Self {
            channels: narrow(*c),
            plane: narrow(plane),
            count: narrow(n * plane),
            total: narrow(total),
        })
    }

    /// Values per image, the distance between the images of a tensor of its own.
    fn image(&self) -> u64 {
        u64::from(self.channels) * u64::from(self.plane)
    }

    /// The blocks of a channel's partial sums.
    pub(super) fn splits(&self) -> u32 {
        self.count.div_ceil(CHUNK)
    }

    /// The channels and the values per image and channel, as the kernels' arguments.
    fn dims_args(&self) -> [Arg; 2] {
        [Arg::U32(self.channels), Arg::U32(self.plane)]
    }
}

/// The partial sums of `kernel` over the channels of `e`, `[sum, sum]` per block: `inputs` are
/// its first arguments, then the partials, the extent and [`CHUNK`], then `rest`.
pub(super) fn partial_sums(
    dev: &CudaDevice,
    stream: &CudaStream,
    kernel: &str,
    e: Extent,
    inputs: &[Arg],
    rest: &[Arg],
) -> candle_core::Result<CudaSlice<f64>> {
    let splits = e.splits();
    // SAFETY: the kernel writes both sums of every block, `splits` per channel.
    let mut partials = unsafe { dev.alloc::<f64>(2 * splits as usize * e.channels as usize) }?;
    let (p, written) = partials.device_ptr_mut(stream);
    let mut args = inputs.to_vec();
    args.push(Arg::Ptr(p));
    args.extend(e.dims_args());
    args.extend([Arg::U32(e.count), Arg::U32(CHUNK)]);
    args.extend_from_slice(rest);
    // SAFETY: the inputs hold the extent's values in the kernel's dtype (checked by the caller),
    // the partials two values per block of the grid.
    unsafe { PROGRAM.launch(dev, kernel, blocks_of((splits, e.channels)), &args) }?;
    drop(written);
    Ok(partials)
}

/// Launches the finishing kernel `kernel_name` over the `partials` of `e`, a thread per channel,
/// which writes a new table of `rows` rows of a value per channel in the statistics' dtype: its
/// arguments the partials and their blocks per channel, `inputs`, the table, then `rest`. `then`
/// runs with the table's address before the guards of the partials and the table drop; returns
/// the table and what `then` returns.
#[allow(clippy::too_many_arguments)]
fn finalize<R>(
    op: &str,
    kernel_name: &str,
    (dev, stream): (&CudaDevice, &CudaStream),
    dtype: DType,
    e: Extent,
    (partials, rows): (&CudaSlice<f64>, usize),
    (inputs, rest): (&[Arg], &[Arg]),
    then: impl FnOnce(u64) -> candle_core::Result<R>,
) -> candle_core::Result<(CudaStorageSlice, R)> {
    let c = e.channels as usize;
    // SAFETY: the finishing kernel writes every row of every channel.
    let mut table = unsafe { uninit(dev, stats_dtype(dtype), rows * c) }?;
    let out = {
        let (pp, read_p) = partials.device_ptr(stream);
        let (pt, written) = address_mut(&mut table, stream)?;
        let mut args = vec![Arg::Ptr(pp), Arg::U32(e.splits())];
        args.extend_from_slice(inputs);
        args.push(Arg::Ptr(pt));
        args.extend_from_slice(rest);
        let name = kernel(op, kernel_name, dtype)?;
        // SAFETY: the partials of `e`; the callers pass the kernel's inputs in its order, `x` of
        // `dtype` and the per-channel operands (checked) of the statistics' dtype, and the table
        // holds its `rows` rows of one value per channel.
        unsafe { PROGRAM.launch(dev, &name, per_item(c), &args) }?;
        let out = then(pt)?;
        drop((read_p, written));
        out
    };
    Ok((table, out))
}

/// Launches `kernel_name` over the extent `e` of `dtype`, a thread per value, and returns its
/// output of `e.total` values of `dtype`: its arguments `inputs`, the output, the extent's total,
/// channels and plane, then `rest`.
pub(super) fn apply(
    op: &str,
    kernel_name: &str,
    (dev, stream): (&CudaDevice, &CudaStream),
    dtype: DType,
    e: Extent,
    (inputs, rest): (&[Arg], &[Arg]),
) -> candle_core::Result<CudaStorageSlice> {
    // SAFETY: the kernel writes every value.
    let mut out = unsafe { uninit(dev, dtype, e.total as usize) }?;
    let (po, written) = address_mut(&mut out, stream)?;
    // SAFETY: the output holds `e.total` values of `dtype`; the rest is the caller's contract.
    unsafe { launch_apply(op, kernel_name, dev, dtype, e, (inputs, po, rest)) }?;
    drop(written);
    Ok(out)
}

/// Launches `kernel_name` over the extent `e` of `dtype`, a thread per value: its arguments
/// `inputs`, the output `out`, the extent's total, channels and plane, then `rest`.
///
/// # Safety
///
/// `inputs` are the kernel's inputs in its order: those of the input's shape `e.total` values of
/// `dtype`, the per-channel ones of the statistics' dtype; `out` holds the kernel's output for
/// the extent `e` (as laid out by the strides in `rest`, if any).
unsafe fn launch_apply(
    op: &str,
    kernel_name: &str,
    dev: &CudaDevice,
    dtype: DType,
    e: Extent,
    (inputs, out, rest): (&[Arg], u64, &[Arg]),
) -> candle_core::Result<()> {
    let mut args = inputs.to_vec();
    args.extend([Arg::Ptr(out), Arg::U32(e.total)]);
    args.extend(e.dims_args());
    args.extend_from_slice(rest);
    let name = kernel(op, kernel_name, dtype)?;
    // SAFETY: the caller's contract.
    unsafe { PROGRAM.launch(dev, &name, per_item(e.total as usize), &args) }
}

/// Launches `y = x * scale + shift` (then the ReLU) over the extent `e` of `dtype` and returns
/// `y`.
pub(super) fn forward_apply(
    op: &str,
    ctx: (&CudaDevice, &CudaStream),
    dtype: DType,
    e: Extent,
    x: u64,
    (scale, shift): (u64, u64),
    relu: bool,
) -> candle_core::Result<CudaStorageSlice> {
    let inputs = [Arg::Ptr(x), Arg::Ptr(scale), Arg::Ptr(shift)];
    let rest = [Arg::I32(relu.into()), Arg::U64(e.image())];
    apply(op, "bn_forward_apply", ctx, dtype, e, (&inputs, &rest))
}

/// How an op's second and third operands are checked against its input.
#[derive(Debug, Clone, Copy)]
enum Companions {
    /// Two per-channel vectors, named so (the weight and bias, or the scale and shift).
    Vectors(&'static str, &'static str),
    /// The output gradient, then the per-channel table named so, of the rows given.
    Gradient(&'static str, usize),
}

/// The device addresses of an op's three operands, and what the kernels need to read them.
struct Operands<'a> {
    /// The extent of the input `x`, the first operand.
    e: Extent,
    pointers: [u64; 3],
    /// The distance between the images of the second operand when it is an output gradient,
    /// which may be a range of a larger tensor's channels.
    dy_stride: u64,
    /// The guards to hold until the kernels that read the operands are queued.
    _guards: Vec<SyncOnDrop<'a>>,
}

/// What each op's CUDA forward pass starts with: the extent of its input `x` (the first
/// operand), the checks of the other two (`companions`), and the device addresses of all three.
fn operands<'a>(
    op: &str,
    [x, a, b]: [(&'a CudaStorage, &Layout); 3],
    companions: Companions,
    stream: &'a CudaStream,
) -> candle_core::Result<Operands<'a>> {
    let e = Extent::of(op, x.1.dims()).map_err(candle_core::Error::Msg)?;
    let dtype = x.0.dtype();
    match companions {
        Companions::Vectors(first, second) => {
            check_table(op, first, a, dtype, None, e.channels)?;
            check_table(op, second, b, dtype, None, e.channels)?;
            let (pointers, guards) = addresses(op, [x, a, b], stream)?;
            Ok(Operands {
                e,
                pointers,
                dy_stride: e.image(),
                _guards: guards,
            })
        }
        Companions::Gradient(what, rows) => {
            check_gradient(op, x, a)?;
            check_table(op, what, b, dtype, Some(rows), e.channels)?;
            let ([px, pb], mut guards) = addresses(op, [x, b], stream)?;
            let (pa, dy_stride, read) = strided_address(op, "output gradient", a, stream)?;
            guards.push(read);
            Ok(Operands {
                e,
                pointers: [px, pa, pb],
                dy_stride,
                _guards: guards,
            })
        }
    }
}

/// An error unless the per-channel operand `(s, l)` `what` has `rows` rows of `channels`
/// values of the statistics' dtype for inputs of `dtype`.
fn check_table(
    op: &str,
    what: &str,
    (s, l): (&CudaStorage, &Layout),
    dtype: DType,
    rows: Option<usize>,
    channels: u32,
) -> candle_core::Result<()> {
    let want: Vec<usize> = rows.into_iter().chain([channels as usize]).collect();
    if s.dtype() != stats_dtype(dtype) || l.dims() != want {
        candle_core::bail!(
            "{op}: the {what} is {:?} {:?}, where {:?} {want:?} is needed",
            s.dtype(),
            l.dims(),
            stats_dtype(dtype)
        );
    }
    Ok(())
}

/// The training forward pass: operands `(x, weight, bias)`.
struct TrainOp {
    epsilon: f64,
    output: TrainOutput,
}

/// What a [`TrainOp`] gives.
enum TrainOutput {
    /// The normalised input (then the ReLU), the statistics table kept in `saved` for the
    /// backward pass and the caller.
    Normalized {
        relu: bool,
        saved: Arc<OnceLock<Tensor>>,
    },
    /// The statistics table alone (`TABLE_ROWS` rows), for [`ApplyInto`] to apply; no backward
    /// pass.
    Statistics,
}

impl CustomOp3 for TrainOp {
    fn name(&self) -> &'static str {
        match self.output {
            TrainOutput::Normalized { .. } => TRAIN_OP,
            TrainOutput::Statistics => STATS_OP,
        }
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(self.name(), CPU_TRAIN))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (op, dev, dtype) = (self.name(), &x.device, x.dtype());
        let stream = dev.cuda_stream();
        let params = Companions::Vectors("weight", "bias");
        let operands = operands(op, [(x, xl), (w, wl), (b, bl)], params, &stream)?;
        let (e, [px, pw, pb]) = (operands.e, operands.pointers);
        let c = e.channels as usize;
        let name = kernel(op, "bn_stats_partial", dtype)?;
        // No shift: the channel's first value is the shift.
        let inputs = [Arg::Ptr(px), Arg::Ptr(0)];
        let partials = partial_sums(dev, &stream, &name, e, &inputs, &[])?;
        let [channels, plane] = e.dims_args();
        let inputs = [Arg::Ptr(px), Arg::Ptr(pw), Arg::Ptr(pb)];
        let rest = [
            channels,
            plane,
            Arg::F64(e.count.into()),
            Arg::F64(self.epsilon),
        ];
        let row = stats_dtype(dtype).size_in_bytes() * c;
        let ctx = (dev, &*stream);
        let (table, y) = finalize(
            op,
            "bn_stats_finalize",
            ctx,
            dtype,
            e,
            (&partials, TABLE_ROWS),
            (&inputs, &rest),
            |pt| match &self.output {
                TrainOutput::Normalized { relu, .. } => {
                    let map = (pt + (ROW_SCALE * row) as u64, pt + (ROW_SHIFT * row) as u64);
                    forward_apply(op, ctx, dtype, e, px, map, *relu).map(Some)
                }
                TrainOutput::Statistics => Ok(None),
            },
        )?;
        drop(operands);
        match (&self.output, y) {
            (TrainOutput::Normalized { saved, .. }, Some(y)) => {
                saved
                    .set(tensor(table, dev, &[TABLE_ROWS, c]))
                    .map_err(|_| candle_core::Error::Msg(format!("{op}: op applied twice")))?;
                Ok((storage(y, dev), xl.shape().clone()))
            }
            _ => Ok((storage(table, dev), Shape::from((TABLE_ROWS, c)))),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        _weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let TrainOutput::Normalized { relu, saved } = &self.output else {
            candle_core::bail!("{STATS_OP}: the statistics have no backward pass");
        };
        let table = saved.get().ok_or_else(|| {
            candle_core::Error::Msg(format!("{TRAIN_OP}: backward before forward"))
        })?;
        backward(x, grad, table, *relu, true)
    }
}

/// `y = x * scale + shift` (then the ReLU) written into the destination, whose images may lie
/// apart (a range of a larger tensor's channels): sources `(x, table)`, the map's scale and
/// shift the rows `rows.1` and `rows.2` of the table of `rows.0` rows.
struct ApplyInto {
    relu: bool,
    rows: (usize, usize, usize),
}

impl InplaceOp3 for ApplyInto {
    fn name(&self) -> &'static str {
        APPLY_OP
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        Err(on_cpu(APPLY_OP, CPU_AFFINE))
    }

    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dst_l: &Layout,
        x: &CudaStorage,
        xl: &Layout,
        t: &CudaStorage,
        tl: &Layout,
    ) -> candle_core::Result<()> {
        let (dev, dtype) = (x.device.clone(), x.dtype());
        let stream = dev.cuda_stream();
        let e = Extent::of(APPLY_OP, xl.dims()).map_err(candle_core::Error::Msg)?;
        let (rows, scale_row, shift_row) = self.rows;
        check_table(
            APPLY_OP,
            "statistics",
            (t, tl),
            dtype,
            Some(rows),
            e.channels,
        )?;
        if dst.dtype() != dtype || dst_l.dims() != xl.dims() {
            candle_core::bail!(
                "{APPLY_OP}: the output {:?} {:?} for an input {:?} {:?}",
                dst.dtype(),
                dst_l.dims(),
                dtype,
                xl.dims()
            );
        }
        let ([px, pt], read) = addresses(APPLY_OP, [(x, xl), (t, tl)], &stream)?;
        let (py, y_stride, written) =
            strided_address_mut(APPLY_OP, "output", (dst, dst_l), &stream)?;
        let row = (stats_dtype(dtype).size_in_bytes() * e.channels as usize) as u64;
        let (scale, shift) = (pt + scale_row as u64 * row, pt + shift_row as u64 * row);
        let inputs = [Arg::Ptr(px), Arg::Ptr(scale), Arg::Ptr(shift)];
        let rest = [Arg::I32(self.relu.into()), Arg::U64(y_stride)];
        // SAFETY: `x` holds the extent's values of `dtype` (contiguous, checked by `addresses`),
        // the table `rows` rows of a value per channel of the statistics' dtype (checked); the
        // destination has `x`'s shape and dtype, its images contiguous and `y_stride` apart
        // within its storage (checked by `strided_address_mut`).
        unsafe {
            launch_apply(
                APPLY_OP,
                "bn_forward_apply",
                &dev,
                dtype,
                e,
                (&inputs, py, &rest),
            )
        }?;
        drop((read, written));
        Ok(())
    }
}

/// The inference affine: operands `(x, scale, shift)`.
struct AffineOp {
    relu: bool,
}

impl CustomOp3 for AffineOp {
    fn name(&self) -> &'static str {
        AFFINE_OP
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(AFFINE_OP, CPU_AFFINE))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (dev, dtype) = (&x.device, x.dtype());
        let stream = dev.cuda_stream();
        let map = Companions::Vectors("scale", "shift");
        let operands = operands(AFFINE_OP, [(x, xl), (a, al), (b, bl)], map, &stream)?;
        let [px, pa, pb] = operands.pointers;
        let ctx = (dev, &*stream);
        let y = forward_apply(AFFINE_OP, ctx, dtype, operands.e, px, (pa, pb), self.relu)?;
        drop(operands);
        Ok((storage(y, dev), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        scale: &Tensor,
        shift: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let table = affine_table(&scale.detach(), &shift.detach())?;
        backward(x, grad, &table, self.relu, false)
    }
}

/// The backward pass of a map whose statistics table is `table`: the gradients of `x`, the
/// weight (or scale) and the bias (or shift), from the output gradient `grad`. `centered` for
/// training's normalisation, whose input gradient has the statistics' terms.
fn backward(
    x: &Tensor,
    grad: &Tensor,
    table: &Tensor,
    relu: bool,
    centered: bool,
) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    if grad.dims() != x.dims() || grad.dtype() != x.dtype() {
        candle_core::bail!(
            "{GRAD_OP}: an output gradient {:?} {:?} for an input {:?} {:?}",
            grad.dtype(),
            grad.dims(),
            x.dtype(),
            x.dims()
        );
    }
    // An output gradient that is a range of a larger tensor's channels is read where it lies.
    let x = x.contiguous()?;
    let grad = match images_contiguous(grad) {
        true => grad.clone(),
        false => grad.contiguous()?,
    };
    let grads = x.apply_op3_no_bwd(&grad, table, &GradSums { relu, centered })?;
    let dx = x.apply_op3_no_bwd(&grad, &grads, &InputGrad { relu, centered })?;
    Ok((
        Some(dx),
        Some(grads.get(GROW_DWEIGHT)?),
        Some(grads.get(GROW_DBIAS)?),
    ))
}

/// The backward pass's sums and what they give per channel: operands `(x, dy, table)`, the
/// output the backward table (`GRAD_ROWS` rows).
struct GradSums {
    relu: bool,
    centered: bool,
}

impl CustomOp3 for GradSums {
    fn name(&self) -> &'static str {
        GRAD_SUMS_OP
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(GRAD_SUMS_OP, CPU_TRAIN))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        dy: &CudaStorage,
        dyl: &Layout,
        t: &CudaStorage,
        tl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (dev, dtype) = (&x.device, x.dtype());
        let stream = dev.cuda_stream();
        let table = Companions::Gradient("statistics", TABLE_ROWS);
        let operands = operands(GRAD_SUMS_OP, [(x, xl), (dy, dyl), (t, tl)], table, &stream)?;
        let (e, [px, pdy, pt]) = (operands.e, operands.pointers);
        let name = kernel(GRAD_SUMS_OP, "bn_grad_partial", dtype)?;
        let inputs = [Arg::Ptr(px), Arg::Ptr(pdy), Arg::Ptr(pt)];
        let rest = [Arg::I32(self.relu.into()), Arg::U64(operands.dy_stride)];
        let partials = partial_sums(dev, &stream, &name, e, &inputs, &rest)?;
        let rest = [
            Arg::U32(e.channels),
            Arg::F64(e.count.into()),
            Arg::I32(self.centered.into()),
        ];
        let (grads, ()) = finalize(
            GRAD_SUMS_OP,
            "bn_grad_finalize",
            (dev, &stream),
            dtype,
            e,
            (&partials, GRAD_ROWS),
            (&[Arg::Ptr(pt)], &rest),
            |_| Ok(()),
        )?;
        drop(operands);
        let c = e.channels as usize;
        Ok((storage(grads, dev), Shape::from((GRAD_ROWS, c))))
    }
}

/// The input gradient: operands `(x, dy, grads)`, `grads` the backward table of [`GradSums`].
struct InputGrad {
    relu: bool,
    centered: bool,
}

impl CustomOp3 for InputGrad {
    fn name(&self) -> &'static str {
        GRAD_OP
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(GRAD_OP, CPU_TRAIN))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        dy: &CudaStorage,
        dyl: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (dev, dtype) = (&x.device, x.dtype());
        let stream = dev.cuda_stream();
        let table = Companions::Gradient("backward table", GRAD_ROWS);
        let operands = operands(GRAD_OP, [(x, xl), (dy, dyl), (g, gl)], table, &stream)?;
        let [px, pdy, pg] = operands.pointers;
        let inputs = [Arg::Ptr(px), Arg::Ptr(pdy), Arg::Ptr(pg)];
        let rest = [
            Arg::I32(self.relu.into()),
            Arg::I32(self.centered.into()),
            Arg::U64(operands.dy_stride),
        ];
        let dx = apply(
            GRAD_OP,
            "bn_grad_apply",
            (dev, &stream),
            dtype,
            operands.e,
            (&inputs, &rest),
        )?;
        drop(operands);
        Ok((storage(dx, dev), xl.shape().clone()))
    }
}

/// An error unless the output gradient `dy` has the input's dtype and shape.
fn check_gradient(
    op: &str,
    (x, xl): (&CudaStorage, &Layout),
    (dy, dyl): (&CudaStorage, &Layout),
) -> candle_core::Result<()> {
    if dy.dtype() != x.dtype() || dyl.dims() != xl.dims() {
        candle_core::bail!(
            "{op}: an output gradient {:?} {:?} for an input {:?} {:?}",
            dy.dtype(),
            dyl.dims(),
            x.dtype(),
            xl.dims()
        );
    }
    Ok(())
}
