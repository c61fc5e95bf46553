//! Losses, loss weights and metrics per output of a functional model, as Keras's
//! `compile(loss={...}, loss_weights={...}, metrics={...})`.
//!
//! [`PerOutput`] names a loss (and optionally a weight and metrics) for each output; `compile`
//! binds it to the model's outputs as an [`Objective`], which applies each output's loss to
//! that output's tensor and its targets' tensor, and sums them with their weights. The logs keep Keras's keys: `loss` (the weighted sum), `<output>_loss`
//! (each output's own mean loss), `<output>_<metric>`, and their `val_` forms.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::losses::Loss;
use crate::metrics::{Metric, Metrics};
use crate::objective::{list, Objective, OutputLoss};
use crate::{Error, Result};

/// Per-output losses, loss weights and metrics, for `compile` of a functional model with
/// several outputs. A model of several outputs compiled with a single loss applies it to every
/// output; `compile`'s metrics likewise go to every output.
///
/// ```
/// use kandle::functional::PerOutput;
/// use kandle::losses::{MeanSquaredError, SparseCategoricalCrossentropy};
/// use kandle::metrics::Accuracy;
///
/// let losses = PerOutput::new()
///     .loss("class", SparseCategoricalCrossentropy::new())
///     .loss("size", MeanSquaredError)
///     .weight("size", 0.5)
///     .metric("class", Accuracy);
/// assert_eq!(losses.outputs(), ["class", "size"]);
/// ```
#[derive(Debug, Clone, Default)]
pub struct PerOutput {
    losses: Vec<(String, Arc<dyn Loss>)>,
    weights: Vec<(String, f64)>,
    metrics: Vec<(String, Arc<dyn Metric>)>,
}

impl PerOutput {
    /// No loss yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The loss of the output named `output` (the name of the layer that gives it).
    pub fn loss(mut self, output: &str, loss: impl Loss + 'static) -> Self {
        self.losses.push((output.to_string(), Arc::new(loss)));
        self
    }

    /// The weight of `output`'s loss in the total (default 1).
    pub fn weight(mut self, output: &str, weight: f64) -> Self {
        self.weights.push((output.to_string(), weight));
        self
    }

    /// A metric of `output`, logged as `<output>_<metric name>`.
    pub fn metric(mut self, output: &str, metric: impl Metric + 'static) -> Self {
        self.metrics.push((output.to_string(), Arc::new(metric)));
        self
    }

    /// The outputs given a loss, in order.
    pub fn outputs(&self) -> Vec<&str> {
        self.losses.iter().map(|(name, _)| name.as_str()).collect()
    }

    /// The same loss for every output.
    pub(crate) fn for_all(loss: Arc<dyn Loss>, outputs: &[String]) -> Self {
        Self {
            losses: outputs
                .iter()
                .map(|name| (name.clone(), Arc::clone(&loss)))
                .collect(),
            ..Self::default()
        }
    }

    /// Binds the losses to the outputs named `names`: the objective `compile` keeps, and the
    /// metrics (each output's loss, when there are several, then the per-output metrics and
    /// `common`'s applied to every output), each bound to its output.
    pub(crate) fn bind(self, names: &[String], common: &Metrics) -> Result<(Objective, Metrics)> {
        let known = |name: &str, what: &str| -> Result<()> {
            match names.iter().any(|n| n == name) {
                true => Ok(()),
                false => Err(Error::invalid(format!(
                    "{what} names output `{name}`, but the model's outputs are {}",
                    list(names)
                ))),
            }
        };
        for (name, _) in &self.losses {
            known(name, "a loss")?;
        }
        for (name, _) in &self.weights {
            known(name, "a loss weight")?;
        }
        for (name, _) in &self.metrics {
            known(name, "a metric")?;
        }
        let several = names.len() > 1;
        let mut parts = Vec::with_capacity(names.len());
        let mut metrics = Metrics::new();
        for (output, name) in names.iter().enumerate() {
            let loss = self
                .losses
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, l)| Arc::clone(l))
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "output `{name}` has no loss: give one for each of {}",
                        list(names)
                    ))
                })?;
            let weight = self
                .weights
                .iter()
                .rev()
                .find(|(n, _)| n == name)
                .map_or(1.0, |&(_, w)| w);
            if !(weight.is_finite() && weight >= 0.0) {
                return Err(Error::invalid(format!(
                    "the loss weight of output `{name}` is {weight}; it must be finite and >= 0"
                )));
            }
            let prefixed = |metric: &str| match several {
                true => format!("{name}_{metric}"),
                false => metric.to_string(),
            };
            if several {
                let own_loss = Renamed {
                    name: prefixed("loss"),
                    inner: Arc::new(LossMean(Arc::clone(&loss))),
                };
                metrics = metrics.with_output(Arc::new(own_loss), output);
            }
            let own = self
                .metrics
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, m)| m);
            for metric in own.chain(common.iter()) {
                let renamed = Renamed {
                    name: prefixed(metric.name()),
                    inner: Arc::clone(metric),
                };
                metrics = metrics.with_output(Arc::new(renamed), output);
            }
            parts.push(OutputLoss {
                name: name.clone(),
                loss,
                weight,
            });
        }
        Ok((Objective::per_output(parts), metrics))
    }
}

/// Given to `compile` of a model of one output, or called outside a model, the per-output
/// losses have no outputs to take apart.
impl Loss for PerOutput {
    fn name(&self) -> &str {
        "per_output"
    }

    fn call(&self, _y_true: &Tensor, _y_pred: &Tensor) -> Result<Tensor> {
        Err(Error::invalid(
            "PerOutput losses apply to a functional model's outputs once `compile` binds them",
        ))
    }
}

/// A metric under another name: an output's metric as `<output>_<metric>`.
#[derive(Debug)]
struct Renamed {
    name: String,
    inner: Arc<dyn Metric>,
}

impl Metric for Renamed {
    fn name(&self) -> &str {
        &self.name
    }

    fn state_size(&self) -> usize {
        self.inner.state_size()
    }

    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        self.inner.batch_state(y_true, y_pred)
    }

    fn result(&self, state: &[f64]) -> f64 {
        self.inner.result(state)
    }

    fn check_targets(&self, targets: &crate::data::Targets, output_shape: &[usize]) -> Result<()> {
        self.inner.check_targets(targets, output_shape)
    }
}

/// An output's own loss as a metric: its mean over the samples (unweighted by the output's
/// loss weight, as Keras logs `<output>_loss`).
#[derive(Debug)]
struct LossMean(Arc<dyn Loss>);

impl Metric for LossMean {
    fn name(&self) -> &str {
        "loss"
    }

    fn state_size(&self) -> usize {
        2
    }

    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        let per_sample = self.0.call(y_true, y_pred)?.to_dtype(DType::F32)?;
        let count = per_sample.dim(0)? as f64;
        let sum = per_sample.sum_all()?.reshape(1)?;
        let count = Tensor::new(&[count as f32], per_sample.device())?;
        Ok(Tensor::cat(&[&sum, &count], 0)?)
    }

    fn result(&self, state: &[f64]) -> f64 {
        match state {
            [sum, count] if *count > 0.0 => sum / count,
            _ => f64::NAN,
        }
    }
}
