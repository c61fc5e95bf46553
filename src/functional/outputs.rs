//! Losses, loss weights and metrics per output of a functional model, as Keras's
//! `compile(loss={...}, loss_weights={...}, metrics={...})`.
//!
//! [`PerOutput`] names a loss (and optionally a weight and metrics) for each output; `compile`
//! binds it to the model's outputs. The bound loss takes each output's part of the laid-out
//! predictions and targets (see [`super::packed`]), and its value is the weighted sum of the
//! outputs' losses. The logs keep Keras's keys: `loss` (the weighted sum), `<output>_loss`
//! (each output's own mean loss), `<output>_<metric>`, and their `val_` forms.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::data::Targets;
use crate::error::shape_with_batch;
use crate::losses::Loss;
use crate::metrics::{Metric, Metrics};
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

    /// Binds the losses to the outputs named `names`, of shapes `shapes`: the loss `compile`
    /// keeps, and the metrics (each output's loss, when there are several, then the per-output
    /// metrics and `common`'s applied to every output).
    pub(crate) fn bind(
        self,
        names: &[String],
        shapes: &[Vec<usize>],
        common: &Metrics,
    ) -> Result<(Arc<dyn Loss>, Metrics)> {
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
        let (mut pred_offset, mut target_offset) = (0, 0);
        for (name, shape) in names.iter().zip(shapes) {
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
            let targets = loss.expected_targets(shape);
            let part = Part {
                name: name.clone(),
                shape: shape.clone(),
                pred_offset,
                targets: targets.clone(),
                target_offset,
                loss: Arc::clone(&loss),
                weight,
            };
            pred_offset += shape.iter().product::<usize>();
            target_offset += targets.width();
            let prefixed = |metric: &str| match several {
                true => format!("{name}_{metric}"),
                false => metric.to_string(),
            };
            if several {
                metrics = metrics.with(OutputMetric {
                    name: prefixed("loss"),
                    part: part.clone(),
                    inner: Arc::new(LossMean(loss)),
                });
            }
            let own = self
                .metrics
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, m)| m);
            for metric in own.chain(common.iter()) {
                metrics = metrics.with(OutputMetric {
                    name: prefixed(metric.name()),
                    part: part.clone(),
                    inner: Arc::clone(metric),
                });
            }
            parts.push(part);
        }
        Ok((Arc::new(OutputLosses { parts }), metrics))
    }
}

fn list(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    quoted.join(", ")
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

/// One output's part of the laid-out predictions and targets, and its loss.
#[derive(Debug, Clone)]
struct Part {
    name: String,
    shape: Vec<usize>,
    pred_offset: usize,
    targets: Targets,
    target_offset: usize,
    loss: Arc<dyn Loss>,
    weight: f64,
}

impl Part {
    /// This output's prediction `(batch, shape...)` and targets (class indices as `u32`
    /// `(batch,)`, values as `(batch, shape...)`), from the laid-out ones.
    fn take(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<(Tensor, Tensor)> {
        let batch = y_pred.dim(0)?;
        let with_batch = |shape: &[usize]| {
            let mut dims = vec![batch];
            dims.extend(shape);
            dims
        };
        let size = self.shape.iter().product();
        let pred = y_pred
            .narrow(1, self.pred_offset, size)?
            .reshape(with_batch(&self.shape))?;
        let width = self.targets.width();
        let target = y_true.narrow(1, self.target_offset, width)?;
        let target = match &self.targets {
            Targets::Classes(_) => target.flatten_all()?.to_dtype(DType::U32)?,
            Targets::Values(shape) => target
                .to_dtype(y_pred.dtype())?
                .reshape(with_batch(shape))?,
            Targets::Parts(_) => {
                return Err(Error::invalid(format!(
                    "output `{}`: a loss's targets cannot have parts",
                    self.name
                )))
            }
        };
        Ok((target, pred))
    }
}

/// The bound losses: the weighted sum of every output's loss.
#[derive(Debug)]
struct OutputLosses {
    parts: Vec<Part>,
}

impl Loss for OutputLosses {
    fn name(&self) -> &str {
        "loss"
    }

    fn call(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        let mut total: Option<Tensor> = None;
        for part in &self.parts {
            let (target, pred) = part.take(y_true, y_pred)?;
            let loss = (part.loss.call(&target, &pred)? * part.weight)?;
            total = Some(match total {
                None => loss,
                Some(sum) => (sum + loss)?,
            });
        }
        total.ok_or_else(|| Error::invalid("a model without outputs"))
    }

    fn check_targets(&self, targets: &Targets, _output_shape: &[usize]) -> Result<()> {
        let names: Vec<String> = self.parts.iter().map(|p| p.name.clone()).collect();
        let given = match targets {
            Targets::Parts(given) if given.len() == self.parts.len() => given,
            Targets::Parts(given) => {
                return Err(Error::invalid(format!(
                    "the targets have {} parts but the model has {} outputs ({})",
                    given.len(),
                    self.parts.len(),
                    list(&names)
                )))
            }
            single if self.parts.len() == 1 => std::slice::from_ref(single),
            _ => {
                return Err(Error::invalid(format!(
                    "the model has {} outputs ({}) but the targets are one tensor; give one \
                     target per output (InMemoryDataset::from_parts)",
                    self.parts.len(),
                    list(&names)
                )))
            }
        };
        for (part, target) in self.parts.iter().zip(given) {
            let context = |e: Error| Error::invalid(format!("output `{}`: {e}", part.name));
            part.loss
                .check_targets(target, &part.shape)
                .map_err(context)?;
            if target.width() != part.targets.width() {
                return Err(Error::invalid(format!(
                    "output `{}` {}: its {} takes {:?} but the targets give {target:?}",
                    part.name,
                    shape_with_batch(&part.shape),
                    part.loss.name(),
                    part.targets
                )));
            }
        }
        Ok(())
    }

    fn expected_targets(&self, _output_shape: &[usize]) -> Targets {
        match &self.parts[..] {
            [one] => one.targets.clone(),
            parts => Targets::Parts(parts.iter().map(|p| p.targets.clone()).collect()),
        }
    }
}

/// A metric of one output: the inner metric on that output's part, under its own name.
#[derive(Debug)]
struct OutputMetric {
    name: String,
    part: Part,
    inner: Arc<dyn Metric>,
}

impl Metric for OutputMetric {
    fn name(&self) -> &str {
        &self.name
    }

    fn state_size(&self) -> usize {
        self.inner.state_size()
    }

    fn batch_state(&self, y_true: &Tensor, y_pred: &Tensor) -> Result<Tensor> {
        let (target, pred) = self.part.take(y_true, y_pred)?;
        self.inner.batch_state(&target, &pred)
    }

    fn result(&self, state: &[f64]) -> f64 {
        self.inner.result(state)
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
