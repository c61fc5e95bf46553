//! `fit`: the epoch loop, with resuming from a backup and the backups callbacks ask for.
//!
//! `fit` checks its options, builds the model for the data, and on a process that trains runs
//! `run_fit`: build the loader, wrap the callbacks, resume if a callback asked to, and
//! for each epoch run `train_step` per batch (`train_epoch`), reduce the statistics,
//! validate, and hand the logs to the callbacks. After each step's and each epoch's callbacks, a
//! backup a callback requested is written with `fit`'s position, so a resumed run continues at
//! that exact step.

use candle_core::Tensor;

use super::resume::{self, FitRequests, Position, RunShape, RunningTotals};
use super::totals::Totals;
use super::{FitOptions, Model};
use crate::callbacks::{
    Callback, CallbackList, FitInfo, History, Logs, ProgressBar, Verbosity, SKIPPED_STEPS,
};
use crate::data::{weighting, Batch, Dataset, Loader, LoaderOptions};
use crate::preemption::{Preempted, StopSignal};
use crate::strategy::StepStats;
use crate::timeline;
use crate::{Error, Result};

impl Model {
    /// Trains on `data`. Returns the per-epoch logs.
    pub fn fit(&mut self, data: &dyn Dataset, options: FitOptions<'_>) -> Result<History> {
        if options.validation.is_some() && options.validation_split > 0.0 {
            return Err(Error::invalid(
                "give either `validation` or `validation_split`, not both",
            ));
        }
        if options.validation_split > 0.0 {
            let (train, held_out) = crate::data::split_tail(data, options.validation_split)?;
            let sample_weight = options
                .sample_weight
                .map(|w| &w[..w.len().min(train.len())]);
            return self.fit(
                &train,
                FitOptions {
                    validation: Some(&held_out),
                    validation_split: 0.0,
                    sample_weight,
                    ..options
                },
            );
        }
        if options.steps_per_epoch == Some(0) {
            return Err(Error::invalid("steps_per_epoch must be positive"));
        }
        if options.validation_freq == 0 {
            return Err(Error::invalid("validation_freq must be positive"));
        }
        self.prepare_for(data)?;
        if let Some(val) = options.validation {
            self.prepare_for(val)?;
        }
        let history = self.strategy_call(|model| model.run_fit(data, options))?;
        Ok(history.unwrap_or_else(History::new))
    }

    /// `fit` once the options are checked and the model is built and prepared for the data, on
    /// a process that trains: the loader, the callbacks, resuming, then the epochs.
    fn run_fit(&mut self, data: &dyn Dataset, options: FitOptions<'_>) -> Result<History> {
        let loader = self.loader(
            data,
            options.batch_size_per_replica,
            LoaderOptions {
                shuffle: options.shuffle,
                seed: options.seed.unwrap_or(self.seed),
                drop_remainder: options.drop_remainder,
                augment: options.augment.clone(),
                sample_weight: weighting::sample_weights(data, options.sample_weight)?,
                class_weight: weighting::class_weights(data, options.class_weight.as_ref())?,
                ..LoaderOptions::default()
            },
        )?;
        let steps = loader
            .steps_per_epoch()
            .min(options.steps_per_epoch.unwrap_or(usize::MAX));
        if steps == 0 {
            return Err(Error::invalid(format!(
                "`{}` has {} samples, fewer than one batch of {}, and drop_remainder is set",
                data.name(),
                data.len(),
                options.batch_size_per_replica * self.num_replicas_in_sync()
            )));
        }
        let info = FitInfo {
            epochs: options.epochs,
            initial_epoch: options.initial_epoch,
            steps_per_epoch: steps,
            samples: loader.samples_per_epoch(),
            global_batch_size: options.batch_size_per_replica * self.num_replicas_in_sync(),
            has_validation: options.validation.is_some(),
        };
        let mut callbacks = CallbackList::new(options.callbacks, self.is_chief());
        if options.verbosity != Verbosity::Silent {
            callbacks.push(Box::new(ProgressBar::new(options.verbosity)));
        }
        let mut history = History::new();
        self.stop_training = false;
        self.requests = FitRequests::default();
        callbacks.on_train_begin(&info, self)?;
        let shape = RunShape {
            steps_per_epoch: steps,
            full_steps: Some(loader.steps_per_epoch()),
            global_batch_size: info.global_batch_size,
            // The whole dataset's, the same on every worker (`info.samples` is this worker's).
            samples: data.len(),
            workers: self.worker().size,
        };
        let requested = self.requests.resume.take();
        let mut start = self
            .resume(requested, shape, &mut history, &mut callbacks)?
            .unwrap_or(Position {
                epoch: options.initial_epoch,
                step: 0,
                totals: None,
            });
        let mut logs = Logs::new();
        for epoch in start.epoch..options.epochs {
            callbacks.on_epoch_begin(epoch, self)?;
            let from = match epoch == start.epoch {
                true => (start.step, start.totals.take()),
                false => (0, None),
            };
            let run = EpochRun {
                loader: &loader,
                epoch,
                steps,
                shape,
                stop_signal: options.stop_signal.as_ref(),
            };
            let mut totals = self.train_epoch(&run, from, &mut callbacks, &history)?;
            if self.requests.preempted.is_some() {
                break;
            }
            let mut epoch_totals = StepStats {
                samples: totals.samples,
                sums: std::mem::take(&mut totals.sums),
                applied: true,
            };
            let extra = self.replicas()?.end_epoch(&mut epoch_totals)?;
            (totals.samples, totals.sums) = (epoch_totals.samples, epoch_totals.sums);
            logs = totals.logs();
            for (name, value) in extra {
                logs.set(name, value);
            }
            let validates = (epoch + 1) % options.validation_freq == 0;
            if let Some(val) = options.validation.filter(|_| validates) {
                let val_loader = self.loader(
                    val,
                    options.batch_size_per_replica,
                    LoaderOptions::default(),
                )?;
                for (k, v) in &self.run_evaluation(&val_loader, &mut callbacks)? {
                    logs.set(format!("val_{k}"), v);
                }
            }
            logs.set("lr", self.learning_rate);
            if let Some(scale) = self.loss_scale()? {
                logs.set("loss_scale", scale);
            }
            // Last, so Keras's columns keep Keras's order.
            if let Some(skipped) = logs.remove(SKIPPED_STEPS) {
                logs.set(SKIPPED_STEPS, skipped);
            }
            history.on_epoch_end(epoch, &logs, self)?;
            callbacks.on_epoch_end(epoch, &logs, self)?;
            let next = Position {
                epoch: epoch + 1,
                step: 0,
                totals: None,
            };
            let stops = epoch + 1 < options.epochs
                && self.preempt_if_signalled(options.stop_signal.as_ref(), &next)?;
            self.write_requested_backup(&next, shape, &history, &callbacks)?;
            if self.stop_training || stops {
                break;
            }
        }
        callbacks.on_train_end(&logs, self)?;
        history.preempted = self.requests.preempted.clone();
        Ok(history)
    }

    /// Whether the stop signal was raised on any worker (every worker answers alike: they
    /// agree through a gather of one word each). When it was, `fit` is marked preempted at
    /// `position` and the backup a callback named ([`Model::set_backup_target`]) is asked for
    /// there.
    fn preempt_if_signalled(
        &mut self,
        signal: Option<&StopSignal>,
        position: &Position,
    ) -> Result<bool> {
        let Some(signal) = signal else {
            return Ok(false);
        };
        let local = u64::from(signal.requested());
        let raised = match self.worker().size {
            1 => local != 0,
            _ => self
                .replicas()?
                .all_gather_workers(&[local])?
                .iter()
                .any(|&w| w != 0),
        };
        if !raised {
            return Ok(false);
        }
        let target = self.requests.backup_target.clone();
        if let Some((path, previous)) = target {
            self.requests.backup = Some((path, previous));
        }
        let reason = signal
            .reason()
            .unwrap_or_else(|| "another worker's signal".to_string());
        self.requests.preempted = Some(Preempted {
            epoch: position.epoch,
            step: position.step,
            reason,
            backed_up: self.requests.backup.is_some(),
        });
        Ok(true)
    }

    /// Loads the first readable backup of `candidates` into the model, the history and the
    /// callbacks, and returns where to continue (`None`: no backup, start from the beginning).
    /// The workers of a multi-worker job first check that they all found the same backup.
    fn resume(
        &mut self,
        candidates: Option<Vec<std::path::PathBuf>>,
        shape: RunShape,
        history: &mut History,
        callbacks: &mut CallbackList,
    ) -> Result<Option<Position>> {
        let read = candidates.map(|c| resume::read(&c));
        if shape.workers > 1 {
            let found = resume::Found::of(read.as_ref()).words();
            let all = self.replicas()?.all_gather_workers(&found)?;
            resume::check_agreement(&all)?;
        }
        let Some(read) = read else {
            return Ok(None);
        };
        let (path, state) = read?;
        let position = resume::restore(&path, &state, shape, history, callbacks)?;
        self.set_training_state(&state)
            .map_err(|e| Error::Checkpoint {
                path: path.clone(),
                reason: format!("does not fit the model: {e}"),
            })?;
        if self.is_chief() {
            log::info!(
                "resuming from `{}`: epoch {} step {}",
                path.display(),
                position.epoch + 1,
                position.step
            );
        }
        Ok(Some(position))
    }

    /// Writes the backup a callback asked for, recording `position`.
    fn write_requested_backup(
        &mut self,
        position: &Position,
        shape: RunShape,
        history: &History,
        callbacks: &CallbackList,
    ) -> Result<()> {
        let Some((path, previous)) = self.requests.backup.take() else {
            return Ok(());
        };
        if !self.is_chief() {
            return Ok(());
        }
        let _backup = timeline::span("backup");
        let mut state = self.training_state()?;
        resume::record(&mut state, position, shape, history, callbacks);
        resume::write(&state, &path, previous.as_deref())
    }

    /// Trains on input and target tensors, as Keras's `fit(x, y)`: `x` is `(n, ...)`; `y` holds
    /// class indices (an integer tensor `(n,)`) or dense targets (a float tensor `(n, ...)`).
    pub fn fit_tensors(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        options: FitOptions<'_>,
    ) -> Result<History> {
        let data =
            crate::data::InMemoryDataset::new(x.clone(), y.clone())?.named("fit_tensors input");
        self.fit(&data, options)
    }

    /// Runs one epoch's steps from step `from.0` (with the running sums `from.1` of the steps
    /// before it, when resuming) and returns the epoch's totals.
    fn train_epoch(
        &mut self,
        run: &EpochRun<'_, '_>,
        from: (usize, Option<RunningTotals>),
        callbacks: &mut CallbackList,
        history: &History,
    ) -> Result<Totals> {
        let (first_step, totals_before) = from;
        let mut totals = Totals::training(&self.metrics, totals_before);
        let epoch = run.epoch;
        std::thread::scope(|scope| -> Result<()> {
            let mut batches = run.loader.spawn_from(scope, epoch, first_step);
            for step in first_step..run.steps {
                let _step = timeline::step(epoch * run.steps + step);
                let batch = {
                    let _wait = timeline::span("input wait");
                    batches.next()
                };
                let Some(batch) = batch else {
                    break;
                };
                let batch = batch?;
                {
                    let _callbacks = timeline::span("callbacks");
                    callbacks.on_train_batch_begin(step, self)?;
                }
                let stats = self.train_or_accumulate(&batch, step + 1 == run.steps)?;
                if self.accumulated > 0 {
                    // A micro-batch of a group whose update is still to come: its loss alone,
                    // and no backup or stop before the group is applied.
                    let mut logs = totals.logs();
                    logs.set("batch_loss", mean_loss(&stats));
                    let _callbacks = timeline::span("callbacks");
                    callbacks.on_train_batch_end(step, &logs, self)?;
                    continue;
                }
                let skipped = !stats.applied && stats.samples > 0;
                let overflowed = self.overflowed(&stats);
                if skipped && self.is_chief() {
                    let why = match overflowed {
                        true => "the scaled gradients overflowed; the loss scale halves and",
                        false => "the loss or a gradient is not finite;",
                    };
                    log::warn!(
                        "epoch {} step {}: {why} the update was skipped",
                        epoch + 1,
                        step + 1
                    );
                }
                totals.add_training_step(&stats, overflowed);
                let loss = match overflowed {
                    true => mean_loss(&stats),
                    false => batch_loss(&stats),
                };
                let mut logs = totals.logs();
                logs.set("batch_loss", loss);
                {
                    let _callbacks = timeline::span("callbacks");
                    callbacks.on_train_batch_end(step, &logs, self)?;
                }
                let position = Position {
                    epoch,
                    step: step + 1,
                    totals: Some(totals.running()),
                };
                let stops = step + 1 < run.steps
                    && self.preempt_if_signalled(run.stop_signal, &position)?;
                self.write_requested_backup(&position, run.shape, history, callbacks)?;
                if self.stop_training || stops {
                    break;
                }
            }
            Ok(())
        })?;
        Ok(totals)
    }
}

impl Model {
    /// Mixed precision's current loss scale, under a policy that scales the loss.
    pub fn loss_scale(&mut self) -> Result<Option<f64>> {
        if self.dtype_policy.loss_scale().is_none() {
            return Ok(None);
        }
        let weights = self.replicas()?.weights()?;
        let Some(state) = weights.get(crate::mixed_precision::LOSS_SCALE) else {
            return Ok(None);
        };
        Ok(Some(
            state.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?[0],
        ))
    }

    /// Whether a step was skipped because its scaled gradients overflowed while its loss was
    /// finite: under a loss scale, that is the scale's to handle (it halves), and the loss
    /// still counts.
    pub(super) fn overflowed(&self, stats: &StepStats) -> bool {
        !stats.applied
            && stats.samples > 0
            && self.dtype_policy.loss_scale().is_some()
            && stats.sums.first().is_some_and(|l| l.is_finite())
    }

    /// One training batch: with gradient accumulation over `k` batches, the replicas keep its
    /// gradients unless it completes a group of `k` (or is the last of an epoch, `closes`),
    /// when its step reduces them all and applies one update.
    pub(super) fn train_or_accumulate(&mut self, batch: &Batch, closes: bool) -> Result<StepStats> {
        let k = self.optimizer.gradient_accumulation_steps();
        if self.accumulated + 1 < k && !closes {
            let stats = self.replicas()?.accumulate(batch)?;
            self.accumulated += 1;
            return Ok(stats);
        }
        let lr = self.learning_rate;
        let stats = self.replicas()?.train_step(batch, lr);
        self.accumulated = 0;
        stats
    }
}

/// The mean loss of a step's samples, applied or not.
fn mean_loss(stats: &StepStats) -> f64 {
    stats.sums.first().copied().unwrap_or(f64::NAN) / stats.samples.max(1) as f64
}

/// The loss of one step alone: NaN when the step was not applied (its loss or a gradient was
/// not finite), so `TerminateOnNaN` sees it at once.
fn batch_loss(stats: &StepStats) -> f64 {
    match stats.sums.first() {
        Some(_) if !stats.applied && stats.samples > 0 => f64::NAN,
        Some(loss) => loss / stats.samples.max(1) as f64,
        None => f64::NAN,
    }
}

/// One epoch of a `fit` run: its loader, number, steps, the run's shape and stop signal.
struct EpochRun<'l, 'd> {
    loader: &'l Loader<'d>,
    epoch: usize,
    steps: usize,
    shape: RunShape,
    stop_signal: Option<&'l StopSignal>,
}
