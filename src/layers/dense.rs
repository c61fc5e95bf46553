//! `Dense`: a fully connected layer `y = x W^T + b` over `(batch, features)` inputs.

use candle_core::Tensor;

use super::{shape_error, BuildContext, Built, Layer, LayerSpec};
use crate::params::Init;
use crate::Result;

/// A fully connected layer. The weight is `(units, in_features)` (PyTorch's layout),
/// initialised Glorot-uniform; the bias starts at zero.
#[derive(Debug, Clone)]
pub struct Dense {
    units: usize,
    use_bias: bool,
}

impl Dense {
    /// `units` outputs, with a bias.
    pub fn new(units: usize) -> Self {
        Self {
            units,
            use_bias: true,
        }
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
            weight: weight.as_tensor().clone(),
            bias: bias.map(|b| b.as_tensor().clone()),
        };
        Ok(Built::leaf(layer, vec![self.units]))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct DenseLayer {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Layer for DenseLayer {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        let y = x.matmul(&self.weight.t()?)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}
