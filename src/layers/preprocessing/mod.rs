//! Preprocessing layers, as Keras's: fixed maps of the input ([`Rescaling`], [`Normalization`])
//! and random augmentations that run in training only ([`RandomFlip`], [`RandomCrop`],
//! [`RandomResizedCrop`], [`RandomRotation`], [`RandomZoom`]), each drawing from its layer's seeded, resumable random
//! stream, one draw per sample. Images are `(channels, height, width)`.
//!
//! ```
//! use kandle::layers::{Normalization, RandomFlip, RandomRotation, Rescaling, Sequential};
//!
//! // Images of 0..255 to ImageNet's normalisation, flipped and turned a little in training.
//! let preprocess = Sequential::new()
//!     .add(Rescaling::new(1.0 / 255.0, 0.0))
//!     .add(Normalization::imagenet())
//!     .add(RandomFlip::horizontal())
//!     .add(RandomRotation::new(0.05));
//! let summary = preprocess.summary(&[3, 32, 32])?;
//! assert_eq!(summary.total(), 0);
//! # Ok::<(), kandle::Error>(())
//! ```

mod normalization;
mod random_affine;
mod random_crop;
mod random_flip;
mod random_resized_crop;
mod rescaling;
#[cfg(test)]
mod tests;

pub use normalization::Normalization;
pub use random_affine::{FillMode, RandomRotation, RandomZoom};
pub use random_crop::RandomCrop;
pub use random_flip::RandomFlip;
pub use random_resized_crop::RandomResizedCrop;
pub use rescaling::Rescaling;

use super::{shape_error, BuildContext};
use crate::Result;

/// The `(channels, height, width)` of an image input, or the error naming the layer.
fn image_shape(ctx: &BuildContext, input_shape: &[usize]) -> Result<(usize, usize, usize)> {
    match *input_shape {
        [c, h, w] if c > 0 && h > 0 && w > 0 => Ok((c, h, w)),
        _ => Err(shape_error(
            ctx,
            "(batch, channels, height, width)",
            input_shape,
        )),
    }
}
