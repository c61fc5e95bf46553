//! Helpers for the callbacks' unit tests: a tiny compiled model and a `FitInfo`.

use candle_core::{Tensor, Var};

use super::FitInfo;
use crate::layers::{Activation, Dense, Sequential};
use crate::optimizers::{Optimizer, OptimizerConfig};
use crate::{Loss, Metric, Model, OneDeviceStrategy, Result};

/// Plain gradient descent, so these tests need no optimizer from elsewhere.
#[derive(Clone)]
struct PlainGd(f64);

struct PlainGdState(Vec<Var>);

impl OptimizerConfig for PlainGd {
    fn learning_rate(&self) -> f64 {
        self.0
    }
    fn build(&self, params: Vec<Var>) -> Result<Box<dyn Optimizer>> {
        Ok(Box::new(PlainGdState(params)))
    }
    fn clone_config(&self) -> Box<dyn OptimizerConfig> {
        Box::new(self.clone())
    }
}

impl Optimizer for PlainGdState {
    fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        for (var, g) in self.0.iter().zip(grads) {
            var.set(&(var.as_tensor() - (g * lr)?)?)?;
        }
        Ok(())
    }
}

/// A built 4 → 3 softmax classifier on the CPU with learning rate 0.1.
pub(crate) fn tiny_model() -> Result<Model> {
    Sequential::new()
        .input_shape(&[4])
        .add(Dense::new(3))
        .add(Activation::Softmax)
        .compile(
            PlainGd(0.1),
            Loss::SparseCategoricalCrossentropy,
            [Metric::Accuracy],
            &OneDeviceStrategy::cpu(),
        )
}

/// What `fit` would report for `epochs` epochs from 0.
pub(crate) fn fit_info(epochs: usize) -> FitInfo {
    FitInfo {
        epochs,
        initial_epoch: 0,
        steps_per_epoch: 1,
        samples: 8,
        global_batch_size: 8,
        has_validation: false,
    }
}

/// Logs from `(key, value)` pairs.
pub(crate) fn logs(pairs: &[(&str, f64)]) -> super::Logs {
    let mut l = super::Logs::new();
    for (k, v) in pairs {
        l.set(*k, *v);
    }
    l
}
