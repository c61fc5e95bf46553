//! [`Totals`]: the running sums of a pass over the data (`fit`'s epochs, `evaluate`, one
//! batch), turned into the logs the callbacks and the caller see.

use crate::callbacks::Logs;
use crate::metrics::Metrics;
use crate::strategy::StepStats;

/// Running sums of a pass over the data, turned into logs: the mean loss and each metric's
/// result from its summed state.
pub(super) struct Totals {
    metrics: Metrics,
    pub(super) samples: usize,
    pub(super) sums: Vec<f64>,
}

impl Totals {
    pub(super) fn new(metrics: &Metrics) -> Self {
        Self {
            sums: vec![0.0; 1 + metrics.state_size()],
            metrics: metrics.clone(),
            samples: 0,
        }
    }

    /// The totals of one step (a training step when `training`).
    pub(super) fn of(metrics: &Metrics, stats: &StepStats, training: bool) -> Self {
        let mut totals = Self::new(metrics);
        if training {
            totals.add_training_step(stats);
        } else {
            totals.add(stats);
        }
        totals
    }

    pub(super) fn add(&mut self, stats: &StepStats) {
        self.samples += stats.samples;
        for (total, s) in self.sums.iter_mut().zip(&stats.sums) {
            *total += s;
        }
    }

    /// Adds a training step. A step that could not be applied had a non-finite loss or
    /// gradient; the epoch's loss reports it as NaN, so `TerminateOnNaN` sees it even when the
    /// loss itself was finite (a NaN gradient behind a finite loss).
    pub(super) fn add_training_step(&mut self, stats: &StepStats) {
        self.add(stats);
        if !stats.applied && stats.samples > 0 {
            if let Some(loss) = self.sums.first_mut() {
                *loss = f64::NAN;
            }
        }
    }

    pub(super) fn logs(&self) -> Logs {
        let mut logs = Logs::new();
        logs.set("loss", self.sums[0] / self.samples.max(1) as f64);
        for (name, value) in self.metrics.results(&self.sums[1..]) {
            logs.set(name.to_string(), value);
        }
        logs
    }
}
