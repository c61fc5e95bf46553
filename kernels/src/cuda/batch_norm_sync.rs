//! SyncBatchNorm on kandle's CUDA kernels: batch normalisation whose statistics, and whose
//! backward pass's sums, are those of every replica's batch, summed between the kernels by the
//! caller (NCCL, or a sum on the device the replicas share), so nothing crosses to the host.
//!
//! Each side of the pass is three steps, with the caller's sum over the replicas in the middle:
//!
//! 1. [`sync_batch_norm_sums`]: this replica's sums of `x - shift` and of their squares per
//!    channel, and its count, as one `f32` vector of `2 * C + 1` values (the shift, the moving
//!    mean, is the same on every replica, so the sums add up; it keeps the squares' sum from
//!    cancelling once the moving mean nears the data's);
//! 2. the caller sums that vector over the replicas;
//! 3. [`sync_batch_norm_apply`]: the statistics of the whole batch from the summed vector, and
//!    the normalised output (then the ReLU), with what the backward pass needs
//!    ([`SyncBatchNormBackward`]).
//!
//! The backward pass likewise: [`SyncBatchNormBackward::grad_sums`] (the sums of `dy'` and
//! `dy' * (x - mean)`, `dy'` the gradient the ReLU passes), the caller's sum, then
//! [`SyncBatchNormBackward::backward`]: the input's gradient from the summed sums, and the
//! weight's and bias's from this replica's own (the training step sums those over the replicas
//! with every other gradient). The arithmetic is that of [`batch_norm_train`](super::
//! batch_norm_train) with the counts and sums of every replica, the sums exchanged in `f32`.

#![allow(unsafe_code)]

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CudaStorage, DType, Storage, Tensor};

use super::batch_norm::{
    apply, check_x, forward_apply, partial_sums, training_operands, Extent, CPU_TRAIN, GRAD_OP,
    GRAD_ROWS, GROW_DBIAS, GROW_DWEIGHT, PROGRAM, ROW_MEAN, ROW_SCALE, ROW_SHIFT, ROW_VAR,
    TABLE_ROWS,
};
use super::channel_views::{images_contiguous, strided_address};
use super::operands::{address_mut, addresses, companion, kernel, stats_dtype, tensor, uninit};
use super::program::{per_item, Arg};
use crate::batch_norm::BatchStats;
use crate::{Error, Result};

const SUMS_OP: &str = "cuda_sync_batch_norm_sums";
const SYNC_OP: &str = "cuda_sync_batch_norm";
const SYNC_GRAD_SUMS_OP: &str = "cuda_sync_batch_norm_grad_sums";

/// The checks of a synchronised pass's input: one the kernels take, in `f32`, `f16` or `bf16`
/// (the sums cross replicas in `f32`); returns its channel count.
fn check_synced(op: &str, x: &Tensor) -> Result<usize> {
    let c = check_x(op, CPU_TRAIN, x)?;
    if x.dtype() == DType::F64 {
        return Err(Error::invalid(format!(
            "{op}: the replicas' sums are exchanged in f32, which would round an f64 input's \
             statistics; normalise it in f32, or without synchronising"
        )));
    }
    Ok(c)
}

/// The CUDA storage behind `storage`, or an error naming the operand `what`.
fn cuda<'a>(op: &str, what: &str, storage: &'a Storage) -> Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        _ => Err(Error::invalid(format!(
            "{op}: the {what} is not on a CUDA device"
        ))),
    }
}

/// This replica's part of SyncBatchNorm's statistics for the `(N, C, ...)` input `x`: per
/// channel the sums of `x - shift` and of their squares, then the count `N * plane`, as an
/// `f32` tensor of `2 * C + 1` values on `x`'s device, for the caller to sum over the replicas
/// and hand to [`sync_batch_norm_apply`]. `shift` is per channel (the moving mean, which every
/// replica holds alike), `f32` like the statistics.
///
/// Errors ([`Error::InvalidInput`]) for an input the kernels do not take (as
/// [`batch_norm_train`](super::batch_norm_train)), an `f64` input, or a shift of another shape.
pub fn sync_batch_norm_sums(x: &Tensor, shift: &Tensor) -> Result<Tensor> {
    let c = check_synced(SUMS_OP, x)?;
    let shift = companion(SUMS_OP, "shift", shift, x, stats_dtype(x.dtype()), &[c])?;
    let x = x.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let (ss, sl) = shift.storage_and_layout();
    let xs = cuda(SUMS_OP, "input", &xs)?;
    let ss = cuda(SUMS_OP, "shift", &ss)?;
    let (dev, dtype) = (&xs.device, xs.dtype());
    let stream = dev.cuda_stream();
    let e = Extent::of(SUMS_OP, xl.dims()).map_err(Error::invalid)?;
    let ([px, ps], guards) = addresses(SUMS_OP, [(xs, xl), (ss, sl)], &stream)?;
    let name = kernel(SUMS_OP, "bn_stats_partial", dtype)?;
    let partials = partial_sums(dev, &stream, &name, e, &[Arg::Ptr(px), Arg::Ptr(ps)], &[])?;
    drop(guards);
    Ok(pack(SUMS_OP, (dev, &stream), &partials, e)?)
}

/// The `2 * C + 1` values of a replica's part from the `partials` of `e`: each channel's two
/// sums, then the count.
fn pack(
    op: &str,
    (dev, stream): (&CudaDevice, &CudaStream),
    partials: &CudaSlice<f64>,
    e: Extent,
) -> candle_core::Result<Tensor> {
    let c = e.channels as usize;
    // SAFETY: the kernel writes both sums of every channel and the count.
    let mut out = unsafe { uninit(dev, DType::F32, 2 * c + 1) }?;
    {
        let (pp, read) = partials.device_ptr(stream);
        let (po, written) = address_mut(&mut out, stream)?;
        let args = [
            Arg::Ptr(pp),
            Arg::U32(e.splits()),
            Arg::Ptr(po),
            Arg::U32(e.channels),
            Arg::F64(e.count.into()),
        ];
        // SAFETY: the partials hold `splits` pairs per channel of `e`, the output `2 * C + 1`
        // values.
        unsafe { PROGRAM.launch(dev, "bn_sync_pack", per_item(c), &args) }
            .map_err(|err| candle_core::Error::Msg(format!("{op}: {err}")))?;
        drop((read, written));
    }
    Ok(tensor(out, dev, &[2 * c + 1]))
}

/// Training-mode batch normalisation of `x` with the statistics of every replica's batch:
/// `sums` is [`sync_batch_norm_sums`]'s vector of this replica summed over the replicas, taken
/// with the same `shift`; then `y = (x - mean) / sqrt(var + epsilon) * weight + bias`, and
/// `max(y, 0)` when `relu`, as [`batch_norm_train`](super::batch_norm_train) computes it. Returns
/// the output, the statistics of the whole batch (for the moving averages, alike on every
/// replica) and what the backward pass needs. Nothing is recorded for candle's autograd.
///
/// Errors as [`sync_batch_norm_sums`], and for `sums` that are not `2 * C + 1` `f32` values on
/// `x`'s device, or a weight or bias of another shape.
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use kandle_kernels::cuda::{sync_batch_norm_apply, sync_batch_norm_sums};
///
/// let dev = Device::new_cuda(0)?;
/// let x = Tensor::randn(0f32, 1., (8, 3, 4, 4), &dev)?;
/// let moving_mean = Tensor::zeros(3, DType::F32, &dev)?;
/// let mine = sync_batch_norm_sums(&x, &moving_mean)?;
/// let all = mine.clone(); // here the replicas' sum, through NCCL
/// let (y, stats, backward) =
///     sync_batch_norm_apply(&x, &all, &moving_mean, None, None, 1e-3, true)?;
/// let dy = y.ones_like()?;
/// let mine = backward.grad_sums(&dy)?;
/// let all = mine.clone(); // the replicas' sum again
/// let (dx, dweight, dbias) = backward.backward(&dy, &mine, &all)?;
/// assert_eq!((dx.dims(), stats.mean.dims()), (x.dims(), &[3][..]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn sync_batch_norm_apply(
    x: &Tensor,
    sums: &Tensor,
    shift: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    epsilon: f64,
    relu: bool,
) -> Result<(Tensor, BatchStats, SyncBatchNormBackward)> {
    let c = check_synced(SYNC_OP, x)?;
    let (weight, bias) = training_operands(SYNC_OP, x, weight, bias, epsilon)?;
    let stats = stats_dtype(x.dtype());
    let shift = companion(SYNC_OP, "shift", shift, x, stats, &[c])?;
    let sums = companion(SYNC_OP, "summed sums", sums, x, DType::F32, &[2 * c + 1])?;
    let x = x.contiguous()?;
    let (y, table) = {
        let guards = [&x, &sums, &shift, &weight, &bias].map(|t| t.storage_and_layout());
        let [(xs, xl), (ss, sl), (hs, hl), (ws, wl), (bs, bl)] = &guards;
        let xs = cuda(SYNC_OP, "input", xs)?;
        let (dev, dtype) = (&xs.device, xs.dtype());
        let stream = dev.cuda_stream();
        let operands = [
            (xs, *xl),
            (cuda(SYNC_OP, "summed sums", ss)?, *sl),
            (cuda(SYNC_OP, "shift", hs)?, *hl),
            (cuda(SYNC_OP, "weight", ws)?, *wl),
            (cuda(SYNC_OP, "bias", bs)?, *bl),
        ];
        let ([px, psums, pshift, pw, pb], read) = addresses(SYNC_OP, operands, &stream)?;
        let e = Extent::of(SYNC_OP, xl.dims()).map_err(Error::invalid)?;
        // SAFETY: the kernel writes every row of every channel.
        let mut table = unsafe { uninit(dev, stats, TABLE_ROWS * c) }?;
        let y = {
            let (pt, written) = address_mut(&mut table, &stream)?;
            let args = [
                Arg::Ptr(psums),
                Arg::Ptr(pshift),
                Arg::Ptr(pw),
                Arg::Ptr(pb),
                Arg::Ptr(pt),
                Arg::U32(e.channels),
                Arg::F64(epsilon),
            ];
            let name = kernel(SYNC_OP, "bn_sync_finalize", dtype)?;
            // SAFETY: the sums hold `2 * C + 1` f32 values, the shift, weight and bias `C`
            // values of the statistics' dtype (all checked), the table `TABLE_ROWS * C`.
            unsafe { PROGRAM.launch(dev, &name, per_item(c), &args) }?;
            let row = (stats.size_in_bytes() * c) as u64;
            let map = (pt + ROW_SCALE as u64 * row, pt + ROW_SHIFT as u64 * row);
            let y = forward_apply(SYNC_OP, (dev, &stream), dtype, e, px, map, relu)?;
            drop(written);
            y
        };
        drop(read);
        (
            tensor(y, dev, xl.dims()),
            tensor(table, dev, &[TABLE_ROWS, c]),
        )
    };
    let stats = BatchStats {
        mean: table.get(ROW_MEAN)?,
        var: table.get(ROW_VAR)?,
    };
    Ok((y, stats, SyncBatchNormBackward { x, table, relu }))
}

/// What the backward pass of [`sync_batch_norm_apply`] reads: the input and the statistics
/// table of the whole batch.
#[derive(Debug, Clone)]
pub struct SyncBatchNormBackward {
    x: Tensor,
    table: Tensor,
    relu: bool,
}

impl SyncBatchNormBackward {
    /// This replica's part of the backward pass's sums for the output gradient `dy`: per
    /// channel the sums of `dy'` and `dy' * (x - mean)`, then the count, as an `f32` tensor of
    /// `2 * C + 1` values, for the caller to sum over the replicas and hand to
    /// [`backward`](Self::backward) with this part. `dy` may be a range of a larger tensor's
    /// channels.
    pub fn grad_sums(&self, dy: &Tensor) -> Result<Tensor> {
        let dy = gradient(&self.x, dy)?;
        let guards = [&self.x, &dy, &self.table].map(|t| t.storage_and_layout());
        let [(xs, xl), (gs, gl), (ts, tl)] = &guards;
        let op = SYNC_GRAD_SUMS_OP;
        let xs = cuda(op, "input", xs)?;
        let (dev, dtype) = (&xs.device, xs.dtype());
        let stream = dev.cuda_stream();
        let ([px, pt], mut read) =
            addresses(op, [(xs, *xl), (cuda(op, "table", ts)?, *tl)], &stream)?;
        let dys = cuda(op, "output gradient", gs)?;
        let (pdy, dy_stride, read_dy) = strided_address(op, "output gradient", (dys, gl), &stream)?;
        read.push(read_dy);
        let e = Extent::of(op, xl.dims()).map_err(Error::invalid)?;
        let name = kernel(op, "bn_grad_partial", dtype)?;
        let inputs = [Arg::Ptr(px), Arg::Ptr(pdy), Arg::Ptr(pt)];
        let rest = [Arg::I32(self.relu.into()), Arg::U64(dy_stride)];
        let partials = partial_sums(dev, &stream, &name, e, &inputs, &rest)?;
        drop(read);
        Ok(pack(op, (dev, &stream), &partials, e)?)
    }

    /// The gradients of the input, the weight and the bias from the output gradient `dy`, this
    /// replica's [`grad_sums`](Self::grad_sums) `local` and their sum over the replicas
    /// `global`: the input's from `global`, the weight's and bias's from `local`.
    pub fn backward(
        &self,
        dy: &Tensor,
        local: &Tensor,
        global: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dy = gradient(&self.x, dy)?;
        let c = self.table.dim(1)?;
        let local = companion(
            GRAD_OP,
            "local sums",
            local,
            &self.x,
            DType::F32,
            &[2 * c + 1],
        )?;
        let global = companion(
            GRAD_OP,
            "summed sums",
            global,
            &self.x,
            DType::F32,
            &[2 * c + 1],
        )?;
        let guards = [&self.x, &dy, &self.table, &local, &global].map(|t| t.storage_and_layout());
        let [(xs, xl), (gs, gl), (ts, tl), (ls, ll), (ss, sl)] = &guards;
        let xs = cuda(GRAD_OP, "input", xs)?;
        let (dev, dtype) = (&xs.device, xs.dtype());
        let stream = dev.cuda_stream();
        let operands = [
            (xs, *xl),
            (cuda(GRAD_OP, "table", ts)?, *tl),
            (cuda(GRAD_OP, "local sums", ls)?, *ll),
            (cuda(GRAD_OP, "summed sums", ss)?, *sl),
        ];
        let ([px, pt, plocal, pglobal], mut read) = addresses(GRAD_OP, operands, &stream)?;
        let dys = cuda(GRAD_OP, "output gradient", gs)?;
        let (pdy, dy_stride, read_dy) =
            strided_address(GRAD_OP, "output gradient", (dys, gl), &stream)?;
        read.push(read_dy);
        let e = Extent::of(GRAD_OP, xl.dims()).map_err(Error::invalid)?;
        // SAFETY: the kernel writes every row of every channel.
        let mut grads = unsafe { uninit(dev, stats_dtype(dtype), GRAD_ROWS * c) }?;
        let dx = {
            let (pg, written) = address_mut(&mut grads, &stream)?;
            let args = [
                Arg::Ptr(plocal),
                Arg::Ptr(pglobal),
                Arg::Ptr(pt),
                Arg::Ptr(pg),
                Arg::U32(e.channels),
            ];
            let name = kernel(GRAD_OP, "bn_sync_grad_finalize", dtype)?;
            // SAFETY: both sums hold `2 * C + 1` f32 values (checked), the table
            // `TABLE_ROWS * C` values of the statistics' dtype (made by the forward pass), the
            // backward table `GRAD_ROWS * C`.
            unsafe { PROGRAM.launch(dev, &name, per_item(c), &args) }?;
            let inputs = [Arg::Ptr(px), Arg::Ptr(pdy), Arg::Ptr(pg)];
            let rest = [Arg::I32(self.relu.into()), Arg::I32(1), Arg::U64(dy_stride)];
            let ctx = (dev, &*stream);
            let dx = apply(GRAD_OP, "bn_grad_apply", ctx, dtype, e, (&inputs, &rest))?;
            drop(written);
            dx
        };
        drop(read);
        let grads = tensor(grads, dev, &[GRAD_ROWS, c]);
        Ok((
            tensor(dx, dev, xl.dims()),
            grads.get(GROW_DWEIGHT)?,
            grads.get(GROW_DBIAS)?,
        ))
    }
}

/// The output gradient `dy` for the input `x`, read where it lies when its images are each
/// contiguous (a range of a concatenation's gradient), copied otherwise; an error for another
/// shape or dtype.
fn gradient(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    if dy.dims() != x.dims() || dy.dtype() != x.dtype() || !dy.device().same_device(x.device()) {
        return Err(Error::invalid(format!(
            "{GRAD_OP}: an output gradient {:?} {:?} on {:?} for an input {:?} {:?} on {:?}",
            dy.dtype(),
            dy.dims(),
            dy.device(),
            x.dtype(),
            x.dims(),
            x.device()
        )));
    }
    Ok(match images_contiguous(dy) {
        true => dy.clone(),
        false => dy.contiguous()?,
    })
}
