//! `ModelCheckpoint`: saves the weights after each epoch, or only when the monitored quantity
//! improves, as Keras's `ModelCheckpoint(save_weights_only=True)` does.
//!
//! Files are written through [`Model::save_weights`], atomically, so an interrupted save never
//! leaves a torn checkpoint. A path containing `{epoch}` (or Keras's `{epoch:02d}`) gets the
//! 1-based epoch number, zero-padded to two digits: `ckpt-{epoch}.safetensors` becomes
//! `ckpt-01.safetensors`, `ckpt-02.safetensors`, ...

use std::path::{Path, PathBuf};

use super::monitor::Monitor;
use super::{state_opt_f64, Callback, CallbackState, Logs, Mode};
use crate::{Model, Result};

/// Saves the model's weights at the end of epochs. Runs on the chief worker only.
///
/// ```no_run
/// use kandle::callbacks::ModelCheckpoint;
///
/// // Keep the weights of the epoch with the best validation accuracy.
/// let best = ModelCheckpoint::new("runs/best.safetensors")
///     .monitor("val_accuracy")
///     .save_best_only(true);
/// ```
#[derive(Debug, Clone)]
pub struct ModelCheckpoint {
    path: PathBuf,
    monitor: Monitor,
    save_best_only: bool,
    best: Option<f64>,
}

impl ModelCheckpoint {
    /// Saves to `path` (which may contain `{epoch}`) after every epoch, monitoring `val_loss`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            monitor: Monitor::new("val_loss"),
            save_best_only: false,
            best: None,
        }
    }

    /// The log key compared between epochs when saving only the best (default `val_loss`).
    pub fn monitor(mut self, key: impl Into<String>) -> Self {
        self.monitor.set_key(key);
        self
    }

    /// Whether lower or higher values of the monitored key are better (default
    /// [`Mode::Auto`]).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.monitor.set_mode(mode);
        self
    }

    /// With `true`, saves only when the monitored key improves on the best value so far. An
    /// epoch whose logs lack the key is then skipped, with a warning on stderr the first time.
    pub fn save_best_only(mut self, save_best_only: bool) -> Self {
        self.save_best_only = save_best_only;
        self
    }

    /// The best value of the monitored key saved so far (with `save_best_only`).
    pub fn best(&self) -> Option<f64> {
        self.best
    }

    /// The file written for `epoch` (counted from 0).
    pub fn path_for_epoch(&self, epoch: usize) -> PathBuf {
        expand_epoch(&self.path, epoch)
    }
}

/// Replaces `{epoch:02d}` and `{epoch}` in `path` with `epoch + 1`, zero-padded to two digits.
fn expand_epoch(path: &Path, epoch: usize) -> PathBuf {
    match path.to_str() {
        Some(s) if s.contains("{epoch") => {
            let number = format!("{:02}", epoch + 1);
            PathBuf::from(
                s.replace("{epoch:02d}", &number)
                    .replace("{epoch}", &number),
            )
        }
        _ => path.to_path_buf(),
    }
}

impl Callback for ModelCheckpoint {
    fn on_epoch_end(&mut self, epoch: usize, logs: &Logs, model: &mut Model) -> Result<()> {
        if self.save_best_only {
            let Some(current) = self.monitor.value(logs, "ModelCheckpoint(save_best_only)") else {
                return Ok(());
            };
            if !self.monitor.is_improvement(current, self.best) {
                return Ok(());
            }
            self.best = Some(current);
        }
        model.save_weights(self.path_for_epoch(epoch))
    }

    /// The best value saved so far.
    fn state(&self) -> Option<CallbackState> {
        Some(serde_json::json!({ "best": self.best }))
    }

    fn load_state(&mut self, state: &CallbackState) -> Result<()> {
        self.best = state_opt_f64(state, "best");
        Ok(())
    }

    fn chief_only(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::callbacks::test_support::{logs, tiny_model};
    use crate::Error;

    #[test]
    fn expands_the_epoch_placeholder() {
        let c = ModelCheckpoint::new("out/w-{epoch}.safetensors");
        assert_eq!(c.path_for_epoch(0), PathBuf::from("out/w-01.safetensors"));
        assert_eq!(c.path_for_epoch(99), PathBuf::from("out/w-100.safetensors"));
        let keras = ModelCheckpoint::new("w-{epoch:02d}.safetensors");
        assert_eq!(keras.path_for_epoch(6), PathBuf::from("w-07.safetensors"));
        let plain = ModelCheckpoint::new("w.safetensors");
        assert_eq!(plain.path_for_epoch(6), PathBuf::from("w.safetensors"));
    }

    #[test]
    fn saves_every_epoch_or_only_improvements() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", "/tmp", e))?;
        let mut model = tiny_model()?;

        // Every epoch, even without the monitored key.
        let mut every = ModelCheckpoint::new(dir.path().join("every-{epoch}.safetensors"));
        assert!(every.chief_only());
        every.on_epoch_end(0, &logs(&[("loss", 1.0)]), &mut model)?;
        every.on_epoch_end(1, &logs(&[("loss", 2.0)]), &mut model)?;
        assert!(dir.path().join("every-01.safetensors").is_file());
        assert!(dir.path().join("every-02.safetensors").is_file());

        // Best only, on accuracy (auto mode maximises it).
        let mut best = ModelCheckpoint::new(dir.path().join("best-{epoch}.safetensors"))
            .monitor("val_accuracy")
            .save_best_only(true);
        let epochs = [0.5, 0.4, f64::NAN, 0.7, 0.7];
        for (epoch, acc) in epochs.into_iter().enumerate() {
            best.on_epoch_end(epoch, &logs(&[("val_accuracy", acc)]), &mut model)?;
        }
        let saved: Vec<bool> = (0..epochs.len())
            .map(|e| best.path_for_epoch(e).is_file())
            .collect();
        assert_eq!(saved, [true, false, false, true, false]);
        assert_eq!(best.best(), Some(0.7));

        // A missing key with save_best_only skips the save and does not fail.
        let mut missing =
            ModelCheckpoint::new(dir.path().join("missing.safetensors")).save_best_only(true);
        missing.on_epoch_end(0, &logs(&[("loss", 1.0)]), &mut model)?;
        assert!(!dir.path().join("missing.safetensors").exists());

        // Mode::Min on accuracy flips the direction.
        let mut min = ModelCheckpoint::new(dir.path().join("min-{epoch}.safetensors"))
            .monitor("accuracy")
            .mode(Mode::Min)
            .save_best_only(true);
        min.on_epoch_end(0, &logs(&[("accuracy", 0.5)]), &mut model)?;
        min.on_epoch_end(1, &logs(&[("accuracy", 0.6)]), &mut model)?;
        assert!(min.path_for_epoch(0).is_file());
        assert!(!min.path_for_epoch(1).exists());
        Ok(())
    }

    #[test]
    fn saved_weights_load_back() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", "/tmp", e))?;
        let path = dir.path().join("w.safetensors");
        let mut model = tiny_model()?;
        ModelCheckpoint::new(&path).on_epoch_end(0, &Logs::new(), &mut model)?;
        let loaded = crate::checkpoint::load(&path)?;
        let current = model.get_weights()?;
        assert_eq!(
            loaded.keys().collect::<Vec<_>>(),
            current.keys().collect::<Vec<_>>()
        );
        for (name, w) in &current {
            let a = w.flatten_all()?.to_vec1::<f32>()?;
            let b = loaded[name].flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(a, b, "{name}");
        }
        Ok(())
    }
}
