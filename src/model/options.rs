//! The options of [`Model::fit`], [`Model::evaluate`] and [`Model::predict`], with Keras's
//! defaults. `evaluate` and `predict` also take a plain batch size, which converts into their
//! options.
//!
//! [`Model::fit`]: crate::Model::fit
//! [`Model::evaluate`]: crate::Model::evaluate
//! [`Model::predict`]: crate::Model::predict

use std::collections::HashMap;
use std::sync::Arc;

use crate::callbacks::{Callback, Verbosity};
use crate::data::{Augment, Dataset};
use crate::preemption::StopSignal;

/// Options of [`Model::fit`](crate::Model::fit), with Keras's defaults.
pub struct FitOptions<'a> {
    /// Train until this epoch (exclusive), counted from 0. Default 1.
    pub epochs: usize,
    /// Samples per replica per step; the global batch is this times the number of replicas.
    /// Default 32.
    pub batch_size_per_replica: usize,
    /// Data evaluated after each epoch (every `validation_freq` epochs), logged with a `val_`
    /// prefix.
    pub validation: Option<&'a dyn Dataset>,
    /// Fraction of the training data, taken from its end before shuffling, held out for
    /// validation instead of `validation`. Default 0.
    pub validation_split: f64,
    /// Validate after every this many epochs (after epochs `f - 1`, `2f - 1`, ...; Keras's
    /// integer `validation_freq`). Default 1.
    pub validation_freq: usize,
    /// Shuffle the training data each epoch. Default true.
    pub shuffle: bool,
    /// Seed for shuffling; the model's seed when `None`.
    pub seed: Option<u64>,
    /// Callbacks, run in order after the built-in history.
    pub callbacks: Vec<Box<dyn Callback>>,
    /// The first epoch to run, to resume training. Default 0.
    pub initial_epoch: usize,
    /// Drop a short last batch instead of training on it. Default false: the short batch is
    /// used and weighted by its true size.
    pub drop_remainder: bool,
    /// Stop each epoch after this many steps (smoke runs). Default: the whole dataset.
    pub steps_per_epoch: Option<usize>,
    /// What to print. Default [`Verbosity::Auto`].
    pub verbosity: Verbosity,
    /// A random transform of each training sample (e.g. [`RandomShiftFlip`]), applied in the
    /// loader's parallel batch assembly, seeded per sample so runs repeat exactly. Validation
    /// and evaluation data are never augmented. Default none.
    ///
    /// [`RandomShiftFlip`]: crate::data::RandomShiftFlip
    pub augment: Option<Arc<dyn Augment>>,
    /// One weight per training sample, in the dataset's order (Keras's `sample_weight`): each
    /// sample's loss is multiplied by it. The loss stays divided by the number of samples, as
    /// Keras's `sum_over_batch_size`. Default none.
    pub sample_weight: Option<&'a [f32]>,
    /// A weight per class (Keras's `class_weight`): each training sample's loss is multiplied
    /// by its class's weight (classes not listed weigh 1). Works with class-index and one-hot
    /// targets. Default none.
    pub class_weight: Option<HashMap<usize, f32>>,
    /// A request to stop cleanly (SIGTERM from a scheduler, Ctrl-C; see
    /// [`crate::preemption`]): once raised, `fit` ends after the current step, writes the
    /// [`BackupAndRestore`](crate::callbacks::BackupAndRestore) backup there, and returns the
    /// history marked [`preempted`](crate::callbacks::History::preempted). Default none.
    pub stop_signal: Option<StopSignal>,
}

impl Default for FitOptions<'_> {
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size_per_replica: 32,
            validation: None,
            validation_split: 0.0,
            validation_freq: 1,
            shuffle: true,
            seed: None,
            callbacks: Vec::new(),
            initial_epoch: 0,
            drop_remainder: false,
            steps_per_epoch: None,
            verbosity: Verbosity::Auto,
            augment: None,
            sample_weight: None,
            class_weight: None,
            stop_signal: None,
        }
    }
}

/// Options of [`Model::evaluate`](crate::Model::evaluate). A plain number converts into options
/// with that batch size.
pub struct EvaluateOptions<'a> {
    /// Samples per replica per step, as in [`FitOptions`]. Default 32.
    pub batch_size_per_replica: usize,
    /// Callbacks; their `on_test_*` hooks run. Default none.
    pub callbacks: Vec<Box<dyn Callback>>,
    /// One weight per sample, in the dataset's order, for the loss. Default none.
    pub sample_weight: Option<&'a [f32]>,
}

impl Default for EvaluateOptions<'_> {
    fn default() -> Self {
        Self {
            batch_size_per_replica: 32,
            callbacks: Vec::new(),
            sample_weight: None,
        }
    }
}

impl From<usize> for EvaluateOptions<'_> {
    fn from(batch_size_per_replica: usize) -> Self {
        Self {
            batch_size_per_replica,
            ..Default::default()
        }
    }
}

/// Options of [`Model::predict`](crate::Model::predict). A plain number converts into options
/// with that batch size.
pub struct PredictOptions {
    /// Samples per replica per step, as in [`FitOptions`]. Default 32.
    pub batch_size_per_replica: usize,
    /// Callbacks; their `on_predict_*` hooks run. Default none.
    pub callbacks: Vec<Box<dyn Callback>>,
}

impl Default for PredictOptions {
    fn default() -> Self {
        Self {
            batch_size_per_replica: 32,
            callbacks: Vec::new(),
        }
    }
}

impl From<usize> for PredictOptions {
    fn from(batch_size_per_replica: usize) -> Self {
        Self {
            batch_size_per_replica,
            ..Default::default()
        }
    }
}
