//! `Dropout`: in training, zeroes each element with probability `rate` and scales the rest by
//! `1 / (1 - rate)`; in inference, and inside `.inference_mode()` (Keras's `training=False`),
//! the identity.
//!
//! Masks come from the layer's [`RandomStream`], drawn on the input's device by kandle-kernels'
//! counter-based generator ([`crate::kernels::dropout::draw_mask`]): a step on a GPU never waits
//! for the host to draw one, a seeded run draws the same masks on the CPU and on a GPU, and a run
//! resumed from a backup draws the masks an uninterrupted one would.

use candle_core::Tensor;

use super::random_stream::RandomStream;
use super::{
    identity, record_with_candle, BuildContext, Built, FastPath, Layer, LayerSpec, ParamGrads,
    RecordRequest, Recorded,
};
use crate::Result;

/// Inverted dropout.
#[derive(Debug, Clone)]
pub struct Dropout {
    rate: f64,
}

impl Dropout {
    /// Drops each element with probability `rate`, in `[0, 1)`.
    pub fn new(rate: f64) -> Self {
        Self { rate }
    }
}

impl LayerSpec for Dropout {
    fn kind(&self) -> &'static str {
        "dropout"
    }

    fn class_name(&self) -> &'static str {
        "Dropout"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        if !(0.0..1.0).contains(&self.rate) {
            return Err(crate::Error::invalid(format!(
                "layer `{}`: dropout rate must be in [0, 1), got {}",
                ctx.path(),
                self.rate
            )));
        }
        let layer = DropoutLayer {
            // Inside `.inference_mode()` (Keras's `training=False`), the identity.
            rate: match ctx.in_inference_mode() {
                true => 0.0,
                false => self.rate,
            },
            stream: RandomStream::new(ctx)?,
        };
        Ok(Built::fast(layer, input_shape.to_vec(), Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct DropoutLayer {
    rate: f64,
    stream: RandomStream,
}

impl DropoutLayer {
    /// A fresh mask for `x`: `1 / (1 - rate)` where an element is kept, zero where it is
    /// dropped. It is drawn where the layer's generator lives (the input's device, unless a
    /// strategy keeps the variables elsewhere) and moved to `x`'s device.
    fn mask(&self, x: &Tensor) -> Result<Tensor> {
        let position = self.stream.position();
        let mask = crate::kernels::dropout::draw_mask(
            position.as_tensor(),
            self.stream.seed(),
            self.rate,
            x.dims(),
            x.dtype(),
        )?;
        match mask.device().same_device(x.device()) {
            true => Ok(mask),
            false => Ok(mask.to_device(x.device())?),
        }
    }
}

impl Layer for DropoutLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if !train || self.rate == 0.0 {
            return Ok(x.clone());
        }
        Ok(x.mul(&self.mask(x)?)?)
    }
}

impl FastPath for DropoutLayer {
    fn passes_through(&self) -> bool {
        true
    }

    fn forward_recorded(&self, x: &Tensor, request: RecordRequest) -> Result<Recorded> {
        if request.logits {
            return record_with_candle(self, x, true);
        }
        if self.rate == 0.0 {
            return Ok(identity(x));
        }
        let mask = self.mask(x)?;
        let y = x.mul(&mask)?;
        Ok(Recorded::new(
            y,
            move |dy: Tensor, _: &mut ParamGrads, input_grad: bool| {
                Ok(if input_grad {
                    Some(dy.mul(&mask)?)
                } else {
                    None
                })
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn inside_inference_mode_it_drops_nothing_in_training() -> Result<()> {
        use crate::layers::LayerSpecExt;
        let mut ctx = BuildContext::new(&Device::Cpu, 0);
        let built = Dropout::new(0.5).inference_mode().build(&mut ctx, &[64])?;
        let x = Tensor::ones((4, 64), DType::F32, &Device::Cpu)?;
        let y = built.layer().forward_t(&x, true)?;
        assert_eq!(y.to_vec2::<f32>()?, x.to_vec2::<f32>()?);
        let mut ctx = BuildContext::new(&Device::Cpu, 0);
        let frozen = Dropout::new(0.5).trainable(false).build(&mut ctx, &[64])?;
        let y = frozen.layer().forward_t(&x, true)?;
        assert!(
            y.flatten_all()?.to_vec1::<f32>()?.contains(&0.0),
            "a frozen dropout drops"
        );
        Ok(())
    }

    #[test]
    fn drops_about_rate_and_keeps_expectation() -> Result<()> {
        let mut ctx = BuildContext::new(&Device::Cpu, 3);
        let built = Dropout::new(0.5).build(&mut ctx, &[1000])?;
        let x = Tensor::ones((4, 1000), DType::F32, &Device::Cpu)?;
        let y: Vec<f32> = built.layer.forward_t(&x, true)?.flatten_all()?.to_vec1()?;
        let zeros = y.iter().filter(|v| **v == 0.0).count();
        assert!((1800..2200).contains(&zeros), "{zeros}");
        assert!(y.iter().all(|v| *v == 0.0 || *v == 2.0));
        let z = built.layer.forward_t(&x, false)?;
        assert_eq!(z.sum_all()?.to_scalar::<f32>()?, 4000.0);
        assert!(Dropout::new(1.0).build(&mut ctx, &[3]).is_err());
        Ok(())
    }

    #[test]
    fn the_position_is_a_saved_variable_that_replays_the_masks() -> Result<()> {
        let mut ctx = BuildContext::new(&Device::Cpu, 5);
        let built = Dropout::new(0.3).build(&mut ctx, &[64])?;
        let store = ctx.into_store();
        let param = store
            .get("generator")
            .ok_or_else(|| crate::Error::invalid("no generator variable"))?;
        assert!(param.generator && !param.trainable && !param.statistic);
        assert_eq!(store.count(""), (0, 0), "a generator is not a parameter");
        let x = Tensor::ones((2, 64), DType::F32, &Device::Cpu)?;
        let first = built
            .layer
            .forward_t(&x, true)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let saved = store.weights()?;
        let second = built
            .layer
            .forward_t(&x, true)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert_ne!(first, second, "each call draws a new mask");
        // Back to the saved position: the same mask again.
        store.assign(&saved)?;
        let again = built
            .layer
            .forward_t(&x, true)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert_eq!(again, second);
        Ok(())
    }
}
