//! Data: the [`Dataset`] trait, datasets held in memory, the batching loader with a background
//! prefetch thread, the bundled digits dataset, the CIFAR-10 reader, images read from a folder
//! with one subfolder per class ([`ImageFolder`]), and the CIFAR-10
//! tutorial's pipeline: mean-image subtraction ([`MeanImage`]), one-hot targets and
//! augmentation ([`RandomShiftFlip`], applied by the loader). Sample and class weights are
//! checked and applied in one private module, `weighting`.
//!
//! A dataset hands out samples by index into caller-provided buffers, so batches are assembled
//! without a per-sample allocation. Images are `f32` in `(channels, height, width)` order.
//! Targets are either class indices (for the sparse losses) or dense values such as one-hot
//! rows (for the categorical losses and regression).

use std::sync::Arc;

use crate::{Error, Result};

mod augment;
pub mod cifar10;
pub mod digits;
#[cfg(feature = "download")]
mod download;
pub mod image_folder;
mod in_memory;
mod loader;
mod mean_image;
mod subset;
pub(crate) mod weighting;

pub use augment::{Augment, RandomShiftFlip};
pub use cifar10::{Cifar10, Cifar10Dataset};
pub use image_folder::{
    ColorMode, ImageFolder, ImageFolderBuilder, Interpolation, SplitSubset, DEFAULT_IMAGE_SIZE,
    DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, MAX_UNNAMED_CLASSES,
};
pub use in_memory::InMemoryDataset;
pub use loader::{shard_range, Batches, EpochIter, Loader, LoaderOptions};
pub use mean_image::{MeanImage, MeanSubtracted};
pub use subset::{split_tail, Subset};

/// What a dataset's targets are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Targets {
    /// One class index per sample, in `0..num_classes`. Batched as a `u32` tensor `(batch,)`.
    Classes(usize),
    /// A dense `f32` value of this shape per sample (a one-hot row is `[num_classes]`).
    /// Batched as `(batch, shape...)`.
    Values(Vec<usize>),
    /// One target per output of a model with several outputs, in the outputs' order, each
    /// [`Classes`](Targets::Classes) or [`Values`](Targets::Values); a sample's buffer holds
    /// them one after the other. Batched as one `f32` tensor `(batch, width)`, class indices
    /// as their values.
    Parts(Vec<Targets>),
}

impl Targets {
    /// Floats per sample in the target buffer (1 for a class index).
    pub fn width(&self) -> usize {
        match self {
            Targets::Classes(_) => 1,
            Targets::Values(shape) => shape.iter().product(),
            Targets::Parts(parts) => parts.iter().map(Targets::width).sum(),
        }
    }

    /// Checks the class indices in a sample's target buffer `row` (which has
    /// [`Self::width`] values): each must be an integer in `0..num_classes`. Returns the first
    /// bad value and its class count.
    pub(crate) fn bad_label(&self, row: &[f32]) -> Option<(f32, usize)> {
        let is_class = |v: f32, k: usize| v >= 0.0 && v < k as f32 && v.fract() == 0.0;
        match self {
            Targets::Classes(k) => row.first().filter(|&&v| !is_class(v, *k)).map(|&v| (v, *k)),
            Targets::Values(_) => None,
            Targets::Parts(parts) => {
                let mut offset = 0;
                for part in parts {
                    let width = part.width();
                    if let Some(bad) = part.bad_label(&row[offset..offset + width]) {
                        return Some(bad);
                    }
                    offset += width;
                }
                None
            }
        }
    }
}

/// Samples addressed by index.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape of one input sample, e.g. `[3, 32, 32]`.
    fn sample_shape(&self) -> &[usize];

    /// What the targets are.
    fn targets(&self) -> Targets;

    /// Writes sample `index` into `x` (`sample_shape` elements) and its target into `y`
    /// (`targets().width()` elements; a class index is written as its `f32` value).
    fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()>;

    /// A name for error messages, e.g. `digits (train)`.
    fn name(&self) -> &str {
        "dataset"
    }
}

/// The error for reading sample `index` of `name`, which has `len` samples.
pub(crate) fn out_of_range(name: &str, index: usize, len: usize) -> Error {
    Error::invalid(format!(
        "sample {index} is out of range for `{name}` with {len} samples"
    ))
}

/// Checks the buffers handed to [`Dataset::read`] of `name`: `sample_len` floats for the input
/// and `width` for the target.
pub(crate) fn check_buffers(
    name: &str,
    x: &[f32],
    y: &[f32],
    sample_len: usize,
    width: usize,
) -> Result<()> {
    if x.len() != sample_len || y.len() != width {
        return Err(Error::invalid(format!(
            "reading `{name}` needs buffers of {sample_len} and {width} floats, got {} and {}",
            x.len(),
            y.len()
        )));
    }
    Ok(())
}

/// Writes class `label` into a checked target buffer: its index, or a one-hot row.
pub(crate) fn write_class(y: &mut [f32], label: usize, one_hot: bool) {
    if one_hot {
        y.fill(0.0);
        y[label] = 1.0;
    } else {
        y[0] = label as f32;
    }
}

/// Forwards every method, `len` and `is_empty` included, to the pointee.
macro_rules! forward_dataset {
    ($($ty:ty),*) => {$(
        impl<D: Dataset + ?Sized> Dataset for $ty {
            fn len(&self) -> usize {
                (**self).len()
            }
            fn is_empty(&self) -> bool {
                (**self).is_empty()
            }
            fn sample_shape(&self) -> &[usize] {
                (**self).sample_shape()
            }
            fn targets(&self) -> Targets {
                (**self).targets()
            }
            fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()> {
                (**self).read(index, x, y)
            }
            fn name(&self) -> &str {
                (**self).name()
            }
        }
    )*};
}

forward_dataset!(&D, Box<D>, Arc<D>);

impl std::fmt::Debug for dyn Dataset + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dataset")
            .field("name", &self.name())
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

/// One batch, assembled on the CPU.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Inputs, `(batch, sample_shape...)`, `f32`.
    pub x: candle_core::Tensor,
    /// Targets: `u32` `(batch,)` for class indices, `f32` `(batch, shape...)` for values.
    pub y: candle_core::Tensor,
    /// Each sample's weight in the loss, `f32` `(batch,)` (sample weights times class weights),
    /// or `None` when every sample weighs 1.
    pub weights: Option<candle_core::Tensor>,
}

impl Batch {
    /// A batch of unweighted samples.
    pub fn new(x: candle_core::Tensor, y: candle_core::Tensor) -> Self {
        Self {
            x,
            y,
            weights: None,
        }
    }

    /// The batch with each sample's loss weighted by `weights` (`(batch,)`).
    pub fn with_weights(mut self, weights: candle_core::Tensor) -> Self {
        self.weights = Some(weights);
        self
    }

    /// Number of samples in the batch.
    pub fn len(&self) -> usize {
        self.x.dims().first().copied().unwrap_or(0)
    }

    /// Whether the batch holds no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples `start..start + len`.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        Ok(Self {
            x: self.x.narrow(0, start, len)?,
            y: self.y.narrow(0, start, len)?,
            weights: match &self.weights {
                Some(w) => Some(w.narrow(0, start, len)?),
                None => None,
            },
        })
    }

    /// Inputs, targets and weights moved to `device`.
    pub fn to_device(
        &self,
        device: &candle_core::Device,
    ) -> Result<(
        candle_core::Tensor,
        candle_core::Tensor,
        Option<candle_core::Tensor>,
    )> {
        let weights = match &self.weights {
            Some(w) => Some(w.to_device(device)?),
            None => None,
        };
        Ok((
            self.x.to_device(device)?,
            self.y.to_device(device)?,
            weights,
        ))
    }
}
