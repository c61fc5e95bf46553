//! `RandomCrop`: in training, a window of the given size at a random place in each image; in
//! inference, the centred window, as Keras's `RandomCrop`.

use candle_core::Tensor;
use rand::Rng;

use super::image_shape;
use crate::layers::random_stream::RandomStream;
use crate::layers::{BuildContext, Built, FastPath, Layer, LayerSpec};
use crate::Result;

/// Crops images to `height` x `width`: at random in training, centred in inference.
///
/// ```
/// use kandle::layers::{RandomCrop, Sequential};
///
/// let summary = Sequential::new().add(RandomCrop::new(24, 24)).summary(&[3, 32, 32])?;
/// assert_eq!(summary.rows[0].output_shape, [3, 24, 24]);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RandomCrop {
    height: usize,
    width: usize,
}

impl RandomCrop {
    /// Windows of `height` x `width`.
    pub fn new(height: usize, width: usize) -> Self {
        Self { height, width }
    }
}

impl LayerSpec for RandomCrop {
    fn kind(&self) -> &'static str {
        "random_crop"
    }

    fn class_name(&self) -> &'static str {
        "RandomCrop"
    }

    fn build(&self, ctx: &mut BuildContext, input_shape: &[usize]) -> Result<Built> {
        let (c, h, w) = image_shape(ctx, input_shape)?;
        let fits = (1..=h).contains(&self.height) && (1..=w).contains(&self.width);
        if !fits {
            return Err(crate::Error::Shape {
                layer: ctx.path(),
                expected: format!(
                    "images of at least {}x{} (the crop)",
                    self.height, self.width
                ),
                got: crate::error::shape_with_batch(input_shape),
            });
        }
        let layer = RandomCropLayer {
            crop: (self.height, self.width),
            spare: (h - self.height, w - self.width),
            stream: RandomStream::new(ctx)?,
        };
        Ok(Built::fast(
            layer,
            vec![c, self.height, self.width],
            Vec::new(),
        ))
    }

    fn clone_spec(&self) -> Box<dyn LayerSpec> {
        Box::new(*self)
    }
}

struct RandomCropLayer {
    crop: (usize, usize),
    /// The rows and columns the window leaves out.
    spare: (usize, usize),
    stream: RandomStream,
}

impl RandomCropLayer {
    fn window(&self, x: &Tensor, top: usize, left: usize) -> Result<Tensor> {
        Ok(x.narrow(2, top, self.crop.0)?
            .narrow(3, left, self.crop.1)?)
    }
}

impl Layer for RandomCropLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let (rows, cols) = self.spare;
        if !train {
            return self.window(x, rows / 2, cols / 2);
        }
        let mut rng = self.stream.next()?;
        let crops = (0..x.dim(0)?)
            .map(|i| {
                let (top, left) = (rng.random_range(0..=rows), rng.random_range(0..=cols));
                self.window(&x.narrow(0, i, 1)?, top, left)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&crops, 0)?)
    }
}

impl FastPath for RandomCropLayer {}
