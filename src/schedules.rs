//! Learning-rate schedules: functions from the epoch (counted from 0) to a learning rate.
//!
//! A [`Schedule`] is anything that maps an epoch to a rate, closures included. The
//! `LearningRateScheduler` callback asks it for a rate before every epoch and hands that rate
//! to the model, which passes it to every optimizer step. The schedules here are the usual
//! Keras ones:
//! - [`PolynomialDecay`]: from a base rate down to 0 at a last epoch (`poly_decay` of the Keras
//!   multi-GPU tutorial; linear with power 1);
//! - [`StepDecay`]: multiply by a factor every few epochs;
//! - [`CosineDecay`]: half a cosine from the initial rate down to a floor;
//! - [`LinearWarmup`]: ramp any other schedule up over its first epochs.
//!
//! Constructors never fail. Degenerate settings (a decay over 0 epochs, a step every 0 epochs)
//! have a documented meaning instead; the callback rejects a rate that is not finite or is
//! negative when it is used.
//!
//! ```
//! use kandle::schedules::{LinearWarmup, PolynomialDecay, Schedule};
//!
//! let poly = PolynomialDecay::new(0.1, 4, 1.0);
//! assert_eq!(poly.learning_rate(2), 0.05);
//! let warm = LinearWarmup::new(poly, 1);
//! assert_eq!(warm.learning_rate(0), 0.05); // 0.1 * 1/2
//! let halve_every_10 = |epoch: usize| 0.1 * 0.5f64.powi((epoch / 10) as i32);
//! assert_eq!(halve_every_10.learning_rate(25), 0.025);
//! ```

/// A learning rate for each epoch, counted from 0. Any `Fn(usize) -> f64` is a schedule.
pub trait Schedule: Send + Sync {
    /// The learning rate for `epoch`.
    fn learning_rate(&self, epoch: usize) -> f64;
}

impl<F: Fn(usize) -> f64 + Send + Sync> Schedule for F {
    fn learning_rate(&self, epoch: usize) -> f64 {
        self(epoch)
    }
}

impl Schedule for Box<dyn Schedule> {
    fn learning_rate(&self, epoch: usize) -> f64 {
        (**self).learning_rate(epoch)
    }
}

/// `base_lr * (1 - epoch / max_epochs)^power`: from `base_lr` at epoch 0 down to 0 at
/// `max_epochs`.
///
/// This is `poly_decay` from the Keras multi-GPU tutorial; a power of 1 decays linearly.
/// From `max_epochs` on (and always, when `max_epochs` is 0) the rate is 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolynomialDecay {
    base_lr: f64,
    max_epochs: usize,
    power: f64,
}

impl PolynomialDecay {
    /// Decay from `base_lr` to 0 over `max_epochs` epochs with exponent `power`.
    pub fn new(base_lr: f64, max_epochs: usize, power: f64) -> Self {
        Self {
            base_lr,
            max_epochs,
            power,
        }
    }
}

impl Schedule for PolynomialDecay {
    fn learning_rate(&self, epoch: usize) -> f64 {
        if epoch >= self.max_epochs {
            return 0.0;
        }
        let remaining = 1.0 - epoch as f64 / self.max_epochs as f64;
        self.base_lr * remaining.powf(self.power)
    }
}

/// `initial_lr * factor^floor(epoch / every_epochs)`: multiply the rate by `factor` every
/// `every_epochs` epochs.
///
/// An `every_epochs` of 0 is taken as 1 (a step every epoch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDecay {
    initial_lr: f64,
    factor: f64,
    every_epochs: usize,
}

impl StepDecay {
    /// Start at `initial_lr` and multiply by `factor` (e.g. 0.5) every `every_epochs` epochs.
    pub fn new(initial_lr: f64, factor: f64, every_epochs: usize) -> Self {
        Self {
            initial_lr,
            factor,
            every_epochs,
        }
    }
}

impl Schedule for StepDecay {
    fn learning_rate(&self, epoch: usize) -> f64 {
        let steps = epoch / self.every_epochs.max(1);
        // Beyond i32::MAX steps, any factor below 1 has long reached 0 anyway.
        let steps = i32::try_from(steps).unwrap_or(i32::MAX);
        self.initial_lr * self.factor.powi(steps)
    }
}

/// Keras's cosine decay: `initial_lr * ((1 - alpha) * 0.5 * (1 + cos(pi * e / d)) + alpha)`
/// with `e = min(epoch, decay_epochs)` and `d = decay_epochs`.
///
/// The rate falls from `initial_lr` at epoch 0 to `alpha * initial_lr` at `decay_epochs`, and
/// stays there. `alpha` defaults to 0; with `decay_epochs` 0 the rate is always the floor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CosineDecay {
    initial_lr: f64,
    decay_epochs: usize,
    alpha: f64,
}

impl CosineDecay {
    /// Decay from `initial_lr` to 0 over `decay_epochs` epochs.
    pub fn new(initial_lr: f64, decay_epochs: usize) -> Self {
        Self {
            initial_lr,
            decay_epochs,
            alpha: 0.0,
        }
    }

    /// Sets the floor, as a fraction of `initial_lr`.
    pub fn alpha(mut self, alpha: f64) -> Self {
        self.alpha = alpha;
        self
    }
}

impl Schedule for CosineDecay {
    fn learning_rate(&self, epoch: usize) -> f64 {
        let progress = if self.decay_epochs == 0 {
            1.0
        } else {
            epoch.min(self.decay_epochs) as f64 / self.decay_epochs as f64
        };
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.initial_lr * ((1.0 - self.alpha) * cosine + self.alpha)
    }
}

/// Ramps another schedule up over its first `warmup_epochs` epochs.
///
/// For `epoch < warmup_epochs` the rate is `inner(epoch) * (epoch + 1) / (warmup_epochs + 1)`;
/// from `warmup_epochs` on it is `inner(epoch)`. Wraps any [`Schedule`]: a concrete one, a
/// closure or a `Box<dyn Schedule>`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearWarmup<S> {
    inner: S,
    warmup_epochs: usize,
}

impl<S: Schedule> LinearWarmup<S> {
    /// Warm `inner` up over `warmup_epochs` epochs (0 leaves it unchanged).
    pub fn new(inner: S, warmup_epochs: usize) -> Self {
        Self {
            inner,
            warmup_epochs,
        }
    }
}

impl<S: Schedule> Schedule for LinearWarmup<S> {
    fn learning_rate(&self, epoch: usize) -> f64 {
        let lr = self.inner.learning_rate(epoch);
        if epoch < self.warmup_epochs {
            lr * (epoch + 1) as f64 / (self.warmup_epochs + 1) as f64
        } else {
            lr
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64) {
        assert!(
            (got - want).abs() <= 1e-12,
            "got {got}, want {want} (difference {})",
            (got - want).abs()
        );
    }

    #[test]
    fn polynomial_decay_linear() {
        let s = PolynomialDecay::new(5e-3, 70, 1.0);
        close(s.learning_rate(0), 5e-3);
        close(s.learning_rate(35), 2.5e-3);
        close(s.learning_rate(69), 5e-3 / 70.0);
        close(s.learning_rate(70), 0.0);
        close(s.learning_rate(1000), 0.0);
    }

    #[test]
    fn polynomial_decay_power() {
        let s = PolynomialDecay::new(0.1, 4, 2.0);
        close(s.learning_rate(0), 0.1);
        close(s.learning_rate(1), 0.1 * 0.75 * 0.75);
        close(s.learning_rate(2), 0.025);
        close(s.learning_rate(3), 0.1 / 16.0);
        close(s.learning_rate(4), 0.0);
    }

    #[test]
    fn polynomial_decay_zero_epochs_is_zero() {
        let s = PolynomialDecay::new(0.1, 0, 1.0);
        assert_eq!(s.learning_rate(0), 0.0);
        assert_eq!(s.learning_rate(5), 0.0);
    }

    #[test]
    fn step_decay() {
        let s = StepDecay::new(0.1, 0.5, 10);
        close(s.learning_rate(0), 0.1);
        close(s.learning_rate(9), 0.1);
        close(s.learning_rate(10), 0.05);
        close(s.learning_rate(19), 0.05);
        close(s.learning_rate(20), 0.025);
        close(s.learning_rate(35), 0.0125);
    }

    #[test]
    fn step_decay_every_zero_means_every_epoch() {
        let s = StepDecay::new(1.0, 0.5, 0);
        close(s.learning_rate(0), 1.0);
        close(s.learning_rate(1), 0.5);
        close(s.learning_rate(3), 0.125);
    }

    #[test]
    fn cosine_decay() {
        let s = CosineDecay::new(0.1, 4);
        close(s.learning_rate(0), 0.1);
        // cos(pi / 4) = sqrt(2) / 2
        close(s.learning_rate(1), 0.1 * 0.5 * (1.0 + 0.5f64.sqrt()));
        close(s.learning_rate(2), 0.05);
        close(s.learning_rate(3), 0.1 * 0.5 * (1.0 - 0.5f64.sqrt()));
        close(s.learning_rate(4), 0.0);
        close(s.learning_rate(9), 0.0);
    }

    #[test]
    fn cosine_decay_alpha() {
        let s = CosineDecay::new(0.2, 2).alpha(0.1);
        close(s.learning_rate(0), 0.2);
        // (1 - 0.1) * 0.5 * (1 + cos(pi / 2)) + 0.1 = 0.55
        close(s.learning_rate(1), 0.2 * 0.55);
        close(s.learning_rate(2), 0.02);
        close(s.learning_rate(7), 0.02);
        let degenerate = CosineDecay::new(0.2, 0).alpha(0.1);
        close(degenerate.learning_rate(0), 0.02);
    }

    #[test]
    fn linear_warmup() {
        let s = LinearWarmup::new(|_: usize| 0.3, 2);
        close(s.learning_rate(0), 0.1);
        close(s.learning_rate(1), 0.2);
        close(s.learning_rate(2), 0.3);
        close(s.learning_rate(10), 0.3);
    }

    #[test]
    fn linear_warmup_wraps_boxed_and_concrete_schedules() {
        let boxed: Box<dyn Schedule> = Box::new(StepDecay::new(0.4, 0.5, 1));
        let s = LinearWarmup::new(boxed, 3);
        close(s.learning_rate(0), 0.4 * 0.25);
        close(s.learning_rate(1), 0.2 * 0.5);
        close(s.learning_rate(2), 0.1 * 0.75);
        close(s.learning_rate(3), 0.05);
        let poly = LinearWarmup::new(PolynomialDecay::new(0.1, 4, 1.0), 0);
        close(poly.learning_rate(0), 0.1);
        close(poly.learning_rate(1), 0.075);
    }
}
