//! Where a `fit` run is, as a backup records it: what [`BackupAndRestore`] asks `fit` to save
//! and to resume from, besides the model's own training state.
//!
//! A backup is a [`TrainingState`] whose `extra["fit"]` holds the position (the epoch, the next
//! step in it, the epoch's running sums), the shape of the run it belongs to (steps per epoch,
//! global batch size, samples per epoch: a resume into another run is refused), the history so
//! far and every callback's state.
//!
//! [`BackupAndRestore`]: crate::callbacks::BackupAndRestore

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::callbacks::{Callback, CallbackList, History};
use crate::training_state::TrainingState;
use crate::{Error, Result};

/// What callbacks asked `fit` to do at its next stop.
#[derive(Debug, Default)]
pub(crate) struct FitRequests {
    /// Write a backup to `.0`, after moving the backup there to `.1` when given.
    pub(crate) backup: Option<(PathBuf, Option<PathBuf>)>,
    /// Resume from the first of these backups that can be read.
    pub(crate) resume: Option<Vec<PathBuf>>,
}

/// The shape of a `fit` run: a backup resumes only into a run of the same shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RunShape {
    pub(crate) steps_per_epoch: usize,
    pub(crate) global_batch_size: usize,
    pub(crate) samples: usize,
}

/// Where a run is: the next step to run is `step` of `epoch`; `totals` are the epoch's running
/// `(samples, sums)` up to there (none at an epoch's start).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Position {
    pub(crate) epoch: usize,
    pub(crate) step: usize,
    pub(crate) totals: Option<(usize, Vec<f64>)>,
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
        .map(|(samples, sums)| json!({ "samples": samples, "sums": sums }));
    state.extra.insert(
        "fit".into(),
        json!({
            "epoch": position.epoch,
            "step": position.step,
            "totals": totals,
            "steps_per_epoch": shape.steps_per_epoch,
            "global_batch_size": shape.global_batch_size,
            "samples": shape.samples,
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
        global_batch_size: number("global_batch_size")?,
        samples: number("samples")?,
    };
    if saved != shape {
        return Err(Error::Checkpoint {
            path: path.to_path_buf(),
            reason: format!(
                "was taken in a run of {} steps per epoch, global batch {} and {} samples, but \
                 this fit has {}, {} and {}: resume with the same data and batch size, or \
                 delete the backup to start again",
                saved.steps_per_epoch,
                saved.global_batch_size,
                saved.samples,
                shape.steps_per_epoch,
                shape.global_batch_size,
                shape.samples
            ),
        });
    }
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
            Some((samples, sums))
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
        step: number("step")?,
        totals,
    })
}
