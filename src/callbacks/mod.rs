//! Callbacks: everything observable about training (progress, history, checkpoints, CSV,
//! plots, early stopping, learning-rate changes) hooks into `fit` through [`Callback`].
//!
//! A callback implements only the hooks it needs; the rest default to doing nothing. Hooks get
//! the flat `name -> value` [`Logs`] (`loss`, `accuracy`, `val_loss`, `val_accuracy`, `lr`)
//! and the [`Model`], through which they read and change the learning rate, save or restore
//! weights, or stop training. Epochs are counted from 0, as in Keras.
//!
//! ```
//! use kandle::callbacks::{Callback, Logs};
//! use kandle::Model;
//!
//! /// Stops once training accuracy passes a threshold.
//! struct StopAt(f64);
//!
//! impl Callback for StopAt {
//!     fn on_epoch_end(&mut self, _epoch: usize, logs: &Logs, model: &mut Model) -> kandle::Result<()> {
//!         if logs.get("accuracy").is_some_and(|a| a >= self.0) {
//!             model.stop_training();
//!         }
//!         Ok(())
//!     }
//! }
//! ```

mod backup_and_restore;
mod callback_list;
mod csv_logger;
mod early_stopping;
mod history;
mod logs;
mod lr_scheduler;
mod model_checkpoint;
mod monitor;
mod plot_history;
mod progress;
mod reduce_lr;
mod tensorboard;
mod terminate_on_nan;
#[cfg(test)]
mod test_support;
mod timeline;

pub use backup_and_restore::{BackupAndRestore, SaveFreq};
pub use callback_list::CallbackList;
pub use csv_logger::CsvLogger;
pub use early_stopping::EarlyStopping;
pub use history::History;
pub use logs::{Logs, SKIPPED_STEPS};
pub use lr_scheduler::LearningRateScheduler;
pub use model_checkpoint::ModelCheckpoint;
pub use monitor::Mode;
pub use plot_history::{plot_font, plot_history, PlotHistory};
pub use progress::{ProgressBar, Verbosity};
pub use reduce_lr::ReduceLROnPlateau;
pub use tensorboard::{TensorBoard, UpdateFreq};
pub use terminate_on_nan::TerminateOnNaN;
pub use timeline::Timeline;

use crate::{Error, Model, Result};

/// A callback's saved progress ([`Callback::state`]): JSON, so that any callback can say what
/// it needs, and a backup stays readable.
pub type CallbackState = serde_json::Value;

/// `state[key]` as an optional `f64` (absent or `null` is `None`).
pub(crate) fn state_opt_f64(state: &CallbackState, key: &str) -> Option<f64> {
    state.get(key).and_then(serde_json::Value::as_f64)
}

/// `state[key]` as a `usize`, or an error naming the callback.
pub(crate) fn state_usize(state: &CallbackState, who: &str, key: &str) -> Result<usize> {
    state
        .get(key)
        .and_then(serde_json::Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| bad_state(who, key))
}

/// `state[key]` as an optional `usize` (absent or `null` is `None`).
pub(crate) fn state_opt_usize(state: &CallbackState, key: &str) -> Option<usize> {
    state
        .get(key)
        .and_then(serde_json::Value::as_u64)
        .map(|v| v as usize)
}

fn bad_state(who: &str, key: &str) -> Error {
    Error::invalid(format!(
        "{who}: the saved state has no valid `{key}`; it was written by another callback or \
         version"
    ))
}

/// What `fit` tells callbacks when training begins.
#[derive(Debug, Clone, PartialEq)]
pub struct FitInfo {
    /// The epoch training stops before (the `epochs` option).
    pub epochs: usize,
    /// The first epoch that runs (`initial_epoch`).
    pub initial_epoch: usize,
    /// Steps in each epoch.
    pub steps_per_epoch: usize,
    /// Training samples this process sees per epoch: the whole epoch's for a single-process
    /// strategy, this worker's share under multi-worker training.
    pub samples: usize,
    /// Samples in each step across all replicas.
    pub global_batch_size: usize,
    /// Whether a validation set is evaluated after each epoch.
    pub has_validation: bool,
}

/// A hook into training. Every method has a default that does nothing.
pub trait Callback: Send {
    /// Before the first epoch.
    fn on_train_begin(&mut self, _info: &FitInfo, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// After the last epoch, with the last epoch's logs.
    fn on_train_end(&mut self, _logs: &Logs, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// Before each epoch.
    fn on_epoch_begin(&mut self, _epoch: usize, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// After each epoch (and its validation), with the epoch's averages.
    fn on_epoch_end(&mut self, _epoch: usize, _logs: &Logs, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// Before each training step.
    fn on_train_batch_begin(&mut self, _batch: usize, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// After each training step, with the epoch's running averages so far and `batch_loss`,
    /// the loss of this step alone (NaN when the step was not applied because a loss or
    /// gradient was not finite).
    fn on_train_batch_end(
        &mut self,
        _batch: usize,
        _logs: &Logs,
        _model: &mut Model,
    ) -> Result<()> {
        Ok(())
    }

    /// Before an evaluation: [`Model::evaluate`], or validation at the end of a `fit` epoch.
    fn on_test_begin(&mut self, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// After an evaluation, with its logs (without the `val_` prefix).
    fn on_test_end(&mut self, _logs: &Logs, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// Before each evaluation step.
    fn on_test_batch_begin(&mut self, _batch: usize, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// After each evaluation step, with the evaluation's running averages so far.
    fn on_test_batch_end(&mut self, _batch: usize, _logs: &Logs, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// Before [`Model::predict`] runs.
    fn on_predict_begin(&mut self, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// After [`Model::predict`] has run.
    fn on_predict_end(&mut self, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// Before each prediction step.
    fn on_predict_batch_begin(&mut self, _batch: usize, _model: &mut Model) -> Result<()> {
        Ok(())
    }

    /// After each prediction step, with that step's outputs (on the CPU).
    fn on_predict_batch_end(
        &mut self,
        _batch: usize,
        _outputs: &candle_core::Tensor,
        _model: &mut Model,
    ) -> Result<()> {
        Ok(())
    }

    /// The callback's progress (a best value, a patience counter, what it has written), saved
    /// with the training state so that a resumed `fit` continues it; `None` for a callback
    /// with nothing to save (the default).
    fn state(&self) -> Option<CallbackState> {
        None
    }

    /// Continues from what [`Self::state`] returned, when `fit` resumes from a backup. It runs
    /// after `on_train_begin`. The default ignores it.
    fn load_state(&mut self, _state: &CallbackState) -> Result<()> {
        Ok(())
    }

    /// Whether only the chief worker runs this callback (true for anything that draws or
    /// writes files). Non-chief workers of a multi-worker run skip it.
    fn chief_only(&self) -> bool {
        false
    }

    /// The callback as a trait object, for `FitOptions::callbacks`.
    fn boxed(self) -> Box<dyn Callback>
    where
        Self: Sized + 'static,
    {
        Box::new(self)
    }
}

impl<C: Callback + ?Sized> Callback for Box<C> {
    fn on_train_begin(&mut self, info: &FitInfo, model: &mut Model) -> Result<()> {
        (**self).on_train_begin(info, model)
    }
    fn on_train_end(&mut self, logs: &Logs, model: &mut Model) -> Result<()> {
        (**self).on_train_end(logs, model)
    }
    fn on_epoch_begin(&mut self, epoch: usize, model: &mut Model) -> Result<()> {
        (**self).on_epoch_begin(epoch, model)
    }
    fn on_epoch_end(&mut self, epoch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        (**self).on_epoch_end(epoch, logs, model)
    }
    fn on_train_batch_begin(&mut self, batch: usize, model: &mut Model) -> Result<()> {
        (**self).on_train_batch_begin(batch, model)
    }
    fn on_train_batch_end(&mut self, batch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        (**self).on_train_batch_end(batch, logs, model)
    }
    fn on_test_begin(&mut self, model: &mut Model) -> Result<()> {
        (**self).on_test_begin(model)
    }
    fn on_test_end(&mut self, logs: &Logs, model: &mut Model) -> Result<()> {
        (**self).on_test_end(logs, model)
    }
    fn on_test_batch_begin(&mut self, batch: usize, model: &mut Model) -> Result<()> {
        (**self).on_test_batch_begin(batch, model)
    }
    fn on_test_batch_end(&mut self, batch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        (**self).on_test_batch_end(batch, logs, model)
    }
    fn on_predict_begin(&mut self, model: &mut Model) -> Result<()> {
        (**self).on_predict_begin(model)
    }
    fn on_predict_end(&mut self, model: &mut Model) -> Result<()> {
        (**self).on_predict_end(model)
    }
    fn on_predict_batch_begin(&mut self, batch: usize, model: &mut Model) -> Result<()> {
        (**self).on_predict_batch_begin(batch, model)
    }
    fn on_predict_batch_end(
        &mut self,
        batch: usize,
        outputs: &candle_core::Tensor,
        model: &mut Model,
    ) -> Result<()> {
        (**self).on_predict_batch_end(batch, outputs, model)
    }
    fn state(&self) -> Option<CallbackState> {
        (**self).state()
    }
    fn load_state(&mut self, state: &CallbackState) -> Result<()> {
        (**self).load_state(state)
    }
    fn chief_only(&self) -> bool {
        (**self).chief_only()
    }
}
