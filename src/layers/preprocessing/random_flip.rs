//! `RandomFlip`: in training, each image flipped left-right and/or upside down with probability
//! one half, as Keras's `RandomFlip("horizontal" | "vertical" | "horizontal_and_vertical")`; in
//! inference, the identity.

use candle_core::{Device, Tensor};
use rand::Rng;

use super::image_shape;
use crate::layers::random_stream::RandomStream;
use crate::layers::{BuildContext, Built, FastPath, Layer, LayerSpec};
use crate::Result;

/// Flips images at random in training.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kandle::layers::{BuildContext, LayerSpec, RandomFlip};
///
/// let built = RandomFlip::horizontal().build(&mut BuildContext::new(&Device::Cpu, 0), &[1, 1, 3])?;
/// let x = Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?.reshape((1, 1, 1, 3))?;
/// let y = built.layer().forward_t(&x, true)?.flatten_all()?.to_vec1::<f32>()?;
/// assert!(y == [1., 2., 3.] || y == [3., 2., 1.]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RandomFlip {
    horizontal: bool,
    vertical: bool,
}

impl RandomFlip {
    /// Left-right flips.
    pub fn horizontal() -> Self {
        Self {
            horizontal: true,
            vertical: false,
        }
    }

    /// Upside-down flips.
    pub fn vertical() -> Self {
        Self {
            horizontal: false,
            vertical: true,
        }
    }

    /// Both, each drawn on its own.
    pub fn horizontal_and_vertical() -> Self {
        Self {
            horizontal: true,
            vertical: true,
        }
    }
}

impl LayerSpec for RandomFlip {
    fn kind(&self) -> &'static str {
        "random_flip"
    }

    fn class_name(&self) -> &'static str {
        "RandomFlip"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let (_, h, w) = image_shape(ctx, input_shape)?;
        let layer = RandomFlipLayer {
            axes: [(self.vertical, 2, h), (self.horizontal, 3, w)],
            stream: RandomStream::new(ctx)?,
        };
        Ok(Built::fast(layer, input_shape.to_vec(), Vec::new()))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

struct RandomFlipLayer {
    /// For rows, then columns: whether they flip, the axis, its length.
    axes: [(bool, usize, usize); 2],
    stream: RandomStream,
}

impl Layer for RandomFlipLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if !train {
            return Ok(x.clone());
        }
        let batch = x.dim(0)?;
        let mut rng = self.stream.next()?;
        let mut y = x.clone();
        for &(flips, axis, len) in &self.axes {
            if !flips {
                continue;
            }
            let chosen: Vec<f32> = (0..batch)
                .map(|_| if rng.random::<bool>() { 1.0 } else { 0.0 })
                .collect();
            let reversed: Vec<u32> = (0..len as u32).rev().collect();
            let reversed = Tensor::new(reversed, x.device())?;
            let flipped = y.index_select(&reversed, axis)?;
            let chosen = Tensor::from_vec(chosen, (batch, 1, 1, 1), &Device::Cpu)?
                .to_dtype(x.dtype())?
                .to_device(x.device())?;
            let kept = chosen.affine(-1.0, 1.0)?;
            y = (flipped.broadcast_mul(&chosen)? + y.broadcast_mul(&kept)?)?;
        }
        Ok(y)
    }
}

impl FastPath for RandomFlipLayer {}
