//! `EarlyStopping`: stops training once the monitored quantity has stopped improving, with
//! Keras's semantics.
//!
//! Each epoch whose logs hold the monitored key increments a wait counter; an improvement (by
//! more than `min_delta`, over the best so far and over `baseline` if one is set) resets it.
//! When the counter reaches `patience`, the callback asks the model to stop. With
//! `restore_best_weights`, it keeps a copy of the best epoch's weights and puts them back when
//! training ends, whether it stopped early or ran out of epochs.
//!
//! It runs on every worker, not only the chief: all workers see the same logs and must stop
//! together.

use super::monitor::Monitor;
use super::{
    state_opt_f64, state_opt_usize, state_usize, Callback, CallbackState, FitInfo, Logs, Mode,
};
use crate::params::Weights;
use crate::{Model, Result};

/// Stops training when the monitored quantity stops improving.
///
/// ```no_run
/// use kandle::callbacks::EarlyStopping;
///
/// // Stop after 5 epochs without a validation-loss improvement of at least 1e-3, and keep the
/// // best weights.
/// let stop = EarlyStopping::new("val_loss")
///     .patience(5)
///     .min_delta(1e-3)
///     .restore_best_weights(true);
/// ```
#[derive(Debug, Clone)]
pub struct EarlyStopping {
    monitor: Monitor,
    patience: usize,
    baseline: Option<f64>,
    restore_best_weights: bool,
    verbose: bool,
    wait: usize,
    best: Option<f64>,
    best_epoch: Option<usize>,
    best_weights: Option<Weights>,
    stopped_epoch: Option<usize>,
    last_epoch: Option<usize>,
}

impl EarlyStopping {
    /// Monitors the log key `monitor` (e.g. `val_loss`), with Keras's defaults: patience 0,
    /// `min_delta` 0, [`Mode::Auto`], no baseline and no weight restoring.
    pub fn new(monitor: impl Into<String>) -> Self {
        Self {
            monitor: Monitor::new(monitor),
            patience: 0,
            baseline: None,
            restore_best_weights: false,
            verbose: true,
            wait: 0,
            best: None,
            best_epoch: None,
            best_weights: None,
            stopped_epoch: None,
            last_epoch: None,
        }
    }

    /// Epochs without improvement after which training stops (default 0).
    pub fn patience(mut self, patience: usize) -> Self {
        self.patience = patience;
        self
    }

    /// The smallest change that counts as an improvement (default 0; the sign is ignored).
    pub fn min_delta(mut self, min_delta: f64) -> Self {
        self.monitor.set_min_delta(min_delta);
        self
    }

    /// Whether lower or higher values are better (default [`Mode::Auto`]).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.monitor.set_mode(mode);
        self
    }

    /// A value the monitored quantity must beat: until an epoch beats both it and the best so
    /// far, the wait counter keeps running, so training stops after `patience` epochs if the
    /// baseline is never reached (default `None`).
    pub fn baseline(mut self, baseline: Option<f64>) -> Self {
        self.baseline = baseline;
        self
    }

    /// Whether to put back the best epoch's weights when training ends (default false: the
    /// last step's weights are kept).
    pub fn restore_best_weights(mut self, restore: bool) -> Self {
        self.restore_best_weights = restore;
        self
    }

    /// Whether the chief prints a line on stderr when it stops training and when it restores
    /// weights (default true).
    pub fn verbose(mut self, verbose: bool) -> Self {
        self.verbose = verbose;
        self
    }

    /// The epoch (from 0) at which this callback stopped the last `fit`, if it did.
    pub fn stopped_epoch(&self) -> Option<usize> {
        self.stopped_epoch
    }

    /// The epoch (from 0) with the best monitored value in the last `fit`.
    pub fn best_epoch(&self) -> Option<usize> {
        self.best_epoch
    }

    /// The best monitored value in the last `fit`.
    pub fn best(&self) -> Option<f64> {
        self.best
    }
}

impl Callback for EarlyStopping {
    fn on_train_begin(&mut self, _info: &FitInfo, _model: &mut Model) -> Result<()> {
        self.wait = 0;
        self.best = None;
        self.best_epoch = None;
        self.best_weights = None;
        self.stopped_epoch = None;
        self.last_epoch = None;
        Ok(())
    }

    fn on_epoch_end(&mut self, epoch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        self.last_epoch = Some(epoch);
        let Some(current) = self.monitor.value(logs, "EarlyStopping") else {
            return Ok(());
        };
        if self.restore_best_weights && self.best_weights.is_none() {
            // Until an epoch improves, the first monitored epoch's weights are the best.
            self.best_weights = Some(model.get_weights()?);
            self.best_epoch = Some(epoch);
        }
        self.wait += 1;
        if self.monitor.is_improvement(current, self.best) {
            self.best = Some(current);
            self.best_epoch = Some(epoch);
            if self.restore_best_weights {
                self.best_weights = Some(model.get_weights()?);
            }
            let beats_baseline = match self.baseline {
                Some(baseline) => self.monitor.is_improvement(current, Some(baseline)),
                None => true,
            };
            if beats_baseline {
                self.wait = 0;
            }
            return Ok(());
        }
        if self.wait >= self.patience && epoch > 0 {
            self.stopped_epoch = Some(epoch);
            model.stop_training();
        }
        Ok(())
    }

    /// The patience counter, the best value and its epoch, and the stopped and last epochs.
    /// The best weights (with `restore_best_weights`) are not saved: after a resume the
    /// callback restores the best weights seen since then.
    fn state(&self) -> Option<CallbackState> {
        Some(serde_json::json!({
            "wait": self.wait,
            "best": self.best,
            "best_epoch": self.best_epoch,
            "stopped_epoch": self.stopped_epoch,
            "last_epoch": self.last_epoch,
        }))
    }

    fn load_state(&mut self, state: &CallbackState) -> Result<()> {
        self.wait = state_usize(state, "EarlyStopping", "wait")?;
        self.best = state_opt_f64(state, "best");
        self.best_epoch = state_opt_usize(state, "best_epoch");
        self.stopped_epoch = state_opt_usize(state, "stopped_epoch");
        self.last_epoch = state_opt_usize(state, "last_epoch");
        Ok(())
    }

    fn on_train_end(&mut self, _logs: &Logs, model: &mut Model) -> Result<()> {
        let announce = self.verbose && model.is_chief();
        if let (Some(epoch), true) = (self.stopped_epoch, announce) {
            log::info!("Epoch {}: early stopping", epoch + 1);
        }
        if let Some(weights) = self.best_weights.take() {
            // When the best epoch was the last, the model already holds its weights.
            if self.best_epoch != self.last_epoch {
                if let (Some(best), true) = (self.best_epoch, announce) {
                    log::info!(
                        "Restoring model weights from the end of the best epoch: {}.",
                        best + 1
                    );
                }
                model.set_weights(&weights)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::callbacks::test_support::{fit_info, logs, tiny_model};

    /// Feeds `values` of `loss` epoch by epoch; returns the epochs run before a stop.
    fn run(stop: &mut EarlyStopping, values: &[f64]) -> Result<usize> {
        let mut model = tiny_model()?;
        stop.on_train_begin(&fit_info(values.len()), &mut model)?;
        let mut ran = 0;
        for (epoch, v) in values.iter().enumerate() {
            stop.on_epoch_end(epoch, &logs(&[("loss", *v)]), &mut model)?;
            ran += 1;
            if model.stop_requested() {
                break;
            }
        }
        stop.on_train_end(&Logs::new(), &mut model)?;
        Ok(ran)
    }

    #[test]
    fn a_state_carries_the_patience_across_a_resume() -> Result<()> {
        let values = [1.0, 0.9, 0.95, 0.91, 0.5];
        let mut model = tiny_model()?;
        let mut first = EarlyStopping::new("loss").patience(2);
        first.on_train_begin(&fit_info(5), &mut model)?;
        for (epoch, v) in values[..3].iter().enumerate() {
            first.on_epoch_end(epoch, &logs(&[("loss", *v)]), &mut model)?;
        }
        let state = first
            .state()
            .ok_or_else(|| crate::Error::invalid("no state"))?;
        let mut resumed = EarlyStopping::new("loss").patience(2);
        resumed.on_train_begin(&fit_info(5), &mut model)?;
        resumed.load_state(&state)?;
        // One more epoch without improvement exhausts the patience carried over.
        resumed.on_epoch_end(3, &logs(&[("loss", values[3])]), &mut model)?;
        assert!(model.stop_requested());
        assert_eq!(resumed.stopped_epoch(), Some(3));
        Ok(())
    }

    #[test]
    fn stops_after_patience_epochs_without_improvement() -> Result<()> {
        let mut stop = EarlyStopping::new("loss").patience(2);
        assert!(!stop.chief_only());
        assert_eq!(run(&mut stop, &[1.0, 0.9, 0.95, 0.91, 0.5, 0.4])?, 4);
        assert_eq!(stop.stopped_epoch(), Some(3));
        assert_eq!(stop.best_epoch(), Some(1));
        assert_eq!(stop.best(), Some(0.9));

        // Patience 0 stops at the first epoch that does not improve.
        let mut stop = EarlyStopping::new("loss");
        assert_eq!(run(&mut stop, &[1.0, 0.9, 0.9, 0.1])?, 3);

        // Reused: the state resets at train begin.
        assert_eq!(run(&mut stop, &[3.0, 2.0, 1.0])?, 3);
        assert_eq!(stop.stopped_epoch(), None);
        Ok(())
    }

    #[test]
    fn min_delta_and_mode() -> Result<()> {
        // Improvements smaller than min_delta do not count.
        let mut stop = EarlyStopping::new("loss").patience(1).min_delta(0.1);
        assert_eq!(run(&mut stop, &[1.0, 0.95, 0.92, 0.5])?, 2);

        // In max mode, a falling loss is no improvement.
        let mut stop = EarlyStopping::new("loss").mode(Mode::Max);
        assert_eq!(run(&mut stop, &[1.0, 0.9, 0.8])?, 2);
        Ok(())
    }

    #[test]
    fn baseline_must_be_beaten() -> Result<()> {
        // Never below the baseline of 0.5: the first epoch's improvement does not reset the
        // counter, so the stop comes one epoch sooner than without a baseline.
        let plateau = [0.9; 6];
        let mut stop = EarlyStopping::new("loss").patience(3).baseline(Some(0.5));
        assert_eq!(run(&mut stop, &plateau)?, 3);
        let mut stop = EarlyStopping::new("loss").patience(3);
        assert_eq!(run(&mut stop, &plateau)?, 4);
        // Beating the baseline resets the counter.
        let mut stop = EarlyStopping::new("loss").patience(2).baseline(Some(0.5));
        assert_eq!(run(&mut stop, &[0.9, 0.4, 0.3, 0.2, 0.1])?, 5);
        Ok(())
    }

    #[test]
    fn nan_and_missing_values_do_not_improve_or_panic() -> Result<()> {
        let mut stop = EarlyStopping::new("loss").patience(1);
        assert_eq!(run(&mut stop, &[1.0, f64::NAN, 0.5])?, 2);

        let mut model = tiny_model()?;
        let mut missing = EarlyStopping::new("val_loss");
        missing.on_train_begin(&fit_info(3), &mut model)?;
        for epoch in 0..3 {
            missing.on_epoch_end(epoch, &logs(&[("loss", 1.0)]), &mut model)?;
        }
        assert!(!model.stop_requested());
        Ok(())
    }

    #[test]
    fn restores_the_best_epochs_weights() -> Result<()> {
        let mut model = tiny_model()?;
        let mut stop = EarlyStopping::new("loss")
            .patience(1)
            .restore_best_weights(true);
        stop.on_train_begin(&fit_info(5), &mut model)?;
        let mut snapshots = Vec::new();
        for (epoch, loss) in [1.0, 0.5, 0.7, 0.6].into_iter().enumerate() {
            // Pretend training changed the weights during the epoch.
            let shifted = model
                .get_weights()?
                .into_iter()
                .map(|(k, v)| Ok((k, (v + 1.0)?)))
                .collect::<Result<Weights>>()?;
            model.set_weights(&shifted)?;
            snapshots.push(shifted);
            stop.on_epoch_end(epoch, &logs(&[("loss", loss)]), &mut model)?;
            if model.stop_requested() {
                break;
            }
        }
        assert_eq!(stop.stopped_epoch(), Some(2));
        stop.on_train_end(&Logs::new(), &mut model)?;
        let now = model.get_weights()?;
        for (name, best) in &snapshots[1] {
            assert_eq!(
                now[name].flatten_all()?.to_vec1::<f32>()?,
                best.flatten_all()?.to_vec1::<f32>()?,
                "{name}"
            );
        }
        Ok(())
    }
}
