//! `Rescaling`: `x * scale + offset`, as Keras's (`Rescaling(1 / 255)` maps 0..255 to 0..1).

use candle_core::Tensor;

use crate::layers::{BuildContext, Built, FastPath, Layer, LayerSpec};
use crate::Result;

/// Multiplies the input by `scale` and adds `offset`, in training and inference alike.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kandle::layers::{BuildContext, LayerSpec, Rescaling};
///
/// let built = Rescaling::new(1.0 / 255.0, -0.5).build(&mut BuildContext::new(&Device::Cpu, 0), &[2])?;
/// let x = Tensor::new(&[[0f32, 255.]], &Device::Cpu)?;
/// assert_eq!(built.layer().forward_t(&x, false)?.to_vec2::<f32>()?, [[-0.5, 0.5]]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rescaling {
    scale: f64,
    offset: f64,
}

impl Rescaling {
    /// `x * scale + offset`.
    pub fn new(scale: f64, offset: f64) -> Self {
        Self { scale, offset }
    }
}

impl LayerSpec for Rescaling {
    fn kind(&self) -> &'static str {
        "rescaling"
    }

    fn class_name(&self) -> &'static str {
        "Rescaling"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        if !(self.scale.is_finite() && self.offset.is_finite()) {
            return Err(crate::Error::invalid(format!(
                "layer `{}`: scale {} and offset {} must be finite",
                ctx.path(),
                self.scale,
                self.offset
            )));
        }
        Ok(Built::fast(*self, input_shape.to_vec(), Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

impl Layer for Rescaling {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        Ok(x.affine(self.scale, self.offset)?)
    }
}

impl FastPath for Rescaling {}
