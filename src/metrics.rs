//! Metrics: accuracy (categorical or sparse), top-k accuracy, MSE and MAE.
//!
//! Each metric yields a per-batch *sum* on the device; `fit` adds the sums of all steps (and,
//! under a distribution strategy, of all replicas) and divides by the sample count, so the
//! reported value is exact whatever the batch split.

use candle_core::{DType, Tensor, D};

use crate::{Loss, Result};

/// A quantity reported alongside the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Metric {
    /// Fraction of samples whose highest output is the true class. Works with class-index and
    /// one-hot targets alike, as Keras's `"accuracy"`. Logged as `accuracy`.
    Accuracy,
    /// Fraction of samples whose true class is among the `k` highest outputs. Logged as
    /// `top_k_accuracy` with `k` spelled out, e.g. `top_5_accuracy`.
    TopKAccuracy(usize),
    /// Mean squared error. Logged as `mse`.
    MeanSquaredError,
    /// Mean absolute error. Logged as `mae`.
    MeanAbsoluteError,
}

impl Metric {
    /// The key in the logs.
    pub fn name(self) -> String {
        match self {
            Metric::Accuracy => "accuracy".into(),
            Metric::TopKAccuracy(k) => format!("top_{k}_accuracy"),
            Metric::MeanSquaredError => "mse".into(),
            Metric::MeanAbsoluteError => "mae".into(),
        }
    }

    /// The metric summed over the batch, as an `f32` scalar on the output's device. `y` holds
    /// `u32` class indices or `f32` values, as for [`Loss::per_sample`].
    pub fn batch_sum(self, output: &Tensor, y: &Tensor, _loss: Loss) -> Result<Tensor> {
        let output = output.detach();
        Ok(match self {
            Metric::Accuracy => top_k_hits(&output, y, 1)?,
            Metric::TopKAccuracy(k) => top_k_hits(&output, y, k)?,
            Metric::MeanSquaredError => {
                let d = (&output - y.to_dtype(output.dtype())?)?;
                d.sqr()?.flatten_from(1)?.mean(1)?.sum_all()?
            }
            Metric::MeanAbsoluteError => {
                let d = (&output - y.to_dtype(output.dtype())?)?;
                d.abs()?.flatten_from(1)?.mean(1)?.sum_all()?
            }
        }
        .to_dtype(DType::F32)?)
    }
}

/// Number of rows whose true class ranks among the `k` highest scores. The rank is the count of
/// classes scoring strictly higher than the true one, so ties count in the sample's favour.
fn top_k_hits(output: &Tensor, y: &Tensor, k: usize) -> Result<Tensor> {
    let classes = if y.dtype() == DType::U32 {
        y.clone()
    } else {
        y.argmax(D::Minus1)?
    };
    let true_score = output.gather(&classes.to_dtype(DType::U32)?.unsqueeze(1)?, 1)?;
    let higher = output
        .broadcast_gt(&true_score)?
        .to_dtype(DType::F32)?
        .sum(1)?;
    Ok(higher.lt(k as f64)?.to_dtype(DType::F32)?.sum_all()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn accuracy_and_top_k() -> Result<()> {
        let dev = Device::Cpu;
        let out = Tensor::new(
            &[[0.1f32, 0.7, 0.2], [0.5, 0.2, 0.3], [0.2, 0.3, 0.5]],
            &dev,
        )?;
        let sparse = Tensor::new(&[1u32, 2, 0], &dev)?;
        let onehot = Tensor::new(&[[0f32, 1., 0.], [0., 0., 1.], [1., 0., 0.]], &dev)?;
        let loss = Loss::SparseCategoricalCrossentropy;
        let sum =
            |m: Metric, y: &Tensor| -> Result<f32> { Ok(m.batch_sum(&out, y, loss)?.to_scalar()?) };
        assert_eq!(sum(Metric::Accuracy, &sparse)?, 1.0);
        assert_eq!(sum(Metric::Accuracy, &onehot)?, 1.0);
        assert_eq!(sum(Metric::TopKAccuracy(2), &sparse)?, 2.0);
        assert_eq!(sum(Metric::TopKAccuracy(3), &sparse)?, 3.0);
        assert_eq!(Metric::TopKAccuracy(5).name(), "top_5_accuracy");
        Ok(())
    }
}
