//! Metrics: the open [`Metric`] trait and Keras's built-ins (`accuracy`, `binary_accuracy`,
//! `top_k_categorical_accuracy`, `mean_squared_error`, `mean_absolute_error`).
//!
//! A metric is reduced from **sums**, never from per-replica averages: each batch yields a
//! small vector of sums (its *state*: hits and samples, or true and false positives per
//! class, ...), `fit` adds the states of every step, replica and worker, and the metric's
//! value is computed once from the total with [`Metric::result`]. So the reported value does
//! not depend on how batches were split across replicas, on a short last batch, or on the
//! number of workers, even for a metric that is not a mean (an F1 score, say).
//!
//! A metric of your own implements four methods:
//!
//! ```
//! use candle_core::{DType, Tensor, D};
//! use kandle::metrics::Metric;
//!
//! /// The fraction of samples predicted as class 0 (a "how often does it say zero" metric).
//! #[derive(Debug)]
//! struct ZeroRate;
//!
//! impl Metric for ZeroRate {
//!     fn name(&self) -> &str {
//!         "zero_rate"
//!     }
//!     fn state_size(&self) -> usize {
//!         2 // [samples predicted 0, samples]
//!     }
//!     fn batch_state(&self, _y_true: &Tensor, y_pred: &Tensor) -> kandle::Result<Tensor> {
//!         let zeros = y_pred.argmax(D::Minus1)?.eq(0u32)?.to_dtype(DType::F32)?.sum_all()?;
//!         let n = Tensor::new(&[y_pred.dim(0)? as f32], y_pred.device())?;
//!         Ok(Tensor::cat(&[&zeros.reshape(1)?, &n], 0)?)
//!     }
//!     fn result(&self, state: &[f64]) -> f64 {
//!         state[0] / state[1].max(1.0)
//!     }
//! }
//!
//! let y_pred = Tensor::new(&[[0.9f32, 0.1], [0.2, 0.8]], &candle_core::Device::Cpu)?;
//! let y_true = Tensor::new(&[0u32, 0], &candle_core::Device::Cpu)?;
//! let state = ZeroRate.batch_state(&y_true, &y_pred)?.to_vec1::<f32>()?;
//! assert_eq!(ZeroRate.result(&[state[0] as f64, state[1] as f64]), 0.5);
//! # Ok::<(), kandle::Error>(())
//! ```

use std::fmt::Debug;
use std::sync::Arc;

use candle_core::{DType, Tensor, D};

use crate::data::Targets;
use crate::Result;

/// A quantity reported alongside the loss, reduced from sums over every batch, replica and
/// worker.
pub trait Metric: Send + Sync + Debug {
    /// The key in the logs, e.g. `accuracy` (and `val_accuracy` on validation data).
    fn name(&self) -> &str;

    /// How many sums make up the metric's state.
    fn state_size(&self) -> usize;

    /// This batch's state: an `f32` vector of [`Self::state_size`] sums on `y_pred`'s device.
    /// `y_true` is as for [`Loss::call`](crate::losses::Loss::call). States add up: the state
    /// of two batches is the sum of theirs.
    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor>;

    /// The metric's value from a total state.
    fn result(&self, state: &[f64]) -> f64;

    /// Checks, before training, that a dataset's targets suit this metric and a model whose
    /// output has `output_shape`. The default accepts anything.
    fn check_targets(&self, _targets: &Targets, _output_shape: &[usize]) -> Result<()> {
        Ok(())
    }
}

/// Forwards every method to the pointee.
macro_rules! forward_metric {
    ($($ty:ty),*) => {$(
        impl<M: Metric + ?Sized> Metric for $ty {
            fn name(&self) -> &str {
                (**self).name()
            }
            fn state_size(&self) -> usize {
                (**self).state_size()
            }
            fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
                (**self).batch_state(y_true, y_pred)
            }
            fn result(&self, state: &[f64]) -> f64 {
                (**self).result(state)
            }
            fn check_targets(&self, targets: &Targets, output_shape: &[usize]) -> Result<()> {
                (**self).check_targets(targets, output_shape)
            }
        }
    )*};
}

forward_metric!(Box<M>, Arc<M>);

/// The metrics a model reports: what [`compile`](crate::Compile::compile) takes.
///
/// Made from an array of one metric type (`[Accuracy]`), a tuple of different ones
/// (`(Accuracy, TopKCategoricalAccuracy::new(5))`), `()` for none, or a `Vec` of boxed or
/// shared metrics.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    metrics: Vec<Arc<dyn Metric>>,
    /// The output each metric scores, by index in the model's outputs (0 for the only one).
    outputs: Vec<usize>,
}

impl Metrics {
    /// No metric.
    pub fn new() -> Self {
        Self::default()
    }

    fn of(metrics: Vec<Arc<dyn Metric>>) -> Self {
        let outputs = vec![0; metrics.len()];
        Self { metrics, outputs }
    }

    /// These metrics and `metric`.
    pub fn with(self, metric: impl Metric + 'static) -> Self {
        self.with_output(Arc::new(metric), 0)
    }

    /// These metrics and `metric` of the model's output number `output`.
    pub(crate) fn with_output(mut self, metric: Arc<dyn Metric>, output: usize) -> Self {
        self.metrics.push(metric);
        self.outputs.push(output);
        self
    }

    /// The metrics, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<dyn Metric>> {
        self.metrics.iter()
    }

    /// The metrics with the output each scores, in order.
    pub(crate) fn iter_outputs(&self) -> impl Iterator<Item = (&Arc<dyn Metric>, usize)> {
        self.metrics.iter().zip(self.outputs.iter().copied())
    }

    /// Number of metrics.
    pub fn len(&self) -> usize {
        self.metrics.len()
    }

    /// Whether there is no metric.
    pub fn is_empty(&self) -> bool {
        self.metrics.is_empty()
    }

    /// The total state size: the sums one step reports for all metrics.
    pub fn state_size(&self) -> usize {
        self.metrics.iter().map(|m| m.state_size()).sum()
    }

    /// Each metric's name and value from a total state laid out as [`Self::batch_states`]
    /// lays it out.
    pub fn results<'a>(&'a self, state: &'a [f64]) -> impl Iterator<Item = (&'a str, f64)> + 'a {
        let mut offset = 0;
        self.metrics.iter().map(move |m| {
            let size = m.state_size();
            let part = state.get(offset..offset + size).unwrap_or(&[]);
            offset += size;
            (m.name(), m.result(part))
        })
    }

    /// Every metric's batch state, one after the other: `state_size()` values, for a model of
    /// one output.
    pub fn batch_states(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Vec<Tensor>> {
        self.output_states(std::slice::from_ref(y_true), std::slice::from_ref(y_pred))
    }

    /// [`Self::batch_states`] with one target tensor and one output tensor per model output:
    /// each metric reads its own output's.
    pub(crate) fn output_states(
        &self,
        targets: &[Tensor],
        outputs: &[Tensor],
    ) -> Result<Vec<Tensor>> {
        self.iter_outputs()
            .map(|(m, output)| {
                let (Some(y_true), Some(y_pred)) = (targets.get(output), outputs.get(output))
                else {
                    return Err(crate::Error::invalid(format!(
                        "metric `{}` scores output {output}, but the model gave {} outputs and \
                         {} targets",
                        m.name(),
                        outputs.len(),
                        targets.len()
                    )));
                };
                let y_true = match y_true.dtype().is_float() {
                    true => y_true.to_dtype(y_pred.dtype())?,
                    false => y_true.clone(),
                };
                let state = m
                    .batch_state(&y_true, &y_pred.detach())?
                    .to_dtype(DType::F32)?;
                let state = state.flatten_all()?;
                if state.elem_count() != m.state_size() {
                    return Err(crate::Error::invalid(format!(
                        "metric `{}` returned a state of {} values but declares {}",
                        m.name(),
                        state.elem_count(),
                        m.state_size()
                    )));
                }
                Ok(state)
            })
            .collect()
    }
}

impl<M: Metric + 'static, const N: usize> From<[M; N]> for Metrics {
    fn from(metrics: [M; N]) -> Self {
        Self::of(metrics.into_iter().map(|m| Arc::new(m) as _).collect())
    }
}

impl<M: Metric + 'static> From<Vec<M>> for Metrics {
    fn from(metrics: Vec<M>) -> Self {
        Self::of(metrics.into_iter().map(|m| Arc::new(m) as _).collect())
    }
}

impl From<()> for Metrics {
    fn from((): ()) -> Self {
        Self::new()
    }
}

macro_rules! metrics_from_tuple {
    ($($m:ident),+) => {
        impl<$($m: Metric + 'static),+> From<($($m,)+)> for Metrics {
            #[allow(non_snake_case)]
            fn from(($($m,)+): ($($m,)+)) -> Self {
                Self::of(vec![$(Arc::new($m) as Arc<dyn Metric>),+])
            }
        }
    };
}

metrics_from_tuple!(A);
metrics_from_tuple!(A, B);
metrics_from_tuple!(A, B, C);
metrics_from_tuple!(A, B, C, D2);
metrics_from_tuple!(A, B, C, D2, E);

/// `[sum of values, count of values]` of a per-sample vector.
fn sum_and_count(per_sample: &Tensor) -> Result<Tensor> {
    let sum = per_sample.to_dtype(DType::F32)?.sum_all()?.reshape(1)?;
    let count = Tensor::new(&[per_sample.elem_count() as f32], per_sample.device())?;
    Ok(Tensor::cat(&[&sum, &count], 0)?)
}

/// `state[0] / state[1]`, 0 for an empty count.
fn mean_of(state: &[f64]) -> f64 {
    match state {
        [sum, count] if *count > 0.0 => sum / count,
        _ => 0.0,
    }
}

/// Per sample, whether its true class ranks among the `k` highest scores (1 or 0). The rank is
/// the count of classes scoring strictly higher than the true one, so ties count in the
/// sample's favour.
fn top_k_hits(y_true: &Tensor, y_pred: &Tensor, k: usize) -> Result<Tensor> {
    let classes = if y_true.dtype() == DType::U32 {
        y_true.flatten_all()?
    } else {
        y_true.argmax(D::Minus1)?
    };
    let true_score = y_pred.gather(&classes.to_dtype(DType::U32)?.unsqueeze(1)?, 1)?;
    let higher = y_pred
        .broadcast_gt(&true_score)?
        .to_dtype(DType::F32)?
        .sum(1)?;
    Ok(higher.lt(k as f64)?.to_dtype(DType::F32)?)
}

/// Per sample, the fraction of outputs on the right side of `threshold` (targets are 0/1).
fn binary_hits(y_true: &Tensor, y_pred: &Tensor, threshold: f64) -> Result<Tensor> {
    let z = y_true.to_dtype(DType::F32)?.reshape(y_pred.shape())?;
    let predicted = y_pred.gt(threshold)?.to_dtype(DType::F32)?;
    let truth = z.gt(0.5)?.to_dtype(DType::F32)?;
    Ok(predicted
        .eq(&truth)?
        .to_dtype(DType::F32)?
        .flatten_from(1)?
        .mean(1)?)
}

/// The `state_size` and `result` of a metric that is a mean over samples: its state is
/// `[sum, count]` ([`sum_and_count`]).
macro_rules! mean_over_samples {
    () => {
        fn state_size(&self) -> usize {
            2
        }
        fn result(&self, state: &[f64]) -> f64 {
            mean_of(state)
        }
    };
}

/// The per-sample mean over features of `f(y_pred - y_true)`, as `[sum, count]`.
fn mean_error(
    y_true: &Tensor,
    y_pred: &Tensor,
    f: fn(&Tensor) -> candle_core::Result<Tensor>,
) -> Result<Tensor> {
    let d = (y_pred - y_true.to_dtype(y_pred.dtype())?.reshape(y_pred.shape())?)?;
    sum_and_count(&f(&d)?.flatten_from(1)?.mean(1)?)
}

/// Fraction of samples whose highest output is the true class, with class-index and one-hot
/// targets alike; for a model of one output unit, the fraction on the right side of 0.5, as
/// Keras's `"accuracy"` resolves to binary accuracy after a sigmoid. Logged as `accuracy`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accuracy;

impl Metric for Accuracy {
    fn name(&self) -> &str {
        "accuracy"
    }
    mean_over_samples!();
    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        let hits = if y_pred.dims().get(1) == Some(&1) && y_pred.rank() == 2 {
            binary_hits(y_true, y_pred, 0.5)?
        } else {
            top_k_hits(y_true, y_pred, 1)?
        };
        sum_and_count(&hits)
    }
}

/// Fraction of 0/1 outputs on the right side of a threshold (default 0.5; use 0 for logits),
/// averaged over each sample's outputs. Logged as `binary_accuracy`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BinaryAccuracy {
    threshold: f64,
}

impl Default for BinaryAccuracy {
    fn default() -> Self {
        Self { threshold: 0.5 }
    }
}

impl BinaryAccuracy {
    /// With threshold 0.5.
    pub fn new() -> Self {
        Self::default()
    }

    /// Outputs above `threshold` count as 1.
    pub fn threshold(mut self, threshold: f64) -> Self {
        self.threshold = threshold;
        self
    }
}

impl Metric for BinaryAccuracy {
    fn name(&self) -> &str {
        "binary_accuracy"
    }
    mean_over_samples!();
    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        sum_and_count(&binary_hits(y_true, y_pred, self.threshold)?)
    }
}

/// Fraction of samples whose true class is among the `k` highest outputs, with class-index
/// and one-hot targets alike. Logged as `top_k_categorical_accuracy`, as in Keras.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopKCategoricalAccuracy {
    k: usize,
}

impl TopKCategoricalAccuracy {
    /// The true class among the `k` highest outputs (Keras's default is 5).
    pub fn new(k: usize) -> Self {
        Self { k }
    }
}

impl Default for TopKCategoricalAccuracy {
    fn default() -> Self {
        Self::new(5)
    }
}

impl Metric for TopKCategoricalAccuracy {
    fn name(&self) -> &str {
        "top_k_categorical_accuracy"
    }
    mean_over_samples!();
    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        sum_and_count(&top_k_hits(y_true, y_pred, self.k)?)
    }
    fn check_targets(&self, _targets: &Targets, _output_shape: &[usize]) -> Result<()> {
        if self.k == 0 {
            return Err(crate::Error::invalid(
                "TopKCategoricalAccuracy needs k >= 1",
            ));
        }
        Ok(())
    }
}

/// Mean over samples of the mean squared error over features. Logged as
/// `mean_squared_error`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeanSquaredError;

impl Metric for MeanSquaredError {
    fn name(&self) -> &str {
        "mean_squared_error"
    }
    mean_over_samples!();
    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        mean_error(y_true, y_pred, Tensor::sqr)
    }
}

/// Mean over samples of the mean absolute error over features. Logged as
/// `mean_absolute_error`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeanAbsoluteError;

impl Metric for MeanAbsoluteError {
    fn name(&self) -> &str {
        "mean_absolute_error"
    }
    mean_over_samples!();
    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        mean_error(y_true, y_pred, Tensor::abs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn value(m: &dyn Metric, y: &Tensor, out: &Tensor) -> Result<f64> {
        let state: Vec<f64> = m
            .batch_state(y, out)?
            .to_vec1::<f32>()?
            .into_iter()
            .map(f64::from)
            .collect();
        Ok(m.result(&state))
    }

    #[test]
    fn accuracy_and_top_k() -> Result<()> {
        let dev = Device::Cpu;
        let out = Tensor::new(
            &[[0.1f32, 0.7, 0.2], [0.5, 0.2, 0.3], [0.2, 0.3, 0.5]],
            &dev,
        )?;
        let sparse = Tensor::new(&[1u32, 2, 0], &dev)?;
        let onehot = Tensor::new(&[[0f32, 1., 0.], [0., 0., 1.], [1., 0., 0.]], &dev)?;
        assert_eq!(value(&Accuracy, &sparse, &out)?, 1.0 / 3.0);
        assert_eq!(value(&Accuracy, &onehot, &out)?, 1.0 / 3.0);
        assert_eq!(
            value(&TopKCategoricalAccuracy::new(2), &sparse, &out)?,
            2.0 / 3.0
        );
        assert_eq!(value(&TopKCategoricalAccuracy::new(3), &sparse, &out)?, 1.0);
        Ok(())
    }

    #[test]
    fn binary_accuracy_and_accuracy_on_one_output() -> Result<()> {
        let dev = Device::Cpu;
        let out = Tensor::new(&[[0.9f32], [0.4], [0.6], [0.1]], &dev)?;
        let labels = Tensor::new(&[1u32, 1, 0, 0], &dev)?;
        assert_eq!(value(&BinaryAccuracy::new(), &labels, &out)?, 0.5);
        assert_eq!(value(&Accuracy, &labels, &out)?, 0.5);
        assert_eq!(
            value(&BinaryAccuracy::new().threshold(0.05), &labels, &out)?,
            0.5
        );
        let two = Tensor::new(&[[0.9f32, 0.2], [0.1, 0.7]], &dev)?;
        let z = Tensor::new(&[[1f32, 1.], [0., 1.]], &dev)?;
        assert_eq!(value(&BinaryAccuracy::new(), &z, &two)?, 0.75);
        Ok(())
    }

    #[test]
    fn states_of_split_batches_add_up_to_the_whole() -> Result<()> {
        let dev = Device::Cpu;
        let out = Tensor::new(&[[1f32, 2.], [0., 0.], [3., 3.]], &dev)?;
        let y = Tensor::new(&[[0f32, 0.], [1., 1.], [3., 1.]], &dev)?;
        let metrics = Metrics::from((MeanSquaredError, MeanAbsoluteError));
        let state = |a: usize, n: usize| -> Result<Vec<f64>> {
            let parts = metrics.batch_states(&y.narrow(0, a, n)?, &out.narrow(0, a, n)?)?;
            let v = Tensor::cat(&parts, 0)?.to_vec1::<f32>()?;
            Ok(v.into_iter().map(f64::from).collect())
        };
        let whole = state(0, 3)?;
        let split: Vec<f64> = state(0, 2)?
            .iter()
            .zip(state(2, 1)?)
            .map(|(a, b)| a + b)
            .collect();
        assert_eq!(whole, split);
        let results: Vec<(&str, f64)> = metrics.results(&whole).collect();
        assert_eq!(results[0], ("mean_squared_error", (2.5 + 1.0 + 2.0) / 3.0));
        assert_eq!(results[1], ("mean_absolute_error", (1.5 + 1.0 + 1.0) / 3.0));
        Ok(())
    }
}
