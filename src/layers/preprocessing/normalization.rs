//! `Normalization`: `(x - mean) / std` per channel (the first axis after the batch's), as
//! Keras's `Normalization` with a given mean and variance; ImageNet's statistics included.

use candle_core::{Device, Tensor};

use crate::layers::{BuildContext, Built, FastPath, Layer, LayerSpec};
use crate::Result;

/// Subtracts a mean and divides by a standard deviation per channel, in training and inference
/// alike. One value for every channel, or one per channel of the input.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kandle::layers::{BuildContext, LayerSpec, Normalization};
///
/// let norm = Normalization::new(&[1.0, 10.0], &[2.0, 5.0]);
/// let built = norm.build(&mut BuildContext::new(&Device::Cpu, 0), &[2])?;
/// let x = Tensor::new(&[[3f32, 20.]], &Device::Cpu)?;
/// assert_eq!(built.layer().forward_t(&x, false)?.to_vec2::<f32>()?, [[1.0, 2.0]]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Normalization {
    mean: Vec<f32>,
    std: Vec<f32>,
}

impl Normalization {
    /// `(x - mean[c]) / std[c]` on channel `c`.
    pub fn new(mean: &[f32], std: &[f32]) -> Self {
        Self {
            mean: mean.to_vec(),
            std: std.to_vec(),
        }
    }

    /// ImageNet's statistics for RGB images of 0..1 (torchvision's pretrained models expect
    /// them): mean `[0.485, 0.456, 0.406]`, standard deviation `[0.229, 0.224, 0.225]`.
    pub fn imagenet() -> Self {
        Self::new(&[0.485, 0.456, 0.406], &[0.229, 0.224, 0.225])
    }
}

impl LayerSpec for Normalization {
    fn kind(&self) -> &'static str {
        "normalization"
    }

    fn class_name(&self) -> &'static str {
        "Normalization"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let channels = input_shape.first().copied().unwrap_or(0);
        let fits = |n: usize| n == 1 || n == channels;
        if self.mean.len() != self.std.len() || !fits(self.mean.len()) {
            return Err(crate::Error::Shape {
                layer: ctx.path(),
                expected: format!(
                    "inputs of 1 or {} channels for a mean of {} values and a standard \
                     deviation of {}",
                    self.mean.len(),
                    self.mean.len(),
                    self.std.len()
                ),
                got: crate::error::shape_with_batch(input_shape),
            });
        }
        if let Some(bad) = self.std.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(crate::Error::invalid(format!(
                "layer `{}`: a standard deviation must be finite and positive, got {bad}",
                ctx.path()
            )));
        }
        // Shaped `(1, channels, 1, ...)` to broadcast over the batch and the other axes.
        let mut dims = vec![1, self.mean.len()];
        dims.extend(std::iter::repeat_n(1, input_shape.len().saturating_sub(1)));
        let per_channel = |values: &[f32]| -> Result<Tensor> {
            Ok(Tensor::from_slice(values, dims.as_slice(), &Device::Cpu)?
                .to_device(ctx.device())?)
        };
        let inv: Vec<f32> = self.std.iter().map(|s| 1.0 / s).collect();
        let layer = NormalizationLayer {
            mean: per_channel(&self.mean)?,
            inv_std: per_channel(&inv)?,
        };
        Ok(Built::fast(layer, input_shape.to_vec(), Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct NormalizationLayer {
    mean: Tensor,
    inv_std: Tensor,
}

impl Layer for NormalizationLayer {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        let mean = self.mean.to_dtype(x.dtype())?;
        let inv_std = self.inv_std.to_dtype(x.dtype())?;
        Ok(x.broadcast_sub(&mean)?.broadcast_mul(&inv_std)?)
    }
}

impl FastPath for NormalizationLayer {}
