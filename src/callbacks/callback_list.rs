//! `CallbackList`: many callbacks run as one, in order, skipping chief-only ones on workers
//! that are not the chief.

use super::{Callback, FitInfo, Logs};
use crate::{Model, Result};

/// Callbacks run in order as one callback.
#[derive(Default)]
pub struct CallbackList {
    callbacks: Vec<Box<dyn Callback>>,
    is_chief: bool,
}

impl CallbackList {
    /// Runs `callbacks`; chief-only ones run only when `is_chief`.
    pub fn new(callbacks: Vec<Box<dyn Callback>>, is_chief: bool) -> Self {
        Self {
            callbacks,
            is_chief,
        }
    }

    /// Appends a callback.
    pub fn push(&mut self, callback: Box<dyn Callback>) {
        self.callbacks.push(callback);
    }

    fn each(&mut self, mut f: impl FnMut(&mut dyn Callback) -> Result<()>) -> Result<()> {
        let is_chief = self.is_chief;
        for cb in self
            .callbacks
            .iter_mut()
            .filter(|cb| is_chief || !cb.chief_only())
        {
            f(cb.as_mut())?;
        }
        Ok(())
    }
}

impl Callback for CallbackList {
    /// Every callback's state, in order, as a JSON array (`null` for those without one).
    fn state(&self) -> Option<super::CallbackState> {
        Some(serde_json::Value::Array(
            self.callbacks
                .iter()
                .map(|cb| cb.state().unwrap_or(serde_json::Value::Null))
                .collect(),
        ))
    }

    /// Gives each callback with a state its part of a state made by [`Self::state`]: the
    /// callbacks that keep a state (those whose [`Callback::state`] is `Some`) are matched in
    /// order, so callbacks without one (a progress bar, TensorBoard, a timeline) may be added
    /// or left out when a run resumes.
    fn load_state(&mut self, state: &super::CallbackState) -> Result<()> {
        let saved: Vec<&serde_json::Value> = state
            .as_array()
            .map(|parts| parts.iter().filter(|p| !p.is_null()).collect())
            .unwrap_or_default();
        let mut stateful: Vec<&mut Box<dyn Callback>> = self
            .callbacks
            .iter_mut()
            .filter(|cb| cb.state().is_some())
            .collect();
        if saved.len() != stateful.len() {
            return Err(crate::Error::invalid(format!(
                "the saved callback state is for {} callbacks that keep a state, but fit has \
                 {}: resume with the same callbacks",
                saved.len(),
                stateful.len()
            )));
        }
        for (cb, part) in stateful.iter_mut().zip(saved) {
            cb.load_state(part)?;
        }
        Ok(())
    }

    fn on_train_begin(&mut self, info: &FitInfo, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_train_begin(info, model))
    }
    fn on_train_end(&mut self, logs: &Logs, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_train_end(logs, model))
    }
    fn on_epoch_begin(&mut self, epoch: usize, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_epoch_begin(epoch, model))
    }
    fn on_epoch_end(&mut self, epoch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_epoch_end(epoch, logs, model))
    }
    fn on_train_batch_begin(&mut self, batch: usize, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_train_batch_begin(batch, model))
    }
    fn on_train_batch_end(&mut self, batch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_train_batch_end(batch, logs, model))
    }
    fn on_test_begin(&mut self, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_test_begin(model))
    }
    fn on_test_end(&mut self, logs: &Logs, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_test_end(logs, model))
    }
    fn on_test_batch_begin(&mut self, batch: usize, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_test_batch_begin(batch, model))
    }
    fn on_test_batch_end(&mut self, batch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_test_batch_end(batch, logs, model))
    }
    fn on_predict_begin(&mut self, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_predict_begin(model))
    }
    fn on_predict_end(&mut self, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_predict_end(model))
    }
    fn on_predict_batch_begin(&mut self, batch: usize, model: &mut Model) -> Result<()> {
        self.each(|cb| cb.on_predict_batch_begin(batch, model))
    }
    fn on_predict_batch_end(
        &mut self,
        batch: usize,
        outputs: &candle_core::Tensor,
        model: &mut Model,
    ) -> Result<()> {
        self.each(|cb| cb.on_predict_batch_end(batch, outputs, model))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::callbacks::{CsvLogger, History, TerminateOnNaN};

    #[test]
    fn a_resumed_list_matches_the_callbacks_that_keep_a_state_in_order() -> Result<()> {
        let dir = std::env::temp_dir();
        let stateful = || -> Vec<Box<dyn Callback>> {
            vec![
                Box::new(History::new()),
                Box::new(CsvLogger::new(dir.join("unused.csv"))),
            ]
        };
        let saved = CallbackList::new(stateful(), true)
            .state()
            .unwrap_or_default();

        // Stateless callbacks added around them change nothing.
        let mut more = stateful();
        more.insert(0, Box::new(TerminateOnNaN));
        more.push(Box::new(TerminateOnNaN));
        CallbackList::new(more, true).load_state(&saved)?;

        // A stateful one missing is an error that says so.
        let err = CallbackList::new(vec![Box::new(History::new())], true)
            .load_state(&saved)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("for 2 callbacks that keep a state, but fit has 1"),
            "{err}"
        );
        Ok(())
    }
}
