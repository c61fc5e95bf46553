//! Learning-rate schedules: functions from the epoch (counted from 0) to a learning rate.

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
