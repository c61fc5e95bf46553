//! [`Totals`]: the running sums of a pass over the data (`fit`'s epochs, `evaluate`, one
//! batch), turned into the logs the callbacks and the caller see.

use super::resume::RunningTotals;
use crate::callbacks::{Logs, SKIPPED_STEPS};
use crate::metrics::Metrics;
use crate::strategy::StepStats;

/// Running sums of a pass over the data, turned into logs: the mean loss and each metric's
/// result from its summed state, and in training the steps skipped.
pub(super) struct Totals {
    metrics: Metrics,
    pub(super) samples: usize,
    pub(super) sums: Vec<f64>,
    /// Training steps whose update was skipped; `None` outside training.
    pub(super) skipped: Option<usize>,
}

impl Totals {
    pub(super) fn new(metrics: &Metrics) -> Self {
        Self {
            sums: vec![0.0; 1 + metrics.state_size()],
            metrics: metrics.clone(),
            samples: 0,
            skipped: None,
        }
    }

    /// Totals of a training pass, from `before` (a resumed epoch's) or from nothing.
    pub(super) fn training(metrics: &Metrics, before: Option<RunningTotals>) -> Self {
        let mut totals = Self::new(metrics);
        totals.skipped = Some(0);
        if let Some(before) = before {
            totals.samples = before.samples;
            totals.sums = before.sums;
            totals.skipped = Some(before.skipped);
        }
        totals
    }

    /// The running sums, for a backup.
    pub(super) fn running(&self) -> RunningTotals {
        RunningTotals {
            samples: self.samples,
            sums: self.sums.clone(),
            skipped: self.skipped.unwrap_or(0),
        }
    }

    /// The totals of one step alone (`train_on_batch`, `test_on_batch`). A training step
    /// (`training`) also counts whether it was skipped, and a step skipped for a non-finite
    /// loss or gradient (not a loss-scale overflow, `overflowed`) reports a NaN loss, so
    /// `TerminateOnNaN` sees it even when the loss itself was finite.
    pub(super) fn of(
        metrics: &Metrics,
        stats: &StepStats,
        training: bool,
        overflowed: bool,
    ) -> Self {
        let mut totals = Self::new(metrics);
        totals.add(stats);
        if training {
            let skipped = !stats.applied && stats.samples > 0;
            totals.skipped = Some(usize::from(skipped));
            if skipped && !overflowed {
                totals.sums[0] = f64::NAN;
            }
        }
        totals
    }

    pub(super) fn add(&mut self, stats: &StepStats) {
        self.samples += stats.samples;
        for (total, s) in self.sums.iter_mut().zip(&stats.sums) {
            *total += s;
        }
    }

    /// Adds a training step. A step whose update was skipped is counted in `skipped_steps`;
    /// one skipped for a non-finite loss or gradient leaves the loss and the metrics, which
    /// describe the steps that trained, as they were, so the total loss and every output's
    /// loss agree. One skipped for a loss-scale overflow (`overflowed`: its loss was finite,
    /// and the loss scale handles it) still counts in them, as in Keras.
    pub(super) fn add_training_step(&mut self, stats: &StepStats, overflowed: bool) {
        let skipped = !stats.applied && stats.samples > 0;
        if skipped {
            *self.skipped.get_or_insert(0) += 1;
        }
        if !skipped || overflowed {
            self.add(stats);
        }
    }

    pub(super) fn logs(&self) -> Logs {
        let mut logs = Logs::new();
        // An epoch whose every step was skipped trained on nothing: its loss is unknown.
        let loss = match (self.samples, self.skipped) {
            (0, Some(skipped)) if skipped > 0 => f64::NAN,
            (samples, _) => self.sums[0] / samples.max(1) as f64,
        };
        logs.set("loss", loss);
        for (name, value) in self.metrics.results(&self.sums[1..]) {
            logs.set(name.to_string(), value);
        }
        if let Some(skipped) = self.skipped {
            logs.set(SKIPPED_STEPS, skipped as f64);
        }
        logs
    }
}
