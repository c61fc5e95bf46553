//! [`Subset`]: a view of some samples of another dataset, and [`split_tail`], which splits a
//! dataset the way Keras's `validation_split` does.
//!
//! A subset copies nothing: it maps its own indices to the underlying dataset's, either through
//! a contiguous range or through a list. It holds the dataset by value, so it works with a
//! borrow (`Subset<&D>`), a shared pointer (`Subset<Arc<D>>`) or an owned dataset.

use std::ops::Range;

use super::{Dataset, InputSpec, PartMut, Targets};
use crate::{Error, Result};

/// The samples of `dataset` at some indices, seen as a dataset of its own.
///
/// ```
/// use kandle::data::{split_tail, Dataset, InMemoryDataset, Targets};
///
/// let ds = InMemoryDataset::from_vecs(vec![0.0; 10], &[1], vec![0.0; 10], Targets::Classes(1))?;
/// let (train, val) = split_tail(&ds, 0.2)?; // the last 20%, as Keras's validation_split
/// assert_eq!((train.len(), val.len()), (8, 2));
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Subset<D> {
    dataset: D,
    indices: Indices,
    name: String,
}

#[derive(Debug, Clone)]
enum Indices {
    Range(Range<usize>),
    List(Vec<usize>),
}

impl<D: Dataset> Subset<D> {
    /// The samples of `dataset` at `indices`, in that order (an index may repeat).
    /// Errors for an index out of range.
    pub fn new(dataset: D, indices: Vec<usize>) -> Result<Self> {
        let len = dataset.len();
        if let Some((pos, &bad)) = indices.iter().enumerate().find(|(_, &i)| i >= len) {
            return Err(Error::invalid(format!(
                "subset index {bad} (at position {pos}) is out of range for `{}` with {len} \
                 samples",
                dataset.name()
            )));
        }
        let name = format!("{} (subset)", dataset.name());
        Ok(Self {
            dataset,
            indices: Indices::List(indices),
            name,
        })
    }

    /// The samples of `dataset` in `range`. Errors when the range reaches past the end or is
    /// reversed.
    pub fn range(dataset: D, range: Range<usize>) -> Result<Self> {
        let len = dataset.len();
        if range.start > range.end || range.end > len {
            return Err(Error::invalid(format!(
                "subset range {range:?} does not fit `{}` with {len} samples",
                dataset.name()
            )));
        }
        let name = format!("{} [{}..{}]", dataset.name(), range.start, range.end);
        Ok(Self {
            dataset,
            indices: Indices::Range(range),
            name,
        })
    }

    /// Sets the name used in error messages and logs.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The underlying dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// The index in the underlying dataset of this subset's sample `index`, or `None` past the
    /// end.
    pub fn source_index(&self, index: usize) -> Option<usize> {
        match &self.indices {
            Indices::Range(r) => (index < r.len()).then(|| r.start + index),
            Indices::List(list) => list.get(index).copied(),
        }
    }
}

impl<D: Dataset> Dataset for Subset<D> {
    fn len(&self) -> usize {
        match &self.indices {
            Indices::Range(r) => r.len(),
            Indices::List(list) => list.len(),
        }
    }

    fn sample_shape(&self) -> &[usize] {
        self.dataset.sample_shape()
    }

    fn targets(&self) -> Targets {
        self.dataset.targets()
    }

    fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()> {
        let source = self
            .source_index(index)
            .ok_or_else(|| super::out_of_range(&self.name, index, self.len()))?;
        self.dataset.read(source, x, y)
    }

    fn inputs(&self) -> Vec<InputSpec> {
        self.dataset.inputs()
    }

    fn read_inputs(&self, index: usize, inputs: &mut [PartMut<'_>], y: &mut [f32]) -> Result<()> {
        let source = self
            .source_index(index)
            .ok_or_else(|| super::out_of_range(&self.name, index, self.len()))?;
        self.dataset.read_inputs(source, inputs, y)
    }

    fn name(&self) -> &str {
        &self.name
    }
}

/// Splits `dataset` into `(head, tail)`, the tail holding the last `fraction` of the samples,
/// before any shuffling, as Keras's `fit(validation_split=fraction)` does: the head is the first
/// `floor(len * (1 - fraction))` samples. They are named `<name> (train)` and
/// `<name> (validation)`.
///
/// Pass a borrow (`split_tail(&ds, 0.1)`) or an `Arc` to keep the dataset usable.
/// Errors when `fraction` is not strictly between 0 and 1, or when either side would be empty.
pub fn split_tail<D: Dataset + Clone>(dataset: D, fraction: f64) -> Result<(Subset<D>, Subset<D>)> {
    if !(fraction > 0.0 && fraction < 1.0) {
        return Err(Error::invalid(format!(
            "the validation fraction must be strictly between 0 and 1, got {fraction}"
        )));
    }
    let len = dataset.len();
    let split_at = ((len as f64) * (1.0 - fraction)).floor() as usize;
    if split_at == 0 || split_at >= len {
        return Err(Error::invalid(format!(
            "splitting off the last {fraction} of the {len} samples of `{}` leaves {} training \
             and {} validation samples; both sides need at least one",
            dataset.name(),
            split_at.min(len),
            len - split_at.min(len)
        )));
    }
    let name = dataset.name().to_string();
    let head = Subset::range(dataset.clone(), 0..split_at)?.named(format!("{name} (train)"));
    let tail = Subset::range(dataset, split_at..len)?.named(format!("{name} (validation)"));
    Ok((head, tail))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::data::InMemoryDataset;
    use std::sync::Arc;

    fn counting(n: usize) -> InMemoryDataset {
        let x: Vec<f32> = (0..n).map(|v| v as f32).collect();
        InMemoryDataset::from_vecs(x, &[1], vec![0.0; n], Targets::Classes(1))
            .unwrap()
            .named("count")
    }

    fn values(ds: &impl Dataset) -> Vec<f32> {
        (0..ds.len())
            .map(|i| {
                let (mut x, mut y) = ([0f32], [0f32]);
                ds.read(i, &mut x, &mut y).unwrap();
                x[0]
            })
            .collect()
    }

    #[test]
    fn list_and_range_views() {
        let ds = counting(6);
        let sub = Subset::new(&ds, vec![5, 1, 1]).unwrap();
        assert_eq!(values(&sub), vec![5.0, 1.0, 1.0]);
        assert_eq!(sub.targets(), Targets::Classes(1));
        assert_eq!(sub.sample_shape(), &[1]);
        let sub = Subset::range(Arc::new(ds.clone()), 2..4).unwrap();
        assert_eq!(values(&sub), vec![2.0, 3.0]);
        assert_eq!(sub.source_index(1), Some(3));
        assert_eq!(sub.source_index(2), None);
        let (mut x, mut y) = ([0f32], [0f32]);
        assert!(sub.read(2, &mut x, &mut y).is_err());
        assert!(Subset::new(&ds, vec![0, 6]).is_err());
        assert!(Subset::range(&ds, 3..7).is_err());
    }

    #[test]
    fn split_tail_takes_the_last_fraction() {
        let ds = counting(10);
        let (train, val) = split_tail(&ds, 0.25).unwrap();
        // Keras: split_at = floor(10 * 0.75) = 7.
        assert_eq!(values(&train), (0..7).map(|v| v as f32).collect::<Vec<_>>());
        assert_eq!(values(&val), vec![7.0, 8.0, 9.0]);
        assert_eq!(train.name(), "count (train)");
        assert_eq!(val.name(), "count (validation)");
        let dyn_ds: &dyn Dataset = &ds;
        let (train, val) = split_tail(dyn_ds, 0.5).unwrap();
        assert_eq!((train.len(), val.len()), (5, 5));
    }

    #[test]
    fn split_tail_errors() {
        let ds = counting(10);
        for bad in [0.0, 1.0, -0.1, 1.1, f64::NAN, 1e-17, 0.95] {
            let err = split_tail(&ds, bad).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{bad}: {err}");
        }
    }
}
