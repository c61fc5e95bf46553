//! [`InMemoryDataset`]: samples held in one contiguous buffer per input (each in its dtype)
//! and targets in one contiguous `f32` buffer.
//!
//! It is what the bundled loaders (digits, CIFAR-10) return, and what a user builds from a pair
//! of tensors, or from one tensor per input and per output (by name or in the model's order). Reading a sample is one slice copy, so the loader's batch assembly is bound by
//! memory bandwidth. Every constructor validates its input and returns an error that names the
//! counts, labels or shapes that do not fit; none of them panics.

use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::{Batch, Dataset, InputSpec, PartBuffer, PartMut, Targets};
use crate::{Error, Result};

/// A dataset held in memory: each input in a contiguous buffer of its dtype, the targets in a
/// contiguous `f32` buffer.
///
/// Sample `i` of an input is `x[i * sample_len..(i + 1) * sample_len]`, where `sample_len` is
/// the product of its shape; its target is `targets().width()` floats at the same position of
/// the target buffer (a class index is stored as its `f32` value).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kandle::data::{Dataset, InMemoryDataset, Targets};
///
/// let x = Tensor::zeros((4, 2), candle_core::DType::F32, &Device::Cpu)?;
/// let y = Tensor::new(&[0u32, 1, 2, 1], &Device::Cpu)?;
/// let ds = InMemoryDataset::new(x, y)?.named("toy");
/// assert_eq!(ds.len(), 4);
/// assert_eq!(ds.targets(), Targets::Classes(3));
/// let ds = ds.one_hot()?;
/// assert_eq!(ds.targets(), Targets::Values(vec![3]));
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct InMemoryDataset {
    name: String,
    len: usize,
    /// One entry per input; the first one's shape is [`Dataset::sample_shape`].
    inputs: Vec<InputSpec>,
    /// One buffer per input, in its dtype.
    x: Vec<PartBuffer>,
    targets: Targets,
    y: Vec<f32>,
}

impl InMemoryDataset {
    /// Builds a dataset from an input tensor `(n, ...)` and a target tensor, on any device (they
    /// are copied to the CPU).
    ///
    /// - `x` may have any dtype; it is converted to `f32`. Its first dimension is the sample
    ///   count and the rest is the sample shape.
    /// - An integer `y` (`u8`, `u32`, `i64`, ...) of shape `(n,)` or `(n, 1)` holds class
    ///   indices; the number of classes is the largest label plus one, unless set with
    ///   [`with_num_classes`](Self::with_num_classes).
    /// - A float `y` of shape `(n, ...)` holds dense values, e.g. one-hot rows `(n, k)`.
    ///
    /// Errors when `x` is a scalar, when the sample counts of `x` and `y` differ, when a label
    /// is negative, or when `x` has a zero-sized sample.
    pub fn new(x: Tensor, y: Tensor) -> Result<Self> {
        let (n, sample_shape) = match x.dims().split_first() {
            Some((&n, rest)) => (n, rest.to_vec()),
            None => {
                return Err(Error::invalid(
                    "x must have a sample dimension, shape (n, ...), but it is a scalar",
                ))
            }
        };
        let ny = y.dims().first().copied().ok_or_else(|| {
            Error::invalid("y must have a sample dimension, shape (n, ...), but it is a scalar")
        })?;
        if n != ny {
            return Err(Error::invalid(format!(
                "x holds {n} samples but y holds {ny} (x has shape {:?}, y has shape {:?})",
                x.dims(),
                y.dims()
            )));
        }
        let x = x
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let (y, targets) = target_values(&y)?;
        Self::from_vecs(x, &sample_shape, y, targets)
    }

    /// Builds the dataset of a model with several inputs and outputs (a functional model): one
    /// tensor `(n, shape...)` per input, in the model's order, and one target tensor per
    /// output, each as [`InMemoryDataset::new`] takes it (an integer tensor of class indices,
    /// or a float tensor of values). Each input keeps its dtype (`f64` becomes `f32`), so
    /// integer ids and half-precision images travel as they are; the model checks each
    /// against the input it feeds.
    ///
    /// Errors when a part's sample count differs from the first input's.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use kandle::data::{Dataset, InMemoryDataset, Targets};
    ///
    /// let images = Tensor::zeros((4, 1, 2, 2), DType::F32, &Device::Cpu)?;
    /// let ids = Tensor::ones((4, 3), DType::U32, &Device::Cpu)?;
    /// let labels = Tensor::new(&[0u32, 1, 2, 1], &Device::Cpu)?;
    /// let sizes = Tensor::ones((4, 1), DType::F32, &Device::Cpu)?;
    /// let data = InMemoryDataset::from_parts(&[images, ids], &[labels, sizes])?;
    /// assert_eq!(data.sample_shape(), [1, 2, 2]);
    /// assert_eq!(data.inputs()[1].dtype, DType::U32);
    /// assert_eq!(
    ///     data.targets(),
    ///     Targets::Parts(vec![Targets::Classes(3), Targets::Values(vec![1])])
    /// );
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn from_parts(inputs: &[Tensor], targets: &[Tensor]) -> Result<Self> {
        let unnamed: Vec<(Option<&str>, &Tensor)> = inputs.iter().map(|t| (None, t)).collect();
        Self::from_inputs(&unnamed, targets)
    }

    /// [`Self::from_parts`] with each input named after the model input it feeds (Keras's
    /// dict of inputs): the model takes them by name, in any order.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use kandle::data::{Dataset, InMemoryDataset};
    ///
    /// let image = Tensor::zeros((4, 1, 2, 2), DType::F32, &Device::Cpu)?;
    /// let extra = Tensor::ones((4, 3), DType::F32, &Device::Cpu)?;
    /// let labels = Tensor::new(&[0u32, 1, 2, 1], &Device::Cpu)?;
    /// let data = InMemoryDataset::from_named_parts(&[("extra", extra), ("image", image)], &[labels])?;
    /// assert_eq!(data.inputs()[0].name.as_deref(), Some("extra"));
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn from_named_parts(inputs: &[(&str, Tensor)], targets: &[Tensor]) -> Result<Self> {
        let named: Vec<(Option<&str>, &Tensor)> =
            inputs.iter().map(|(name, t)| (Some(*name), t)).collect();
        for (i, (name, _)) in inputs.iter().enumerate() {
            if inputs[..i].iter().any(|(other, _)| other == name) {
                return Err(Error::invalid(format!("input `{name}` is given twice")));
            }
        }
        Self::from_inputs(&named, targets)
    }

    fn from_inputs(inputs: &[(Option<&str>, &Tensor)], targets: &[Tensor]) -> Result<Self> {
        let n = inputs
            .first()
            .and_then(|(_, x)| x.dims().first().copied())
            .ok_or_else(|| {
                Error::invalid("a dataset needs at least one input of shape (n, ...)")
            })?;
        let check_rows = |t: &Tensor, what: String| -> Result<()> {
            match t.dims().first() {
                Some(&m) if m == n => Ok(()),
                _ => Err(Error::invalid(format!(
                    "{what} has shape {:?}, but the first input holds {n} samples",
                    t.dims()
                ))),
            }
        };
        let mut specs = Vec::with_capacity(inputs.len());
        let mut x = Vec::with_capacity(inputs.len());
        for (i, (name, t)) in inputs.iter().enumerate() {
            let what = match name {
                Some(name) => format!("input `{name}`"),
                None => format!("input {}", i + 1),
            };
            check_rows(t, what)?;
            let t = match t.dtype() {
                DType::F64 => t.to_dtype(DType::F32)?,
                _ => (*t).clone(),
            };
            let mut spec = InputSpec::new(&t.dims()[1..]).with_dtype(t.dtype());
            spec.name = name.map(str::to_string);
            if spec.sample_len() == 0 {
                return Err(Error::invalid(format!("input {spec} has no element")));
            }
            x.push(PartBuffer::from_tensor(&t)?);
            specs.push(spec);
        }
        let mut y_parts = Vec::with_capacity(targets.len());
        let mut kinds = Vec::with_capacity(targets.len());
        for (i, y) in targets.iter().enumerate() {
            check_rows(y, format!("target {}", i + 1))?;
            let (values, kind) = target_values(y)?;
            y_parts.push(Tensor::from_vec(values, (n, kind.width()), &Device::Cpu)?);
            kinds.push(kind);
        }
        let targets = match kinds.len() {
            0 => return Err(Error::invalid("a dataset needs at least one target")),
            1 => kinds.remove(0),
            _ => Targets::Parts(kinds),
        };
        let y = Tensor::cat(&y_parts, 1)?.flatten_all()?.to_vec1::<f32>()?;
        check_targets(&y, &targets)?;
        Ok(Self {
            name: "in-memory dataset".to_string(),
            len: n,
            inputs: specs,
            x,
            targets,
            y,
        })
    }

    /// Builds a dataset from flat buffers, as the file loaders do: `x` holds the samples one
    /// after another, each `sample_shape` in row-major order; `y` holds `targets.width()` floats
    /// per sample (a class index as its `f32` value).
    ///
    /// Errors when a buffer is not a whole number of samples, when `x` and `y` hold different
    /// sample counts, when the sample or target shape has no element, or when a class label is
    /// not an integer in `0..num_classes`.
    pub fn from_vecs(
        x: Vec<f32>,
        sample_shape: &[usize],
        y: Vec<f32>,
        targets: Targets,
    ) -> Result<Self> {
        let sample_len: usize = sample_shape.iter().product();
        if sample_len == 0 {
            return Err(Error::invalid(format!(
                "the sample shape {sample_shape:?} has no element"
            )));
        }
        let width = targets.width();
        if width == 0 {
            return Err(Error::invalid(format!(
                "the target shape {targets:?} has no element"
            )));
        }
        if !x.len().is_multiple_of(sample_len) {
            return Err(Error::invalid(format!(
                "x holds {} values, which is not a whole number of samples of shape \
                 {sample_shape:?} ({sample_len} values each)",
                x.len()
            )));
        }
        if !y.len().is_multiple_of(width) {
            return Err(Error::invalid(format!(
                "y holds {} values, which is not a whole number of targets of {width} values",
                y.len()
            )));
        }
        let n = x.len() / sample_len;
        let ny = y.len() / width;
        if n != ny {
            return Err(Error::invalid(format!(
                "x holds {n} samples but y holds {ny}"
            )));
        }
        check_targets(&y, &targets)?;
        Ok(Self {
            name: "in-memory dataset".to_string(),
            len: n,
            inputs: vec![InputSpec::new(sample_shape)],
            x: vec![PartBuffer::F32(x)],
            targets,
            y,
        })
    }

    /// Sets the name used in error messages and logs, e.g. `digits (train)`.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets the number of classes of class targets, checking that every label is below it.
    ///
    /// Useful when a split lacks the highest class, so that every split agrees. Errors for
    /// dense targets or a label outside `0..num_classes`.
    pub fn with_num_classes(mut self, num_classes: usize) -> Result<Self> {
        match self.targets {
            Targets::Classes(_) => {
                check_labels(&self.y, num_classes)?;
                self.targets = Targets::Classes(num_classes);
                Ok(self)
            }
            Targets::Values(ref shape) => Err(Error::invalid(format!(
                "`{}` has dense targets of shape {shape:?}, not class indices",
                self.name
            ))),
            Targets::Parts(_) => Err(Error::invalid(format!(
                "`{}` has one target per output, not one set of class indices",
                self.name
            ))),
        }
    }

    /// Turns class targets into one-hot rows: `Classes(k)` becomes `Values([k])`.
    ///
    /// Errors when the targets are already dense values.
    pub fn one_hot(self) -> Result<Self> {
        let k = match self.targets {
            Targets::Classes(k) => k,
            Targets::Values(ref shape) => {
                return Err(Error::invalid(format!(
                    "`{}` already has dense targets of shape {shape:?}; one_hot needs class \
                     indices",
                    self.name
                )))
            }
            Targets::Parts(_) => {
                return Err(Error::invalid(format!(
                    "`{}` has one target per output; one_hot needs one set of class indices",
                    self.name
                )))
            }
        };
        let mut y = vec![0f32; self.len * k];
        for (row, &label) in y.chunks_exact_mut(k).zip(&self.y) {
            // Labels were validated as integers in 0..k when the dataset was built.
            row[label as usize] = 1.0;
        }
        Ok(Self {
            targets: Targets::Values(vec![k]),
            y,
            ..self
        })
    }

    /// A new dataset holding copies of the samples at `indices`, in that order (an index may
    /// repeat). The number of classes is kept. Errors for an index out of range.
    pub fn subset(&self, indices: &[usize]) -> Result<Self> {
        if let Some((pos, &bad)) = indices.iter().enumerate().find(|(_, &i)| i >= self.len) {
            return Err(Error::invalid(format!(
                "subset index {bad} (at position {pos}) is out of range for `{}` with {} samples",
                self.name, self.len
            )));
        }
        let x = self
            .x
            .iter()
            .zip(&self.inputs)
            .map(|(buffer, spec)| {
                let len = spec.sample_len();
                buffer.gather(indices.iter().map(move |&i| (i * len, len)))
            })
            .collect();
        let width = self.targets.width();
        let mut y = Vec::with_capacity(indices.len() * width);
        for &i in indices {
            y.extend_from_slice(&self.y[i * width..(i + 1) * width]);
        }
        Ok(Self {
            name: self.name.clone(),
            len: indices.len(),
            inputs: self.inputs.clone(),
            x,
            targets: self.targets.clone(),
            y,
        })
    }

    /// Splits into `(train, test)` at random: the samples are shuffled with a
    /// [`StdRng`](rand::rngs::StdRng) seeded with `seed`, and the first
    /// `ceil(len * test_fraction)` of them form the test set (as scikit-learn's
    /// `train_test_split` counts). The split is plain, not stratified; each side keeps the
    /// number of classes, and is named `<name> (train)` and `<name> (test)`.
    ///
    /// For the 1,797 digits and `test_fraction = 0.2`, the test set has 360 samples and the
    /// training set 1,437. The same seed gives the same split.
    ///
    /// Errors when `test_fraction` is not strictly between 0 and 1, or when either side would
    /// be empty.
    pub fn train_test_split(&self, test_fraction: f64, seed: u64) -> Result<(Self, Self)> {
        if !(test_fraction > 0.0 && test_fraction < 1.0) {
            return Err(Error::invalid(format!(
                "test_fraction must be strictly between 0 and 1, got {test_fraction}"
            )));
        }
        // The small epsilon keeps e.g. 0.7 * 10 = 7.000000000000001 from rounding up to 8.
        let n_test = ((self.len as f64) * test_fraction - 1e-9).ceil().max(0.0) as usize;
        if n_test == 0 || n_test >= self.len {
            return Err(Error::invalid(format!(
                "a test fraction of {test_fraction} of the {} samples of `{}` leaves {} test and \
                 {} training samples; both sides need at least one",
                self.len,
                self.name,
                n_test.min(self.len),
                self.len - n_test.min(self.len)
            )));
        }
        let mut order: Vec<usize> = (0..self.len).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        let (test, train) = order.split_at(n_test);
        let train = self.subset(train)?.named(format!("{} (train)", self.name));
        let test = self.subset(test)?.named(format!("{} (test)", self.name));
        Ok((train, test))
    }

    /// The first input's values, sample after sample, `len() * sample_shape().iter().product()`
    /// floats; empty when that input is not `f32`.
    pub fn input_values(&self) -> &[f32] {
        match self.x.first() {
            Some(PartBuffer::F32(x)) => x,
            _ => &[],
        }
    }

    /// All targets, sample after sample, `len() * targets().width()` floats.
    pub fn target_values(&self) -> &[f32] {
        &self.y
    }

    /// The inputs as one CPU tensor `(n, sample_shape...)` and the targets as a `u32` tensor
    /// `(n,)` (class indices) or an `f32` tensor `(n, shape...)` (dense values), as in a
    /// [`Batch`] of a model of one input and one output. Errors for a dataset of several
    /// inputs or outputs: [`Self::to_batch`] gives every part.
    pub fn to_tensors(&self) -> Result<(Tensor, Tensor)> {
        let batch = self.to_batch()?;
        match (&batch.inputs[..], &batch.targets[..]) {
            ([x], [y]) => Ok((x.clone(), y.clone())),
            (inputs, targets) => Err(Error::invalid(format!(
                "`{}` has {} inputs and {} targets; to_tensors gives one of each, to_batch \
                 gives them all",
                self.name,
                inputs.len(),
                targets.len()
            ))),
        }
    }

    /// Every sample as one [`Batch`]: one tensor per input, in its dtype, and one per output.
    pub fn to_batch(&self) -> Result<Batch> {
        let inputs = self
            .x
            .iter()
            .zip(&self.inputs)
            .map(|(buffer, spec)| {
                let mut dims = vec![self.len];
                dims.extend_from_slice(&spec.shape);
                buffer.clone().into_tensor(dims)
            })
            .collect::<Result<Vec<_>>>()?;
        let indices: Vec<usize> = (0..self.len).collect();
        let targets = self
            .targets
            .batch_tensors(self.y.clone(), &indices, &self.name)?;
        Ok(Batch {
            inputs,
            targets,
            weights: None,
        })
    }
}

/// Checks the class indices among targets `y`, `targets.width()` values per sample.
fn check_targets(y: &[f32], targets: &Targets) -> Result<()> {
    match targets {
        Targets::Classes(k) => check_labels(y, *k),
        Targets::Values(_) => Ok(()),
        Targets::Parts(_) => {
            for (i, row) in y.chunks_exact(targets.width()).enumerate() {
                if let Some((label, k)) = targets.bad_label(row) {
                    return Err(Error::invalid(format!(
                        "label {label} of sample {i} is not a class index in 0..{k}"
                    )));
                }
            }
            Ok(())
        }
    }
}

/// Checks that every value in `labels` is an integer class index in `0..num_classes`.
/// A target tensor's values as the dataset holds them, and what they are: an integer tensor
/// `(n,)` or `(n, 1)` of class indices, or a float tensor `(n, ...)` of values.
fn target_values(y: &Tensor) -> Result<(Vec<f32>, Targets)> {
    let y_dtype = y.dtype();
    let y_dims = y.dims().to_vec();
    let y = y.to_device(&Device::Cpu)?;
    if y_dtype.is_int() {
        if !(y_dims.len() == 1 || (y_dims.len() == 2 && y_dims[1] == 1)) {
            return Err(Error::invalid(format!(
                "integer targets are class indices of shape (n,) or (n, 1), but y has shape \
                 {y_dims:?}; pass dense targets as a float tensor"
            )));
        }
        let y = y.flatten_all()?;
        let labels: Vec<i64> = match y_dtype {
            DType::U8 => y.to_vec1::<u8>()?.into_iter().map(i64::from).collect(),
            DType::U32 => y.to_vec1::<u32>()?.into_iter().map(i64::from).collect(),
            DType::I64 => y.to_vec1::<i64>()?,
            _ => y.to_dtype(DType::I64)?.to_vec1::<i64>()?,
        };
        let mut values = Vec::with_capacity(labels.len());
        let mut num_classes = 0usize;
        for (i, &label) in labels.iter().enumerate() {
            // f32 holds every integer up to 2^24 exactly.
            if !(0..1 << 24).contains(&label) {
                return Err(Error::invalid(format!(
                    "label {label} of sample {i} is not a class index (0..{})",
                    1 << 24
                )));
            }
            num_classes = num_classes.max(label as usize + 1);
            values.push(label as f32);
        }
        Ok((values, Targets::Classes(num_classes)))
    } else {
        let y = y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok((y, Targets::Values(y_dims[1..].to_vec())))
    }
}

fn check_labels(labels: &[f32], num_classes: usize) -> Result<()> {
    for (i, &label) in labels.iter().enumerate() {
        if !label.is_finite() || label.fract() != 0.0 {
            return Err(Error::invalid(format!(
                "label {label} of sample {i} is not an integer class index"
            )));
        }
        if label < 0.0 || label >= num_classes as f32 {
            return Err(Error::invalid(format!(
                "label {label} of sample {i} is outside the class range 0..{num_classes}"
            )));
        }
    }
    Ok(())
}

impl Dataset for InMemoryDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn sample_shape(&self) -> &[usize] {
        &self.inputs[0].shape
    }

    fn targets(&self) -> Targets {
        self.targets.clone()
    }

    fn inputs(&self) -> Vec<InputSpec> {
        self.inputs.clone()
    }

    fn read(&self, index: usize, x: &mut [f32], y: &mut [f32]) -> Result<()> {
        self.read_inputs(index, &mut [PartMut::F32(x)], y)
    }

    fn read_inputs(&self, index: usize, inputs: &mut [PartMut<'_>], y: &mut [f32]) -> Result<()> {
        if index >= self.len {
            return Err(super::out_of_range(&self.name, index, self.len));
        }
        if inputs.len() != self.inputs.len() {
            return Err(Error::invalid(format!(
                "`{}` has {} inputs but was read into {}",
                self.name,
                self.inputs.len(),
                inputs.len()
            )));
        }
        let width = self.targets.width();
        for ((buffer, spec), out) in self.x.iter().zip(&self.inputs).zip(inputs.iter_mut()) {
            let sample_len = spec.sample_len();
            if out.len() != sample_len || y.len() != width {
                return Err(Error::invalid(format!(
                    "reading `{}` needs buffers of {sample_len} and {width} values, got {} and {}",
                    self.name,
                    out.len(),
                    y.len()
                )));
            }
            buffer.copy_to(index * sample_len, out)?;
        }
        y.copy_from_slice(&self.y[index * width..(index + 1) * width]);
        Ok(())
    }

    fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn toy() -> InMemoryDataset {
        let x: Vec<f32> = (0..12).map(|v| v as f32).collect();
        InMemoryDataset::from_vecs(x, &[2, 2], vec![0.0, 2.0, 1.0], Targets::Classes(3))
            .unwrap()
            .named("toy")
    }

    #[test]
    fn new_from_integer_labels() {
        let x = Tensor::arange(0f64, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap();
        for y in [
            Tensor::new(&[0u8, 4, 1], &Device::Cpu).unwrap(),
            Tensor::new(&[0u32, 4, 1], &Device::Cpu).unwrap(),
            Tensor::new(&[0i64, 4, 1], &Device::Cpu).unwrap(),
            Tensor::new(&[[0i64], [4], [1]], &Device::Cpu).unwrap(),
        ] {
            let ds = InMemoryDataset::new(x.clone(), y).unwrap();
            assert_eq!(ds.len(), 3);
            assert_eq!(ds.sample_shape(), &[4]);
            assert_eq!(ds.targets(), Targets::Classes(5));
            let (mut xs, mut ys) = ([0f32; 4], [0f32; 1]);
            ds.read(1, &mut xs, &mut ys).unwrap();
            assert_eq!(xs, [4.0, 5.0, 6.0, 7.0]);
            assert_eq!(ys, [4.0]);
        }
    }

    #[test]
    fn new_from_dense_targets() {
        let x = Tensor::zeros((2, 3, 2, 2), DType::F16, &Device::Cpu).unwrap();
        let y = Tensor::new(&[[0f32, 1.0], [1.0, 0.0]], &Device::Cpu).unwrap();
        let ds = InMemoryDataset::new(x, y).unwrap();
        assert_eq!(ds.sample_shape(), &[3, 2, 2]);
        assert_eq!(ds.targets(), Targets::Values(vec![2]));
        let (x, y) = ds.to_tensors().unwrap();
        assert_eq!(x.dims(), &[2, 3, 2, 2]);
        assert_eq!(
            y.to_vec2::<f32>().unwrap(),
            vec![vec![0.0, 1.0], vec![1.0, 0.0]]
        );
    }

    #[test]
    fn count_mismatch_names_both_counts() {
        let x = Tensor::zeros((5, 2), DType::F32, &Device::Cpu).unwrap();
        let y = Tensor::new(&[0u32, 1, 2], &Device::Cpu).unwrap();
        let err = InMemoryDataset::new(x, y).unwrap_err().to_string();
        assert!(
            err.contains("5 samples") && err.contains("holds 3"),
            "{err}"
        );
        let err =
            InMemoryDataset::from_vecs(vec![0.0; 10], &[2], vec![0.0; 4], Targets::Classes(2))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("5 samples") && err.contains("holds 4"),
            "{err}"
        );
    }

    #[test]
    fn bad_shapes_and_labels_are_errors() {
        let scalar = Tensor::new(1f32, &Device::Cpu).unwrap();
        let y = Tensor::new(&[0u32], &Device::Cpu).unwrap();
        assert!(InMemoryDataset::new(scalar, y).is_err());
        let x = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
        let y2 = Tensor::new(&[[0u32, 1], [1, 0]], &Device::Cpu).unwrap();
        assert!(InMemoryDataset::new(x.clone(), y2).is_err());
        let negative = Tensor::new(&[0i64, -3], &Device::Cpu).unwrap();
        let err = InMemoryDataset::new(x, negative).unwrap_err().to_string();
        assert!(err.contains("-3") && err.contains("sample 1"), "{err}");
        // Partial sample, zero-sized sample.
        assert!(
            InMemoryDataset::from_vecs(vec![0.0; 5], &[2], vec![0.0; 2], Targets::Classes(1))
                .is_err()
        );
        assert!(InMemoryDataset::from_vecs(vec![], &[0, 3], vec![], Targets::Classes(1)).is_err());
        assert!(InMemoryDataset::from_vecs(
            vec![0.0; 4],
            &[2],
            vec![0.0; 3],
            Targets::Values(vec![2])
        )
        .is_err());
        // Non-integer and out-of-range labels.
        let err =
            InMemoryDataset::from_vecs(vec![0.0; 4], &[2], vec![0.0, 1.5], Targets::Classes(3))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("1.5") && err.contains("not an integer"),
            "{err}"
        );
        let err =
            InMemoryDataset::from_vecs(vec![0.0; 4], &[2], vec![7.0, 1.0], Targets::Classes(3))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("label 7") && err.contains("sample 0") && err.contains("0..3"),
            "{err}"
        );
        assert!(InMemoryDataset::from_vecs(
            vec![0.0; 2],
            &[2],
            vec![f32::NAN],
            Targets::Classes(3)
        )
        .is_err());
    }

    #[test]
    fn with_num_classes_validates() {
        let ds = toy();
        assert_eq!(
            ds.clone().with_num_classes(10).unwrap().targets(),
            Targets::Classes(10)
        );
        let err = ds.clone().with_num_classes(2).unwrap_err().to_string();
        assert!(
            err.contains("label 2") && err.contains("sample 1") && err.contains("0..2"),
            "{err}"
        );
        assert!(ds.one_hot().unwrap().with_num_classes(3).is_err());
    }

    #[test]
    fn one_hot_rows() {
        let ds = toy().one_hot().unwrap();
        assert_eq!(ds.targets(), Targets::Values(vec![3]));
        assert_eq!(ds.target_values(), &[1., 0., 0., 0., 0., 1., 0., 1., 0.]);
        assert!(ds.one_hot().is_err());
    }

    #[test]
    fn subset_copies_in_order() {
        let ds = toy();
        let sub = ds.subset(&[2, 0, 2]).unwrap();
        assert_eq!(sub.len(), 3);
        assert_eq!(sub.targets(), Targets::Classes(3));
        assert_eq!(sub.target_values(), &[1.0, 0.0, 1.0]);
        assert_eq!(&sub.input_values()[..4], &[8.0, 9.0, 10.0, 11.0]);
        let err = ds.subset(&[0, 3]).unwrap_err().to_string();
        assert!(
            err.contains("index 3") && err.contains("3 samples"),
            "{err}"
        );
    }

    #[test]
    fn read_checks_index_and_buffers() {
        let ds = toy();
        let (mut x, mut y) = ([0f32; 4], [0f32; 1]);
        assert!(ds.read(3, &mut x, &mut y).is_err());
        assert!(ds.read(0, &mut x[..3], &mut y).is_err());
    }

    #[test]
    fn train_test_split_sizes_and_errors() {
        let x: Vec<f32> = (0..10).map(|v| v as f32).collect();
        let ds = InMemoryDataset::from_vecs(x, &[1], vec![0.0; 10], Targets::Classes(1))
            .unwrap()
            .named("ten");
        let (train, test) = ds.train_test_split(0.7, 1).unwrap();
        assert_eq!((train.len(), test.len()), (3, 7));
        assert_eq!(train.name(), "ten (train)");
        assert_eq!(test.name(), "ten (test)");
        let mut all: Vec<f32> = train
            .input_values()
            .iter()
            .chain(test.input_values())
            .copied()
            .collect();
        all.sort_by(f32::total_cmp);
        assert_eq!(all, (0..10).map(|v| v as f32).collect::<Vec<_>>());
        for bad in [0.0, 1.0, -0.5, 1.5, f64::NAN, 0.95] {
            assert!(ds.train_test_split(bad, 1).is_err(), "{bad}");
        }
        let (train, test) = ds.train_test_split(0.01, 1).unwrap();
        assert_eq!((train.len(), test.len()), (9, 1));
    }
}
