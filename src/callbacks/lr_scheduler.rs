//! The `LearningRateScheduler` callback: sets the learning rate before every epoch.
//!
//! It asks a [`Schedule`] (or a Keras-style `(epoch, lr) -> lr` closure) for the epoch's rate
//! and hands it to the [`Model`], which passes it to every optimizer step of that epoch. The
//! rate then shows up as `lr` in the logs and in the `History`.

use crate::callbacks::Callback;
use crate::schedules::Schedule;
use crate::{Error, Model, Result};

/// Where the rate comes from.
enum Source {
    /// A function of the epoch alone.
    Schedule(Box<dyn Schedule>),
    /// Keras's signature: the epoch and the current rate give the new rate.
    Fn(Box<dyn FnMut(usize, f64) -> f64 + Send>),
}

/// Sets the model's learning rate at the start of every epoch, as Keras's
/// `LearningRateScheduler` does.
///
/// ```
/// use kandle::callbacks::LearningRateScheduler;
/// use kandle::schedules::PolynomialDecay;
///
/// // Linear decay from 0.1 to 0 over 70 epochs.
/// let poly = LearningRateScheduler::new(PolynomialDecay::new(0.1, 70, 1.0));
/// // Keras's closure form: halve the current rate every 10 epochs.
/// let halve = LearningRateScheduler::from_fn(|epoch, lr| {
///     if epoch > 0 && epoch % 10 == 0 { lr * 0.5 } else { lr }
/// });
/// ```
///
/// A rate that is not finite or is negative stops training with
/// [`Error::InvalidInput`](crate::Error::InvalidInput).
pub struct LearningRateScheduler {
    source: Source,
}

impl LearningRateScheduler {
    /// Takes each epoch's rate from `schedule`.
    pub fn new(schedule: impl Schedule + 'static) -> Self {
        Self {
            source: Source::Schedule(Box::new(schedule)),
        }
    }

    /// Takes each epoch's rate from `f(epoch, current_lr)`, Keras's signature.
    pub fn from_fn(f: impl FnMut(usize, f64) -> f64 + Send + 'static) -> Self {
        Self {
            source: Source::Fn(Box::new(f)),
        }
    }
}

impl std::fmt::Debug for LearningRateScheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source = match self.source {
            Source::Schedule(_) => "schedule",
            Source::Fn(_) => "closure",
        };
        f.debug_struct("LearningRateScheduler")
            .field("source", &source)
            .finish()
    }
}

impl Callback for LearningRateScheduler {
    fn on_epoch_begin(&mut self, epoch: usize, model: &mut Model) -> Result<()> {
        let lr = match &mut self.source {
            Source::Schedule(schedule) => schedule.learning_rate(epoch),
            Source::Fn(f) => f(epoch, model.learning_rate()),
        };
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::invalid(format!(
                "LearningRateScheduler: the learning rate for epoch {epoch} must be finite and >= 0, got {lr}"
            )));
        }
        model.set_learning_rate(lr)
    }
}
