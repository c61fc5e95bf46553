//! Softmax cross-entropy with class-index labels on CUDA devices with kandle's own kernels
//! (`cross_entropy.cu`), as a candle custom op with its backward pass: what kandle's sparse
//! categorical cross-entropy computes from logits with candle's ops (`log_softmax`, a gather
//! and a negation), in two kernels instead of a dozen.
//!
//! The forward pass takes a warp per row for its maximum, the sum of `exp(x - max)` and the
//! loss `log(sum) - (x[label] - max)`, keeping `max` and `log(sum)` of each row for the backward
//! pass; that takes a thread per logit, `dx = dloss * (softmax(x) - onehot(label))`. NaNs
//! propagate as PyTorch's: a NaN logit (or an infinite one, as `inf - inf`) makes its row's loss
//! and gradient NaN. A label outside the classes makes its row's loss NaN; [`LabelCheck`] says
//! whether the op also reads back the count of such labels the kernel keeps (two words, one
//! wait for the stream) to return an error naming the first, as the gather's on the CPU, or
//! leaves the NaN to the caller and never waits (a training step, whose labels were checked
//! when the dataset was made). The label `u32::MAX`, which candle's gathers (on every device)
//! read as "no index", gives a zero loss and gradient, as there.

#![allow(unsafe_code)]

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use super::operands::{
    address, address_mut, addresses, check_input, kernel, on_cpu, stats_dtype, storage, tensor,
    uninit,
};
use super::program::{per_item, Arg, Program, THREADS};
use crate::{Error, Result};

const OP: &str = "cuda_sparse_softmax_cross_entropy";
const GRAD_OP: &str = "cuda_sparse_softmax_cross_entropy_grad";
const CPU_PATH: &str = "candle_nn::ops::log_softmax and a gather";

static PROGRAM: Program = Program::new(
    "kandle_cross_entropy",
    concat!(include_str!("common.cuh"), include_str!("cross_entropy.cu")),
);

/// The loss of each row of the `(N, C)` logits `x` on a CUDA device (`f32`, `f64`, `f16` or
/// `bf16`) against the class indices `labels` (`u32`, `N` of them, on the same device):
/// `-log_softmax(x)[label]`, `(N,)` in `x`'s dtype (half precision computing in `f32`),
/// differentiable with respect to `x`.
///
/// Errors ([`Error::InvalidInput`]) for logits on another device, of another dtype or rank,
/// labels of another dtype, count or device, and a label outside `0..C`, which names the
/// sample and the label; `u32::MAX` is candle's "no index", a zero loss and gradient.
///
/// ```no_run
/// # fn main() -> kandle_kernels::Result<()> {
/// use candle_core::{Device, Tensor};
/// use kandle_kernels::cuda;
///
/// let dev = Device::new_cuda(0)?;
/// let logits = Tensor::new(&[[0f32, 0.], [1., 1.]], &dev)?;
/// let labels = Tensor::new(&[1u32, 0], &dev)?;
/// let loss = cuda::sparse_softmax_cross_entropy(&logits, &labels)?;
/// let ln2 = 2f32.ln();
/// assert!(loss.to_vec1::<f32>()?.iter().all(|l| (l - ln2).abs() < 1e-6));
/// # Ok(()) }
/// ```
pub fn sparse_softmax_cross_entropy(x: &Tensor, labels: &Tensor) -> Result<Tensor> {
    sparse_softmax_cross_entropy_with(x, labels, LabelCheck::ReadBack)
}

/// What [`sparse_softmax_cross_entropy_with`] does about labels outside the classes (never a
/// finite loss: their rows' losses are NaN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelCheck {
    /// Read back the kernel's count of such labels (one wait for the stream) and return an
    /// error naming the first.
    ReadBack,
    /// Leave their NaN losses to the caller; never wait for the stream.
    NanLoss,
}

/// [`sparse_softmax_cross_entropy`], with labels outside the classes handled as `check` says.
pub fn sparse_softmax_cross_entropy_with(
    x: &Tensor,
    labels: &Tensor,
    check: LabelCheck,
) -> Result<Tensor> {
    check_input(OP, x, CPU_PATH)?;
    let &[rows, classes] = x.dims() else {
        return Err(Error::invalid(format!(
            "{OP}: expected logits of shape (N, C), got {:?}",
            x.dims()
        )));
    };
    if !labels.device().same_device(x.device())
        || labels.dtype() != DType::U32
        || labels.elem_count() != rows
    {
        return Err(Error::invalid(format!(
            "{OP}: the labels are {:?} {:?} on {:?}, where the logits {:?} on {:?} need {rows} \
             u32 class indices on their device",
            labels.dtype(),
            labels.dims(),
            labels.device(),
            x.dims(),
            x.device()
        )));
    }
    if rows == 0 {
        return Ok(Tensor::zeros(0, x.dtype(), x.device())?);
    }
    let labels = labels.flatten_all()?.contiguous()?;
    let op = SparseXent {
        rows,
        classes,
        stats: Arc::new(OnceLock::new()),
        bad: Arc::new(OnceLock::new()),
    };
    let bad = Arc::clone(&op.bad);
    let loss = x.contiguous()?.apply_op2(&labels, op)?;
    if check == LabelCheck::NanLoss {
        return Ok(loss);
    }
    let Some(bad) = bad.get() else {
        return Err(Error::invalid(format!("{OP}: the labels were not checked")));
    };
    let bad = bad.to_vec1::<u32>()?;
    if bad[0] > 0 {
        let row = rows - bad[1] as usize;
        let label = labels.get(row)?.to_scalar::<u32>()?;
        return Err(Error::invalid(format!(
            "{OP}: label {label} of sample {row} is not a class index in 0..{classes} ({} \
             such labels)",
            bad[0]
        )));
    }
    Ok(loss)
}

/// The number of `THREADS`-thread blocks that give each of `rows` a warp (at most 65,536; the
/// warps loop over the rest).
fn warp_per_row(rows: usize) -> u32 {
    let warps_per_block = (THREADS / 32) as usize;
    rows.div_ceil(warps_per_block).clamp(1, 1 << 16) as u32
}

/// The loss: operands `(x, labels)`; keeps each row's maximum and log-sum for the backward
/// pass, and the count of bad labels (with the first one's position) for the caller.
struct SparseXent {
    rows: usize,
    classes: usize,
    /// `(N, 2)`: each row's maximum and `log(sum(exp(x - max)))`, in the statistics' dtype.
    stats: Arc<OnceLock<Tensor>>,
    /// `u32` `[count, N - first row]` of the labels outside the classes.
    bad: Arc<OnceLock<Tensor>>,
}

/// Checks that the operand `what` of `op`, laid out as `l`, has the `dims` that logits of
/// `rows x classes` need.
fn check_dims(
    op: &str,
    what: &str,
    l: &Layout,
    dims: &[usize],
    (rows, classes): (usize, usize),
) -> candle_core::Result<()> {
    if l.dims() != dims {
        candle_core::bail!(
            "{op}: the {what} is {:?}, where logits ({rows}, {classes}) need {dims:?}",
            l.dims()
        );
    }
    Ok(())
}

impl CustomOp2 for SparseXent {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(OP, CPU_PATH))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        labels: &CudaStorage,
        ll: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, classes) = (self.rows, self.classes);
        check_dims(OP, "logits", xl, &[rows, classes], (rows, classes))?;
        check_dims(OP, "labels", ll, &[rows], (rows, classes))?;
        if labels.dtype() != DType::U32 {
            candle_core::bail!("{OP}: the labels are {:?}", labels.dtype());
        }
        let (dev, dtype) = (&x.device, x.dtype());
        let stream = dev.cuda_stream();
        let stats_dtype = stats_dtype(dtype);
        // SAFETY: the kernel writes every row's loss and statistics.
        let mut loss = unsafe { uninit(dev, dtype, rows) }?;
        // SAFETY: as above.
        let mut stats = unsafe { uninit(dev, stats_dtype, 2 * rows) }?;
        let mut bad = candle_core::cuda_backend::CudaStorageSlice::U32(dev.alloc_zeros(2)?);
        {
            let ([px, pl], read) = addresses(OP, [(x, xl), (labels, ll)], &stream)?;
            let (ploss, w1) = address_mut(&mut loss, &stream)?;
            let (pstats, w2) = address_mut(&mut stats, &stream)?;
            let (pbad, w3) = address_mut(&mut bad, &stream)?;
            let args = [
                Arg::Ptr(px),
                Arg::Ptr(pl),
                Arg::Ptr(ploss),
                Arg::Ptr(pstats),
                Arg::Ptr(pbad),
                Arg::U32(rows as u32),
                Arg::U32(classes as u32),
            ];
            let name = kernel(OP, "xent_forward", dtype)?;
            let cfg = super::program::blocks_of((warp_per_row(rows), 1));
            // SAFETY: `x` holds `rows * classes` values and `labels` `rows` (checked above);
            // the kernel writes `rows` losses, `2 * rows` statistics and the two words of `bad`.
            unsafe { PROGRAM.launch(dev, &name, cfg, &args) }?;
            drop((read, w1, w2, w3));
        }
        let applied = || candle_core::Error::Msg(format!("{OP}: op applied twice"));
        self.stats
            .set(tensor(stats, dev, &[rows, 2]))
            .map_err(|_| applied())?;
        self.bad
            .set(tensor(bad, dev, &[2]))
            .map_err(|_| applied())?;
        Ok((storage(loss, dev), Shape::from(vec![rows])))
    }

    fn bwd(
        &self,
        x: &Tensor,
        labels: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let Some(stats) = self.stats.get() else {
            candle_core::bail!("{OP}: backward pass before the forward pass");
        };
        let op = SparseXentGrad {
            rows: self.rows,
            classes: self.classes,
            stats: stats.clone(),
        };
        let dx = x.apply_op3_no_bwd(labels, &grad.contiguous()?, &op)?;
        Ok((Some(dx), None))
    }
}

/// The loss's gradient with respect to the logits: operands `(x, labels, dloss)`, with the
/// forward pass's statistics.
struct SparseXentGrad {
    rows: usize,
    classes: usize,
    stats: Tensor,
}

impl CustomOp3 for SparseXentGrad {
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
        Err(on_cpu(GRAD_OP, CPU_PATH))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        labels: &CudaStorage,
        ll: &Layout,
        dloss: &CudaStorage,
        dl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, classes) = (self.rows, self.classes);
        let dims = [rows, classes];
        check_dims(GRAD_OP, "logits", xl, &dims, (rows, classes))?;
        check_dims(GRAD_OP, "labels", ll, &[rows], (rows, classes))?;
        if dl.dims() != [rows] || dloss.dtype() != x.dtype() {
            candle_core::bail!(
                "{GRAD_OP}: the loss's gradient is {:?} {:?}, where the logits {dims:?} {:?} \
                 need ({rows},)",
                dloss.dtype(),
                dl.dims(),
                x.dtype()
            );
        }
        let (dev, dtype) = (&x.device, x.dtype());
        let (stats, sl) = self.stats.storage_and_layout();
        let candle_core::Storage::Cuda(stats) = &*stats else {
            candle_core::bail!("{GRAD_OP}: the statistics left the CUDA device");
        };
        if sl.dims() != [rows, 2] || stats.dtype() != stats_dtype(dtype) {
            candle_core::bail!("{GRAD_OP}: the statistics are {:?}", sl.dims());
        }
        let stream = dev.cuda_stream();
        // SAFETY: the kernel writes every value.
        let mut dx = unsafe { uninit(dev, dtype, rows * classes) }?;
        {
            let ([px, pl, pdl], read) =
                addresses(GRAD_OP, [(x, xl), (labels, ll), (dloss, dl)], &stream)?;
            let (ps, read_stats) = address(GRAD_OP, stats, sl, &stream)?;
            let (pdx, written) = address_mut(&mut dx, &stream)?;
            let args = [
                Arg::Ptr(px),
                Arg::Ptr(pl),
                Arg::Ptr(ps),
                Arg::Ptr(pdl),
                Arg::Ptr(pdx),
                Arg::U32(rows as u32),
                Arg::U32(classes as u32),
            ];
            let name = kernel(GRAD_OP, "xent_backward", dtype)?;
            launch_grad(dev, &name, rows * classes, &args)?;
            drop((read, read_stats, written));
        }
        Ok((storage(dx, dev), Shape::from(dims.to_vec())))
    }
}

/// Launches the backward kernel `name` with `args`, a thread per logit.
fn launch_grad(
    dev: &CudaDevice,
    name: &str,
    items: usize,
    args: &[Arg],
) -> candle_core::Result<()> {
    // SAFETY: the caller passes the logits, labels, statistics and loss gradient of the shapes
    // checked above and an output of `items` values.
    unsafe { PROGRAM.launch(dev, name, per_item(items), args) }
}
