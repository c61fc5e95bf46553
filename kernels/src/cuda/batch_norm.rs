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
//! NaNs propagate as in PyTorch and the CPU kernels: a NaN in a channel of a training batch
//! makes the channel's statistics and outputs NaN; in inference only its own output is NaN.

#![allow(unsafe_code)]

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Layout, Shape, Tensor};

use super::operands::{
    address_mut, addresses, check_input, companion, kernel, on_cpu, stats_dtype, storage, tensor,
    uninit,
};
use super::program::{blocks_of, per_item, Arg, Program};
use crate::batch_norm::BatchStats;
use crate::replay::Replay3;
use crate::{Error, Result};

const TRAIN_OP: &str = "cuda_batch_norm";
const AFFINE_OP: &str = "cuda_channel_affine";
const GRAD_SUMS_OP: &str = "cuda_batch_norm_grad_sums";
const GRAD_OP: &str = "cuda_batch_norm_input_grad";
const CPU_TRAIN: &str = "kandle_kernels::batch_norm::batch_norm_train";
const CPU_AFFINE: &str = "kandle_kernels::batch_norm::channel_affine";

static PROGRAM: Program = Program::new(
    "kandle_batch_norm",
    concat!(include_str!("common.cuh"), include_str!("batch_norm.cu")),
);

/// Values of a channel that one block of the partial sums takes (16 per thread).
const CHUNK: u32 = 4096;

/// The statistics table's rows (as `batch_norm.cu`'s `ROW_*`): mean, variance, `invstd`, the
/// map's scale and shift.
const ROW_MEAN: usize = 0;
const ROW_VAR: usize = 1;
const ROW_SCALE: usize = 3;
const ROW_SHIFT: usize = 4;
const TABLE_ROWS: usize = 5;
/// The backward table's rows (as `batch_norm.cu`'s `GROW_*`): the bias's and the weight's
/// gradients first, then the input gradient's coefficients.
const GROW_DBIAS: usize = 0;
const GROW_DWEIGHT: usize = 1;
const GRAD_ROWS: usize = 7;

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
    let c = check_x(TRAIN_OP, CPU_TRAIN, x)?;
    if epsilon.is_nan() || epsilon < 0.0 {
        return Err(Error::invalid(format!(
            "{TRAIN_OP}: epsilon must be non-negative, got {epsilon}"
        )));
    }
    let stats = stats_dtype(x.dtype());
    let weight = match weight {
        Some(w) => companion(TRAIN_OP, "weight", w, x, stats, &[c])?,
        None => Tensor::ones(c, stats, x.device())?,
    };
    let bias = match bias {
        Some(b) => companion(TRAIN_OP, "bias", b, x, stats, &[c])?,
        None => Tensor::zeros(c, stats, x.device())?,
    };
    let saved = Arc::new(OnceLock::new());
    let op = TrainOp {
        epsilon,
        relu,
        saved: Arc::clone(&saved),
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
fn check_x(op: &str, cpu_kernel: &str, x: &Tensor) -> Result<usize> {
    check_input(op, x, cpu_kernel)?;
    let extent = Extent::of(op, x.dims()).map_err(Error::invalid)?;
    Ok(extent.channels as usize)
}

/// An `(N, C, ...)` input's extent, within the kernels' 32-bit indices.
#[derive(Debug, Clone, Copy)]
struct Extent {
    channels: u32,
    /// Values per image and channel.
    plane: u32,
    /// Values per channel, `N * plane`.
    count: u32,
    /// Values in all.
    total: u32,
}

impl Extent {
    fn of(op: &str, dims: &[usize]) -> std::result::Result<Self, String> {
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

    /// The blocks of a channel's partial sums.
    fn splits(&self) -> u32 {
        self.count.div_ceil(CHUNK)
    }

    /// The channels and the values per image and channel, as the kernels' arguments.
    fn dims_args(&self) -> [Arg; 2] {
        [Arg::U32(self.channels), Arg::U32(self.plane)]
    }
}

/// The partial sums of `kernel` over the channels of `e`, `[sum, sum]` per block: `inputs` are
/// its first arguments, then the partials, the extent and [`CHUNK`], then `rest`.
fn partial_sums(
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
fn apply(
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
    let mut args = inputs.to_vec();
    args.extend([Arg::Ptr(po), Arg::U32(e.total)]);
    args.extend(e.dims_args());
    args.extend_from_slice(rest);
    let name = kernel(op, kernel_name, dtype)?;
    // SAFETY: the callers pass the kernel's inputs in its order: those of the input's shape
    // `e.total` values of `dtype` (checked), the per-channel ones (checked) of the statistics'
    // dtype; the output holds `e.total` values of `dtype`.
    unsafe { PROGRAM.launch(dev, &name, per_item(e.total as usize), &args) }?;
    drop(written);
    Ok(out)
}

/// Launches `y = x * scale + shift` (then the ReLU) over the extent `e` of `dtype` and returns
/// `y`.
fn forward_apply(
    op: &str,
    ctx: (&CudaDevice, &CudaStream),
    dtype: DType,
    e: Extent,
    x: u64,
    (scale, shift): (u64, u64),
    relu: bool,
) -> candle_core::Result<CudaStorageSlice> {
    let inputs = [Arg::Ptr(x), Arg::Ptr(scale), Arg::Ptr(shift)];
    let rest = [Arg::I32(relu.into())];
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

/// What each op's CUDA forward pass starts with: the extent of its input `x` (the first
/// operand), the checks of the other two (`companions`), and the device addresses of all three,
/// with their guards to hold until the kernels that read them are queued.
fn operands<'a>(
    op: &str,
    [x, a, b]: [(&'a CudaStorage, &Layout); 3],
    companions: Companions,
    stream: &'a CudaStream,
) -> candle_core::Result<(Extent, [u64; 3], Vec<SyncOnDrop<'a>>)> {
    let e = Extent::of(op, x.1.dims()).map_err(candle_core::Error::Msg)?;
    let dtype = x.0.dtype();
    match companions {
        Companions::Vectors(first, second) => {
            check_table(op, first, a, dtype, None, e.channels)?;
            check_table(op, second, b, dtype, None, e.channels)?;
        }
        Companions::Gradient(what, rows) => {
            check_gradient(op, x, a)?;
            check_table(op, what, b, dtype, Some(rows), e.channels)?;
        }
    }
    let (pointers, guards) = addresses(op, [x, a, b], stream)?;
    Ok((e, pointers, guards))
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

/// The training forward pass: operands `(x, weight, bias)`; keeps its statistics table for the
/// backward pass and the caller.
struct TrainOp {
    epsilon: f64,
    relu: bool,
    saved: Arc<OnceLock<Tensor>>,
}

impl CustomOp3 for TrainOp {
    fn name(&self) -> &'static str {
        TRAIN_OP
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
        Err(on_cpu(TRAIN_OP, CPU_TRAIN))
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
        let (dev, dtype) = (&x.device, x.dtype());
        let stream = dev.cuda_stream();
        let params = Companions::Vectors("weight", "bias");
        let (e, [px, pw, pb], read) =
            operands(TRAIN_OP, [(x, xl), (w, wl), (b, bl)], params, &stream)?;
        let name = kernel(TRAIN_OP, "bn_stats_partial", dtype)?;
        let partials = partial_sums(dev, &stream, &name, e, &[Arg::Ptr(px)], &[])?;
        let c = e.channels as usize;
        let row = stats_dtype(dtype).size_in_bytes() * c;
        let [channels, plane] = e.dims_args();
        let inputs = [Arg::Ptr(px), Arg::Ptr(pw), Arg::Ptr(pb)];
        let rest = [
            channels,
            plane,
            Arg::F64(e.count.into()),
            Arg::F64(self.epsilon),
        ];
        let ctx = (dev, &*stream);
        let (table, y) = finalize(
            TRAIN_OP,
            "bn_stats_finalize",
            ctx,
            dtype,
            e,
            (&partials, TABLE_ROWS),
            (&inputs, &rest),
            |pt| {
                let map = (pt + (ROW_SCALE * row) as u64, pt + (ROW_SHIFT * row) as u64);
                forward_apply(TRAIN_OP, ctx, dtype, e, px, map, self.relu)
            },
        )?;
        drop(read);
        let table = tensor(table, dev, &[TABLE_ROWS, c]);
        self.saved
            .set(table)
            .map_err(|_| candle_core::Error::Msg(format!("{TRAIN_OP}: op applied twice")))?;
        Ok((storage(y, dev), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let table = self.saved.get().ok_or_else(|| {
            candle_core::Error::Msg(format!("{TRAIN_OP}: backward before forward"))
        })?;
        backward(x, grad, table, self.relu, true)
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
        let (e, [px, pa, pb], read) =
            operands(AFFINE_OP, [(x, xl), (a, al), (b, bl)], map, &stream)?;
        let ctx = (dev, &*stream);
        let y = forward_apply(AFFINE_OP, ctx, dtype, e, px, (pa, pb), self.relu)?;
        drop(read);
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
        // The statistics table (mean, variance, invstd, scale, shift) of a map of `x` itself:
        // mean 0 (no centring), invstd 1.
        let (scale, shift) = (scale.detach(), shift.detach());
        let (zeros, ones) = (scale.zeros_like()?, scale.ones_like()?);
        let table = Tensor::stack(&[&zeros, &zeros, &ones, &scale, &shift], 0)?;
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
    let (x, grad) = (x.contiguous()?, grad.contiguous()?);
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
        let (e, [px, pdy, pt], read) =
            operands(GRAD_SUMS_OP, [(x, xl), (dy, dyl), (t, tl)], table, &stream)?;
        let name = kernel(GRAD_SUMS_OP, "bn_grad_partial", dtype)?;
        let inputs = [Arg::Ptr(px), Arg::Ptr(pdy), Arg::Ptr(pt)];
        let relu = [Arg::I32(self.relu.into())];
        let partials = partial_sums(dev, &stream, &name, e, &inputs, &relu)?;
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
        drop(read);
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
        let (e, [px, pdy, pg], read) =
            operands(GRAD_OP, [(x, xl), (dy, dyl), (g, gl)], table, &stream)?;
        let inputs = [Arg::Ptr(px), Arg::Ptr(pdy), Arg::Ptr(pg)];
        let rest = [Arg::I32(self.relu.into()), Arg::I32(self.centered.into())];
        let dx = apply(
            GRAD_OP,
            "bn_grad_apply",
            (dev, &stream),
            dtype,
            e,
            (&inputs, &rest),
        )?;
        drop(read);
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
