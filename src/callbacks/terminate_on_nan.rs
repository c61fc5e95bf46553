//! `TerminateOnNaN`: stops training at the first batch whose loss is NaN or infinite, as
//! Keras's `TerminateOnNaN` does.
//!
//! kandle never applies an update whose loss or gradients are not finite, so when this callback
//! stops training the model still holds the weights of the last good step.

use super::{Callback, Logs};
use crate::{Model, Result};

/// Stops training when the loss becomes NaN or infinite. Runs on every worker, so all of them
/// stop together.
///
/// ```no_run
/// use kandle::callbacks::TerminateOnNaN;
/// use kandle::FitOptions;
///
/// let options = FitOptions {
///     callbacks: vec![Box::new(TerminateOnNaN)],
///     ..Default::default()
/// };
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct TerminateOnNaN;

impl Callback for TerminateOnNaN {
    fn on_train_batch_end(&mut self, batch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        let invalid = ["loss", "batch_loss"]
            .iter()
            .filter_map(|k| logs.get(k))
            .any(|v| !v.is_finite());
        if invalid {
            if model.is_chief() {
                log::warn!("Batch {batch}: invalid loss, terminating training");
            }
            model.stop_training();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::callbacks::test_support::{logs, tiny_model};

    #[test]
    fn stops_on_nan_or_infinite_loss_only() -> Result<()> {
        let mut model = tiny_model()?;
        let mut cb = TerminateOnNaN;
        assert!(!cb.chief_only());
        cb.on_train_batch_end(
            0,
            &logs(&[("loss", 0.5), ("accuracy", f64::NAN)]),
            &mut model,
        )?;
        cb.on_train_batch_end(1, &Logs::new(), &mut model)?;
        assert!(!model.stop_requested());
        cb.on_train_batch_end(2, &logs(&[("loss", f64::NAN)]), &mut model)?;
        assert!(model.stop_requested());

        let mut model = tiny_model()?;
        cb.on_train_batch_end(0, &logs(&[("loss", f64::INFINITY)]), &mut model)?;
        assert!(model.stop_requested());

        let mut model = tiny_model()?;
        let batch = logs(&[("loss", 0.5), ("batch_loss", f64::NEG_INFINITY)]);
        cb.on_train_batch_end(0, &batch, &mut model)?;
        assert!(model.stop_requested());
        Ok(())
    }
}
