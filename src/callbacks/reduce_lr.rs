//! `ReduceLROnPlateau`: multiplies the learning rate by `factor` when the monitored quantity
//! has not improved for `patience` epochs, with Keras's semantics (cooldown, `min_lr`).
//!
//! The rate is changed through [`Model::set_learning_rate`], so the next epoch's steps use it
//! and `fit` logs it as `lr`.

use super::monitor::Monitor;
use super::{state_opt_f64, state_usize, Callback, CallbackState, FitInfo, Logs, Mode};
use crate::{Error, Model, Result};

/// Lowers the learning rate when the monitored quantity plateaus.
///
/// ```no_run
/// use kandle::callbacks::ReduceLROnPlateau;
///
/// // Divide the rate by 5 after 3 epochs without a validation-loss improvement, to 1e-5 at most.
/// let reduce = ReduceLROnPlateau::new("val_loss")
///     .factor(0.2)
///     .patience(3)
///     .min_lr(1e-5);
/// ```
#[derive(Debug, Clone)]
pub struct ReduceLROnPlateau {
    monitor: Monitor,
    factor: f64,
    patience: usize,
    cooldown: usize,
    min_lr: f64,
    verbose: bool,
    best: Option<f64>,
    wait: usize,
    cooldown_counter: usize,
}

impl ReduceLROnPlateau {
    /// Monitors the log key `monitor` with Keras's defaults: factor 0.1, patience 10,
    /// `min_delta` 1e-4, cooldown 0, `min_lr` 0, [`Mode::Auto`].
    pub fn new(monitor: impl Into<String>) -> Self {
        let mut monitor = Monitor::new(monitor);
        monitor.set_min_delta(1e-4);
        Self {
            monitor,
            factor: 0.1,
            patience: 10,
            cooldown: 0,
            min_lr: 0.0,
            verbose: true,
            best: None,
            wait: 0,
            cooldown_counter: 0,
        }
    }

    /// The new rate is the old one times `factor`, which must be in `[0, 1)`; training
    /// begins with an error otherwise.
    pub fn factor(mut self, factor: f64) -> Self {
        self.factor = factor;
        self
    }

    /// Epochs without improvement before the rate is lowered (default 10).
    pub fn patience(mut self, patience: usize) -> Self {
        self.patience = patience;
        self
    }

    /// The smallest change that counts as an improvement (default 1e-4; the sign is ignored).
    pub fn min_delta(mut self, min_delta: f64) -> Self {
        self.monitor.set_min_delta(min_delta);
        self
    }

    /// Epochs after a reduction during which plateaus are not counted (default 0).
    pub fn cooldown(mut self, cooldown: usize) -> Self {
        self.cooldown = cooldown;
        self
    }

    /// The rate is never lowered below this (default 0).
    pub fn min_lr(mut self, min_lr: f64) -> Self {
        self.min_lr = min_lr;
        self
    }

    /// Whether lower or higher values are better (default [`Mode::Auto`]).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.monitor.set_mode(mode);
        self
    }

    /// Whether the chief prints a line on stderr at each reduction (default true).
    pub fn verbose(mut self, verbose: bool) -> Self {
        self.verbose = verbose;
        self
    }

    fn in_cooldown(&self) -> bool {
        self.cooldown_counter > 0
    }
}

impl Callback for ReduceLROnPlateau {
    fn on_train_begin(&mut self, _info: &FitInfo, _model: &mut Model) -> Result<()> {
        if !(0.0..1.0).contains(&self.factor) {
            return Err(Error::invalid(format!(
                "ReduceLROnPlateau needs a factor in [0, 1), got {}",
                self.factor
            )));
        }
        if !self.min_lr.is_finite() || self.min_lr < 0.0 {
            return Err(Error::invalid(format!(
                "ReduceLROnPlateau needs a finite min_lr >= 0, got {}",
                self.min_lr
            )));
        }
        self.best = None;
        self.wait = 0;
        self.cooldown_counter = 0;
        Ok(())
    }

    /// The best value, the patience counter and the cooldown left.
    fn state(&self) -> Option<CallbackState> {
        Some(serde_json::json!({
            "best": self.best,
            "wait": self.wait,
            "cooldown_counter": self.cooldown_counter,
        }))
    }

    fn load_state(&mut self, state: &CallbackState) -> Result<()> {
        self.best = state_opt_f64(state, "best");
        self.wait = state_usize(state, "ReduceLROnPlateau", "wait")?;
        self.cooldown_counter = state_usize(state, "ReduceLROnPlateau", "cooldown_counter")?;
        Ok(())
    }

    fn on_epoch_end(&mut self, epoch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        let Some(current) = self.monitor.value(logs, "ReduceLROnPlateau") else {
            return Ok(());
        };
        if self.in_cooldown() {
            self.cooldown_counter -= 1;
            self.wait = 0;
        }
        if self.monitor.is_improvement(current, self.best) {
            self.best = Some(current);
            self.wait = 0;
        } else if !self.in_cooldown() {
            self.wait += 1;
            if self.wait >= self.patience {
                let old_lr = model.learning_rate();
                // Keras compares in f32, so a rate equal to min_lr up to rounding stays put.
                if (old_lr as f32) > (self.min_lr as f32) {
                    let new_lr = (old_lr * self.factor).max(self.min_lr);
                    model.set_learning_rate(new_lr)?;
                    if self.verbose && model.is_chief() {
                        log::info!(
                            "Epoch {}: ReduceLROnPlateau reducing learning rate to {new_lr:e}.",
                            epoch + 1
                        );
                    }
                    self.cooldown_counter = self.cooldown;
                    self.wait = 0;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::callbacks::test_support::{fit_info, logs, tiny_model};

    /// Feeds `values` of `val_loss`; returns the rate after each epoch.
    fn rates(reduce: &mut ReduceLROnPlateau, values: &[f64]) -> Result<Vec<f64>> {
        let mut model = tiny_model()?;
        model.set_learning_rate(1.0)?;
        reduce.on_train_begin(&fit_info(values.len()), &mut model)?;
        values
            .iter()
            .enumerate()
            .map(|(epoch, v)| {
                reduce.on_epoch_end(epoch, &logs(&[("val_loss", *v)]), &mut model)?;
                Ok(model.learning_rate())
            })
            .collect()
    }

    #[test]
    fn reduces_after_patience_down_to_min_lr() -> Result<()> {
        let mut reduce = ReduceLROnPlateau::new("val_loss")
            .factor(0.5)
            .patience(2)
            .min_lr(0.2)
            .verbose(false);
        assert!(!reduce.chief_only());
        let got = rates(
            &mut reduce,
            &[1.0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9],
        )?;
        assert_eq!(got, [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2, 0.2, 0.2]);
        Ok(())
    }

    #[test]
    fn cooldown_and_min_delta() -> Result<()> {
        // After a reduction, plateaus are not counted while the cooldown runs. As in Keras, the
        // counter is decremented before the check, so a cooldown of 2 skips one epoch.
        let mut reduce = ReduceLROnPlateau::new("val_loss")
            .factor(0.5)
            .patience(1)
            .cooldown(2)
            .verbose(false);
        let got = rates(&mut reduce, &[1.0; 6])?;
        assert_eq!(got, [1.0, 0.5, 0.5, 0.25, 0.25, 0.125]);
        let mut no_cooldown = ReduceLROnPlateau::new("val_loss")
            .factor(0.5)
            .patience(1)
            .verbose(false);
        let got = rates(&mut no_cooldown, &[1.0; 4])?;
        assert_eq!(got, [1.0, 0.5, 0.25, 0.125]);

        // A change smaller than min_delta is a plateau.
        let mut reduce = ReduceLROnPlateau::new("val_loss")
            .factor(0.5)
            .patience(1)
            .min_delta(0.1)
            .verbose(false);
        let got = rates(&mut reduce, &[1.0, 0.95, 0.8, 0.5])?;
        assert_eq!(got, [1.0, 0.5, 0.5, 0.5]);
        Ok(())
    }

    #[test]
    fn bad_factor_is_an_error_and_missing_key_is_ignored() -> Result<()> {
        let mut model = tiny_model()?;
        let err = ReduceLROnPlateau::new("val_loss")
            .factor(1.5)
            .on_train_begin(&fit_info(1), &mut model);
        assert!(matches!(err, Err(Error::InvalidInput(_))));

        let mut reduce = ReduceLROnPlateau::new("val_loss").patience(0);
        reduce.on_train_begin(&fit_info(3), &mut model)?;
        let lr = model.learning_rate();
        for epoch in 0..3 {
            reduce.on_epoch_end(epoch, &logs(&[("loss", 1.0)]), &mut model)?;
        }
        assert_eq!(model.learning_rate(), lr);
        Ok(())
    }
}
