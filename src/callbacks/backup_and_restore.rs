//! `BackupAndRestore`: backs the whole training state up while `fit` runs, and resumes from
//! the backup at the exact step where it was taken when `fit` starts again after a crash.
//!
//! A backup is one training-state file (weights, optimizer state, learning rate; see
//! [`crate::training_state`]) whose metadata also holds where training was (the epoch, the next
//! step in it, the epoch's running sums), every callback's state ([`Callback::state`]) and the
//! history so far. It is written atomically, so a crash while saving leaves the previous
//! backup whole; with [`double_checkpoint`](BackupAndRestore::double_checkpoint) the backup
//! before it is kept too, until the new one is complete.
//!
//! The callback asks; `fit` does the work ([`Model::request_backup`], [`Model::request_resume`]),
//! because only `fit` knows the position, the running sums and the other callbacks.

use std::path::{Path, PathBuf};

use super::{Callback, FitInfo, Logs};
use crate::{Error, Model, Result};

/// How often [`BackupAndRestore`] backs up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SaveFreq {
    /// At the end of every epoch (Keras's `save_freq="epoch"`), the default.
    #[default]
    Epoch,
    /// After every `n` training steps, counted across epochs (Keras's integer `save_freq`).
    Steps(usize),
}

/// Keras's `BackupAndRestore`: when `fit` starts and `dir` holds a backup, training continues
/// at the exact step where the backup was taken (the same shuffle order, the batches already
/// done skipped, the epoch's running loss and metrics, the learning rate, the optimizer's state
/// and every callback's state as they were); otherwise it starts from the beginning. Backups
/// are taken at the end of each epoch or every `n` steps, and deleted when `fit` completes
/// (unless [`delete_checkpoint(false)`](Self::delete_checkpoint)).
///
/// Under multi-worker training only the chief writes; every worker reads the backup directory
/// (keep it on a file system all workers share) and restores, after the workers have checked
/// that they all found the same backup: a worker that found another one, or none, fails the
/// job with a message naming it, and so does a worker restarted alone (a backup of `N` workers
/// resumes only into a job of `N` workers).
///
/// ```no_run
/// use kandle::callbacks::{BackupAndRestore, SaveFreq};
/// use kandle::FitOptions;
///
/// let options = FitOptions {
///     epochs: 70,
///     callbacks: vec![Box::new(BackupAndRestore::new("backups/run-1").save_freq(SaveFreq::Steps(200)))],
///     ..Default::default()
/// };
/// ```
#[derive(Debug, Clone)]
pub struct BackupAndRestore {
    dir: PathBuf,
    save_freq: SaveFreq,
    delete_checkpoint: bool,
    double_checkpoint: bool,
    /// Training steps since the last backup (for [`SaveFreq::Steps`]).
    steps_since_backup: usize,
}

/// The backup's file name in the backup directory.
const LATEST: &str = "backup.safetensors";
/// The backup before it, kept with `double_checkpoint`.
const PREVIOUS: &str = "backup.previous.safetensors";

impl BackupAndRestore {
    /// Backs up into `dir` (created when needed) at the end of every epoch.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            save_freq: SaveFreq::Epoch,
            delete_checkpoint: true,
            double_checkpoint: false,
            steps_since_backup: 0,
        }
    }

    /// When to back up (default [`SaveFreq::Epoch`]).
    pub fn save_freq(mut self, save_freq: SaveFreq) -> Self {
        self.save_freq = save_freq;
        self
    }

    /// Whether to delete the backups when `fit` completes (default true, as in Keras).
    pub fn delete_checkpoint(mut self, delete: bool) -> Self {
        self.delete_checkpoint = delete;
        self
    }

    /// Whether to keep the previous backup until the new one is complete, and fall back to it
    /// when the latest one cannot be read (default false).
    pub fn double_checkpoint(mut self, double: bool) -> Self {
        self.double_checkpoint = double;
        self
    }

    /// The latest backup's path.
    pub fn latest(&self) -> PathBuf {
        self.dir.join(LATEST)
    }

    /// The previous backup's path (with `double_checkpoint`).
    pub fn previous(&self) -> PathBuf {
        self.dir.join(PREVIOUS)
    }

    /// Where `fit` will resume, when the directory holds a readable backup: a line such as
    /// ``resuming from `dir/backup.safetensors`: epoch 3 step 120`` (epochs counted from 1),
    /// for a program to print before it starts. `None` when there is no backup.
    pub fn pending(&self) -> Option<String> {
        let candidates: Vec<PathBuf> = [self.latest(), self.previous()]
            .into_iter()
            .filter(|p| p.is_file())
            .collect();
        if candidates.is_empty() {
            return None;
        }
        Some(match crate::model::resume::read(&candidates) {
            Ok((path, state)) => match crate::model::resume::position(&state) {
                Some((epoch, step)) => format!(
                    "resuming from `{}`: epoch {} step {step}",
                    path.display(),
                    epoch + 1
                ),
                None => format!("resuming from `{}`", path.display()),
            },
            Err(e) => format!("a backup is there but cannot be read: {e}"),
        })
    }

    fn backup(&mut self, model: &mut Model) {
        self.steps_since_backup = 0;
        let previous = self.double_checkpoint.then(|| self.previous());
        model.request_backup(self.latest(), previous);
    }
}

impl Callback for BackupAndRestore {
    fn on_train_begin(&mut self, _info: &FitInfo, model: &mut Model) -> Result<()> {
        if self.save_freq == SaveFreq::Steps(0) {
            return Err(Error::invalid(
                "BackupAndRestore: save_freq Steps(n) needs n >= 1",
            ));
        }
        self.steps_since_backup = 0;
        if model.is_chief() {
            for path in [self.latest(), self.previous()] {
                let torn = crate::checkpoint::remove_torn_writes(&path)?;
                if torn > 0 {
                    log::info!(
                        "removed {torn} partial write(s) of `{}` left by a run killed while it \
                         saved a backup",
                        path.display()
                    );
                }
            }
        }
        let candidates: Vec<PathBuf> = [self.latest(), self.previous()]
            .into_iter()
            .filter(|p| p.is_file())
            .collect();
        if !candidates.is_empty() {
            model.request_resume(candidates);
        }
        let previous = self.double_checkpoint.then(|| self.previous());
        model.set_backup_target(self.latest(), previous);
        Ok(())
    }

    fn on_train_batch_end(&mut self, _batch: usize, _logs: &Logs, model: &mut Model) -> Result<()> {
        if let SaveFreq::Steps(n) = self.save_freq {
            self.steps_since_backup += 1;
            if self.steps_since_backup >= n {
                self.backup(model);
            }
        }
        Ok(())
    }

    fn on_epoch_end(&mut self, _epoch: usize, _logs: &Logs, model: &mut Model) -> Result<()> {
        if self.save_freq == SaveFreq::Epoch {
            self.backup(model);
        }
        Ok(())
    }

    fn on_train_end(&mut self, _logs: &Logs, model: &mut Model) -> Result<()> {
        // A preempted run resumes from its backup: only a finished one deletes it.
        if self.delete_checkpoint && model.is_chief() && model.preempted().is_none() {
            for path in [self.latest(), self.previous()] {
                remove_if_present(&path)?;
            }
        }
        Ok(())
    }
}

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("cannot delete backup", path, e)),
    }
}
