//! Pooling: `MaxPooling2D`, `AveragePooling2D` and `GlobalAveragePooling2D`.
//!
//! When an average pool's windows tile the input exactly, Candle's own op runs. Otherwise (max
//! pools, MiniGoogLeNet's 3x3/stride-2 max pool, `same` padding) the pool is the element-wise
//! maximum or sum of the `kh * kw` strided views of the input, which autograd differentiates on
//! every device (Candle's own max-pool backward scales the gradient by one over the window
//! size, and its average-pool backward misplaces it when the windows leave a remainder). `same` average pooling divides by the number of real (unpadded) elements, as
//! TensorFlow does. For `f32` tensors on the CPU, all three run the dedicated kernels of
//! [`crate::kernels::pooling`] instead, with the same results, unless they are built for
//! [`ComputePath::DeviceGeneric`](crate::ComputePath::DeviceGeneric). With the `cuda` feature,
//! the three run the same kernels of `kandle_kernels::cuda` for tensors on a CUDA device
//! (`f32`, `f64`, or `f16` and `bf16` computing in `f32`), on the same condition; the recorded
//! backward pass calls the kernels' backward passes directly, on both devices.

use candle_core::{DType, Device, Tensor};

use super::window::{subsample, Padding, Window};
use super::{
    record_into_by_copy, record_with_candle, shape_error, BuildContext, Built, ChannelAffine,
    ChannelPart, ChannelSlot, FastPath, Layer, LayerSpec, ParamGrads, RecordRequest, Recorded,
};
use crate::kernels::pooling::{self as kernels, PoolWindow};
use crate::kernels::replay::Replay1;
use crate::Result;

/// The reduction a pooling layer applies (public only to the sealed [`Reduction`] trait).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// The maximum of each window.
    Max,
    /// The mean of each window.
    Average,
}

/// Window, stride and padding shared by the two pooling layers.
#[derive(Debug, Clone, Copy)]
struct Pool2D {
    kind: PoolKind,
    window: (usize, usize),
    stride: Option<(usize, usize)>,
    padding: Padding,
}

impl Pool2D {
    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let c = input_shape.first().copied().unwrap_or(0);
        let window = self.window;
        let stride = self.stride.unwrap_or(self.window);
        let Window { out: (oh, ow), pad } =
            Window::resolve(ctx, input_shape, window, stride, self.padding, "pool")?;
        let (h, w) = (input_shape[1], input_shape[2]);
        let geometry = Geometry {
            window,
            stride,
            pad,
            out: (oh, ow),
        };
        // Same-padded average pools divide each window by its count of real elements.
        let divisor = match self.kind {
            PoolKind::Average if geometry.padded() => {
                let ones = Tensor::ones((1, 1, h, w), candle_core::DType::F32, &Device::Cpu)?;
                let counts = geometry.reduce(&ones, PoolKind::Average, false)?;
                Some(counts.to_device(ctx.device())?)
            }
            _ => None,
        };
        let layer = PoolLayer {
            kind: self.kind,
            geometry,
            divisor,
            kernels: ctx.compute_path().uses_kernels(),
        };
        Ok(Built::fast(layer, vec![c, oh, ow], Vec::new()))
    }
}

#[derive(Debug, Clone, Copy)]
struct Geometry {
    window: (usize, usize),
    stride: (usize, usize),
    /// top, bottom, left, right
    pad: (usize, usize, usize, usize),
    out: (usize, usize),
}

impl Geometry {
    fn padded(&self) -> bool {
        self.pad != (0, 0, 0, 0)
    }

    fn kernel_window(&self) -> PoolWindow {
        PoolWindow {
            window: self.window,
            stride: self.stride,
            pad: self.pad,
        }
    }

    /// Max or sum over each window, by combining the strided views of the padded input. A
    /// window that holds a NaN has a NaN maximum, as the CPU kernel's and PyTorch's. With
    /// `routed`, a max pool's gradient goes to each window's first maximum (its first NaN, if
    /// any), as the CPU kernel's does (training); without, it is candle's (inference, where no
    /// gradient is taken).
    fn reduce(&self, x: &Tensor, kind: PoolKind, routed: bool) -> Result<Tensor> {
        let (pt, pb, pl, pr) = self.pad;
        let x = if self.padded() {
            let fill = match kind {
                PoolKind::Max => f64::NEG_INFINITY,
                PoolKind::Average => 0.0,
            };
            pad_with(&pad_with(x, 2, pt, pb, fill)?, 3, pl, pr, fill)?
        } else {
            x.clone()
        };
        let (kh, kw) = self.window;
        let (sh, sw) = self.stride;
        let (oh, ow) = self.out;
        // The window's strided views in row-major window order.
        let mut views = Vec::with_capacity(kh * kw);
        for i in 0..kh {
            let rows = subsample(&x.narrow(2, i, sh * (oh - 1) + 1)?, 2, sh)?;
            for j in 0..kw {
                views.push(subsample(&rows.narrow(3, j, sw * (ow - 1) + 1)?, 3, sw)?);
            }
        }
        let mut acc: Option<Tensor> = None;
        for view in &views {
            acc = Some(match (acc, kind) {
                (None, _) => view.clone(),
                (Some(a), PoolKind::Max) => a.maximum(view)?,
                (Some(a), PoolKind::Average) => (a + view)?,
            });
        }
        let acc = acc.ok_or_else(|| crate::Error::invalid("empty pooling window"))?;
        if kind == PoolKind::Average {
            return Ok(acc);
        }
        // Candle's `maximum` passes over a NaN (CUDA's always, the CPU's unless it comes
        // first): where a view holds one, the window's maximum is NaN.
        let nans = views
            .iter()
            .map(|view| Ok(view.ne(view)?))
            .collect::<Result<Vec<_>>>()?;
        let (first, rest) = nans
            .split_first()
            .ok_or_else(|| crate::Error::invalid("empty pooling window"))?;
        let any_nan = rest
            .iter()
            .try_fold(first.clone(), |any, nan| any.maximum(nan))?;
        let max = any_nan.where_cond(&(acc.zeros_like()? + f64::NAN)?, &acc)?;
        match routed {
            true => first_maximum(&views, &nans, &max.detach()),
            false => Ok(max),
        }
    }
}

/// The maxima `max` of `views` (a window's strided views, in row-major window order; `nans`
/// marks their NaNs) as a sum that candle's autograd differentiates the way the CPU kernel's
/// backward pass does: each output gradient goes to the first view that holds the maximum (a
/// NaN, where the window holds one), and to no other. (Candle's `maximum` splits the gradient
/// between equal operands, so a chain of them spreads it over every tied position: flat
/// regions of an image, a ReLU's zeros.) The value is `max` exactly: one view per output is
/// selected, the others contribute zeros.
fn first_maximum(views: &[Tensor], nans: &[Tensor], max: &Tensor) -> Result<Tensor> {
    let zeros = max.zeros_like()?;
    // 1 where no earlier view held the maximum.
    let mut free = max.ones_like()?.to_dtype(DType::U8)?;
    let mut sum: Option<Tensor> = None;
    for (view, nan) in views.iter().zip(nans) {
        // A NaN view holds its window's maximum, a NaN (which equals nothing).
        let first = (view.eq(max)?.maximum(nan)? * &free)?;
        free = (&free - &first)?;
        let part = first.where_cond(view, &zeros)?;
        sum = Some(match sum {
            None => part,
            Some(s) => (s + part)?,
        });
    }
    sum.ok_or_else(|| crate::Error::invalid("empty pooling window"))
}

/// Pads `dim` with `before` and `after` elements of `value`.
fn pad_with(x: &Tensor, dim: usize, before: usize, after: usize, value: f64) -> Result<Tensor> {
    if before == 0 && after == 0 {
        return Ok(x.clone());
    }
    let block = |n: usize| -> Result<Tensor> {
        let mut dims = x.dims().to_vec();
        dims[dim] = n;
        Ok(Tensor::full(value, dims, x.device())?.to_dtype(x.dtype())?)
    };
    let mut parts = Vec::with_capacity(3);
    if before > 0 {
        parts.push(block(before)?);
    }
    parts.push(x.clone());
    if after > 0 {
        parts.push(block(after)?);
    }
    Ok(Tensor::cat(&parts, dim)?)
}

struct PoolLayer {
    kind: PoolKind,
    geometry: Geometry,
    divisor: Option<Tensor>,
    /// Whether the layer may call the kernels (see [`crate::ComputePath::uses_kernels`]).
    kernels: bool,
}

/// The pooling kernels of one device, which take the same arguments and keep the same
/// semantics: kandle's CPU kernels ([`crate::kernels::pooling`]) or, with the `cuda` feature,
/// its CUDA kernels (`kandle_kernels::cuda`).
#[derive(Debug, Clone, Copy)]
enum PoolKernels {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda,
}

impl PoolKernels {
    /// The kernels that take `x`, if any: `f32` on the CPU; `f32`, `f64`, `f16` or `bf16` on a
    /// CUDA device; `(N, C, H, W)` on both.
    fn of(x: &Tensor) -> Option<Self> {
        if kernels::supported(x) {
            return Some(PoolKernels::Cpu);
        }
        #[cfg(feature = "cuda")]
        if crate::kernels::cuda::supported(x) && x.rank() == 4 {
            return Some(PoolKernels::Cuda);
        }
        None
    }

    /// The maxima alone, for inference (`max_pool2d`).
    fn max_pool2d(self, x: &Tensor, window: &PoolWindow) -> Result<Tensor> {
        Ok(match self {
            PoolKernels::Cpu => kernels::max_pool2d(x, window)?,
            #[cfg(feature = "cuda")]
            PoolKernels::Cuda => crate::kernels::cuda::max_pool2d(x, window)?,
        })
    }

    /// The `kind` pool, kept for calling its backward pass directly (`max_pool2d_replay` or
    /// `avg_pool2d_replay`).
    fn replay(self, kind: PoolKind, x: &Tensor, window: &PoolWindow) -> Result<Replay1> {
        Ok(match (self, kind) {
            (PoolKernels::Cpu, PoolKind::Max) => kernels::max_pool2d_replay(x, window)?,
            (PoolKernels::Cpu, PoolKind::Average) => kernels::avg_pool2d_replay(x, window)?,
            #[cfg(feature = "cuda")]
            (PoolKernels::Cuda, PoolKind::Max) => {
                crate::kernels::cuda::max_pool2d_replay(x, window)?
            }
            #[cfg(feature = "cuda")]
            (PoolKernels::Cuda, PoolKind::Average) => {
                crate::kernels::cuda::avg_pool2d_replay(x, window)?
            }
        })
    }
}

impl PoolLayer {
    /// `part`'s view, where this is a max pool whose CUDA kernel writes its output for `x` there
    /// (the part in `x`'s dtype); `None` otherwise.
    #[cfg(feature = "cuda")]
    fn cuda_max_part(&self, x: &Tensor, part: &ChannelPart<'_>) -> Result<Option<Tensor>> {
        let cuda = matches!(self.kernels_for(x), Some(PoolKernels::Cuda));
        if !cuda || self.kind != PoolKind::Max {
            return Ok(None);
        }
        let out = part.view()?;
        Ok((out.dtype() == x.dtype()).then_some(out))
    }

    /// The kernels that pool `x`, where the layer may call kernels.
    fn kernels_for(&self, x: &Tensor) -> Option<PoolKernels> {
        self.kernels.then(|| PoolKernels::of(x)).flatten()
    }

    /// The kernel's pass, kept for calling its backward directly.
    fn replay(&self, ops: PoolKernels, x: &Tensor) -> Result<Replay1> {
        ops.replay(self.kind, x, &self.geometry.kernel_window())
    }
}

/// The backward pass of a CUDA max pool that wrote its output into a concatenation's channels:
/// the output gradient is read where it lies, in the concatenation's gradient.
#[cfg(feature = "cuda")]
struct MaxPoolIntoBackward(crate::kernels::cuda::MaxPoolBackward);

#[cfg(feature = "cuda")]
impl super::Backward for MaxPoolIntoBackward {
    fn backward(
        self: Box<Self>,
        dy: Tensor,
        _: &mut ParamGrads,
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        match input_grad {
            true => Ok(Some(self.0.backward(&dy)?)),
            false => Ok(None),
        }
    }

    fn takes_channel_views(&self) -> bool {
        true
    }
}

/// Records a kernel pass whose backward is the replayed op's; `output` is the op's output,
/// possibly reshaped.
fn record_replay(replay: Replay1, output: Tensor) -> Recorded {
    Recorded::new(
        output,
        move |dy: Tensor, _: &mut ParamGrads, input_grad: bool| {
            if !input_grad {
                return Ok(None);
            }
            let dy = dy.reshape(replay.output().shape())?;
            Ok(replay.backward(&dy)?)
        },
    )
}

impl Layer for PoolLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let g = &self.geometry;
        if let Some(ops) = self.kernels_for(x) {
            if !train && self.kind == PoolKind::Max {
                // No backward pass is expected: the maxima alone (one still works if it comes).
                return ops.max_pool2d(x, &g.kernel_window());
            }
            return Ok(self.replay(ops, x)?.output().clone());
        }
        // Candle's pooling backward is right only for an average over windows that tile the
        // input exactly (its max-pool backward scales the gradient by one over the window size).
        let (_, _, h, w) = x.dims4()?;
        let native =
            g.window == g.stride && !g.padded() && h % g.window.0 == 0 && w % g.window.1 == 0;
        let (kh, kw) = g.window;
        Ok(match self.kind {
            PoolKind::Average if native => x.avg_pool2d((kh, kw))?,
            PoolKind::Max => g.reduce(x, PoolKind::Max, train)?,
            PoolKind::Average => {
                let sum = g.reduce(x, PoolKind::Average, false)?;
                match &self.divisor {
                    Some(d) => sum.broadcast_div(&d.to_dtype(x.dtype())?)?,
                    None => (sum / (kh * kw) as f64)?,
                }
            }
        })
    }
}

impl FastPath for PoolLayer {
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        let Some(ops) = self.kernels_for(x).filter(|_| !request.logits) else {
            return record_with_candle(self, x, request.logits);
        };
        let replay = self.replay(ops, x)?;
        let y = replay.output().clone();
        Ok(record_replay(replay, y))
    }

    fn forward_recorded_into(&self, x: &Tensor, part: &ChannelPart<'_>) -> Result<Recorded> {
        #[cfg(feature = "cuda")]
        if let Some(out) = self.cuda_max_part(x, part)? {
            let window = self.geometry.kernel_window();
            let pass = crate::kernels::cuda::max_pool2d_train_into(x, &window, &out)?;
            return Ok(Recorded::new(out, MaxPoolIntoBackward(pass)));
        }
        record_into_by_copy(self, x, part)
    }

    fn forward_inference_into(&self, x: &Tensor, part: &ChannelPart<'_>) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if let Some(out) = self.cuda_max_part(x, part)? {
            let window = self.geometry.kernel_window();
            crate::kernels::cuda::max_pool2d_into(x, &window, &out)?;
            return Ok(Some(out));
        }
        let _ = (x, part);
        Ok(None)
    }

    fn forward_into(
        &self,
        x: &Tensor,
        affine: Option<&ChannelAffine>,
        slot: &mut ChannelSlot<'_>,
    ) -> Result<bool> {
        // The CPU kernel alone writes into a slot.
        let cpu = matches!(self.kernels_for(x), Some(PoolKernels::Cpu));
        if affine.is_some() || self.kind != PoolKind::Max || !cpu {
            return Ok(false);
        }
        kernels::max_pool2d_into(x, &self.geometry.kernel_window(), slot)?;
        Ok(true)
    }
}

/// A pooling layer over windows of the image, reducing each window as `R` says:
/// [`MaxPooling2D`] (`R` = [`Max`]) or [`AveragePooling2D`] (`R` = [`Average`]).
#[derive(Debug, Clone)]
pub struct Pooling2D<R> {
    config: Pool2D,
    reduction: std::marker::PhantomData<R>,
}

/// Maximum over each window.
pub type MaxPooling2D = Pooling2D<Max>;

/// Mean over each window.
pub type AveragePooling2D = Pooling2D<Average>;

/// The reduction of [`MaxPooling2D`]: the maximum of each window.
#[derive(Debug, Clone, Copy)]
pub struct Max;

/// The reduction of [`AveragePooling2D`]: the mean of each window.
#[derive(Debug, Clone, Copy)]
pub struct Average;

/// How a [`Pooling2D`] reduces a window: [`Max`] or [`Average`] (no other).
pub trait Reduction: reduction::Sealed + std::fmt::Debug + Clone + Send + Sync + 'static {}

impl Reduction for Max {}
impl Reduction for Average {}

mod reduction {
    use super::PoolKind;

    /// What a [`Reduction`](super::Reduction) is to the pooling code; only kandle implements it.
    pub trait Sealed {
        /// The reduction.
        const KIND: PoolKind;
        /// The layer's kind, for its automatic name.
        const LABEL: &'static str;
        /// The Keras class the summary prints.
        const CLASS: &'static str;
    }

    impl Sealed for super::Max {
        const KIND: PoolKind = PoolKind::Max;
        const LABEL: &'static str = "max_pooling2d";
        const CLASS: &'static str = "MaxPooling2D";
    }

    impl Sealed for super::Average {
        const KIND: PoolKind = PoolKind::Average;
        const LABEL: &'static str = "average_pooling2d";
        const CLASS: &'static str = "AveragePooling2D";
    }
}

impl<R: Reduction> Pooling2D<R> {
    /// A square `pool_size` window; the stride defaults to the window, padding to `valid`.
    pub fn new(pool_size: usize) -> Self {
        Self {
            config: Pool2D {
                kind: R::KIND,
                window: (pool_size, pool_size),
                stride: None,
                padding: Padding::Valid,
            },
            reduction: std::marker::PhantomData,
        }
    }

    /// A rectangular `(height, width)` window.
    pub fn window(mut self, kh: usize, kw: usize) -> Self {
        self.config.window = (kh, kw);
        self
    }

    /// The same stride along both axes.
    pub fn stride(mut self, stride: usize) -> Self {
        self.config.stride = Some((stride, stride));
        self
    }

    /// `(vertical, horizontal)` strides.
    pub fn strides(mut self, sh: usize, sw: usize) -> Self {
        self.config.stride = Some((sh, sw));
        self
    }

    /// Border handling.
    pub fn padding(mut self, padding: Padding) -> Self {
        self.config.padding = padding;
        self
    }
}

impl<R: Reduction> LayerSpec for Pooling2D<R> {
    fn kind(&self) -> &'static str {
        R::LABEL
    }

    fn class_name(&self) -> &'static str {
        R::CLASS
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        self.config.build(ctx, input_shape)
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

/// Mean over the spatial axes: `(batch, C, H, W)` to `(batch, C)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalAveragePooling2D;

impl LayerSpec for GlobalAveragePooling2D {
    fn kind(&self) -> &'static str {
        "global_average_pooling2d"
    }

    fn class_name(&self) -> &'static str {
        "GlobalAveragePooling2D"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let &[c, _, _] = input_shape else {
            return Err(shape_error(
                ctx,
                "(batch, channels, height, width)",
                input_shape,
            ));
        };
        let layer = GlobalPoolLayer {
            kernels: ctx.compute_path().uses_kernels(),
        };
        Ok(Built::fast(layer, vec![c], Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

/// One window over each whole `(H, W)` plane of `x`.
fn whole_plane(x: &Tensor) -> Result<PoolWindow> {
    let (_, _, h, w) = x.dims4()?;
    Ok(PoolWindow {
        window: (h, w),
        stride: (h, w),
        pad: (0, 0, 0, 0),
    })
}

/// A built [`GlobalAveragePooling2D`].
struct GlobalPoolLayer {
    /// Whether the layer may call the kernels (see [`crate::ComputePath::uses_kernels`]).
    kernels: bool,
}

impl GlobalPoolLayer {
    /// The average pooling kernels that take `x`, where the layer may call kernels.
    fn kernels_for(&self, x: &Tensor) -> Option<PoolKernels> {
        self.kernels.then(|| PoolKernels::of(x)).flatten()
    }
}

/// The recipe used directly as a layer, without building it, takes the default path.
impl Layer for GlobalAveragePooling2D {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        GlobalPoolLayer { kernels: true }.forward_t(x, train)
    }
}

impl FastPath for GlobalAveragePooling2D {
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        GlobalPoolLayer { kernels: true }.forward_recorded(x, request)
    }
}

impl Layer for GlobalPoolLayer {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        match self.kernels_for(x) {
            Some(PoolKernels::Cpu) => {
                Ok(kernels::avg_pool2d(x, &whole_plane(x)?)?.flatten_from(1)?)
            }
            // The CUDA kernel's pool, differentiable through its own backward pass.
            #[cfg(feature = "cuda")]
            Some(ops @ PoolKernels::Cuda) => {
                let replay = ops.replay(PoolKind::Average, x, &whole_plane(x)?)?;
                Ok(replay.output().flatten_from(1)?)
            }
            None => Ok(x.mean((2, 3))?),
        }
    }
}

impl FastPath for GlobalPoolLayer {
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        let Some(ops) = self.kernels_for(x).filter(|_| !request.logits) else {
            return record_with_candle(self, x, request.logits);
        };
        let replay = ops.replay(PoolKind::Average, x, &whole_plane(x)?)?;
        let y = replay.output().flatten_from(1)?;
        Ok(record_replay(replay, y))
    }
}

#[cfg(test)]
mod tests;
