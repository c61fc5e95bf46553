//! `Conv2D`: a 2-D convolution over `(channels, height, width)` inputs, with Keras's `same` and
//! `valid` padding, strides, an optional bias and an optional activation.
//!
//! `f32` tensors on the CPU go through the GEMM kernel in [`crate::kernels::conv2d`]; other
//! devices and types, and every tensor of a layer built for
//! [`ComputePath::DeviceGeneric`](crate::ComputePath::DeviceGeneric), use candle's `conv2d`
//! (kandle's cuDNN op on CUDA devices with the `cudnn` feature). The recorded backward pass
//! calls the CPU kernel's backward, or cuDNN's two gradient operations on a CUDA device, and
//! records candle's `conv2d` under candle's autograd elsewhere.

use candle_core::{DType, Tensor};

use super::window::{subsample, Padding, Window};
use super::{
    missing_input_grad, record_with_candle, Activation, Backward, BuildContext, Built,
    BuiltActivation, ChannelAffine, ChannelSlot, FastPath, Layer, LayerSpec, ParamGrads,
    RecordRequest, Recorded,
};
use crate::kernels;
use crate::kernels::conv2d::{FoldedAffine, KernelCache};
use crate::params::Init;
use crate::Result;

/// A 2-D convolution. Weights are `(filters, in_channels, kh, kw)`, initialised Glorot-uniform;
/// the bias starts at zero.
///
/// As in Keras, the layer may apply an activation to its output
/// (`Conv2D::new(32, 3).activation(Activation::Relu)`), with no row of its own in the summary
/// and no variable.
#[derive(Debug, Clone)]
pub struct Conv2D {
    filters: usize,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: Padding,
    use_bias: bool,
    activation: Activation,
}

impl Conv2D {
    /// `filters` output channels with a square `kernel_size` window, stride 1, `valid` padding
    /// and a bias.
    pub fn new(filters: usize, kernel_size: usize) -> Self {
        Self {
            filters,
            kernel: (kernel_size, kernel_size),
            stride: (1, 1),
            padding: Padding::Valid,
            use_bias: true,
            activation: Activation::Linear,
        }
    }

    /// The activation applied to the output (default [`Activation::Linear`], none).
    pub fn activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// A rectangular `(height, width)` window.
    pub fn kernel(mut self, kh: usize, kw: usize) -> Self {
        self.kernel = (kh, kw);
        self
    }

    /// The same stride along both axes.
    pub fn stride(mut self, stride: usize) -> Self {
        self.stride = (stride, stride);
        self
    }

    /// `(vertical, horizontal)` strides.
    pub fn strides(mut self, sh: usize, sw: usize) -> Self {
        self.stride = (sh, sw);
        self
    }

    /// Border handling.
    pub fn padding(mut self, padding: Padding) -> Self {
        self.padding = padding;
        self
    }

    /// Whether to add a bias (default true).
    pub fn use_bias(mut self, use_bias: bool) -> Self {
        self.use_bias = use_bias;
        self
    }
}

impl LayerSpec for Conv2D {
    fn kind(&self) -> &'static str {
        "conv2d"
    }

    fn class_name(&self) -> &'static str {
        "Conv2D"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let c = input_shape.first().copied().unwrap_or(0);
        if self.filters == 0 {
            return Err(crate::Error::invalid(format!(
                "layer `{}`: filters must be positive",
                ctx.path()
            )));
        }
        let (kh, kw) = self.kernel;
        let window = Window::resolve(
            ctx,
            input_shape,
            self.kernel,
            self.stride,
            self.padding,
            "convolution",
        )?;
        let (oh, ow) = window.out;
        let fan_in = c * kh * kw;
        let fan_out = self.filters * kh * kw;
        let weight = ctx.variable(
            "weight",
            &[self.filters, c, kh, kw],
            Init::GlorotUniform { fan_in, fan_out },
        )?;
        let bias = if self.use_bias {
            Some(ctx.variable("bias", &[self.filters], Init::Zeros)?)
        } else {
            None
        };
        let layer = Conv2DLayer {
            weight: ctx.tensor_of(&weight),
            bias: bias.map(|b| ctx.tensor_of(&b)),
            trainable: ctx.trainable(),
            stride: self.stride,
            pad: window.pad,
            activation: self.activation,
            kernels: ctx.compute_path().uses_kernels(),
            compute: ctx.compute_dtype(),
            lowered: KernelCache::default(),
        };
        Ok(Built::fast(layer, vec![self.filters, oh, ow], Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct Conv2DLayer {
    weight: Tensor,
    bias: Option<Tensor>,
    /// Whether the weight and bias train: a frozen layer computes no gradient for them.
    trainable: bool,
    stride: (usize, usize),
    /// top, bottom, left, right
    pad: (usize, usize, usize, usize),
    activation: Activation,
    /// Whether the layer may call the CPU kernel (see [`crate::ComputePath::uses_kernels`]).
    kernels: bool,
    /// The dtype candle's convolution computes in (mixed precision): the input and the
    /// variables are cast to it.
    compute: DType,
    /// The kernel inference's folded convolution last lowered, for the next call with the
    /// same weights and BatchNorm scale.
    lowered: KernelCache,
}

impl Conv2DLayer {
    /// Whether the CPU kernel computes the convolution of `x`.
    fn kernel_takes(&self, x: &Tensor) -> bool {
        self.kernels && kernels::conv2d::supported(x, &self.weight)
    }

    /// What the kernel's affine epilogue applies to each output channel for this layer's bias
    /// and activation, followed by `affine` if given: `(scale, shift, relu)`. `None` when the
    /// kernel does not take `x`, or the activation is neither linear nor (with no map to
    /// follow) a ReLU.
    fn output_affine(
        &self,
        x: &Tensor,
        affine: Option<&ChannelAffine>,
    ) -> Result<Option<(Tensor, Tensor, bool)>> {
        if !self.kernel_takes(x) {
            return Ok(None);
        }
        let bias = self.bias.as_ref().map(Tensor::detach);
        Ok(match (affine, self.activation) {
            (Some(a), Activation::Linear) => {
                let shift = match bias {
                    Some(b) => ((b * &a.scale)? + &a.shift)?,
                    None => a.shift.clone(),
                };
                Some((a.scale.clone(), shift, a.relu))
            }
            (None, Activation::Linear | Activation::Relu) => {
                let o = self.weight.dim(0)?;
                let scale = Tensor::ones(o, self.weight.dtype(), self.weight.device())?;
                let shift = match bias {
                    Some(b) => b,
                    None => scale.zeros_like()?,
                };
                Some((scale, shift, self.activation == Activation::Relu))
            }
            _ => None,
        })
    }

    /// The activation, on the CPU kernel where the layer may call kernels.
    fn built_activation(&self) -> BuiltActivation {
        self.activation.with_kernels(self.kernels)
    }

    /// The folded convolution's epilogue, with this layer's kernel cache.
    fn folded<'a>(&'a self, scale: &'a Tensor, shift: &'a Tensor, relu: bool) -> FoldedAffine<'a> {
        FoldedAffine {
            scale,
            shift,
            relu,
            cache: Some(&self.lowered),
        }
    }

    /// The convolution with its bias, before the activation.
    fn convolve(&self, x: &Tensor) -> Result<Tensor> {
        if self.kernel_takes(x) {
            let bias = self.bias.as_ref();
            let y = kernels::conv2d::conv2d(x, &self.weight, bias, self.stride, self.pad)?;
            return Ok(y);
        }
        let y = self.candle_conv(&x.to_dtype(self.compute)?)?;
        Ok(match &self.bias {
            Some(b) => {
                let b = b.to_dtype(self.compute)?;
                y.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?)?
            }
            None => y,
        })
    }

    /// The convolution without bias for devices and types the CPU kernel does not take:
    /// kandle's cuDNN op on CUDA devices (with the `cudnn` feature), candle's own ops
    /// elsewhere. The weight is cast to `x`'s dtype.
    fn candle_conv(&self, x: &Tensor) -> Result<Tensor> {
        let (pt, pb, pl, pr) = self.pad;
        let weight = self.weight.to_dtype(x.dtype())?;
        #[cfg(feature = "cudnn")]
        if x.device().is_cuda() {
            // kandle's cuDNN op: algorithms searched once per shape and kept, one workspace;
            // candle's autograd differentiates it through cuDNN's two gradient operations,
            // which the recorded pass calls itself (`record_cudnn`).
            return Ok(kernels::cuda::conv2d(
                &x.contiguous()?,
                &weight.contiguous()?,
                self.cudnn_params(),
            )?);
        }
        if pt == pb && pl == pr && pt == pl && self.stride.0 == self.stride.1 {
            Ok(x.conv2d(&weight, pt, self.stride.0, 1, 1)?)
        } else {
            let x = x.pad_with_zeros(2, pt, pb)?.pad_with_zeros(3, pl, pr)?;
            strided_conv(&x, &weight, self.stride)
        }
    }

    /// The recorded convolution with its bias, before the activation: the kernel's own
    /// backward pass, or candle's autograd over candle's ops when the kernel does not take `x`.
    fn record_convolution(&self, x: &Tensor) -> Result<Recorded> {
        if !self.kernel_takes(x) {
            #[cfg(feature = "cudnn")]
            if x.device().is_cuda() {
                return self.record_cudnn(x);
            }
            return record_with_candle(&Convolution(self), x, false);
        }
        let weight = self.weight.detach();
        let bias = self.bias.as_ref().map(Tensor::detach);
        let y = kernels::conv2d::conv2d(x, &weight, bias.as_ref(), self.stride, self.pad)?;
        let window = (self.stride, self.pad);
        let adds_in_place = kernels::conv2d::input_grad_adds_in_place(x, &weight, window);
        Ok(Recorded::new(
            y,
            ConvBackward {
                x: x.clone(),
                weight,
                bias,
                vars: self
                    .trainable
                    .then(|| (self.weight.clone(), self.bias.clone())),
                window,
                adds_in_place,
            },
        ))
    }
}

#[cfg(feature = "cudnn")]
impl Conv2DLayer {
    /// The window of kandle's cuDNN convolution.
    fn cudnn_params(&self) -> kernels::cuda::Conv2dParams {
        kernels::cuda::Conv2dParams {
            stride: self.stride,
            padding: self.pad,
            ..Default::default()
        }
    }

    /// The recorded convolution with its bias on a CUDA device: kandle's cuDNN forward, and
    /// cuDNN's two gradient operations called directly by the backward pass, in the layer's
    /// compute dtype; the gradients are cast back as candle's autograd casts them (the
    /// variables' to theirs, the input's to the input's).
    fn record_cudnn(&self, x: &Tensor) -> Result<Recorded> {
        let params = self.cudnn_params();
        let input = x.to_dtype(self.compute)?.contiguous()?;
        let weight = self.weight.detach().to_dtype(self.compute)?.contiguous()?;
        let y = kernels::cuda::conv2d(&input, &weight, params)?;
        let y = match &self.bias {
            Some(b) => {
                let b = b.detach().to_dtype(self.compute)?;
                y.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?)?
            }
            None => y,
        };
        let vars = self
            .trainable
            .then(|| (self.weight.clone(), self.bias.clone()));
        let input_dtype = x.dtype();
        Ok(Recorded::new(
            y,
            move |dy: Tensor, grads: &mut ParamGrads, input_grad: bool| {
                if let Some((weight_var, bias_var)) = vars {
                    let dw = kernels::cuda::conv2d_kernel_grad(&input, &dy, weight.dims(), params)?;
                    grads.add(&weight_var, dw.to_dtype(weight_var.dtype())?)?;
                    if let Some(b) = bias_var {
                        grads.add(&b, dy.sum(&[0usize, 2, 3][..])?.to_dtype(b.dtype())?)?;
                    }
                }
                if !input_grad {
                    return Ok(None);
                }
                let dx = kernels::cuda::conv2d_input_grad(&dy, &weight, input.dims(), params)?;
                Ok(Some(dx.to_dtype(input_dtype)?))
            },
        ))
    }
}

/// The recorded backward pass of a kernel convolution: both gradients in one call of
/// [`kernels::conv2d::conv2d_backward`], which adds another branch's input gradient as it
/// writes its own when asked.
struct ConvBackward {
    x: Tensor,
    /// The kernel and bias the forward pass used (detached).
    weight: Tensor,
    bias: Option<Tensor>,
    /// The variables their gradients go to; `None` when the layer is frozen, so that the
    /// kernel computes no weight gradient.
    vars: Option<(Tensor, Option<Tensor>)>,
    window: kernels::conv2d::Window,
    adds_in_place: bool,
}

impl ConvBackward {
    /// Adds the parameters' gradients to `grads` and returns the input's, plus `add`.
    fn run(
        self,
        dy: &Tensor,
        grads: &mut ParamGrads,
        (input_grad, add): (bool, Option<&Tensor>),
    ) -> Result<Option<Tensor>> {
        let (stride, pad) = self.window;
        let trains = self.vars.is_some();
        let g = kernels::conv2d::conv2d_backward(
            &self.x,
            &self.weight,
            dy,
            (input_grad, trains, trains && self.bias.is_some()),
            stride,
            pad,
            add,
        )?;
        if let Some((weight_var, bias_var)) = self.vars {
            if let Some(dw) = g.weight {
                grads.add(&weight_var, dw)?;
            }
            if let (Some(b), Some(db)) = (bias_var, g.bias) {
                grads.add(&b, db)?;
            }
        }
        Ok(g.input)
    }
}

impl Backward for ConvBackward {
    fn backward(
        self: Box<Self>,
        dy: Tensor,
        grads: &mut ParamGrads,
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        self.run(&dy, grads, (input_grad, None))
    }

    fn backward_adding(
        self: Box<Self>,
        dy: Tensor,
        grads: &mut ParamGrads,
        add: Tensor,
    ) -> Result<Tensor> {
        self.run(&dy, grads, (true, Some(&add)))?
            .ok_or_else(|| missing_input_grad("conv2d"))
    }

    fn adds_in_place(&self) -> bool {
        self.adds_in_place
    }
}

/// The convolution alone, as a layer, for recording it under candle's autograd.
struct Convolution<'a>(&'a Conv2DLayer);

impl Layer for Convolution<'_> {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        self.0.convolve(x)
    }
}

impl Layer for Conv2DLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.built_activation().after(self.convolve(x)?, train)
    }

    fn forward_with_logits(&self, x: &Tensor, _train: bool) -> Result<(Tensor, Option<Tensor>)> {
        self.built_activation().after_with_logits(self.convolve(x)?)
    }
}

impl FastPath for Conv2DLayer {
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        self.built_activation()
            .after_recorded(self.record_convolution(x)?, request.logits)
    }

    fn forward_then_affine(&self, x: &Tensor, affine: &ChannelAffine) -> Result<Option<Tensor>> {
        let Some((scale, shift, relu)) = self.output_affine(x, Some(affine))? else {
            return Ok(None);
        };
        let folded = self.folded(&scale, &shift, relu);
        let window = (self.stride, self.pad);
        let y = kernels::conv2d::conv2d_affine(x, &self.weight.detach(), folded, window)?;
        Ok(Some(y))
    }

    fn forward_into(
        &self,
        x: &Tensor,
        affine: Option<&ChannelAffine>,
        slot: &mut ChannelSlot<'_>,
    ) -> Result<bool> {
        let Some((scale, shift, relu)) = self.output_affine(x, affine)? else {
            return Ok(false);
        };
        let (weight, window) = (self.weight.detach(), (self.stride, self.pad));
        let folded = self.folded(&scale, &shift, relu);
        kernels::conv2d::conv2d_affine_into(x, &weight, folded, window, slot)?;
        Ok(true)
    }
}

/// A convolution without padding whose vertical and horizontal strides may differ.
fn strided_conv(x: &Tensor, weight: &Tensor, (sh, sw): (usize, usize)) -> Result<Tensor> {
    if sh == sw {
        return Ok(x.conv2d(weight, 0, sh, 1, 1)?);
    }
    // Candle takes one stride for both axes: convolve densely, then subsample each axis.
    let y = x.conv2d(weight, 0, 1, 1, 1)?;
    Ok(subsample(&subsample(&y, 2, sh)?, 3, sw)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn output_shape_and_values() -> Result<()> {
        let mut ctx = BuildContext::new(&Device::Cpu, 0);
        let built = Conv2D::new(4, 3)
            .stride(2)
            .padding(Padding::Same)
            .build(&mut ctx, &[2, 9, 8])?;
        assert_eq!(built.output_shape, vec![4, 5, 4]);
        let x = Tensor::ones((3, 2, 9, 8), DType::F32, &Device::Cpu)?;
        assert_eq!(built.layer.forward_t(&x, true)?.dims(), &[3, 4, 5, 4]);

        // A 1x1 convolution with unit weights sums channels.
        let mut ctx = BuildContext::new(&Device::Cpu, 0);
        let built = Conv2D::new(1, 1).build(&mut ctx, &[2, 2, 2])?;
        let store = ctx.into_store();
        let w = store.get("weight").map(|p| p.var.clone());
        w.as_ref()
            .map(|w| w.set(&Tensor::ones((1, 2, 1, 1), DType::F32, &Device::Cpu)?))
            .transpose()?;
        let x = Tensor::arange(0f32, 8., &Device::Cpu)?.reshape((1, 2, 2, 2))?;
        let y = built
            .layer
            .forward_t(&x, false)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert_eq!(y, vec![4., 6., 8., 10.]);
        Ok(())
    }

    #[test]
    fn cpu_kernel_agrees_with_candle() -> Result<()> {
        // Stride-2 `same` on 10x9: padding (0, 1, 1, 1), uneven vertically.
        let mut ctx = BuildContext::new(&Device::Cpu, 3);
        let spec = Conv2D::new(5, 3).stride(2).padding(Padding::Same);
        let built = spec.build(&mut ctx, &[4, 10, 9])?;
        let store = ctx.into_store();
        let weight = store.get("weight").map(|p| p.var.as_tensor().clone());
        let weight = weight.ok_or_else(|| crate::Error::invalid("no weight"))?;
        let layer = Conv2DLayer {
            weight,
            bias: None,
            trainable: true,
            stride: (2, 2),
            pad: (0, 1, 1, 1),
            activation: Activation::Linear,
            kernels: false,
            compute: DType::F32,
            lowered: KernelCache::default(),
        };
        let x = kandle_testing::random::seeded_normal(&[2, 4, 10, 9], 1.0, 1)?;
        let y = built.layer.forward_t(&x, true)?;
        let want = layer.candle_conv(&x)?;
        let diff = (y - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-4, "{diff}");
        Ok(())
    }

    #[test]
    fn mixed_strides() -> Result<()> {
        let x = Tensor::arange(0f32, 30., &Device::Cpu)?.reshape((1, 1, 5, 6))?;
        let w = Tensor::ones((1, 1, 1, 1), DType::F32, &Device::Cpu)?;
        let y = strided_conv(&x, &w, (2, 3))?;
        assert_eq!(y.dims(), &[1, 1, 3, 2]);
        assert_eq!(
            y.flatten_all()?.to_vec1::<f32>()?,
            vec![0., 3., 12., 15., 24., 27.]
        );
        Ok(())
    }
}
