//! `ProgressBar`: an indicatif bar with the running loss, metrics and ETA on a terminal, and one
//! Keras-style line per epoch anywhere else (indicatif draws nothing without a TTY).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use super::{Callback, FitInfo, Logs};
use crate::{Model, Result};

/// How much `fit` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verbosity {
    /// Nothing.
    Silent,
    /// A bar when stderr is a terminal, epoch lines otherwise (Keras `verbose=1`).
    #[default]
    Auto,
    /// One line per epoch (Keras `verbose=2`).
    EpochLines,
}

/// Shows training progress on stderr. `fit` adds one unless the verbosity is `Silent`.
pub struct ProgressBar {
    bar: Option<indicatif::ProgressBar>,
    use_bar: bool,
    epochs: usize,
    steps: usize,
    epoch_start: Instant,
    batches_done: usize,
}

impl ProgressBar {
    /// A display for `verbosity` (`Silent` shows nothing).
    pub fn new(verbosity: Verbosity) -> Self {
        Self {
            bar: None,
            use_bar: verbosity == Verbosity::Auto && std::io::stderr().is_terminal(),
            epochs: 0,
            steps: 0,
            epoch_start: Instant::now(),
            batches_done: 0,
        }
    }

    fn epoch_line(&self, epoch: usize, elapsed: Duration, logs: &Logs) -> String {
        let per_step = elapsed.as_secs_f64() * 1e3 / self.batches_done.max(1) as f64;
        format!(
            "Epoch {}/{} - {:.1}s - {:.0}ms/step - {}",
            epoch + 1,
            self.epochs,
            elapsed.as_secs_f64(),
            per_step,
            logs.to_line()
        )
    }
}

impl Callback for ProgressBar {
    fn on_train_begin(&mut self, info: &FitInfo, _model: &mut Model) -> Result<()> {
        self.epochs = info.epochs;
        self.steps = info.steps_per_epoch;
        Ok(())
    }

    fn on_epoch_begin(&mut self, epoch: usize, _model: &mut Model) -> Result<()> {
        self.epoch_start = Instant::now();
        self.batches_done = 0;
        if self.use_bar {
            let bar = indicatif::ProgressBar::new(self.steps as u64);
            let style = indicatif::ProgressStyle::with_template(
                "{prefix} [{bar:30.cyan/blue}] {pos}/{len} - ETA {eta} - {msg}",
            )
            .map_err(|e| crate::Error::invalid(format!("progress bar template: {e}")))?
            .progress_chars("=> ");
            bar.set_style(style);
            bar.set_prefix(format!("Epoch {}/{}", epoch + 1, self.epochs));
            self.bar = Some(bar);
        }
        Ok(())
    }

    fn on_train_batch_end(&mut self, batch: usize, logs: &Logs, _model: &mut Model) -> Result<()> {
        self.batches_done = batch + 1;
        if let Some(bar) = &self.bar {
            bar.set_position((batch + 1) as u64);
            bar.set_message(logs.to_line());
        }
        Ok(())
    }

    fn on_epoch_end(&mut self, epoch: usize, logs: &Logs, _model: &mut Model) -> Result<()> {
        let line = self.epoch_line(epoch, self.epoch_start.elapsed(), logs);
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        eprintln!("{line}");
        Ok(())
    }

    fn chief_only(&self) -> bool {
        true
    }
}
