//! [`Objective`]: what a model's outputs are scored by. One loss per output with its weight in
//! the total (Keras's `loss` and `loss_weights`), applied to that output's own tensor and its
//! targets' own tensor.
//!
//! `compile` makes it: a single loss for a model of one output, or [`PerOutput`] bound to the
//! outputs by name (see `functional::outputs`). The value differentiated is, per sample, the
//! weighted sum of the outputs' losses.
//!
//! [`PerOutput`]: crate::functional::PerOutput

use std::sync::Arc;

use candle_core::Tensor;

use crate::data::Targets;
use crate::error::shape_with_batch;
use crate::losses::Loss;
use crate::{ComputePath, Error, Result};

/// The losses of a model's outputs and their weights: what a replica differentiates.
///
/// ```
/// use kandle::losses::MeanSquaredError;
/// use kandle::Objective;
///
/// let objective = Objective::new(MeanSquaredError);
/// assert_eq!(objective.outputs(), 1);
/// ```
#[derive(Debug, Clone)]
pub struct Objective {
    outputs: Vec<OutputLoss>,
}

/// One output's loss: the output's name, the loss and its weight in the total.
#[derive(Debug, Clone)]
pub(crate) struct OutputLoss {
    pub(crate) name: String,
    pub(crate) loss: Arc<dyn Loss>,
    pub(crate) weight: f64,
}

impl Objective {
    /// `loss` of a model's only output.
    pub fn new(loss: impl Loss + 'static) -> Self {
        Self::from(Arc::new(loss) as Arc<dyn Loss>)
    }

    /// One loss per output, in the model's order.
    pub(crate) fn per_output(outputs: Vec<OutputLoss>) -> Self {
        Self { outputs }
    }

    /// Number of outputs it scores.
    pub fn outputs(&self) -> usize {
        self.outputs.len()
    }

    /// The loss of the only output, when there is one output.
    pub fn only_loss(&self) -> Option<&Arc<dyn Loss>> {
        match &self.outputs[..] {
            [one] => Some(&one.loss),
            _ => None,
        }
    }

    /// Each sample's loss `(batch,)`: the outputs' losses, weighted and summed, for targets
    /// `targets` and outputs `outputs` (one tensor each, in the model's order); `logits` are
    /// those of the only output's softmax, when the model gives them; `path` is the code path
    /// the model runs ([`Loss::call_on_path`]).
    pub(crate) fn per_sample(
        &self,
        targets: &[Tensor],
        outputs: &[Tensor],
        logits: Option<&Tensor>,
        path: ComputePath,
    ) -> Result<Tensor> {
        if targets.len() != self.outputs.len() || outputs.len() != self.outputs.len() {
            return Err(Error::invalid(format!(
                "the loss scores {} outputs but was given {} outputs and {} targets",
                self.outputs.len(),
                outputs.len(),
                targets.len()
            )));
        }
        if let [one] = &self.outputs[..] {
            return one
                .loss
                .call_on_path(&targets[0], &outputs[0], logits, path);
        }
        let mut total: Option<Tensor> = None;
        for ((part, y), out) in self.outputs.iter().zip(targets).zip(outputs) {
            let y = match y.dtype().is_float() {
                true => y.to_dtype(out.dtype())?,
                false => y.clone(),
            };
            let loss = (part.loss.call(&y, out)? * part.weight)?;
            total = Some(match total {
                None => loss,
                Some(sum) => (sum + loss)?,
            });
        }
        total.ok_or_else(|| Error::invalid("a model without outputs"))
    }

    /// Checks `targets` against the outputs' losses, the outputs having shapes
    /// `output_shapes`: one target per output, each of the kind its loss takes.
    pub(crate) fn check_targets(
        &self,
        targets: &Targets,
        output_shapes: &[Vec<usize>],
    ) -> Result<()> {
        if let ([one], [shape]) = (&self.outputs[..], output_shapes) {
            if !matches!(targets, Targets::Parts(_)) {
                return one.loss.check_targets(targets, shape);
            }
        }
        let names: Vec<String> = self.outputs.iter().map(|p| p.name.clone()).collect();
        if targets.outputs() != self.outputs.len() {
            return Err(Error::invalid(format!(
                "the model has {} output(s) ({}) but the targets have {}; give one target per \
                 output (InMemoryDataset::from_parts)",
                self.outputs.len(),
                list(&names),
                targets.outputs()
            )));
        }
        for (i, (part, shape)) in self.outputs.iter().zip(output_shapes).enumerate() {
            let Some(target) = targets.part(i) else {
                continue;
            };
            let context = |e: Error| Error::invalid(format!("output `{}`: {e}", part.name));
            part.loss.check_targets(target, shape).map_err(context)?;
            let expected = part.loss.expected_targets(shape);
            if target.width() != expected.width() {
                return Err(Error::invalid(format!(
                    "output `{}` {}: its {} takes {expected:?} but the targets give {target:?}",
                    part.name,
                    shape_with_batch(shape),
                    part.loss.name(),
                )));
            }
        }
        Ok(())
    }
}

impl From<Arc<dyn Loss>> for Objective {
    fn from(loss: Arc<dyn Loss>) -> Self {
        Self {
            outputs: vec![OutputLoss {
                name: "output".into(),
                loss,
                weight: 1.0,
            }],
        }
    }
}

/// `` `a`, `b` ``.
pub(crate) fn list(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    quoted.join(", ")
}
