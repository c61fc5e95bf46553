//! A crash or a preemption on cue, for the tests of `BackupAndRestore` (kandle's and
//! `kandle-strategies`'): a callback that fails one training step, and one that raises a stop
//! signal at one.

use kandle::callbacks::{Callback, Logs};
use kandle::preemption::StopSignal;
use kandle::Model;

/// Fails the step `at` (epoch, step) once armed: a crash in the middle of an epoch.
pub struct Crash {
    /// The `(epoch, step)` to fail, or `None` for a run that does not crash.
    pub at: Option<(usize, usize)>,
    /// The epoch under way (set as each epoch begins; start it at 0).
    pub epoch: usize,
}

impl Callback for Crash {
    fn on_epoch_begin(&mut self, epoch: usize, _model: &mut Model) -> kandle::Result<()> {
        self.epoch = epoch;
        Ok(())
    }

    fn on_train_batch_end(&mut self, step: usize, _l: &Logs, _m: &mut Model) -> kandle::Result<()> {
        if self.at == Some((self.epoch, step)) {
            return Err(kandle::Error::invalid("simulated crash"));
        }
        Ok(())
    }
}

/// Raises `signal` at the end of step `at` (epoch, step), as a SIGTERM arriving during it
/// would: `fit` stops after that step.
pub struct Preempt {
    /// The `(epoch, step)` during which the signal comes, or `None` for a run without one.
    pub at: Option<(usize, usize)>,
    /// The signal `fit` was given.
    pub signal: StopSignal,
    /// The epoch under way (set as each epoch begins; start it at 0).
    pub epoch: usize,
}

impl Callback for Preempt {
    fn on_epoch_begin(&mut self, epoch: usize, _model: &mut Model) -> kandle::Result<()> {
        self.epoch = epoch;
        Ok(())
    }

    fn on_train_batch_end(&mut self, step: usize, _l: &Logs, _m: &mut Model) -> kandle::Result<()> {
        if self.at == Some((self.epoch, step)) {
            self.signal.request();
        }
        Ok(())
    }
}
