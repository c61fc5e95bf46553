//! `Dense`: a fully connected layer `y = activation(x W^T + b)` over `(batch, features)`
//! inputs.

use candle_core::Tensor;

use super::{
    shape_error, Activation, BuildContext, Built, BuiltActivation, FastPath, Layer, LayerSpec,
    ParamGrads, RecordRequest, Recorded,
};
use crate::params::Init;
use crate::Result;

/// A fully connected layer. The weight is `(units, in_features)` (PyTorch's layout),
/// initialised Glorot-uniform; the bias starts at zero.
///
/// As in Keras, the layer may apply an activation to its output, which then takes no row of its
/// own in the summary and no variable; a final `Dense(..).activation(Activation::Softmax)`
/// gives its logits to cross-entropy losses, as a separate softmax layer does.
///
/// ```
/// use kandle::layers::{Activation, Dense, Flatten, Sequential};
///
/// let net = Sequential::new()
///     .add(Flatten)
///     .add(Dense::new(32).activation(Activation::Relu))
///     .add(Dense::new(10).activation(Activation::Softmax));
/// let summary = net.summary(&[1, 8, 8])?;
/// assert_eq!(summary.rows.len(), 3);
/// assert_eq!(summary.trainable, 64 * 32 + 32 + 32 * 10 + 10);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Dense {
    units: usize,
    use_bias: bool,
    activation: Activation,
}

impl Dense {
    /// `units` outputs, with a bias.
    pub fn new(units: usize) -> Self {
        Self {
            units,
            use_bias: true,
            activation: Activation::Linear,
        }
    }

    /// The activation applied to the output (default [`Activation::Linear`], none).
    pub fn activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// Whether to add a bias (default true).
    pub fn use_bias(mut self, use_bias: bool) -> Self {
        self.use_bias = use_bias;
        self
    }
}

impl LayerSpec for Dense {
    fn kind(&self) -> &'static str {
        "dense"
    }

    fn class_name(&self) -> &'static str {
        "Dense"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let &[features] = input_shape else {
            return Err(shape_error(
                ctx,
                "(batch, features): add a Flatten before it",
                input_shape,
            ));
        };
        if self.units == 0 {
            return Err(crate::Error::invalid(format!(
                "layer `{}`: units must be positive",
                ctx.path()
            )));
        }
        let weight = ctx.variable(
            "weight",
            &[self.units, features],
            Init::GlorotUniform {
                fan_in: features,
                fan_out: self.units,
            },
        )?;
        let bias = if self.use_bias {
            Some(ctx.variable("bias", &[self.units], Init::Zeros)?)
        } else {
            None
        };
        let layer = DenseLayer {
            weight: ctx.tensor_of(&weight),
            bias: bias.map(|b| ctx.tensor_of(&b)),
            trainable: ctx.trainable(),
            activation: self
                .activation
                .with_kernels(ctx.compute_path().uses_kernels()),
            compute: ctx.compute_dtype(),
            #[cfg(feature = "cuda")]
            kernels: ctx.compute_path().uses_kernels(),
        };
        Ok(Built::fast(layer, vec![self.units], Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct DenseLayer {
    weight: Tensor,
    bias: Option<Tensor>,
    /// Whether the weight and bias train: a frozen layer computes no gradient for them.
    trainable: bool,
    activation: BuiltActivation,
    /// The dtype the product computes in (mixed precision): the input and the variables are
    /// cast to it.
    compute: candle_core::DType,
    /// Whether the product may run on kandle's kernels (see
    /// [`crate::ComputePath::uses_kernels`]): on a CUDA device, one cuBLASLt matmul with the
    /// bias in its epilogue.
    #[cfg(feature = "cuda")]
    kernels: bool,
}

impl DenseLayer {
    /// `x W^T + b` with the given weight and bias: on kandle's kernels on a CUDA device, one
    /// cuBLASLt matmul with the bias in its epilogue (differentiable, as candle's ops are);
    /// elsewhere candle's matmul and broadcast add.
    fn affine(&self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.kernels && x.device().is_cuda() && crate::kernels::cuda::dense_supported(x.dtype())
        {
            return Ok(crate::kernels::cuda::dense(x, weight, bias)?);
        }
        let y = x.matmul(&weight.t()?)?;
        Ok(match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// The recorded `x W^T + b`, before the activation, in the layer's compute dtype: the
    /// input and the variables are cast to it (a no-op in `float32`), and the gradients are cast
    /// back, the variables' to `float32` and the input's to the input's dtype, as candle's
    /// autograd casts them.
    fn record_affine(&self, x: &Tensor) -> Result<Recorded> {
        let cast = |t: &Tensor| t.to_dtype(self.compute);
        let weight = cast(&self.weight.detach())?;
        let input = cast(x)?;
        let bias = self.bias.as_ref().map(|b| cast(&b.detach())).transpose()?;
        let y = self.affine(&input, &weight, bias.as_ref())?;
        let input_dtype = x.dtype();
        let params = self
            .trainable
            .then(|| (input, self.weight.clone(), self.bias.clone()));
        Ok(Recorded::new(
            y,
            move |dy: Tensor, grads: &mut ParamGrads, input_grad: bool| {
                if let Some((x, weight_var, bias_var)) = params {
                    let dw = dy.t()?.matmul(&x)?.to_dtype(weight_var.dtype())?;
                    grads.add(&weight_var, dw)?;
                    if let Some(b) = bias_var {
                        grads.add(&b, dy.sum(0)?.to_dtype(b.dtype())?)?;
                    }
                }
                Ok(if input_grad {
                    Some(dy.matmul(&weight)?.to_dtype(input_dtype)?)
                } else {
                    None
                })
            },
        ))
    }
}

impl DenseLayer {
    /// `x W^T + b` in the layer's compute dtype.
    fn compute_affine(&self, x: &Tensor) -> Result<Tensor> {
        let cast = |t: &Tensor| t.to_dtype(self.compute);
        let bias = self.bias.as_ref().map(cast).transpose()?;
        self.affine(&cast(x)?, &cast(&self.weight)?, bias.as_ref())
    }
}

impl Layer for DenseLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.activation.after(self.compute_affine(x)?, train)
    }

    fn forward_with_logits(&self, x: &Tensor, _train: bool) -> Result<(Tensor, Option<Tensor>)> {
        self.activation.after_with_logits(self.compute_affine(x)?)
    }
}

impl FastPath for DenseLayer {
    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        self.activation
            .after_recorded(self.record_affine(x)?, request.logits)
    }
}
