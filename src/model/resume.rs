//! Where a `fit` run is, as a backup records it: what [`BackupAndRestore`] asks `fit` to save
//! and to resume from, besides the model's own training state.
//!
//! A backup is a [`TrainingState`] whose `extra["fit"]` holds the position (the epoch, the next
//! step in it, the epoch's running sums), the shape of the run it belongs to (steps per epoch,
//! global batch size, samples in the dataset, workers: a resume into another run is refused), the
//! history so far and every callback's state.
//!
//! Under multi-worker training every worker reads the backup itself, and the workers compare
//! what they found ([`Found`]) before any of them resumes: a worker that found another backup,
//! or none, fails every worker alike instead of training from another point. A backup taken by
//! a job of `N` workers resumes only into a job of `N` workers, so a worker restarted alone is
//! refused.
//!
//! [`BackupAndRestore`]: crate::callbacks::BackupAndRestore

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::callbacks::{Callback, CallbackList, History};
use crate::preemption::Preempted;
use crate::training_state::TrainingState;
use crate::{Error, Result};

/// What callbacks asked `fit` to do at its next stop.
#[derive(Debug, Default)]
pub(crate) struct FitRequests {
    /// Write a backup to `.0`, after moving the backup there to `.1` when given.
    pub(crate) backup: Option<(PathBuf, Option<PathBuf>)>,
    /// Resume from the first of these backups that can be read.
    pub(crate) resume: Option<Vec<PathBuf>>,
    /// Where a backup goes when `fit` writes one of its own accord (at a preemption), as
    /// `backup`.
    pub(crate) backup_target: Option<(PathBuf, Option<PathBuf>)>,
    /// Where `fit` stopped for a stop signal.
    pub(crate) preempted: Option<Preempted>,
}

/// The shape of a `fit` run, the same on every worker: a backup resumes into a run of the same
/// data, at the same global batch or (elastically) at another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RunShape {
    pub(crate) steps_per_epoch: usize,
    /// The loader's steps per epoch, before `steps_per_epoch` cut them (`None` in backups of
    /// runs before it was recorded).
    pub(crate) full_steps: Option<usize>,
    pub(crate) global_batch_size: usize,
    /// Samples in the dataset.
    pub(crate) samples: usize,
    /// Processes of the job (workers of a multi-worker strategy; 1 otherwise).
    pub(crate) workers: usize,
}

/// Where a run is: the next step to run is `step` of `epoch`; `totals` are the epoch's running
/// sums up to there (none at an epoch's start).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Position {
    pub(crate) epoch: usize,
    pub(crate) step: usize,
    pub(crate) totals: Option<RunningTotals>,
}

/// An epoch's running sums over the steps it applied, and the steps it skipped.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct RunningTotals {
    /// Samples of the steps counted.
    pub(crate) samples: usize,
    /// `[loss_sum, metric_state...]` of the steps counted.
    pub(crate) sums: Vec<f64>,
    /// Steps whose update was skipped (a non-finite loss or gradient, or a loss-scale
    /// overflow).
    pub(crate) skipped: usize,
}

/// Adds the run's position, shape, history and callbacks' states to `state`.
pub(crate) fn record(
    state: &mut TrainingState,
    position: &Position,
    shape: RunShape,
    history: &History,
    callbacks: &CallbackList,
) {
    let totals = position
        .totals
        .as_ref()
        .map(|t| json!({ "samples": t.samples, "sums": t.sums, "skipped": t.skipped }));
    state.extra.insert(
        "fit".into(),
        json!({
            "epoch": position.epoch,
            "step": position.step,
            "totals": totals,
            "steps_per_epoch": shape.steps_per_epoch,
            "full_steps": shape.full_steps,
            "global_batch_size": shape.global_batch_size,
            "samples": shape.samples,
            "workers": shape.workers,
            "history": history.state(),
            "callbacks": callbacks.state(),
        }),
    );
}

/// Writes a backup to `path` atomically; with `previous`, the backup already at `path` is moved
/// there first, so one whole backup exists at every moment.
pub(crate) fn write(state: &TrainingState, path: &Path, previous: Option<&Path>) -> Result<()> {
    if let (Some(previous), true) = (previous, path.is_file()) {
        std::fs::rename(path, previous)
            .map_err(|e| Error::io("cannot keep the previous backup", previous, e))?;
    }
    state.save(path)
}

/// The first of `candidates` that reads as a backup, with its path; when none does, the first
/// one's error. A later candidate is only tried (with a warning) when an earlier one fails.
pub(crate) fn read(candidates: &[PathBuf]) -> Result<(PathBuf, TrainingState)> {
    let mut first_error = None;
    for path in candidates {
        let loaded = TrainingState::load(path).and_then(|s| {
            fit_part(path, &s)?;
            Ok(s)
        });
        match loaded {
            Ok(state) => return Ok((path.clone(), state)),
            Err(e) => {
                log::warn!("cannot resume from `{}`: {e}", path.display());
                first_error.get_or_insert(e);
            }
        }
    }
    Err(first_error.unwrap_or_else(|| Error::invalid("no backup to resume from")))
}

fn fit_part<'s>(path: &Path, state: &'s TrainingState) -> Result<&'s Value> {
    state.extra.get("fit").ok_or_else(|| Error::Checkpoint {
        path: path.to_path_buf(),
        reason: "is a training state without a fit position: not a backup".into(),
    })
}

/// The `(epoch, step)` a backup resumes at.
pub(crate) fn position(state: &TrainingState) -> Option<(usize, usize)> {
    let fit = state.extra.get("fit")?;
    let number = |key: &str| fit.get(key).and_then(Value::as_u64).map(|v| v as usize);
    Some((number("epoch")?, number("step")?))
}

/// Restores the history and the callbacks' states of the backup at `path`, checks that it
/// belongs to a run of `shape`, and returns where to continue.
pub(crate) fn restore(
    path: &Path,
    state: &TrainingState,
    shape: RunShape,
    history: &mut History,
    callbacks: &mut CallbackList,
) -> Result<Position> {
    let fit = fit_part(path, state)?;
    let bad = |what: &str| Error::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("the backup's fit position has no valid `{what}`"),
    };
    let number = |key: &str| -> Result<usize> {
        fit.get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| bad(key))
    };
    let saved = RunShape {
        steps_per_epoch: number("steps_per_epoch")?,
        full_steps: fit
            .get("full_steps")
            .filter(|v| !v.is_null())
            .map(|_| number("full_steps"))
            .transpose()?,
        global_batch_size: number("global_batch_size")?,
        samples: number("samples")?,
        // Backups of single-process runs before the field existed.
        workers: fit.get("workers").map_or(Ok(1), |_| number("workers"))?,
    };
    let step = resumed_step(path, &saved, &shape, number("step")?)?;
    let totals = match fit.get("totals") {
        None | Some(Value::Null) => None,
        Some(t) => {
            let samples = t
                .get("samples")
                .and_then(Value::as_u64)
                .ok_or_else(|| bad("totals"))? as usize;
            let sums = t
                .get("sums")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("totals"))?
                .iter()
                .map(|v| v.as_f64().unwrap_or(f64::NAN))
                .collect();
            // Backups from before skipped steps were counted hold none.
            let skipped = t.get("skipped").and_then(Value::as_u64).unwrap_or(0) as usize;
            Some(RunningTotals {
                samples,
                sums,
                skipped,
            })
        }
    };
    let in_context = |e: Error| Error::Checkpoint {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    if let Some(h) = fit.get("history").filter(|h| !h.is_null()) {
        history.load_state(h).map_err(in_context)?;
    }
    if let Some(c) = fit.get("callbacks").filter(|c| !c.is_null()) {
        callbacks.load_state(c).map_err(in_context)?;
    }
    Ok(Position {
        epoch: number("epoch")?,
        step,
        totals,
    })
}

/// The step of this run at which a backup taken after `step` steps of a run of shape `saved`
/// resumes. At the same global batch (and epoch length) it is `step`, whatever the number of
/// replicas or workers. At another global batch (more or fewer replicas or workers at the same
/// batch per replica), the samples seen so far in the epoch carry over: the data order is the
/// seeded one, so the run resumes at the last whole global batch of the new size at or before
/// them, and sees at most one batch's worth of samples again. Another dataset, or epochs cut
/// short by `steps_per_epoch` at another batch size, are errors.
pub(crate) fn resumed_step(
    path: &Path,
    saved: &RunShape,
    shape: &RunShape,
    step: usize,
) -> Result<usize> {
    let refuse = |reason: String| Error::Checkpoint {
        path: path.to_path_buf(),
        reason,
    };
    if saved.samples != shape.samples {
        return Err(refuse(format!(
            "was taken in a run over {} samples, but this fit has {}: resume with the same data, \
             or delete the backup to start again",
            saved.samples, shape.samples
        )));
    }
    if saved.global_batch_size == shape.global_batch_size {
        if saved.steps_per_epoch != shape.steps_per_epoch {
            return Err(refuse(format!(
                "was taken in a run of {} steps per epoch, but this fit has {}: resume with the \
                 same steps_per_epoch and drop_remainder",
                saved.steps_per_epoch, shape.steps_per_epoch
            )));
        }
        return Ok(step);
    }
    let whole = |s: &RunShape| s.full_steps == Some(s.steps_per_epoch);
    if !whole(saved) || !whole(shape) {
        return Err(refuse(format!(
            "was taken at global batch {} and this fit's is {}, but {}: where an epoch ends at \
             another batch size is ambiguous, so resume at global batch {} (batch size per \
             replica x replicas in sync) or without steps_per_epoch",
            saved.global_batch_size,
            shape.global_batch_size,
            match saved.full_steps {
                None => "the backup does not say how long its epochs were".to_string(),
                Some(_) => "an epoch is cut short by steps_per_epoch".to_string(),
            },
            saved.global_batch_size
        )));
    }
    let seen = (step * saved.global_batch_size).min(saved.samples);
    let resumed = seen / shape.global_batch_size;
    log::info!(
        "the backup was taken at global batch {} after {seen} samples of its epoch; at global \
         batch {} this run resumes at step {resumed} ({} samples seen again)",
        saved.global_batch_size,
        shape.global_batch_size,
        seen - resumed * shape.global_batch_size
    );
    Ok(resumed.min(shape.steps_per_epoch))
}

/// What a worker found to resume from: the words the workers of a job compare before resuming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// No backup: the run starts from the beginning.
    Nothing,
    /// Backups that cannot be read (the error is the worker's own).
    Unreadable,
    /// A backup that resumes at `step` of `epoch`; `digest` tells backups of one position apart.
    Backup { epoch: u64, step: u64, digest: u64 },
}

impl Found {
    /// Words of one worker's finding, for [`check_agreement`].
    pub(crate) const WORDS: usize = 4;

    /// What reading the candidates gave (`None`: there were none).
    pub(crate) fn of(read: Option<&Result<(PathBuf, TrainingState)>>) -> Self {
        match read {
            None => Found::Nothing,
            Some(Err(_)) => Found::Unreadable,
            Some(Ok((_, state))) => {
                let (epoch, step) = position(state).unwrap_or_default();
                let fit = state.extra.get("fit").map(Value::to_string);
                Found::Backup {
                    epoch: epoch as u64,
                    step: step as u64,
                    digest: fnv1a(fit.unwrap_or_default().as_bytes()),
                }
            }
        }
    }

    pub(crate) fn words(self) -> [u64; Self::WORDS] {
        match self {
            Found::Nothing => [0; Self::WORDS],
            Found::Unreadable => [1, 0, 0, 0],
            Found::Backup {
                epoch,
                step,
                digest,
            } => [2, epoch, step, digest],
        }
    }

    fn from_words(w: &[u64]) -> Self {
        match w {
            [2, epoch, step, digest] => Found::Backup {
                epoch: *epoch,
                step: *step,
                digest: *digest,
            },
            [1, ..] => Found::Unreadable,
            _ => Found::Nothing,
        }
    }
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Found::Nothing => f.write_str("no backup (it starts from the beginning)"),
            Found::Unreadable => f.write_str("backups it cannot read"),
            Found::Backup {
                epoch,
                step,
                digest,
            } => write!(
                f,
                "the backup of epoch {} step {step} (digest {digest:016x})",
                epoch + 1
            ),
        }
    }
}

/// Fails unless every worker found what the chief found; `all` holds every worker's
/// [`Found::words`] in rank order. Every worker gets the same `all`, so all fail alike.
pub(crate) fn check_agreement(all: &[u64]) -> Result<()> {
    let mut findings = all.chunks(Found::WORDS).map(Found::from_words);
    let Some(chief) = findings.next() else {
        return Ok(());
    };
    for (rank, theirs) in findings.enumerate().map(|(i, f)| (i + 1, f)) {
        if theirs != chief {
            return Err(Error::Replica {
                replica: format!("worker {rank}"),
                reason: format!(
                    "found {theirs}, but the chief found {chief}: every worker must resume \
                     from the chief's backup, so keep the backup directory on a file system \
                     all workers share (or delete the backups to start again)"
                ),
            });
        }
    }
    Ok(())
}

/// FNV-1a: a stable 64-bit digest of `bytes`, the same in every process.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(findings: &[Found]) -> Vec<u64> {
        findings.iter().flat_map(|f| f.words()).collect()
    }

    #[test]
    fn workers_that_found_the_same_backup_agree() {
        let backup = Found::Backup {
            epoch: 2,
            step: 7,
            digest: fnv1a(b"fit"),
        };
        assert!(check_agreement(&words(&[backup, backup, backup])).is_ok());
        assert!(check_agreement(&words(&[Found::Nothing, Found::Nothing])).is_ok());
        assert_eq!(Found::from_words(&backup.words()), backup);
    }

    #[test]
    fn a_worker_that_found_another_backup_or_none_is_named() {
        let chief = Found::Backup {
            epoch: 2,
            step: 7,
            digest: 1,
        };
        let err = check_agreement(&words(&[chief, chief, Found::Nothing]))
            .expect_err("workers disagree")
            .to_string();
        assert!(
            err.starts_with(
                "worker 2: found no backup (it starts from the beginning), but the \
                 chief found the backup of epoch 3 step 7"
            ),
            "{err}"
        );
        let older = Found::Backup {
            epoch: 2,
            step: 7,
            digest: 2,
        };
        let err = check_agreement(&words(&[chief, older]))
            .expect_err("workers disagree")
            .to_string();
        assert!(
            err.contains("worker 1: found the backup of epoch 3 step 7 (digest 0000000000000002)"),
            "{err}"
        );
        let err = check_agreement(&words(&[Found::Nothing, Found::Unreadable]))
            .expect_err("workers disagree")
            .to_string();
        assert!(
            err.contains("worker 1: found backups it cannot read"),
            "{err}"
        );
    }

    fn shape(batch: usize, steps: usize, full: Option<usize>) -> RunShape {
        RunShape {
            steps_per_epoch: steps,
            full_steps: full,
            global_batch_size: batch,
            samples: 400,
            workers: 1,
        }
    }

    fn step(saved: RunShape, now: RunShape, at: usize) -> std::result::Result<usize, String> {
        resumed_step(Path::new("b.safetensors"), &saved, &now, at).map_err(|e| e.to_string())
    }

    #[test]
    fn a_backup_resumes_at_the_samples_it_saw_at_any_global_batch() {
        let at32 = shape(32, 13, Some(13));
        // The same global batch (any replicas or workers): the same step.
        assert_eq!(step(at32, at32, 5), Ok(5));
        // 5 steps of 32 are 160 samples: 10 of 16, 3 whole ones of 48 (16 seen again).
        assert_eq!(step(at32, shape(16, 25, Some(25)), 5), Ok(10));
        assert_eq!(step(at32, shape(48, 9, Some(9)), 5), Ok(3));
        // At the epoch's end the new run's epoch is over too.
        assert_eq!(step(at32, shape(48, 9, Some(9)), 13), Ok(8));
    }

    #[test]
    fn what_cannot_carry_over_is_an_error_saying_why() {
        let at32 = shape(32, 13, Some(13));
        let other_data = RunShape {
            samples: 380,
            ..at32
        };
        let err = step(at32, other_data, 5).err().unwrap_or_default();
        assert!(
            err.contains("over 400 samples, but this fit has 380"),
            "{err}"
        );
        let cut = shape(32, 10, Some(13));
        let err = step(cut, shape(16, 25, Some(25)), 5)
            .err()
            .unwrap_or_default();
        assert!(err.contains("cut short by steps_per_epoch"), "{err}");
        let old = shape(32, 13, None);
        let err = step(old, shape(16, 25, Some(25)), 5)
            .err()
            .unwrap_or_default();
        assert!(
            err.contains("does not say how long its epochs were"),
            "{err}"
        );
        let err = step(at32, shape(32, 10, Some(13)), 5)
            .err()
            .unwrap_or_default();
        assert!(
            err.contains("13 steps per epoch, but this fit has 10"),
            "{err}"
        );
    }
}
