//! Per-pixel mean-image subtraction, as in the CIFAR-10 tutorial (`mean = np.mean(trainX,
//! axis=0); trainX -= mean; testX -= mean`): [`MeanImage`] is the average of every input of a
//! dataset, value by value, and [`MeanSubtracted`] is a dataset whose inputs have it subtracted.
//!
//! Compute the mean on the training set only and subtract that same mean from the training and
//! the test sets. The wrapper subtracts while reading, so nothing is copied and the underlying
//! dataset may keep compact storage (CIFAR-10 keeps bytes).
//!
//! ```
//! use kandle::data::{Dataset, InMemoryDataset, MeanImage, Targets};
//!
//! let train = InMemoryDataset::from_vecs(vec![1.0, 4.0, 3.0, 8.0], &[2], vec![0.0, 1.0], Targets::Classes(2))?;
//! let test = InMemoryDataset::from_vecs(vec![2.0, 6.0], &[2], vec![1.0], Targets::Classes(2))?;
//! let mean = MeanImage::compute(&train)?;
//! assert_eq!(mean.values(), &[2.0, 6.0]);
//! let test = mean.subtract_from(test)?;
//! let (mut x, mut y) = ([0.0; 2], [0.0; 1]);
//! test.read(0, &mut x, &mut y)?;
//! assert_eq!(x, [0.0, 0.0]);
//! # Ok::<(), kandle::Error>(())
//! ```

use std::sync::Arc;

use rayon::prelude::*;

use super::{Dataset, Targets};
use crate::{Error, Result};

/// Samples per partial sum when computing a mean: the partial sums are added in a fixed order,
/// so the mean does not depend on the number of threads.
const CHUNK: usize = 512;

/// The average input of a dataset, value by value: one image of the sample shape.
///
/// Cloning it is cheap (the values are shared).
#[derive(Debug, Clone, PartialEq)]
pub struct MeanImage {
    shape: Vec<usize>,
    values: Arc<[f32]>,
}

impl MeanImage {
    /// The mean of every input of `dataset`, accumulated in `f64` on all cores, in an order
    /// that does not depend on the threads.
    ///
    /// Errors for an empty dataset ([`Error::EmptyDataset`]) or one whose `read` fails.
    pub fn compute(dataset: &dyn Dataset) -> Result<Self> {
        let n = dataset.len();
        if n == 0 {
            return Err(Error::EmptyDataset(dataset.name().to_string()));
        }
        let shape = dataset.sample_shape().to_vec();
        let len: usize = shape.iter().product();
        let width = dataset.targets().width();
        let chunks: Vec<std::ops::Range<usize>> = (0..n.div_ceil(CHUNK))
            .map(|c| c * CHUNK..((c + 1) * CHUNK).min(n))
            .collect();
        let partials: Vec<Vec<f64>> = chunks
            .into_par_iter()
            .map(|range| -> Result<Vec<f64>> {
                let mut sum = vec![0f64; len];
                let (mut x, mut y) = (vec![0f32; len], vec![0f32; width]);
                for i in range {
                    dataset.read(i, &mut x, &mut y)?;
                    for (s, &v) in sum.iter_mut().zip(&x) {
                        *s += f64::from(v);
                    }
                }
                Ok(sum)
            })
            .collect::<Result<_>>()?;
        let mut total = vec![0f64; len];
        for partial in &partials {
            for (t, p) in total.iter_mut().zip(partial) {
                *t += p;
            }
        }
        let values: Vec<f32> = total.iter().map(|&s| (s / n as f64) as f32).collect();
        Self::from_vec(values, &shape)
    }

    /// A mean image with the given values, e.g. one saved from an earlier run. Errors when
    /// `values` does not hold `shape.iter().product()` values or one of them is not finite.
    pub fn from_vec(values: Vec<f32>, shape: &[usize]) -> Result<Self> {
        let len: usize = shape.iter().product();
        if values.len() != len || len == 0 {
            return Err(Error::invalid(format!(
                "a mean image of shape {shape:?} needs {len} values (at least one), got {}",
                values.len()
            )));
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(format!(
                "mean image value {i} is {}, not a finite number",
                values[i]
            )));
        }
        Ok(Self {
            shape: shape.to_vec(),
            values: values.into(),
        })
    }

    /// The sample shape, e.g. `[3, 32, 32]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The mean values, in the sample's row-major order.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// `dataset` with this mean subtracted from every input; see [`MeanSubtracted::new`].
    pub fn subtract_from<D: Dataset>(&self, dataset: D) -> Result<MeanSubtracted<D>> {
        MeanSubtracted::new(dataset, self.clone())
    }
}

/// A dataset whose inputs have a [`MeanImage`] subtracted, value by value. Targets, length and
/// name are the underlying dataset's.
///
/// It holds the dataset by value, so it wraps a borrow (`MeanSubtracted<&D>`), a shared pointer
/// or an owned dataset.
#[derive(Debug, Clone)]
pub struct MeanSubtracted<D> {
    dataset: D,
    mean: MeanImage,
}

impl<D: Dataset> MeanSubtracted<D> {
    /// Wraps `dataset`. Errors when the mean's shape differs from the dataset's sample shape,
    /// or when the dataset's samples are not one `f32` image.
    pub fn new(dataset: D, mean: MeanImage) -> Result<Self> {
        let inputs = dataset.inputs();
        if !matches!(&inputs[..], [one] if one.dtype == candle_core::DType::F32) {
            return Err(Error::invalid(format!(
                "a mean image is subtracted from one f32 input, but `{}` has inputs {}",
                dataset.name(),
                super::list_inputs(&inputs)
            )));
        }
        if dataset.sample_shape() != mean.shape() {
            return Err(Error::invalid(format!(
                "the mean image has shape {:?} but `{}` has samples of shape {:?}",
                mean.shape(),
                dataset.name(),
                dataset.sample_shape()
            )));
        }
        Ok(Self { dataset, mean })
    }

    /// The mean being subtracted.
    pub fn mean(&self) -> &MeanImage {
        &self.mean
    }

    /// The underlying dataset.
    pub fn inner(&self) -> &D {
        &self.dataset
    }

    /// Gives back the underlying dataset.
    pub fn into_inner(self) -> D {
        self.dataset
    }
}

impl<D: Dataset> Dataset for MeanSubtracted<D> {
    fn len(&self) -> usize {
        self.dataset.len()
    }

    fn is_empty(&self) -> bool {
        self.dataset.is_empty()
    }

    fn sample_shape(&self) -> &[usize] {
        self.dataset.sample_shape()
    }

    fn targets(&self) -> Targets {
        self.dataset.targets()
    }

    fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()> {
        self.dataset.read(index, x, y)?;
        for (v, m) in x.iter_mut().zip(self.mean.values.iter()) {
            *v -= m;
        }
        Ok(())
    }

    fn name(&self) -> &str {
        self.dataset.name()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::data::InMemoryDataset;

    fn dataset(n: usize) -> InMemoryDataset {
        let x: Vec<f32> = (0..n * 6).map(|v| ((v * 7) % 11) as f32 * 0.5).collect();
        let y: Vec<f32> = (0..n).map(|i| (i % 2) as f32).collect();
        InMemoryDataset::from_vecs(x, &[1, 2, 3], y, Targets::Classes(2)).unwrap()
    }

    #[test]
    fn mean_matches_a_plain_loop_over_several_chunks() {
        let ds = dataset(CHUNK * 2 + 37);
        let mean = MeanImage::compute(&ds).unwrap();
        assert_eq!(mean.shape(), &[1, 2, 3]);
        let n = ds.len();
        for j in 0..6 {
            let expected: f64 = (0..n)
                .map(|i| f64::from(ds.input_values()[i * 6 + j]))
                .sum::<f64>()
                / n as f64;
            assert!((f64::from(mean.values()[j]) - expected).abs() < 1e-5);
        }
    }

    #[test]
    fn subtracted_inputs_have_zero_mean_and_keep_targets() {
        let ds = dataset(100);
        let mean = MeanImage::compute(&ds).unwrap();
        let centred = mean.subtract_from(&ds).unwrap();
        assert_eq!(centred.len(), 100);
        assert_eq!(centred.targets(), Targets::Classes(2));
        let again = MeanImage::compute(&centred).unwrap();
        assert!(again.values().iter().all(|v| v.abs() < 1e-5), "{again:?}");
        let (mut x, mut y) = (vec![0f32; 6], vec![0f32; 1]);
        centred.read(3, &mut x, &mut y).unwrap();
        assert_eq!(y, vec![1.0]);
        for (j, &v) in x.iter().enumerate() {
            assert_eq!(v, ds.input_values()[18 + j] - mean.values()[j]);
        }
    }

    #[test]
    fn shape_and_value_errors() {
        let ds = dataset(4);
        let wrong = MeanImage::from_vec(vec![0.0; 6], &[6]).unwrap();
        let err = MeanSubtracted::new(&ds, wrong).unwrap_err().to_string();
        assert!(err.contains("[6]") && err.contains("[1, 2, 3]"), "{err}");
        assert!(MeanImage::from_vec(vec![0.0; 5], &[6]).is_err());
        assert!(MeanImage::from_vec(vec![f32::NAN; 1], &[1]).is_err());
        let empty = InMemoryDataset::from_vecs(vec![], &[2], vec![], Targets::Classes(1)).unwrap();
        assert!(matches!(
            MeanImage::compute(&empty),
            Err(Error::EmptyDataset(_))
        ));
    }
}
