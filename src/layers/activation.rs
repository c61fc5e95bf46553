//! `Activation`: an element-wise (or, for softmax, per-row) non-linearity with no variables.

use candle_core::{Tensor, D};

use super::{
    identity, pass_through, record_with_candle, BuildContext, Built, Layer, LayerSpec, ParamGrads,
    Recorded,
};
use crate::Result;

/// A non-linearity applied to the whole input.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// `max(x, slope * x)`.
    LeakyRelu(f64),
    /// Softmax over the last axis. Cross-entropy losses read the logits before it, so a model
    /// ending in softmax trains as stably as one that outputs logits.
    Softmax,
    /// `1 / (1 + exp(-x))`.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
    /// Gaussian error linear unit (erf form).
    Gelu,
    /// `x * sigmoid(x)`.
    Swish,
    /// The identity.
    Linear,
}

impl Activation {
    /// Applies the function to a tensor.
    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Activation::Relu => x.relu()?,
            Activation::LeakyRelu(slope) => x.maximum(&(x * slope)?)?,
            Activation::Softmax => candle_nn::ops::softmax_last_dim(x)?,
            Activation::Sigmoid => candle_nn::ops::sigmoid(x)?,
            Activation::Tanh => x.tanh()?,
            Activation::Gelu => x.gelu_erf()?,
            Activation::Swish => x.silu()?,
            Activation::Linear => x.clone(),
        })
    }
}

impl LayerSpec for Activation {
    fn kind(&self) -> &'static str {
        match self {
            Activation::Relu => "relu",
            Activation::LeakyRelu(_) => "leaky_relu",
            Activation::Softmax => "softmax",
            Activation::Sigmoid => "sigmoid",
            Activation::Tanh => "tanh",
            Activation::Gelu => "gelu",
            Activation::Swish => "swish",
            Activation::Linear => "linear",
        }
    }

    fn class_name(&self) -> &'static str {
        "Activation"
    }

    fn build(&self, _ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        Ok(Built::leaf(*self, input_shape.to_vec()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

impl Layer for Activation {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        self.apply(x)
    }

    fn forward_with_logits(&self, x: &Tensor, _train: bool) -> Result<(Tensor, Option<Tensor>)> {
        let logits = (*self == Activation::Softmax).then(|| x.clone());
        Ok((self.apply(x)?, logits))
    }

    fn forward_recorded(&self, x: &Tensor) -> Result<Recorded> {
        match self {
            Activation::Linear => Ok(identity(x)),
            Activation::Relu => {
                // Candle's ReLU passes the gradient where the input is >= 0; so does this.
                let passes = x.ge(0.0)?.to_dtype(x.dtype())?;
                Ok(Recorded::new(
                    x.relu()?,
                    move |dy: Tensor, _: &mut ParamGrads, input_grad: bool| {
                        Ok(if input_grad {
                            Some(dy.mul(&passes)?)
                        } else {
                            None
                        })
                    },
                ))
            }
            _ => record_with_candle(self, x, false),
        }
    }

    fn forward_recorded_with_logits(&self, x: &Tensor) -> Result<Recorded> {
        if *self != Activation::Softmax {
            return self.forward_recorded(x);
        }
        // The backward pass takes the gradient of the logits, which pass through unchanged.
        Ok(Recorded {
            output: self.apply(x)?,
            logits: Some(x.clone()),
            backward: Box::new(pass_through),
        })
    }

    fn is_relu(&self) -> bool {
        *self == Activation::Relu
    }
}

/// Numerically stable `log(softmax(x))` over the last axis.
pub(crate) fn log_softmax(x: &Tensor) -> Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(x, D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn values() -> Result<()> {
        let x = Tensor::new(&[-2f32, 0., 3.], &Device::Cpu)?;
        assert_eq!(
            Activation::Relu.apply(&x)?.to_vec1::<f32>()?,
            vec![0., 0., 3.]
        );
        assert_eq!(
            Activation::LeakyRelu(0.5).apply(&x)?.to_vec1::<f32>()?,
            vec![-1., 0., 3.]
        );
        let s = Activation::Softmax.apply(&x)?.to_vec1::<f32>()?;
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(s[2] > s[1] && s[1] > s[0]);
        let big = Tensor::new(&[[1000f32, 0.]], &Device::Cpu)?;
        let ls = log_softmax(&big)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(ls.iter().all(|v| v.is_finite()) && (ls[1] + 1000.).abs() < 1e-3);
        Ok(())
    }
}
