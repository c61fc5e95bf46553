//! Max and average pooling on CUDA devices with kandle's own kernels (`pooling.cu`), as candle
//! custom ops with their backward passes: the same functions and semantics as the CPU kernels
//! of [`crate::pooling`].
//!
//! An `(N, C, H, W)` tensor, any window, strides and zero-or-more padding on each side
//! ([`PoolWindow`]). Padding is never a candidate: a max pool takes the maximum of a window's
//! real values and an average pool divides by their count. The forward passes take a thread per
//! output. The max pool's maximum is the first in row-major window order among equal values, and
//! a NaN wins over numbers (as the CPU kernel, and PyTorch); when a backward pass is to follow it
//! records each maximum's index in its plane (`u32`), or the backward pass finds them first. The
//! backward passes take a thread per input, which adds the gradients of the outputs whose
//! windows hold it in output order (no atomics, the same sums on every run): those of the
//! windows whose maximum it is, or each window's gradient over its count.

#![allow(unsafe_code)]

use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, InplaceOp2, Layout, Shape, Tensor,
};

use super::channel_views::{images_contiguous, strided_address, strided_address_mut};
use super::operands::{address, address_mut, check_input, kernel, on_cpu, storage, tensor, uninit};
use super::program::{per_item, Arg, Program};
use crate::pooling::PoolWindow;
use crate::replay::Replay1;
use crate::{Error, Result};

const MAX_OP: &str = "cuda_max_pool2d";
const MAX_INDICES_OP: &str = "cuda_max_pool2d_indices";
const MAX_GRAD_OP: &str = "cuda_max_pool2d_grad";
const AVG_OP: &str = "cuda_avg_pool2d";
const AVG_GRAD_OP: &str = "cuda_avg_pool2d_grad";
const CPU_MAX: &str = "kandle_kernels::pooling::max_pool2d";
const CPU_AVG: &str = "kandle_kernels::pooling::avg_pool2d";

static PROGRAM: Program = Program::new(
    "kandle_pooling",
    concat!(include_str!("common.cuh"), include_str!("pooling.cu")),
);

/// The maximum over each window of the `(N, C, H, W)` tensor `x` on a CUDA device (`f32`,
/// `f64`, `f16` or `bf16`), differentiable, as [`crate::pooling::max_pool2d`] on the CPU. The
/// forward pass finds the maxima alone, for inference; a backward pass, if one follows, finds
/// their positions first.
///
/// Errors ([`Error::InvalidInput`]) for a tensor on another device, of another dtype or rank,
/// or a window that does not fit it.
pub fn max_pool2d(x: &Tensor, window: &PoolWindow) -> Result<Tensor> {
    let g = Geometry::new(MAX_OP, CPU_MAX, x, window)?;
    Ok(x.contiguous()?.apply_op1(MaxPool::new(g, false))?)
}

/// [`max_pool2d`] recording where each maximum is as it runs, for a backward pass that follows,
/// kept for calling that backward pass directly.
pub fn max_pool2d_replay(x: &Tensor, window: &PoolWindow) -> Result<Replay1> {
    let g = Geometry::new(MAX_OP, CPU_MAX, x, window)?;
    Ok(Replay1::apply(&x.contiguous()?, MaxPool::new(g, true))?)
}

/// [`max_pool2d`] with its output written into `out`, a tensor of the output's shape and `x`'s
/// dtype whose images are each contiguous: a range of a larger tensor's channels (`narrow` on
/// axis 1 of a [`channel_buffer`](super::channel_buffer)), as a concatenation hands its
/// branches. For inference: nothing is kept for a backward pass.
///
/// Errors as [`max_pool2d`], and for an `out` of another shape, dtype or device, or whose
/// images are not contiguous.
pub fn max_pool2d_into(x: &Tensor, window: &PoolWindow, out: &Tensor) -> Result<()> {
    let g = Geometry::new(MAX_OP, CPU_MAX, x, window)?;
    check_out(&g, x, out)?;
    let op = MaxPoolInto { g, argmax: None };
    Ok(out.inplace_op2(&x.contiguous()?, &op)?)
}

/// [`max_pool2d_into`] for training: keeps where each maximum is, for the backward pass
/// ([`MaxPoolBackward`]), which reads its output gradient where it lies when that is a range of
/// a larger tensor's channels too.
///
/// ```no_run
/// use candle_core::{DType, Device, Tensor};
/// use kandle_kernels::cuda::{channel_buffer, max_pool2d_train_into};
/// use kandle_kernels::pooling::PoolWindow;
///
/// let dev = Device::new_cuda(0)?;
/// let x = Tensor::randn(0f32, 1., (8, 3, 8, 8), &dev)?;
/// let window = PoolWindow { window: (2, 2), stride: (2, 2), pad: (0, 0, 0, 0) };
/// let joined = channel_buffer(&[8, 5, 4, 4], DType::F32, &dev)?;
/// let part = joined.narrow(1, 2, 3)?; // channels 2..5 of the joined tensor
/// let backward = max_pool2d_train_into(&x, &window, &part)?;
/// let dx = backward.backward(&part.ones_like()?)?;
/// assert_eq!(dx.dims(), x.dims());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn max_pool2d_train_into(
    x: &Tensor,
    window: &PoolWindow,
    out: &Tensor,
) -> Result<MaxPoolBackward> {
    let g = Geometry::new(MAX_OP, CPU_MAX, x, window)?;
    check_out(&g, x, out)?;
    let argmax = Arc::new(OnceLock::new());
    let op = MaxPoolInto {
        g,
        argmax: Some(Arc::clone(&argmax)),
    };
    out.inplace_op2(&x.contiguous()?, &op)?;
    let argmax = argmax
        .get()
        .cloned()
        .ok_or_else(|| Error::invalid(format!("{MAX_OP}: the forward pass did not run")))?;
    Ok(MaxPoolBackward { g, argmax })
}

/// What the backward pass of [`max_pool2d_train_into`] reads: where each maximum is.
#[derive(Debug, Clone)]
pub struct MaxPoolBackward {
    g: Geometry,
    argmax: Tensor,
}

impl MaxPoolBackward {
    /// The input's gradient from the output gradient `dy`, which may be a range of a larger
    /// tensor's channels (read where it lies, as the output was written).
    pub fn backward(&self, dy: &Tensor) -> Result<Tensor> {
        let dims = self.g.out_dims();
        if dy.dims() != dims || !dy.device().same_device(self.argmax.device()) {
            return Err(Error::invalid(format!(
                "{MAX_GRAD_OP}: an output gradient {:?} on {:?}, where {dims:?} on {:?} is needed",
                dy.dims(),
                dy.device(),
                self.argmax.device()
            )));
        }
        Ok(max_pool_grad(dy, &self.argmax, self.g)?)
    }
}

/// The max pool's input gradient from `dy` (read where it lies when its images are each
/// contiguous) and the maxima's indices.
fn max_pool_grad(dy: &Tensor, argmax: &Tensor, g: Geometry) -> candle_core::Result<Tensor> {
    let dy = match images_contiguous(dy) {
        true => dy.clone(),
        false => dy.contiguous()?,
    };
    dy.apply_op2_no_bwd(argmax, &MaxPoolGrad { g })
}

/// An error unless `out` can take the max pool's output for `x`: its shape, dtype and device,
/// its images each contiguous.
fn check_out(g: &Geometry, x: &Tensor, out: &Tensor) -> Result<()> {
    let fits = out.dims() == g.out_dims()
        && out.dtype() == x.dtype()
        && out.device().same_device(x.device())
        && images_contiguous(out);
    if !fits {
        return Err(Error::invalid(format!(
            "{MAX_OP}: the output {:?} {:?} with strides {:?} on {:?} cannot take the pooled {:?} \
             {:?} on {:?} (that shape, dtype and device, each image contiguous)",
            out.dtype(),
            out.dims(),
            out.stride(),
            out.device(),
            x.dtype(),
            g.out_dims(),
            x.device()
        )));
    }
    Ok(())
}

/// The mean over each window's real values of the `(N, C, H, W)` tensor `x` on a CUDA device,
/// differentiable, as [`crate::pooling::avg_pool2d`] on the CPU. Dtypes and errors as
/// [`max_pool2d`]'s.
pub fn avg_pool2d(x: &Tensor, window: &PoolWindow) -> Result<Tensor> {
    Ok(avg_pool2d_replay(x, window)?.output().clone())
}

/// [`avg_pool2d`], kept for calling its backward pass directly.
pub fn avg_pool2d_replay(x: &Tensor, window: &PoolWindow) -> Result<Replay1> {
    let g = Geometry::new(AVG_OP, CPU_AVG, x, window)?;
    Ok(Replay1::apply(&x.contiguous()?, AvgPool { g })?)
}

/// Where the windows land on an input's planes: the kernels' `Geometry`, with the batch and
/// channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    n: usize,
    c: usize,
    /// Input height and width.
    input: (usize, usize),
    /// Output height and width.
    output: (usize, usize),
    window: PoolWindow,
}

impl Geometry {
    /// The geometry of `window` over `x`, or an error unless the kernels take `x` and the
    /// window fits it (at least one window along each axis, at most `i32::MAX` outputs).
    fn new(op: &str, cpu_kernel: &str, x: &Tensor, window: &PoolWindow) -> Result<Self> {
        check_input(op, x, cpu_kernel)?;
        let &[n, c, h, w] = x.dims() else {
            return Err(Error::invalid(format!(
                "{op}: expected a tensor of shape (N, C, H, W), got {:?}",
                x.dims()
            )));
        };
        let (kh, kw) = window.window;
        let (sh, sw) = window.stride;
        let (pt, pb, pl, pr) = window.pad;
        match (outputs(h, kh, sh, pt, pb), outputs(w, kw, sw, pl, pr)) {
            (Some(oh), Some(ow)) if n * c > 0 && fits_i32(&[n, c, oh, ow]) => Ok(Self {
                n,
                c,
                input: (h, w),
                output: (oh, ow),
                window: *window,
            }),
            _ => Err(Error::invalid(format!(
                "{op}: a {kh}x{kw} window with strides ({sh}, {sw}) and padding {:?} does not fit \
                 the input {:?}",
                window.pad,
                x.dims()
            ))),
        }
    }

    fn in_dims(&self) -> [usize; 4] {
        [self.n, self.c, self.input.0, self.input.1]
    }

    fn out_dims(&self) -> [usize; 4] {
        [self.n, self.c, self.output.0, self.output.1]
    }

    /// The kernels' geometry arguments, which [`Geometry::new`] has checked fit in an `int`
    /// (every size is at most its padded axis, and that at most the input's values).
    fn args(&self) -> [Arg; 11] {
        let int = |v: usize| Arg::I32(v as i32);
        let w = &self.window;
        [
            Arg::U32((self.n * self.c) as u32),
            int(self.input.0),
            int(self.input.1),
            int(self.output.0),
            int(self.output.1),
            int(w.window.0),
            int(w.window.1),
            int(w.stride.0),
            int(w.stride.1),
            int(w.pad.0),
            int(w.pad.2),
        ]
    }

    /// Values per image of the output.
    fn out_image(&self) -> u64 {
        (self.c * self.output.0 * self.output.1) as u64
    }

    /// The max pool kernels' last arguments for an output (or output gradient) whose images lie
    /// `stride` values apart: the values per image, and the stride.
    fn image_args(&self, stride: u64) -> [Arg; 2] {
        // At most the output's values, which `new` checked fit an `int`.
        [Arg::U32(self.out_image() as u32), Arg::U64(stride)]
    }

    /// An error unless the operand `what` of layout `l` has `dims`.
    fn check(&self, op: &str, what: &str, l: &Layout, dims: [usize; 4]) -> candle_core::Result<()> {
        if l.dims() != dims {
            candle_core::bail!(
                "{op}: the {what} is {:?}, where the window over {:?} needs {dims:?}",
                l.dims(),
                self.in_dims()
            );
        }
        Ok(())
    }
}

/// The number of windows of `k` at `stride` along an axis of `input` values with `before` and
/// `after` of padding, or `None` when not even one fits or the padded axis is too long for the
/// kernels' `int`s.
fn outputs(input: usize, k: usize, stride: usize, before: usize, after: usize) -> Option<usize> {
    let padded = input.checked_add(before)?.checked_add(after)?;
    if k == 0 || stride == 0 || padded < k || input == 0 || padded > i32::MAX as usize {
        return None;
    }
    Some((padded - k) / stride + 1)
}

/// Whether a tensor of `dims` has at most `i32::MAX` values (the kernels' 32-bit indices).
fn fits_i32(dims: &[usize]) -> bool {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .is_some_and(|n| n <= i32::MAX as usize)
}

/// Launches `kernel` of `dtype` with the device addresses `pointers`, `g`'s geometry and
/// `rest`, a thread per value of `items`.
#[allow(clippy::too_many_arguments)]
fn launch(
    op: &str,
    dev: &CudaDevice,
    kernel_name: &str,
    dtype: DType,
    pointers: &[u64],
    g: &Geometry,
    items: [usize; 4],
    rest: &[Arg],
) -> candle_core::Result<()> {
    let args: Vec<Arg> = pointers
        .iter()
        .map(|&p| Arg::Ptr(p))
        .chain(g.args())
        .chain(rest.iter().copied())
        .collect();
    let name = kernel(op, kernel_name, dtype)?;
    // SAFETY: the callers pass the kernel's buffers in its order, each of `g`'s input or output
    // dims in `dtype` (or `u32` for the maxima's indices), or null where the kernel allows it.
    unsafe { PROGRAM.launch(dev, &name, per_item(items.iter().product()), &args) }
}

/// The max pool's forward pass: the maxima (unless `values` is false) and, when `indices`, the
/// index of each in its plane, from `(x, xl)`.
fn max_forward(
    op: &str,
    g: &Geometry,
    (x, xl): (&CudaStorage, &Layout),
    values: bool,
    indices: bool,
) -> candle_core::Result<(Option<CudaStorageSlice>, Option<CudaStorageSlice>)> {
    g.check(op, "input", xl, g.in_dims())?;
    let (dev, dtype) = (&x.device, x.dtype());
    let len = g.out_dims().iter().product();
    let stream = dev.cuda_stream();
    // SAFETY: the kernel writes every value of each output it is given.
    let mut y = values
        .then(|| unsafe { uninit(dev, dtype, len) })
        .transpose()?;
    // SAFETY: as above.
    let mut at = indices
        .then(|| unsafe { uninit(dev, DType::U32, len) })
        .transpose()?;
    {
        let (px, read_x) = address(op, x, xl, &stream)?;
        let y = y.as_mut().map(|y| address_mut(y, &stream)).transpose()?;
        let at = at.as_mut().map(|a| address_mut(a, &stream)).transpose()?;
        let ptr = |out: &Option<(u64, _)>| out.as_ref().map_or(0, |(p, _)| *p);
        let pointers = [px, ptr(&y), ptr(&at)];
        launch(
            op,
            dev,
            "max_pool_forward",
            dtype,
            &pointers,
            g,
            g.out_dims(),
            &g.image_args(g.out_image()),
        )?;
        drop((read_x, y, at));
    }
    Ok((y, at))
}

/// The max pool: operand `x`; records the maxima's indices when `record`.
struct MaxPool {
    g: Geometry,
    record: bool,
    /// The indices of the maxima in their planes, `u32` of the output's dims: recorded by the
    /// forward pass, or found by the backward pass.
    argmax: Arc<OnceLock<Tensor>>,
}

impl MaxPool {
    fn new(g: Geometry, record: bool) -> Self {
        Self {
            g,
            record,
            argmax: Arc::new(OnceLock::new()),
        }
    }
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        MAX_OP
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(MAX_OP, CPU_MAX))
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (y, at) = max_forward(MAX_OP, &self.g, (x, xl), true, self.record)?;
        let dims = self.g.out_dims();
        if let Some(at) = at {
            self.argmax
                .set(tensor(at, &x.device, &dims))
                .map_err(|_| candle_core::Error::Msg(format!("{MAX_OP}: op applied twice")))?;
        }
        let y = y.ok_or_else(|| candle_core::Error::Msg(format!("{MAX_OP}: no maxima")))?;
        Ok((storage(y, &x.device), Shape::from(dims.to_vec())))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let argmax = match self.argmax.get() {
            Some(argmax) => argmax.clone(),
            None => {
                let found = x.apply_op1_no_bwd(&MaxIndices { g: self.g })?;
                self.argmax.get_or_init(|| found).clone()
            }
        };
        Ok(Some(max_pool_grad(grad, &argmax, self.g)?))
    }
}

/// The indices of the maxima alone: operand `x`, output `u32`, for a backward pass after
/// [`max_pool2d`]'s forward pass, which did not record them.
struct MaxIndices {
    g: Geometry,
}

impl CustomOp1 for MaxIndices {
    fn name(&self) -> &'static str {
        MAX_INDICES_OP
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(MAX_INDICES_OP, CPU_MAX))
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (_, at) = max_forward(MAX_INDICES_OP, &self.g, (x, xl), false, true)?;
        let at =
            at.ok_or_else(|| candle_core::Error::Msg(format!("{MAX_INDICES_OP}: no indices")))?;
        Ok((
            storage(at, &x.device),
            Shape::from(self.g.out_dims().to_vec()),
        ))
    }
}

/// The max pool written into the destination, whose images may lie apart (a range of a larger
/// tensor's channels): source `x`; the maxima's indices kept in `argmax` when given.
struct MaxPoolInto {
    g: Geometry,
    argmax: Option<Arc<OnceLock<Tensor>>>,
}

impl InplaceOp2 for MaxPoolInto {
    fn name(&self) -> &'static str {
        MAX_OP
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        Err(on_cpu(MAX_OP, CPU_MAX))
    }

    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dst_l: &Layout,
        x: &CudaStorage,
        xl: &Layout,
    ) -> candle_core::Result<()> {
        let g = &self.g;
        g.check(MAX_OP, "input", xl, g.in_dims())?;
        g.check(MAX_OP, "output", dst_l, g.out_dims())?;
        let (dev, dtype) = (x.device.clone(), x.dtype());
        if dst.dtype() != dtype {
            candle_core::bail!("{MAX_OP}: a {:?} output for a {dtype:?} input", dst.dtype());
        }
        let stream = dev.cuda_stream();
        let len = g.out_dims().iter().product();
        // SAFETY: the kernel writes every index it is given room for.
        let mut at = match self.argmax {
            Some(_) => Some(unsafe { uninit(&dev, DType::U32, len) }?),
            None => None,
        };
        {
            let (px, read) = address(MAX_OP, x, xl, &stream)?;
            let (py, y_stride, written) =
                strided_address_mut(MAX_OP, "output", (dst, dst_l), &stream)?;
            let at = at.as_mut().map(|a| address_mut(a, &stream)).transpose()?;
            let pat = at.as_ref().map_or(0, |(p, _)| *p);
            launch(
                MAX_OP,
                &dev,
                "max_pool_forward",
                dtype,
                &[px, py, pat],
                g,
                g.out_dims(),
                &g.image_args(y_stride),
            )?;
            drop((read, written, at));
        }
        if let (Some(kept), Some(at)) = (&self.argmax, at) {
            kept.set(tensor(at, &dev, &g.out_dims()))
                .map_err(|_| candle_core::Error::Msg(format!("{MAX_OP}: op applied twice")))?;
        }
        Ok(())
    }
}

/// The max pool's input gradient: operands `(dy, argmax)`.
struct MaxPoolGrad {
    g: Geometry,
}

impl CustomOp2 for MaxPoolGrad {
    fn name(&self) -> &'static str {
        MAX_GRAD_OP
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(MAX_GRAD_OP, CPU_MAX))
    }

    fn cuda_fwd(
        &self,
        dy: &CudaStorage,
        dyl: &Layout,
        at: &CudaStorage,
        atl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let g = &self.g;
        g.check(MAX_GRAD_OP, "output gradient", dyl, g.out_dims())?;
        g.check(MAX_GRAD_OP, "maxima's indices", atl, g.out_dims())?;
        if at.dtype() != DType::U32 {
            candle_core::bail!("{MAX_GRAD_OP}: the maxima's indices are {:?}", at.dtype());
        }
        let (dev, dtype) = (&dy.device, dy.dtype());
        let stream = dev.cuda_stream();
        // SAFETY: the kernel writes every value.
        let mut dx = unsafe { uninit(dev, dtype, g.in_dims().iter().product()) }?;
        {
            let (pat, read) = address(MAX_GRAD_OP, at, atl, &stream)?;
            // The output gradient may be a range of a larger tensor's channels.
            let (pdy, dy_stride, read_dy) =
                strided_address(MAX_GRAD_OP, "output gradient", (dy, dyl), &stream)?;
            let (pdx, written) = address_mut(&mut dx, &stream)?;
            let pointers = [pdy, pat, pdx];
            launch(
                MAX_GRAD_OP,
                dev,
                "max_pool_backward",
                dtype,
                &pointers,
                g,
                g.in_dims(),
                &g.image_args(dy_stride),
            )?;
            drop((read, read_dy, written));
        }
        Ok((storage(dx, dev), Shape::from(g.in_dims().to_vec())))
    }
}

/// The average pool: operand `x`.
struct AvgPool {
    g: Geometry,
}

impl CustomOp1 for AvgPool {
    fn name(&self) -> &'static str {
        AVG_OP
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(AVG_OP, CPU_AVG))
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let g = &self.g;
        g.check(AVG_OP, "input", xl, g.in_dims())?;
        avg_pass(AVG_OP, "avg_pool_forward", g, (x, xl), g.out_dims())
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let dx = grad
            .contiguous()?
            .apply_op1_no_bwd(&AvgPoolGrad { g: self.g })?;
        Ok(Some(dx))
    }
}

/// The average pool's input gradient: operand `dy`.
struct AvgPoolGrad {
    g: Geometry,
}

impl CustomOp1 for AvgPoolGrad {
    fn name(&self) -> &'static str {
        AVG_GRAD_OP
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(AVG_GRAD_OP, CPU_AVG))
    }

    fn cuda_fwd(
        &self,
        dy: &CudaStorage,
        dyl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let g = &self.g;
        g.check(AVG_GRAD_OP, "output gradient", dyl, g.out_dims())?;
        avg_pass(AVG_GRAD_OP, "avg_pool_backward", g, (dy, dyl), g.in_dims())
    }
}

/// One of the average pool's passes: `kernel` from `(a, al)` to a new tensor of `dims` in `a`'s
/// dtype, a thread per output value.
fn avg_pass(
    op: &str,
    kernel_name: &str,
    g: &Geometry,
    (a, al): (&CudaStorage, &Layout),
    dims: [usize; 4],
) -> candle_core::Result<(CudaStorage, Shape)> {
    let (dev, dtype) = (&a.device, a.dtype());
    let stream = dev.cuda_stream();
    // SAFETY: the kernel writes every value.
    let mut out = unsafe { uninit(dev, dtype, dims.iter().product()) }?;
    {
        let (pa, read) = address(op, a, al, &stream)?;
        let (po, written) = address_mut(&mut out, &stream)?;
        launch(op, dev, kernel_name, dtype, &[pa, po], g, dims, &[])?;
        drop((read, written));
    }
    Ok((storage(out, dev), Shape::from(dims.to_vec())))
}
