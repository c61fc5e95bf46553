//! Losses: the open [`Loss`] trait and Keras's built-ins, computed per sample.
//!
//! A loss maps `(y_true, y_pred)` to one value per sample; `fit` weights those values (by
//! sample and class weights), sums them, and divides by the global batch's sample count, so a
//! short last batch, or a batch split unevenly across replicas and workers, weighs exactly as
//! many samples as it holds. Any type implementing [`Loss`] plugs into
//! [`compile`](crate::Compile::compile), under every strategy.
//!
//! Cross-entropy from probabilities is numerically stable: when the model ends in a softmax,
//! the built-in cross-entropies compute the loss from the logits before it with
//! `log_softmax`, as Keras does ([`Loss::call_with_logits`]); otherwise probabilities are
//! clipped to `[1e-7, 1 - 1e-7]`. `from_logits(true)` says the model outputs logits. On a CUDA
//! device (the `cuda` feature), the sparse cross-entropy of `f32` logits is one fused kernel of
//! kandle's, its gradient too, unless the model runs the device-generic path
//! ([`Loss::call_on_path`]), which keeps candle's ops.
//!
//! A loss of your own needs only [`Loss::call`] and a name:
//!
//! ```
//! use candle_core::{Tensor, D};
//! use kandle::losses::Loss;
//!
//! /// Mean absolute error, per sample.
//! #[derive(Debug)]
//! struct MeanAbsolute;
//!
//! impl Loss for MeanAbsolute {
//!     fn name(&self) -> &str {
//!         "mean_absolute"
//!     }
//!     fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> kandle::Result<Tensor> {
//!         Ok((y_pred - y_true)?.abs()?.mean(D::Minus1)?)
//!     }
//! }
//!
//! let y_pred = Tensor::new(&[[1f32, 3.], [0., 0.]], &candle_core::Device::Cpu)?;
//! let y_true = Tensor::new(&[[0f32, 0.], [1., 1.]], &candle_core::Device::Cpu)?;
//! assert_eq!(MeanAbsolute.call(&y_true, &y_pred)?.to_vec1::<f32>()?, [2.0, 1.0]);
//! # Ok::<(), kandle::Error>(())
//! ```

use std::fmt::{self, Debug};
use std::marker::PhantomData;

use candle_core::{DType, Tensor, D};

use crate::data::Targets;
use crate::layers::activation_log_softmax as log_softmax;
use crate::{ComputePath, Error, Result};

/// The objective `fit` minimises: one value per sample.
pub trait Loss: Send + Sync + Debug {
    /// The name in messages and summaries, e.g. `sparse_categorical_crossentropy`. The logs
    /// always call the loss `loss`, as Keras does.
    fn name(&self) -> &str;

    /// The loss of each sample, `(batch,)`. `y_true` is `u32` class indices `(batch,)` for a
    /// dataset of [`Targets::Classes`], `f32` `(batch, shape...)` for [`Targets::Values`];
    /// `y_pred` is the model's output.
    fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor>;

    /// [`Self::call`], given also the logits of the model's final softmax when it ends in one,
    /// so that a cross-entropy can be computed stably from them. The default ignores them.
    fn call_with_logits(
        &self,
        y_true: &Tensor,
        y_pred: &Tensor,
        _logits: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.call(y_true, y_pred)
    }

    /// [`Self::call_with_logits`] for a model that runs the code path `path` ([`ComputePath`];
    /// a model's training step calls its loss this way): the sparse cross-entropy runs kandle's
    /// fused CUDA kernel on `f32` logits on a CUDA device unless `path` is the device-generic
    /// one, and `call_with_logits` alone takes the path from the environment
    /// ([`ComputePath::from_env`]). The default ignores the path.
    fn call_on_path(
        &self,
        y_true: &Tensor,
        y_pred: &Tensor,
        logits: Option<&Tensor>,
        path: ComputePath,
    ) -> Result<Tensor> {
        let _ = path;
        self.call_with_logits(y_true, y_pred, logits)
    }

    /// Checks, before training, that a dataset's targets suit this loss and a model whose
    /// output has `output_shape` (without the batch dimension). The default accepts anything.
    fn check_targets(&self, _targets: &Targets, _output_shape: &[usize]) -> Result<()> {
        Ok(())
    }

    /// The targets this loss takes for an output of `output_shape`: how a model of several
    /// outputs lays out this output's part of each sample's targets (see
    /// [`Targets::Parts`]). The default is dense values of the output's shape; the sparse
    /// losses take a class index.
    fn expected_targets(&self, output_shape: &[usize]) -> Targets {
        Targets::Values(output_shape.to_vec())
    }
}

/// Forwards every method to the pointee.
macro_rules! forward_loss {
    ($($ty:ty),*) => {$(
        impl<L: Loss + ?Sized> Loss for $ty {
            fn name(&self) -> &str {
                (**self).name()
            }
            fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
                (**self).call(y_true, y_pred)
            }
            fn call_with_logits(
                &self,
                y: &Tensor,
                p: &Tensor,
                logits: Option<&Tensor>,
            ) -> Result<Tensor> {
                (**self).call_with_logits(y, p, logits)
            }
            fn call_on_path(
                &self,
                y: &Tensor,
                p: &Tensor,
                logits: Option<&Tensor>,
                path: ComputePath,
            ) -> Result<Tensor> {
                (**self).call_on_path(y, p, logits, path)
            }
            fn check_targets(&self, targets: &Targets, output_shape: &[usize]) -> Result<()> {
                (**self).check_targets(targets, output_shape)
            }
            fn expected_targets(&self, output_shape: &[usize]) -> Targets {
                (**self).expected_targets(output_shape)
            }
        }
    )*};
}

forward_loss!(Box<L>, std::sync::Arc<L>);

const PROB_EPSILON: f64 = 1e-7;

/// Log-probabilities of `y_pred`: from itself when it holds logits, from a final softmax's
/// logits when there are some, else from the clipped probabilities.
fn log_probabilities(
    y_pred: &Tensor,
    logits: Option<&Tensor>,
    from_logits: bool,
) -> Result<Tensor> {
    match (from_logits, logits) {
        (true, _) => log_softmax(y_pred),
        (false, Some(logits)) => log_softmax(logits),
        (false, None) => Ok(y_pred.clamp(PROB_EPSILON, 1.0 - PROB_EPSILON)?.log()?),
    }
}

/// Targets of the same shape as the output, or an error saying what the loss needs.
fn check_dense_targets(loss: &str, targets: &Targets, output_shape: &[usize]) -> Result<()> {
    let out = crate::error::shape_with_batch(output_shape);
    match targets {
        Targets::Classes(_) => Err(Error::invalid(format!(
            "{loss} takes dense (e.g. one-hot) targets, but the labels are class indices; \
             use SparseCategoricalCrossentropy or one-hot the labels"
        ))),
        Targets::Values(shape) if shape.as_slice() != output_shape => Err(Error::invalid(format!(
            "{loss}: targets have shape {} but the model outputs {out}",
            crate::error::shape_with_batch(shape)
        ))),
        Targets::Values(_) => Ok(()),
        Targets::Parts(_) => Err(parts_for_one_output(loss)),
    }
}

/// The error for targets of several parts given to a loss of one output.
pub(crate) fn parts_for_one_output(loss: &str) -> Error {
    Error::invalid(format!(
        "{loss}: the targets have one part per output of a model of several outputs, but this \
         loss is given one output; compile the model with a loss per output (PerOutput)"
    ))
}

/// A cross-entropy loss with Keras's `from_logits` option, `K` saying what it compares:
/// [`CategoricalCrossentropy`] (`K` = [`Categorical`]), [`SparseCategoricalCrossentropy`]
/// (`K` = [`SparseCategorical`]) or [`BinaryCrossentropy`] (`K` = [`Binary`]).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use kandle::losses::{Loss, SparseCategoricalCrossentropy};
///
/// let logits = Tensor::new(&[[0f32, 0.]], &Device::Cpu)?;
/// let label = Tensor::new(&[1u32], &Device::Cpu)?;
/// let loss = SparseCategoricalCrossentropy::new().from_logits(true);
/// let value = loss.call(&label, &logits)?.to_vec1::<f32>()?[0];
/// assert!((value - 2f32.ln()).abs() < 1e-6);
/// # Ok::<(), kandle::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CrossEntropy<K> {
    from_logits: bool,
    kind: PhantomData<K>,
}

/// Cross-entropy between one-hot (or soft) targets and predicted class probabilities (or
/// logits, with [`from_logits`](CrossEntropy::from_logits)). Keras's `CategoricalCrossentropy`.
pub type CategoricalCrossentropy = CrossEntropy<Categorical>;

/// Cross-entropy between class-index targets and predicted class probabilities (or logits,
/// with [`from_logits`](CrossEntropy::from_logits)). Keras's `SparseCategoricalCrossentropy`.
pub type SparseCategoricalCrossentropy = CrossEntropy<SparseCategorical>;

/// Cross-entropy of independent yes/no outputs: targets in `[0, 1]`, predictions are
/// probabilities (a sigmoid's output) or, with [`from_logits`](CrossEntropy::from_logits),
/// logits. The loss of a sample is the mean over its outputs. Keras's `BinaryCrossentropy`.
///
/// Class-index labels of two classes (`0`/`1`) work with a model of one output unit.
pub type BinaryCrossentropy = CrossEntropy<Binary>;

/// The targets of [`CategoricalCrossentropy`]: one-hot (or soft) class probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Categorical;

/// The targets of [`SparseCategoricalCrossentropy`]: class indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseCategorical;

/// The targets of [`BinaryCrossentropy`]: one value in `[0, 1]` per output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binary;

/// What a [`CrossEntropy`] compares: [`Categorical`], [`SparseCategorical`] or [`Binary`] (no
/// other).
pub trait CrossEntropyKind: kind::Sealed + Copy + Eq + Send + Sync + 'static {}

impl CrossEntropyKind for Categorical {}
impl CrossEntropyKind for SparseCategorical {}
impl CrossEntropyKind for Binary {}

mod kind {
    /// What a [`CrossEntropyKind`](super::CrossEntropyKind) is to the loss code; only kandle
    /// implements it.
    pub trait Sealed {
        /// The loss type's name, as `Debug` writes it.
        const TYPE_NAME: &'static str;
    }

    impl Sealed for super::Categorical {
        const TYPE_NAME: &'static str = "CategoricalCrossentropy";
    }

    impl Sealed for super::SparseCategorical {
        const TYPE_NAME: &'static str = "SparseCategoricalCrossentropy";
    }

    impl Sealed for super::Binary {
        const TYPE_NAME: &'static str = "BinaryCrossentropy";
    }
}

impl<K: CrossEntropyKind> CrossEntropy<K> {
    /// From probabilities.
    pub fn new() -> Self {
        Self {
            from_logits: false,
            kind: PhantomData,
        }
    }

    /// Whether the model outputs logits rather than probabilities (default false).
    pub fn from_logits(mut self, from_logits: bool) -> Self {
        self.from_logits = from_logits;
        self
    }
}

impl<K: CrossEntropyKind> Default for CrossEntropy<K> {
    /// From probabilities, as [`CrossEntropy::new`].
    fn default() -> Self {
        Self::new()
    }
}

/// Written as the loss type's name: `SparseCategoricalCrossentropy { from_logits: false }`.
impl<K: CrossEntropyKind> fmt::Debug for CrossEntropy<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(K::TYPE_NAME)
            .field("from_logits", &self.from_logits)
            .finish()
    }
}

impl Loss for CategoricalCrossentropy {
    fn name(&self) -> &str {
        "categorical_crossentropy"
    }

    fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        self.call_with_logits(y_true, y_pred, None)
    }

    fn call_with_logits(&self, y: &Tensor, p: &Tensor, logits: Option<&Tensor>) -> Result<Tensor> {
        let log_p = log_probabilities(p, logits, self.from_logits)?;
        Ok((log_p * y.to_dtype(p.dtype())?)?.sum(D::Minus1)?.neg()?)
    }

    fn check_targets(&self, targets: &Targets, output_shape: &[usize]) -> Result<()> {
        check_dense_targets(self.name(), targets, output_shape)
    }
}

impl Loss for SparseCategoricalCrossentropy {
    fn name(&self) -> &str {
        "sparse_categorical_crossentropy"
    }

    fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        self.call_with_logits(y_true, y_pred, None)
    }

    fn call_with_logits(&self, y: &Tensor, p: &Tensor, logits: Option<&Tensor>) -> Result<Tensor> {
        self.call_on_path(y, p, logits, ComputePath::from_env())
    }

    fn call_on_path(
        &self,
        y: &Tensor,
        p: &Tensor,
        logits: Option<&Tensor>,
        path: ComputePath,
    ) -> Result<Tensor> {
        let idx = y.to_dtype(DType::U32)?.flatten_all()?;
        let logits = if self.from_logits { Some(p) } else { logits };
        if let Some(loss) = fused_on_cuda(logits, &idx, path)? {
            return Ok(loss);
        }
        let log_p = log_probabilities(p, logits, self.from_logits)?;
        Ok(log_p.gather(&idx.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?)
    }

    fn check_targets(&self, targets: &Targets, output_shape: &[usize]) -> Result<()> {
        let out = crate::error::shape_with_batch(output_shape);
        match targets {
            Targets::Classes(k) if output_shape.len() != 1 || output_shape[0] < *k => {
                Err(Error::invalid(format!(
                    "labels have {k} classes but the model outputs {out}; \
                     the last layer needs at least {k} units"
                )))
            }
            Targets::Classes(_) => Ok(()),
            Targets::Values(shape) => Err(Error::invalid(format!(
                "{} takes class-index labels, but the targets are values of shape {shape:?}; \
                 use CategoricalCrossentropy for one-hot targets",
                self.name()
            ))),
            Targets::Parts(_) => Err(parts_for_one_output(self.name())),
        }
    }

    fn expected_targets(&self, output_shape: &[usize]) -> Targets {
        Targets::Classes(output_shape.first().copied().unwrap_or(1))
    }
}

/// The sparse cross-entropy of `(N, C)` `f32` logits on a CUDA device against the class indices
/// `labels`, through kandle's fused CUDA kernel (the `cuda` feature): what `log_softmax`, the
/// gather and the negation compute, its gradient registered with candle's autograd. `None`
/// where it does not apply (no logits, another device, dtype or rank, no `cuda` feature, or the
/// device-generic `path`, which keeps candle's ops).
#[cfg(feature = "cuda")]
fn fused_on_cuda(
    logits: Option<&Tensor>,
    labels: &Tensor,
    path: ComputePath,
) -> Result<Option<Tensor>> {
    let Some(x) = logits else {
        return Ok(None);
    };
    let fits = x.device().is_cuda() && x.dtype() == DType::F32 && x.rank() == 2;
    if !(fits && path.uses_kernels()) {
        return Ok(None);
    }
    // A dataset's labels are checked when it is made: a label outside the classes here gives
    // a NaN loss (which training reports), not a wait for the stream every step.
    use crate::kernels::cuda::{sparse_softmax_cross_entropy_with, LabelCheck};
    Ok(Some(sparse_softmax_cross_entropy_with(
        x,
        labels,
        LabelCheck::NanLoss,
    )?))
}

#[cfg(not(feature = "cuda"))]
fn fused_on_cuda(
    _logits: Option<&Tensor>,
    _labels: &Tensor,
    _path: ComputePath,
) -> Result<Option<Tensor>> {
    Ok(None)
}

/// `y_true` as `f32` values shaped like `y_pred` (class indices become a column).
fn as_values_like(y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
    let y = y_true.to_dtype(y_pred.dtype())?;
    if y.dims() == y_pred.dims() {
        return Ok(y);
    }
    Ok(y.reshape(y_pred.shape())?)
}

impl Loss for BinaryCrossentropy {
    fn name(&self) -> &str {
        "binary_crossentropy"
    }

    fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        let z = as_values_like(y_true, y_pred)?;
        let per_output = if self.from_logits {
            // max(x, 0) - x z + log(1 + exp(-|x|)), stable for any x.
            let x = y_pred;
            let soft = (x.abs()?.neg()?.exp()? + 1.0)?.log()?;
            ((x.relu()? - (x * &z)?)? + soft)?
        } else {
            let p = y_pred.clamp(PROB_EPSILON, 1.0 - PROB_EPSILON)?;
            let one_minus_z = (z.ones_like()? - &z)?;
            let one_minus_p = (p.ones_like()? - &p)?;
            ((&z * p.log()?)? + (one_minus_z * one_minus_p.log()?)?)?.neg()?
        };
        Ok(per_output.flatten_from(1)?.mean(1)?)
    }

    fn check_targets(&self, targets: &Targets, output_shape: &[usize]) -> Result<()> {
        match targets {
            Targets::Classes(k) if *k <= 2 && output_shape == [1] => Ok(()),
            Targets::Classes(k) => Err(Error::invalid(format!(
                "binary_crossentropy takes 0/1 labels with a model of one output, but the labels \
                 have {k} classes and the model outputs {}",
                crate::error::shape_with_batch(output_shape)
            ))),
            values => check_dense_targets(self.name(), values, output_shape),
        }
    }
}

/// Mean over features of the squared error. Keras's `MeanSquaredError`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeanSquaredError;

impl Loss for MeanSquaredError {
    fn name(&self) -> &str {
        "mean_squared_error"
    }

    fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        let diff = (y_pred - as_values_like(y_true, y_pred)?)?;
        Ok(diff.sqr()?.flatten_from(1)?.mean(1)?)
    }

    fn check_targets(&self, targets: &Targets, output_shape: &[usize]) -> Result<()> {
        check_dense_targets(self.name(), targets, output_shape)
    }
}

/// Squared error near the target and absolute error beyond `delta`, averaged over features:
/// `0.5 e^2` where `|e| <= delta`, `delta (|e| - 0.5 delta)` elsewhere. Keras's `Huber`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Huber {
    delta: f64,
}

impl Default for Huber {
    fn default() -> Self {
        Self { delta: 1.0 }
    }
}

impl Huber {
    /// With `delta` 1, Keras's default.
    pub fn new() -> Self {
        Self::default()
    }

    /// Where the loss turns from quadratic to linear. It must be positive and finite.
    pub fn delta(delta: f64) -> Result<Self> {
        if !(delta.is_finite() && delta > 0.0) {
            return Err(Error::invalid(format!(
                "Huber's delta must be positive and finite, got {delta}"
            )));
        }
        Ok(Self { delta })
    }
}

impl Loss for Huber {
    fn name(&self) -> &str {
        "huber_loss"
    }

    fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        let abs = (y_pred - as_values_like(y_true, y_pred)?)?.abs()?;
        // min(|e|, delta) splits the error into its quadratic and linear parts:
        // 0.5 q^2 + delta (|e| - q) is the Huber loss for both branches.
        let quadratic = abs.clamp(0.0, self.delta)?;
        let linear = (&abs - &quadratic)?;
        let loss = ((quadratic.sqr()? * 0.5)? + (linear * self.delta)?)?;
        Ok(loss.flatten_from(1)?.mean(1)?)
    }

    fn check_targets(&self, targets: &Targets, output_shape: &[usize]) -> Result<()> {
        check_dense_targets(self.name(), targets, output_shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn values(t: Tensor) -> Vec<f32> {
        t.to_vec1::<f32>().expect("a vector")
    }

    #[test]
    fn cross_entropy_values_agree_across_forms() -> Result<()> {
        let dev = Device::Cpu;
        let logits = Tensor::new(&[[2f32, 1., 0.1], [0.5, 2.5, -1.]], &dev)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits)?;
        let sparse = Tensor::new(&[0u32, 1], &dev)?;
        let onehot = Tensor::new(&[[1f32, 0., 0.], [0., 1., 0.]], &dev)?;
        // -log softmax by hand
        let want: Vec<f32> = [[2f32, 1., 0.1], [0.5, 2.5, -1.]]
            .iter()
            .zip([0usize, 1])
            .map(|(r, c)| -(r[c] - r.iter().map(|v| v.exp()).sum::<f32>().ln()))
            .collect();
        let sce = SparseCategoricalCrossentropy::new();
        let cce = CategoricalCrossentropy::new();
        let cases = [
            sce.from_logits(true).call(&sparse, &logits)?,
            sce.call(&sparse, &probs)?,
            sce.call_with_logits(&sparse, &probs, Some(&logits))?,
            cce.call_with_logits(&onehot, &probs, Some(&logits))?,
            cce.from_logits(true).call(&onehot, &logits)?,
        ];
        for got in cases {
            let got = values(got);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn stable_for_saturated_softmax() -> Result<()> {
        let dev = Device::Cpu;
        let logits = Tensor::new(&[[200f32, 0.]], &dev)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits)?;
        let y = Tensor::new(&[1u32], &dev)?;
        let sce = SparseCategoricalCrossentropy::new();
        let fused = sce.call_with_logits(&y, &probs, Some(&logits))?;
        assert!((values(fused)[0] - 200.0).abs() < 1e-3);
        assert!(values(sce.call(&y, &probs)?)[0].is_finite());
        Ok(())
    }

    #[test]
    fn binary_crossentropy_from_probabilities_and_logits() -> Result<()> {
        let dev = Device::Cpu;
        let logits = Tensor::new(&[[0.3f32, -2.0], [4.0, 0.0]], &dev)?;
        let probs = candle_nn::ops::sigmoid(&logits)?;
        let z = Tensor::new(&[[1f32, 0.], [0., 1.]], &dev)?;
        let by_hand: Vec<f32> = [[(0.3f32, 1f32), (-2.0, 0.)], [(4.0, 0.), (0.0, 1.)]]
            .iter()
            .map(|row| {
                row.iter()
                    .map(|&(x, z)| {
                        let p = 1.0 / (1.0 + (-x).exp());
                        -(z * p.ln() + (1.0 - z) * (1.0 - p).ln())
                    })
                    .sum::<f32>()
                    / 2.0
            })
            .collect();
        let from_p = values(BinaryCrossentropy::new().call(&z, &probs)?);
        let from_x = values(
            BinaryCrossentropy::new()
                .from_logits(true)
                .call(&z, &logits)?,
        );
        for ((p, x), w) in from_p.iter().zip(&from_x).zip(&by_hand) {
            assert!((p - w).abs() < 1e-5 && (x - w).abs() < 1e-5, "{p} {x} {w}");
        }
        // Far-out logits stay finite and exact.
        let big = Tensor::new(&[[-100f32]], &dev)?;
        let one = Tensor::new(&[[1f32]], &dev)?;
        let l = values(
            BinaryCrossentropy::new()
                .from_logits(true)
                .call(&one, &big)?,
        );
        assert!((l[0] - 100.0).abs() < 1e-3, "{l:?}");
        // 0/1 class labels with one output unit.
        let labels = Tensor::new(&[1u32, 0], &dev)?;
        let col = Tensor::new(&[[0.8f32], [0.1]], &dev)?;
        let l = values(BinaryCrossentropy::new().call(&labels, &col)?);
        assert!((l[0] + 0.8f32.ln()).abs() < 1e-6 && (l[1] + 0.9f32.ln()).abs() < 1e-6);
        Ok(())
    }

    #[test]
    fn huber_is_quadratic_then_linear() -> Result<()> {
        let dev = Device::Cpu;
        let y_pred = Tensor::new(&[[0.5f32, 3.0], [-2.0, 0.0]], &dev)?;
        let y_true = Tensor::zeros((2, 2), DType::F32, &dev)?;
        // delta 1: 0.5*0.25 = 0.125 and 1*(3-0.5) = 2.5 -> 1.3125; 1.5 and 0 -> 0.75.
        assert_eq!(values(Huber::new().call(&y_true, &y_pred)?), [1.3125, 0.75]);
        // delta 2: 0.125 and 2*(3-1) = 4 -> 2.0625; 0.5*4 = 2 and 0 -> 1.
        assert_eq!(
            values(Huber::delta(2.0)?.call(&y_true, &y_pred)?),
            [2.0625, 1.0]
        );
        assert!(Huber::delta(0.0).is_err() && Huber::delta(f64::NAN).is_err());
        Ok(())
    }

    #[test]
    fn mse_and_target_checks() -> Result<()> {
        let dev = Device::Cpu;
        let out = Tensor::new(&[[1f32, 2.], [0., 0.]], &dev)?;
        let y = Tensor::new(&[[0f32, 0.], [1., 1.]], &dev)?;
        assert_eq!(values(MeanSquaredError.call(&y, &out)?), [2.5, 1.0]);
        let sce = SparseCategoricalCrossentropy::new();
        assert!(sce.check_targets(&Targets::Classes(10), &[10]).is_ok());
        let e = sce.check_targets(&Targets::Classes(12), &[10]);
        assert!(e.is_err_and(|e| e.to_string().contains("12 classes")));
        let cce = CategoricalCrossentropy::new();
        assert!(cce.check_targets(&Targets::Classes(10), &[10]).is_err());
        assert!(MeanSquaredError
            .check_targets(&Targets::Values(vec![3]), &[2])
            .is_err());
        let bce = BinaryCrossentropy::new();
        assert!(bce.check_targets(&Targets::Classes(2), &[1]).is_ok());
        assert!(bce.check_targets(&Targets::Classes(3), &[1]).is_err());
        Ok(())
    }

    /// On a CUDA device the sparse cross-entropy of `f32` logits (from logits, or from a final
    /// softmax's) runs kandle's fused kernel: its loss and the logits' gradient agree with
    /// candle's ops on the same device (the device-generic path, `KANDLE_COMPUTE=device-generic`)
    /// and on the CPU.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_kernels_match_the_device_generic_path() -> anyhow::Result<()> {
        use candle_core::Var;
        use kandle_kernels::test_support::{assert_close, gradients, random, weighted_sum};

        let gpu = crate::devices::cuda(0)?;
        let sce = SparseCategoricalCrossentropy::new();
        for (i, &(n, c)) in [(64usize, 10usize), (7, 33), (3, 1000), (300, 2)]
            .iter()
            .enumerate()
        {
            let labels: Vec<u32> = (0..n).map(|k| ((k * 7 + i) % c) as u32).collect();
            let x = (random(&[n, c], 11 + i as u64, 0.0)? * 4.0)?;
            // The loss and the gradient of a weighted sum of it, by `loss` on `dev`.
            let pass = |dev: &Device,
                        loss: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>|
             -> anyhow::Result<(Tensor, Tensor)> {
                let xv = Var::from_tensor(&x.to_device(dev)?)?;
                let y = Tensor::new(labels.as_slice(), dev)?;
                let l = loss(&y, xv.as_tensor())?;
                let dx = gradients(&weighted_sum(&l, 5)?, &[xv.as_tensor()])?;
                Ok((l.to_device(&Device::Cpu)?, dx[0].to_device(&Device::Cpu)?))
            };
            let generic = |y: &Tensor, x: &Tensor| -> Result<Tensor> {
                let idx = y.flatten_all()?.unsqueeze(1)?;
                Ok(log_softmax(x)?.gather(&idx, 1)?.squeeze(1)?.neg()?)
            };
            let fused = |y: &Tensor, x: &Tensor| -> Result<Tensor> {
                fused_on_cuda(Some(x), y, ComputePath::Auto)?
                    .ok_or_else(|| Error::invalid("the fused kernel did not run"))
            };
            let from_softmax = |y: &Tensor, x: &Tensor| -> Result<Tensor> {
                let probs = candle_nn::ops::softmax_last_dim(x)?;
                sce.call_with_logits(y, &probs, Some(x))
            };
            let from_logits = |y: &Tensor, x: &Tensor| sce.from_logits(true).call(y, x);
            let (want, want_dx) = pass(&gpu, &generic)?;
            let (cpu, cpu_dx) = pass(&Device::Cpu, &generic)?;
            for (what, loss) in [
                (
                    "fused",
                    &fused as &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
                ),
                ("from a softmax's logits", &from_softmax),
                ("from logits", &from_logits),
            ] {
                let (got, dx) = pass(&gpu, loss)?;
                let what = |part: &str| format!("({n}, {c}) {what}: {part}");
                assert_close(&what("loss"), &got, &want, 1e-5)?;
                assert_close(&what("gradient"), &dx, &want_dx, 1e-5)?;
                assert_close(&what("loss against the CPU"), &got, &cpu, 1e-5)?;
                assert_close(&what("gradient against the CPU"), &dx, &cpu_dx, 1e-5)?;
            }
        }
        Ok(())
    }

    #[test]
    fn cross_entropies_debug_as_their_type_names() {
        assert_eq!(
            format!("{:?}", CategoricalCrossentropy::default()),
            "CategoricalCrossentropy { from_logits: false }"
        );
        assert_eq!(
            format!(
                "{:?}",
                SparseCategoricalCrossentropy::new().from_logits(true)
            ),
            "SparseCategoricalCrossentropy { from_logits: true }"
        );
        assert_eq!(
            format!("{:?}", BinaryCrossentropy::new()),
            "BinaryCrossentropy { from_logits: false }"
        );
        assert_ne!(
            BinaryCrossentropy::new(),
            BinaryCrossentropy::new().from_logits(true)
        );
    }
}
