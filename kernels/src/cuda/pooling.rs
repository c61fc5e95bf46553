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
use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};

use super::operands::{
    address, address_mut, addresses, check_input, kernel, on_cpu, storage, tensor, uninit,
};
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

/// Launches `kernel` of `dtype` with the device addresses `pointers` and `g`'s geometry, a
/// thread per value of `items`.
fn launch(
    op: &str,
    dev: &CudaDevice,
    kernel_name: &str,
    dtype: DType,
    pointers: &[u64],
    g: &Geometry,
    items: [usize; 4],
) -> candle_core::Result<()> {
    let args: Vec<Arg> = pointers
        .iter()
        .map(|&p| Arg::Ptr(p))
        .chain(g.args())
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
        let dx = grad
            .contiguous()?
            .apply_op2_no_bwd(&argmax, &MaxPoolGrad { g: self.g })?;
        Ok(Some(dx))
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
            let ([pdy, pat], read) = addresses(MAX_GRAD_OP, [(dy, dyl), (at, atl)], &stream)?;
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
            )?;
            drop((read, written));
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
        launch(op, dev, kernel_name, dtype, &[pa, po], g, dims)?;
        drop((read, written));
    }
    Ok((storage(out, dev), Shape::from(dims.to_vec())))
}
