//! The watched quantity shared by [`ModelCheckpoint`](super::ModelCheckpoint),
//! [`EarlyStopping`](super::EarlyStopping) and [`ReduceLROnPlateau`](super::ReduceLROnPlateau):
//! which log key, which direction is better ([`Mode`]), and how much better counts as an
//! improvement (`min_delta`), so the three callbacks agree on what "improved" means.

use super::Logs;

/// Which direction of the monitored quantity is an improvement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Inferred from the key, as Keras does: higher is better for keys containing `acc`, `auc`,
    /// `f1`, `precision` or `recall` (`accuracy`, `val_macro_f1`), lower is better for
    /// everything else (`loss`, `mean_squared_error`).
    #[default]
    Auto,
    /// Lower is better.
    Min,
    /// Higher is better.
    Max,
}

impl Mode {
    /// Whether higher values of `key` are better under this mode.
    pub fn maximizes(self, key: &str) -> bool {
        match self {
            Mode::Auto => ["acc", "auc", "f1", "precision", "recall"]
                .iter()
                .any(|k| key.contains(k)),
            Mode::Min => false,
            Mode::Max => true,
        }
    }
}

/// A log key with a direction and a minimum improvement, read from epoch logs.
#[derive(Debug, Clone)]
pub(crate) struct Monitor {
    key: String,
    mode: Mode,
    min_delta: f64,
    warned_missing: bool,
}

impl Monitor {
    /// Watches `key` in [`Mode::Auto`] with no minimum improvement.
    pub(crate) fn new(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            mode: Mode::Auto,
            min_delta: 0.0,
            warned_missing: false,
        }
    }

    /// Watches `key` instead.
    pub(crate) fn set_key(&mut self, key: impl Into<String>) {
        self.key = key.into();
        self.warned_missing = false;
    }

    /// Sets the direction.
    pub(crate) fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// Sets the smallest change that counts as an improvement; its sign is ignored.
    pub(crate) fn set_min_delta(&mut self, min_delta: f64) {
        self.min_delta = min_delta.abs();
    }

    /// Whether higher values are better.
    pub(crate) fn maximizes(&self) -> bool {
        self.mode.maximizes(&self.key)
    }

    /// Whether `current` beats `reference` by more than `min_delta` in the better direction.
    /// Any value improves on no reference at all; a NaN never improves on anything.
    pub(crate) fn is_improvement(&self, current: f64, reference: Option<f64>) -> bool {
        if current.is_nan() {
            return false;
        }
        match reference {
            None => true,
            Some(best) if self.maximizes() => current - self.min_delta > best,
            Some(best) => current + self.min_delta < best,
        }
    }

    /// The watched value in `logs`. When it is missing, `who` warns on stderr, once per
    /// monitor, naming the keys that are there.
    pub(crate) fn value(&mut self, logs: &Logs, who: &str) -> Option<f64> {
        let value = logs.get(&self.key);
        if value.is_none() && !self.warned_missing {
            self.warned_missing = true;
            let available: Vec<&str> = logs.keys().collect();
            log::warn!(
                "{who} monitors `{}`, which is not in the logs (available: {}); \
                 it is ignored",
                self.key,
                if available.is_empty() {
                    "none".to_string()
                } else {
                    available.join(", ")
                }
            );
        }
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_mode_follows_the_key() {
        assert!(Mode::Auto.maximizes("accuracy"));
        assert!(Mode::Auto.maximizes("val_top_5_accuracy"));
        assert!(!Mode::Auto.maximizes("val_loss"));
        assert!(!Mode::Auto.maximizes("mse"));
        assert!(Mode::Max.maximizes("loss"));
        assert!(!Mode::Min.maximizes("accuracy"));
    }

    #[test]
    fn improvement_respects_direction_and_min_delta() {
        let mut loss = Monitor::new("val_loss");
        assert!(loss.is_improvement(1.0, None));
        assert!(loss.is_improvement(0.9, Some(1.0)));
        assert!(!loss.is_improvement(1.0, Some(1.0)), "equal is not better");
        assert!(!loss.is_improvement(1.1, Some(1.0)));
        loss.set_min_delta(-0.2); // the sign is ignored, as in Keras
        assert!(!loss.is_improvement(0.9, Some(1.0)));
        assert!(loss.is_improvement(0.79, Some(1.0)));

        let mut acc = Monitor::new("val_accuracy");
        assert!(acc.is_improvement(0.6, Some(0.5)));
        assert!(!acc.is_improvement(0.4, Some(0.5)));
        acc.set_min_delta(0.05);
        assert!(!acc.is_improvement(0.54, Some(0.5)));
        assert!(acc.is_improvement(0.56, Some(0.5)));

        acc.set_mode(Mode::Min);
        assert!(acc.is_improvement(0.4, Some(0.5)));
    }

    #[test]
    fn nan_never_improves() {
        let loss = Monitor::new("loss");
        assert!(!loss.is_improvement(f64::NAN, None));
        assert!(!loss.is_improvement(f64::NAN, Some(1.0)));
        assert!(!loss.is_improvement(1.0, Some(f64::NAN)));
        assert!(loss.is_improvement(f64::NEG_INFINITY, Some(1.0)));
    }

    #[test]
    fn missing_key_is_none() {
        let mut m = Monitor::new("val_loss");
        let mut logs = Logs::new();
        logs.set("loss", 0.5);
        assert_eq!(m.value(&logs, "test"), None);
        assert!(m.warned_missing);
        assert_eq!(m.value(&logs, "test"), None);
        logs.set("val_loss", 0.25);
        assert_eq!(m.value(&logs, "test"), Some(0.25));
    }
}
