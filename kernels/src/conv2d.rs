//! Convolution as GEMM on the CPU: forward, backward-input and backward-weight.
//!
//! [`conv2d`] correlates an `(N, C, H, W)` `f32` CPU tensor with an `(O, C, kh, kw)` kernel at
//! any strides and `(top, bottom, left, right)` zero padding, and adds an optional bias, as a
//! candle custom op whose backward pass runs two more custom ops: one for the input's gradient
//! and one for the kernel's (which also sums the bias gradient).
//! Training through candle's autograd therefore uses these kernels in both directions; the
//! gradient of an input that does not depend on a variable (the images fed to the first layer)
//! is not computed at all.
//!
//! Each pass is a few GEMMs per tile of output rows over a row-shift expansion of the input
//! (see `plan`), split over the images of the batch in the current rayon pool, and run in
//! kandle's micro-kernel (`microkernel`, compiled for AVX-512 and for AVX2), or by the `gemm`
//! crate for a GEMM split over the pool and on CPUs without AVX2. 3x3 correlations at unit
//! strides with 16 channels or more and output planes of 3x3 or more (6 positions a tile or
//! more) go through Winograd's F(4x4, 3x3) instead (see `winograd`), four times fewer
//! multiplications, in all three passes. The input gradient at stride `s` is `s^2` stride-1
//! correlations of the output gradient, one per stride phase, so no work is spent on
//! the zeros a dilated transposed convolution would multiply.
//!
//! [`conv2d_backward`] returns all three gradients at once, for a caller that runs its own
//! backward pass (kandle's recorded training forward, `Recorded`). The gradient ops are not themselves
//! differentiable (no second derivatives).

mod cache;
mod epilogue;
mod gemm;
mod groups;
mod lowered;
mod microkernel;
mod passes;
mod plan;
#[cfg(test)]
mod tests;
mod transpose;
mod winograd;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use super::concat::ChannelSlot;
use super::output::PartedOutput;
use super::planes::{f32_data, with_f32};
use crate::{Error, Result};
pub use cache::KernelCache;
use epilogue::Epilogue;
use passes::Conv;

const FORWARD: &str = "conv2d";
const INPUT_GRAD: &str = "conv2d_input_grad";
const WEIGHT_GRAD: &str = "conv2d_weight_grad";

/// Strides and padding of a convolution: `(vertical, horizontal)` and
/// `(top, bottom, left, right)`.
pub type Window = ((usize, usize), (usize, usize, usize, usize));

/// Whether [`conv2d`] can run on these tensors: both `f32` and on the CPU.
pub fn supported(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu() && w.device().is_cpu() && x.dtype() == DType::F32 && w.dtype() == DType::F32
}

/// The correlation of `x (N, C, H, W)` with `w (O, C, kh, kw)`, plus `bias (O,)` when given,
/// all `f32` on the CPU, at strides `(sh, sw)` over `x` zero-padded by
/// `(top, bottom, left, right)`: an
/// `(N, O, (H + top + bottom - kh) / sh + 1, (W + left + right - kw) / sw + 1)` tensor, as
/// candle's `conv2d` (and a broadcast bias add) computes it. Differentiable in `x`, `w` and
/// `bias`; the bias is added in the GEMMs' output and its gradient summed alongside the
/// kernel's.
///
/// Errors name the op and the shapes when they do not fit together, and say so when a tensor
/// is not `f32` or not on the CPU.
pub fn conv2d(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    stride: (usize, usize),
    padding: (usize, usize, usize, usize),
) -> Result<Tensor> {
    check_tensors(FORWARD, &[("input", x), ("weight", w)])?;
    forward_geometry(x.dims(), w.dims(), (stride, padding)).map_err(Error::invalid)?;
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let op = Forward { stride, padding };
    let Some(b) = bias else {
        return Ok(x.apply_op2(&w, op)?);
    };
    check_tensors(FORWARD, &[("bias", b)])?;
    check_bias(b.dims(), w.dims()).map_err(Error::invalid)?;
    Ok(x.apply_op3(&w, &b.contiguous()?, op)?)
}

/// What inference's folded convolution applies to each output channel `o` after the
/// correlation: `max(scale[o] * y + shift[o], 0)` (the ReLU when `relu`), `scale` and `shift`
/// of shape `(O,)`; and where it keeps its lowered kernel between calls, if anywhere.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct FoldedAffine<'a> {
    /// What each output channel is multiplied by.
    pub scale: &'a Tensor,
    /// What is then added to it.
    pub shift: &'a Tensor,
    /// Whether a ReLU follows.
    pub relu: bool,
    /// The layer's cache of its lowered kernel (see [`KernelCache`]).
    pub cache: Option<&'a KernelCache>,
}

/// Inference's convolution with a per-output-channel affine map folded in (a BatchNorm's, from
/// its running statistics) and an optional ReLU: `max(scale[o] * (x ⋆ w)[o] + shift[o], 0)`,
/// `x`, `w` and the window (strides, padding) as in [`conv2d`]. The scale multiplies the
/// kernel's taps as they are lowered and the ReLU runs on each image's output while it is in
/// cache, so a convolution, BatchNorm and ReLU cost one pass. Not differentiable: training
/// runs the layers apart.
///
/// Errors as [`conv2d`]'s, and name `scale` or `shift` when it does not hold one value per
/// output channel.
pub fn conv2d_affine(
    x: &Tensor,
    w: &Tensor,
    affine: FoldedAffine<'_>,
    window: Window,
) -> Result<Tensor> {
    check_affine(x, w, &affine, window)?;
    let channels = Tensor::stack(&[affine.scale, affine.shift], 0)?;
    let op = AffineForward {
        window: Forward {
            stride: window.0,
            padding: window.1,
        },
        relu: affine.relu,
        cache: affine.cache,
    };
    Ok(x.contiguous()?
        .apply_op3_no_bwd(&w.contiguous()?, &channels, &op)?)
}

/// [`conv2d_affine`] written into a concatenation's channels (`slot`) instead of a tensor of
/// its own: inference's branches fill their concatenation's output with no copy after.
///
/// Errors as [`conv2d_affine`]'s, and when the result's shape is not the slot's.
pub fn conv2d_affine_into(
    x: &Tensor,
    w: &Tensor,
    affine: FoldedAffine<'_>,
    window: Window,
    slot: &mut ChannelSlot<'_>,
) -> Result<()> {
    let conv = check_affine(x, w, &affine, window)?;
    let (out, offset) = slot.target(FORWARD, &[conv.n, conv.o, conv.ho, conv.wo])?;
    let channels = Tensor::stack(&[affine.scale, affine.shift], 0)?;
    with_f32(FORWARD, x, |x| {
        with_f32(FORWARD, w, |w| {
            with_f32(FORWARD, &channels, |channels| {
                let (scale, shift) = channels.split_at(conv.o);
                let epilogue = Epilogue {
                    scale: Some(scale),
                    bias: Some(shift),
                    relu: affine.relu,
                };
                passes::forward(&conv, (x, w), epilogue, (out, offset), affine.cache)
            })
        })
    })?;
    Ok(())
}

/// The geometry of a folded convolution, once its tensors are checked.
fn check_affine(x: &Tensor, w: &Tensor, affine: &FoldedAffine<'_>, window: Window) -> Result<Conv> {
    let tensors = [
        ("input", x),
        ("weight", w),
        ("scale", affine.scale),
        ("shift", affine.shift),
    ];
    check_tensors(FORWARD, &tensors)?;
    let conv = forward_geometry(x.dims(), w.dims(), window).map_err(Error::invalid)?;
    for v in [affine.scale, affine.shift] {
        check_bias(v.dims(), w.dims()).map_err(Error::invalid)?;
    }
    Ok(conv)
}

/// The gradient of [`conv2d`]'s input: from the output gradient `dy (N, O, Ho, Wo)` and the
/// kernel `w (O, C, kh, kw)`, the `(N, C, H, W)` gradient of an input of height and width
/// `input_hw`. Not differentiable.
#[cfg(test)]
pub(crate) fn conv2d_input_grad(
    dy: &Tensor,
    w: &Tensor,
    input_hw: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize, usize, usize),
) -> Result<Tensor> {
    let op = InputGrad {
        stride,
        padding,
        input_hw,
        add: None,
    };
    apply_gradient_op(&op, ("output gradient", dy), ("weight", w))
}

/// The gradient of [`conv2d`]'s kernel: from the input `x (N, C, H, W)` and the output gradient
/// `dy (N, O, Ho, Wo)`, the `(O, C, kh, kw)` gradient summed over the batch, for a kernel of
/// size `kernel_hw`. Not differentiable.
#[cfg(test)]
pub(crate) fn conv2d_weight_grad(
    x: &Tensor,
    dy: &Tensor,
    kernel_hw: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize, usize, usize),
) -> Result<Tensor> {
    let op = WeightGrad {
        stride,
        padding,
        kernel_hw,
        with_bias: false,
    };
    apply_gradient_op(&op, ("input", x), ("output gradient", dy))
}

/// Whether [`conv2d_backward`] adds its `add` while it writes the input's gradient (the direct
/// correlations), rather than in a pass of its own after Winograd's (3x3 unit-stride kernels
/// with 16 channels or more on both sides).
pub fn input_grad_adds_in_place(x: &Tensor, w: &Tensor, window: Window) -> bool {
    forward_geometry(x.dims(), w.dims(), window)
        .is_ok_and(|conv| passes::input_grad_adds_in_place(&conv))
}

/// The gradients of one [`conv2d`], from [`conv2d_backward`].
#[derive(Debug, Clone)]
pub struct Conv2dGrads {
    /// The input's gradient `(N, C, H, W)`, when asked for.
    pub input: Option<Tensor>,
    /// The kernel's gradient `(O, C, kh, kw)`, summed over the batch, when asked for.
    pub weight: Option<Tensor>,
    /// The bias's gradient `(O,)`, when asked for.
    pub bias: Option<Tensor>,
}

/// All gradients of [`conv2d`] at once, from its input `x`, its kernel `w` and the output
/// gradient `dy`: the input's when `input_grad`, the kernel's when `weight_grad` and the
/// bias's when `bias_grad` (summed in the same pass as the kernel's); a frozen layer asks for
/// neither of the last two. With `add` (shaped as `x`), the
/// input's gradient is returned plus `add`: where the input feeds several branches, the
/// others' gradient is added as this one is written ([`input_grad_adds_in_place`]) instead of
/// in a pass of its own. Not differentiable.
pub fn conv2d_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    (input_grad, weight_grad, bias_grad): (bool, bool, bool),
    stride: (usize, usize),
    padding: (usize, usize, usize, usize),
    add: Option<&Tensor>,
) -> Result<Conv2dGrads> {
    check_tensors(
        WEIGHT_GRAD,
        &[("input", x), ("weight", w), ("output gradient", dy)],
    )?;
    let conv = forward_geometry(x.dims(), w.dims(), (stride, padding)).map_err(Error::invalid)?;
    check_output(WEIGHT_GRAD, &conv, dy.dims()).map_err(Error::invalid)?;
    if let Some(add) = add {
        check_tensors(INPUT_GRAD, &[("gradient to add", add)])?;
        if add.dims() != x.dims() {
            return Err(Error::invalid(format!(
                "{INPUT_GRAD}: cannot add a gradient {:?} to the input's {:?}",
                add.dims(),
                x.dims()
            )));
        }
    }
    let op = Forward { stride, padding };
    let [input, weight, bias] = op.grads(
        &x.contiguous()?,
        &w.contiguous()?,
        dy,
        [input_grad, weight_grad, bias_grad],
        add,
    )?;
    Ok(Conv2dGrads {
        input,
        weight,
        bias,
    })
}

/// A gradient op's two operands: their check against the convolution, and the computation.
trait Operands {
    /// The convolution, or an error naming the op and the shapes.
    fn geometry(&self, a: &[usize], b: &[usize]) -> std::result::Result<Conv, String>;

    /// The op's result and its shape, from its operands' data.
    fn compute(&self, conv: &Conv, a: &[f32], b: &[f32]) -> candle_core::Result<(Vec<f32>, Shape)>;
}

/// A gradient op's forward on CPU storage: check, borrow the data, compute.
fn cpu_gradient<Op: CustomOp2 + Operands>(
    op: &Op,
    (a, al): (&CpuStorage, &Layout),
    (b, bl): (&CpuStorage, &Layout),
) -> candle_core::Result<(CpuStorage, Shape)> {
    let conv = op
        .geometry(al.dims(), bl.dims())
        .map_err(candle_core::Error::Msg)?;
    let (a, b) = (f32_data(op.name(), a, al)?, f32_data(op.name(), b, bl)?);
    let (out, shape) = op.compute(&conv, a, b)?;
    Ok((CpuStorage::F32(out), shape))
}

/// Checks the named operands `a` and `b` of a gradient op and applies it, without backward.
#[cfg(test)]
fn apply_gradient_op<Op: CustomOp2 + Operands>(
    op: &Op,
    (a_name, a): (&str, &Tensor),
    (b_name, b): (&str, &Tensor),
) -> Result<Tensor> {
    check_tensors(op.name(), &[(a_name, a), (b_name, b)])?;
    op.geometry(a.dims(), b.dims()).map_err(Error::invalid)?;
    Ok(a.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, op)?)
}

/// An error unless the bias `b_dims` has one value per output channel of the weight `w_dims`.
fn check_bias(b_dims: &[usize], w_dims: &[usize]) -> std::result::Result<(), String> {
    match (b_dims, w_dims.first()) {
        ([len], Some(o)) if len == o => Ok(()),
        _ => Err(format!(
            "{FORWARD}: the bias {b_dims:?} must have one value per output channel of the \
             weight {w_dims:?}"
        )),
    }
}

/// An error unless every tensor is `f32` on the CPU.
fn check_tensors(op: &str, tensors: &[(&str, &Tensor)]) -> Result<()> {
    for (what, t) in tensors {
        if !t.device().is_cpu() || t.dtype() != DType::F32 {
            return Err(Error::invalid(format!(
                "{op}: the CPU kernel takes f32 tensors on the CPU, but the {what} {:?} is {:?} \
                 on {:?}",
                t.dims(),
                t.dtype(),
                t.device()
            )));
        }
    }
    Ok(())
}

/// The four dimensions of `dims`, or an error naming `op` and the tensor.
fn dims4(op: &str, what: &str, dims: &[usize]) -> std::result::Result<[usize; 4], String> {
    <[usize; 4]>::try_from(dims)
        .map_err(|_| format!("{op}: the {what} must have 4 dimensions, got shape {dims:?}"))
}

/// The convolution of an `x_dims` input with a `w_dims` kernel, or an error naming both shapes.
fn forward_geometry(
    x_dims: &[usize],
    w_dims: &[usize],
    (stride, padding): Window,
) -> std::result::Result<Conv, String> {
    let [n, c, h, w] = dims4(FORWARD, "input", x_dims)?;
    let [o, wc, kh, kw] = dims4(FORWARD, "weight", w_dims)?;
    if wc != c {
        return Err(format!(
            "{FORWARD}: the input {x_dims:?} has {c} channels but the weight {w_dims:?} \
             expects {wc}"
        ));
    }
    let (sh, sw) = stride;
    let (pt, pb, pl, pr) = padding;
    if [c, h, w, o, kh, kw, sh, sw].contains(&0) {
        return Err(format!(
            "{FORWARD}: input {x_dims:?}, weight {w_dims:?} and strides {stride:?} must have \
             non-zero channels, sizes and strides"
        ));
    }
    let (hp, wp) = (h + pt + pb, w + pl + pr);
    if hp < kh || wp < kw {
        return Err(format!(
            "{FORWARD}: the input {x_dims:?} padded by {padding:?} is {hp}x{wp}, smaller than \
             the weight {w_dims:?}'s {kh}x{kw} window"
        ));
    }
    Ok(Conv {
        n,
        c,
        h,
        w,
        o,
        kh,
        kw,
        stride,
        pad: padding,
        ho: (hp - kh) / sh + 1,
        wo: (wp - kw) / sw + 1,
    })
}

/// An error unless the output gradient's shape `dy_dims` is the convolution's output.
fn check_output(op: &str, conv: &Conv, dy_dims: &[usize]) -> std::result::Result<(), String> {
    let expected = [conv.n, conv.o, conv.ho, conv.wo];
    if dy_dims != expected {
        return Err(format!(
            "{op}: the output gradient {dy_dims:?} does not match the convolution's output \
             {expected:?}"
        ));
    }
    Ok(())
}

/// The forward op, with (`CustomOp3`) or without (`CustomOp2`) a bias; its backward runs
/// [`InputGrad`] and [`WeightGrad`].
struct Forward {
    stride: (usize, usize),
    padding: (usize, usize, usize, usize),
}

impl Forward {
    /// The forward pass on CPU storage, with `epilogue` applied to each output channel.
    fn run(
        &self,
        (xs, xl): (&CpuStorage, &Layout),
        (ws, wl): (&CpuStorage, &Layout),
        epilogue: Epilogue<'_>,
        cache: Option<&KernelCache>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let conv = forward_geometry(xl.dims(), wl.dims(), (self.stride, self.padding))
            .map_err(candle_core::Error::Msg)?;
        for v in [epilogue.scale, epilogue.bias].into_iter().flatten() {
            if v.len() != conv.o {
                candle_core::bail!(
                    "{FORWARD}: {} per-channel values for the weight {:?}",
                    v.len(),
                    wl.dims()
                );
            }
        }
        let x = f32_data(FORWARD, xs, xl)?;
        let mut y = PartedOutput::new(conv.n, conv.o * conv.ho * conv.wo);
        let w = f32_data(FORWARD, ws, wl)?;
        passes::forward(&conv, (x, w), epilogue, (&mut y, 0), cache)?;
        Ok((
            CpuStorage::F32(y.into_vec()),
            Shape::from((conv.n, conv.o, conv.ho, conv.wo)),
        ))
    }

    /// The gradients of the input, the kernel and the bias that `want` asks for, in that order.
    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        want: [bool; 3],
        add: Option<&Tensor>,
    ) -> candle_core::Result<[Option<Tensor>; 3]> {
        let [want_input, want_weight, want_bias] = want;
        let dy = dy.contiguous()?;
        let dx = if want_input {
            let (_, _, h, wd) = x.dims4()?;
            let op = InputGrad {
                stride: self.stride,
                padding: self.padding,
                input_hw: (h, wd),
                add: add.cloned(),
            };
            Some(dy.apply_op2_no_bwd(w, &op)?)
        } else {
            None
        };
        if !want_weight && !want_bias {
            return Ok([dx, None, None]);
        }
        let (o, c, kh, kw) = w.dims4()?;
        let op = WeightGrad {
            stride: self.stride,
            padding: self.padding,
            kernel_hw: (kh, kw),
            with_bias: want_bias,
        };
        let grads = x.apply_op2_no_bwd(&dy, &op)?;
        if !want_bias {
            return Ok([dx, Some(grads), None]);
        }
        // The weight's gradient comes with the bias's, and is dropped when not asked for.
        let len = o * c * kh * kw;
        let dw = grads.narrow(0, 0, len)?.reshape((o, c, kh, kw))?;
        let db = grads.narrow(0, len, o)?;
        Ok([dx, want_weight.then_some(dw), Some(db)])
    }
}

impl CustomOp2 for Forward {
    fn name(&self) -> &'static str {
        FORWARD
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.run((xs, xl), (ws, wl), Epilogue::default(), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let [dx, dw, _] = self.grads(x, w, dy, [x.track_op(), w.track_op(), false], None)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        FORWARD
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        check_bias(bl.dims(), wl.dims()).map_err(candle_core::Error::Msg)?;
        let bias = Epilogue {
            bias: Some(f32_data(FORWARD, bs, bl)?),
            ..Default::default()
        };
        self.run((xs, xl), (ws, wl), bias, None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dx, dw, db] =
            self.grads(x, w, dy, [x.track_op(), w.track_op(), b.track_op()], None)?;
        Ok((dx, dw, db))
    }
}

/// [`conv2d_affine`]'s op: the forward pass with the third operand `(2, O)` holding the
/// scale and the shift of each output channel.
struct AffineForward<'a> {
    window: Forward,
    relu: bool,
    cache: Option<&'a KernelCache>,
}

impl CustomOp3 for AffineForward<'_> {
    fn name(&self) -> &'static str {
        FORWARD
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let channels = f32_data(FORWARD, cs, cl)?;
        let (scale, shift) = channels.split_at(channels.len() / 2);
        self.window.run(
            (xs, xl),
            (ws, wl),
            Epilogue {
                scale: Some(scale),
                bias: Some(shift),
                relu: self.relu,
            },
            self.cache,
        )
    }
}

/// The input gradient: `(dy, w)` to `dx`.
struct InputGrad {
    stride: (usize, usize),
    padding: (usize, usize, usize, usize),
    input_hw: (usize, usize),
    /// A gradient `(N, C, H, W)` the result is added to (another branch's, where the input
    /// feeds several).
    add: Option<Tensor>,
}

impl Operands for InputGrad {
    fn geometry(&self, dy_dims: &[usize], w_dims: &[usize]) -> std::result::Result<Conv, String> {
        let [n, _, _, _] = dims4(INPUT_GRAD, "output gradient", dy_dims)?;
        let [_, c, _, _] = dims4(INPUT_GRAD, "weight", w_dims)?;
        let x_dims = [n, c, self.input_hw.0, self.input_hw.1];
        let conv = forward_geometry(&x_dims, w_dims, (self.stride, self.padding))
            .map_err(|e| e.replacen(FORWARD, INPUT_GRAD, 1))?;
        check_output(INPUT_GRAD, &conv, dy_dims)?;
        Ok(conv)
    }

    fn compute(
        &self,
        conv: &Conv,
        dy: &[f32],
        w: &[f32],
    ) -> candle_core::Result<(Vec<f32>, Shape)> {
        let dx = match &self.add {
            Some(add) => with_f32(INPUT_GRAD, add, |a| {
                passes::input_grad(conv, dy, w, Some(a))
            })?,
            None => passes::input_grad(conv, dy, w, None)?,
        };
        Ok((dx, Shape::from((conv.n, conv.c, conv.h, conv.w))))
    }
}

impl CustomOp2 for InputGrad {
    fn name(&self) -> &'static str {
        INPUT_GRAD
    }

    fn cpu_fwd(
        &self,
        dys: &CpuStorage,
        dyl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu_gradient(self, (dys, dyl), (ws, wl))
    }
}

/// The kernel gradient: `(x, dy)` to `dw`, or to `dw` and the bias gradient flattened into
/// one vector when `with_bias`.
struct WeightGrad {
    stride: (usize, usize),
    padding: (usize, usize, usize, usize),
    kernel_hw: (usize, usize),
    with_bias: bool,
}

impl Operands for WeightGrad {
    fn geometry(&self, x_dims: &[usize], dy_dims: &[usize]) -> std::result::Result<Conv, String> {
        let [_, c, _, _] = dims4(WEIGHT_GRAD, "input", x_dims)?;
        let [_, o, _, _] = dims4(WEIGHT_GRAD, "output gradient", dy_dims)?;
        let w_dims = [o, c, self.kernel_hw.0, self.kernel_hw.1];
        let conv = forward_geometry(x_dims, &w_dims, (self.stride, self.padding))
            .map_err(|e| e.replacen(FORWARD, WEIGHT_GRAD, 1))?;
        check_output(WEIGHT_GRAD, &conv, dy_dims)?;
        Ok(conv)
    }

    fn compute(
        &self,
        conv: &Conv,
        x: &[f32],
        dy: &[f32],
    ) -> candle_core::Result<(Vec<f32>, Shape)> {
        let grads = passes::weight_grad(conv, x, dy, self.with_bias)?;
        let shape = if self.with_bias {
            Shape::from(grads.len())
        } else {
            Shape::from((conv.o, conv.c, conv.kh, conv.kw))
        };
        Ok((grads, shape))
    }
}

impl CustomOp2 for WeightGrad {
    fn name(&self) -> &'static str {
        WEIGHT_GRAD
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        dys: &CpuStorage,
        dyl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        cpu_gradient(self, (xs, xl), (dys, dyl))
    }
}
