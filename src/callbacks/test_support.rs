//! Helpers for the callbacks' unit tests: a tiny compiled model and a `FitInfo`.

use super::FitInfo;
use crate::layers::{Activation, Dense, Sequential};
use crate::losses::SparseCategoricalCrossentropy;
use crate::metrics::Accuracy;
use crate::optimizers::Sgd;
use crate::Compile;
use crate::{Model, OneDeviceStrategy, Result};

/// A built 4 → 3 softmax classifier on the CPU with learning rate 0.1.
pub(crate) fn tiny_model() -> Result<Model> {
    Sequential::new()
        .input_shape(&[4])
        .add(Dense::new(3))
        .add(Activation::Softmax)
        .compile(
            Sgd::new(0.1),
            SparseCategoricalCrossentropy::new(),
            [Accuracy],
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
