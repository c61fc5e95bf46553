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
//! rows (for the categorical losses and regression), or one of those per output.
//!
//! A sample may have several inputs ([`InputSpec`], one per model input, each with its own
//! shape and dtype), and a [`Batch`] carries one tensor per input and one per output's
//! targets: nothing is packed into one tensor, so each part is checked against the model
//! input it feeds, by name and shape.

use std::sync::Arc;

use crate::{Error, Result};

mod augment;
mod batch;
pub mod cifar10;
pub mod digits;
#[cfg(feature = "download")]
mod download;
pub mod image_folder;
mod in_memory;
mod loader;
mod mean_image;
mod parts;
mod subset;
pub(crate) mod weighting;

pub use augment::{Augment, RandomShiftFlip};
pub use batch::Batch;
pub use cifar10::{Cifar10, Cifar10Dataset};
pub use image_folder::{
    ColorMode, ImageFolder, ImageFolderBuilder, Interpolation, SplitSubset, DEFAULT_IMAGE_SIZE,
    DEFAULT_MAX_PIXELS, IMAGE_EXTENSIONS, MAX_UNNAMED_CLASSES,
};
pub use in_memory::InMemoryDataset;
pub use loader::{shard_range, Batches, EpochIter, Loader, LoaderOptions};
pub use mean_image::{MeanImage, MeanSubtracted};
pub(crate) use parts::PartBuffer;
pub use parts::{InputSpec, PartMut};
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

impl Targets {
    /// The targets of the samples at `indices` of `name`, read into `y` (`width()` values
    /// each), as one tensor per output: class indices checked and as `u32` `(m,)`, values as
    /// `f32` `(m, shape...)`. A label outside its classes is an error naming the sample.
    pub(crate) fn batch_tensors(
        &self,
        y: Vec<f32>,
        indices: &[usize],
        name: &str,
    ) -> Result<Vec<candle_core::Tensor>> {
        let width = self.width();
        for (row, &index) in y.chunks_exact(width.max(1)).zip(indices) {
            if let Some((value, k)) = self.bad_label(row) {
                return Err(Error::Data {
                    path: name.into(),
                    reason: format!(
                        "sample {index} has target {value}, which is not a class index in 0..{k}"
                    ),
                });
            }
        }
        let m = indices.len();
        let parts = match self {
            Targets::Parts(parts) => parts.as_slice(),
            single => std::slice::from_ref(single),
        };
        let mut offset = 0;
        let mut tensors = Vec::with_capacity(parts.len());
        for part in parts {
            let part_width = part.width();
            let values: Vec<f32> = match parts.len() {
                1 => y.clone(),
                _ => y
                    .chunks_exact(width)
                    .flat_map(|row| row[offset..offset + part_width].iter().copied())
                    .collect(),
            };
            offset += part_width;
            let cpu = &candle_core::Device::Cpu;
            tensors.push(match part {
                Targets::Classes(_) => candle_core::Tensor::from_vec(
                    values.into_iter().map(|v| v as u32).collect::<Vec<u32>>(),
                    m,
                    cpu,
                )?,
                Targets::Values(shape) => {
                    let mut dims = Vec::with_capacity(shape.len() + 1);
                    dims.push(m);
                    dims.extend_from_slice(shape);
                    candle_core::Tensor::from_vec(values, dims, cpu)?
                }
                Targets::Parts(_) => {
                    return Err(Error::invalid(format!(
                        "`{name}`: a target part cannot have parts of its own"
                    )))
                }
            });
        }
        Ok(tensors)
    }

    /// Number of outputs the targets are for.
    pub fn outputs(&self) -> usize {
        match self {
            Targets::Parts(parts) => parts.len(),
            _ => 1,
        }
    }

    /// The targets of output `i`.
    pub fn part(&self, i: usize) -> Option<&Targets> {
        match self {
            Targets::Parts(parts) => parts.get(i),
            single => (i == 0).then_some(single),
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
    ///
    /// A dataset of several inputs, or of an input that is not `f32`, is read through
    /// [`Self::read_inputs`] instead, and may answer this with an error.
    fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()>;

    /// The inputs of a sample, one per model input: by default one unnamed `f32` input of
    /// [`Self::sample_shape`]. A dataset of several inputs (or of integer ids, or of
    /// half-precision images) lists each, with its name where it feeds a model input by name.
    fn inputs(&self) -> Vec<InputSpec> {
        vec![InputSpec::new(self.sample_shape())]
    }

    /// Writes sample `index`'s inputs into `inputs` (one slice per [`Self::inputs`] entry, of
    /// its dtype and sample length) and its target into `y`. The default reads the one `f32`
    /// input through [`Self::read`].
    fn read_inputs(&self, index: usize, inputs: &mut [PartMut<'_>], y: &mut [f32]) -> Result<()> {
        match inputs {
            [x] => {
                let name = self.name().to_string();
                self.read(index, x.as_f32(&format!("the input of `{name}`"))?, y)
            }
            _ => Err(Error::invalid(format!(
                "`{}` has one input but was asked for {}",
                self.name(),
                inputs.len()
            ))),
        }
    }

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

/// The inputs `specs` for an error message: `` `image` (batch, 1, 8, 8) f32, (batch, 3) u32 ``.
pub(crate) fn list_inputs(specs: &[InputSpec]) -> String {
    let each: Vec<String> = specs.iter().map(InputSpec::to_string).collect();
    each.join(", ")
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
            fn inputs(&self) -> Vec<InputSpec> {
                (**self).inputs()
            }
            fn read_inputs(
                &self,
                index: usize,
                inputs: &mut [PartMut<'_>],
                y: &mut [f32],
            ) -> Result<()> {
                (**self).read_inputs(index, inputs, y)
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
