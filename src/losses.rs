//! Losses: categorical and sparse categorical cross-entropy (from probabilities or logits) and
//! mean squared error, computed per sample.
//!
//! Cross-entropy from probabilities is numerically stable: when the model ends in a softmax,
//! the loss is computed from the logits before it with `log_softmax` (as Keras does); otherwise
//! probabilities are clipped to `[1e-7, 1 - 1e-7]`. Per-sample losses let a short last batch,
//! or a batch split unevenly across replicas, be weighted by its true sample count.

use candle_core::{DType, Tensor, D};

use crate::data::Targets;
use crate::layers::activation_log_softmax as log_softmax;
use crate::{Error, Result};

/// The objective minimised by `fit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Loss {
    /// Cross-entropy between one-hot (or soft) targets and predicted probabilities.
    CategoricalCrossentropy,
    /// Cross-entropy between one-hot (or soft) targets and logits.
    CategoricalCrossentropyFromLogits,
    /// Cross-entropy between class-index targets and predicted probabilities.
    SparseCategoricalCrossentropy,
    /// Cross-entropy between class-index targets and logits.
    SparseCategoricalCrossentropyFromLogits,
    /// Mean over features of the squared error.
    MeanSquaredError,
}

const PROB_EPSILON: f64 = 1e-7;

impl Loss {
    /// The name used in logs.
    pub fn name(self) -> &'static str {
        match self {
            Loss::CategoricalCrossentropy | Loss::CategoricalCrossentropyFromLogits => {
                "categorical_crossentropy"
            }
            Loss::SparseCategoricalCrossentropy | Loss::SparseCategoricalCrossentropyFromLogits => {
                "sparse_categorical_crossentropy"
            }
            Loss::MeanSquaredError => "mean_squared_error",
        }
    }

    /// Whether the loss takes class indices as targets.
    pub fn is_sparse(self) -> bool {
        matches!(
            self,
            Loss::SparseCategoricalCrossentropy | Loss::SparseCategoricalCrossentropyFromLogits
        )
    }

    fn takes_logits(self) -> bool {
        matches!(
            self,
            Loss::CategoricalCrossentropyFromLogits | Loss::SparseCategoricalCrossentropyFromLogits
        )
    }

    /// Checks that a dataset's targets suit this loss and a model with `output_shape`.
    pub fn check_targets(self, targets: &Targets, output_shape: &[usize]) -> Result<()> {
        let out = crate::error::shape_with_batch(output_shape);
        match (self.is_sparse(), targets) {
            (true, Targets::Classes(k)) => {
                if output_shape.len() != 1 || output_shape[0] < *k {
                    return Err(Error::invalid(format!(
                        "labels have {k} classes but the model outputs {out}; \
                         the last layer needs at least {k} units"
                    )));
                }
            }
            (true, Targets::Values(shape)) => {
                return Err(Error::invalid(format!(
                    "{} takes class-index labels, but the targets are values of shape {shape:?}; \
                     use {} for one-hot targets",
                    self.name(),
                    if self.takes_logits() {
                        "Loss::CategoricalCrossentropyFromLogits"
                    } else {
                        "Loss::CategoricalCrossentropy"
                    }
                )))
            }
            (false, Targets::Classes(_)) => {
                return Err(Error::invalid(format!(
                    "{} takes dense (e.g. one-hot) targets, but the labels are class indices; \
                     use Loss::SparseCategoricalCrossentropy or one-hot the labels",
                    self.name()
                )))
            }
            (false, Targets::Values(shape)) => {
                if shape.as_slice() != output_shape {
                    return Err(Error::invalid(format!(
                        "targets have shape {} but the model outputs {out}",
                        crate::error::shape_with_batch(shape)
                    )));
                }
            }
        }
        Ok(())
    }

    /// The loss of each sample, `(batch,)`. `output` is the model's output; `logits` the input
    /// of its final softmax, when it ends in one. `y` is `u32` class indices for the sparse
    /// losses, `f32` values otherwise.
    pub fn per_sample(
        self,
        output: &Tensor,
        logits: Option<&Tensor>,
        y: &Tensor,
    ) -> Result<Tensor> {
        let log_probs = || -> Result<Tensor> {
            match (self.takes_logits(), logits) {
                (true, _) => log_softmax(output),
                (false, Some(logits)) => log_softmax(logits),
                (false, None) => Ok(output.clamp(PROB_EPSILON, 1.0 - PROB_EPSILON)?.log()?),
            }
        };
        Ok(match self {
            Loss::CategoricalCrossentropy | Loss::CategoricalCrossentropyFromLogits => {
                (log_probs()? * y.to_dtype(output.dtype())?)?
                    .sum(D::Minus1)?
                    .neg()?
            }
            Loss::SparseCategoricalCrossentropy | Loss::SparseCategoricalCrossentropyFromLogits => {
                let idx = y.to_dtype(DType::U32)?.unsqueeze(1)?;
                log_probs()?.gather(&idx, 1)?.squeeze(1)?.neg()?
            }
            Loss::MeanSquaredError => {
                let diff = (output - y.to_dtype(output.dtype())?)?;
                diff.sqr()?.flatten_from(1)?.mean(1)?
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

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
        let cases = [
            Loss::SparseCategoricalCrossentropyFromLogits.per_sample(&logits, None, &sparse)?,
            Loss::SparseCategoricalCrossentropy.per_sample(&probs, None, &sparse)?,
            Loss::SparseCategoricalCrossentropy.per_sample(&probs, Some(&logits), &sparse)?,
            Loss::CategoricalCrossentropy.per_sample(&probs, Some(&logits), &onehot)?,
            Loss::CategoricalCrossentropyFromLogits.per_sample(&logits, None, &onehot)?,
        ];
        for got in cases {
            let got = got.to_vec1::<f32>()?;
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
        let fused = Loss::SparseCategoricalCrossentropy.per_sample(&probs, Some(&logits), &y)?;
        assert!((fused.to_vec1::<f32>()?[0] - 200.0).abs() < 1e-3);
        let clipped = Loss::SparseCategoricalCrossentropy.per_sample(&probs, None, &y)?;
        assert!(clipped.to_vec1::<f32>()?[0].is_finite());
        Ok(())
    }

    #[test]
    fn mse_and_target_checks() -> Result<()> {
        let dev = Device::Cpu;
        let out = Tensor::new(&[[1f32, 2.], [0., 0.]], &dev)?;
        let y = Tensor::new(&[[0f32, 0.], [1., 1.]], &dev)?;
        assert_eq!(
            Loss::MeanSquaredError
                .per_sample(&out, None, &y)?
                .to_vec1::<f32>()?,
            vec![2.5, 1.0]
        );
        assert!(Loss::SparseCategoricalCrossentropy
            .check_targets(&Targets::Classes(10), &[10])
            .is_ok());
        let e = Loss::SparseCategoricalCrossentropy.check_targets(&Targets::Classes(12), &[10]);
        assert!(e.is_err_and(|e| e.to_string().contains("12 classes")));
        assert!(Loss::CategoricalCrossentropy
            .check_targets(&Targets::Classes(10), &[10])
            .is_err());
        assert!(Loss::MeanSquaredError
            .check_targets(&Targets::Values(vec![3]), &[2])
            .is_err());
        Ok(())
    }
}
