//! `Dropout`: in training, zeroes each element with probability `rate` and scales the rest by
//! `1 / (1 - rate)`; in inference, the identity.
//!
//! Mask `k` of a layer comes from a generator seeded with the layer's seed (drawn at build
//! time from the model's seed) and `k`, the layer's position, which lives in a variable saved
//! with the weights ([`BuildContext::generator_position`]): a seeded run is repeatable on any
//! device, and a run resumed from a backup draws the masks an uninterrupted one would.

use candle_core::{Device, Tensor, Var};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{identity, BuildContext, Built, FastPath, Layer, LayerSpec, ParamGrads, Recorded};
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
        let seed = ctx.rng().random();
        let layer = DropoutLayer {
            rate: self.rate,
            seed,
            position: ctx.generator_position("generator")?,
        };
        Ok(Built::fast(layer, input_shape.to_vec(), Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(self.clone())
    }
}

struct DropoutLayer {
    rate: f64,
    seed: u64,
    /// How many masks the layer has drawn, as `[count / 2^24, count % 2^24]` (exact in `f32`).
    position: Var,
}

/// `2^24`: below it every integer is exact in `f32`.
const F32_EXACT: u64 = 1 << 24;

/// SplitMix64's finaliser: nearby inputs give unrelated seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl DropoutLayer {
    /// A fresh mask for `x`: `1 / (1 - rate)` where an element is kept, zero where it is
    /// dropped.
    fn mask(&self, x: &Tensor) -> Result<Tensor> {
        let keep = 1.0 - self.rate;
        let scale = (1.0 / keep) as f32;
        let position = self.next_position()?;
        let mut rng = StdRng::seed_from_u64(mix(self.seed ^ mix(position)));
        let mask: Vec<f32> = (0..x.elem_count())
            .map(|_| {
                if rng.random::<f64>() < keep {
                    scale
                } else {
                    0.0
                }
            })
            .collect();
        Ok(Tensor::from_vec(mask, x.dims(), &Device::Cpu)?
            .to_dtype(x.dtype())?
            .to_device(x.device())?)
    }
}

impl DropoutLayer {
    /// The position of this mask in the layer's sequence; moves the layer to the next one.
    fn next_position(&self) -> Result<u64> {
        let parts = self.position.as_tensor().to_vec1::<f32>()?;
        let (high, low) = match parts.as_slice() {
            [high, low] => (*high as u64, *low as u64),
            _ => (0, 0),
        };
        let position = high * F32_EXACT + low;
        let next = position + 1;
        let next = [(next / F32_EXACT) as f32, (next % F32_EXACT) as f32];
        self.position
            .set(&Tensor::new(&next, self.position.device())?)?;
        Ok(position)
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

    fn forward_recorded(&self, x: &Tensor) -> Result<Recorded> {
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
    use candle_core::DType;

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
