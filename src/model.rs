//! `Model`: a compiled network. It owns the epoch loop (`fit`), `evaluate`, `predict`, their
//! one-batch forms, weight I/O and the training state (`save`, `load`); the strategy it was
//! compiled with owns placement and the training step.
//!
//! `fit` stays short, as Keras's does: build the loader, wrap the callbacks, and for each epoch
//! run `train_step` per batch, reduce the statistics, validate, and hand the logs to the
//! callbacks. Everything observable happens in callbacks.
//!
//! **Batch size** means the same everywhere: samples per replica per step. `fit`, `evaluate`
//! and `predict` each run global batches of `batch_size_per_replica * num_replicas_in_sync()`
//! samples (split across replicas and workers), so one number fits the model's memory on each
//! device whatever the strategy.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Tensor;

use crate::callbacks::{Callback, CallbackList, FitInfo, History, Logs, ProgressBar, Verbosity};
use crate::data::{Augment, Batch, Dataset, Loader, LoaderOptions};
use crate::layers::{Sequential, Summary};
use crate::losses::Loss;
use crate::metrics::Metrics;
use crate::optimizers::OptimizerConfig;
use crate::params::Weights;
use crate::resume::{self, FitRequests, Position, RunShape};
use crate::strategy::{DistributedModel, ModelSpec, StepStats, Strategy, WorkerInfo};
use crate::training_state::TrainingState;
use crate::{ComputePath, Error, Result};

/// Options of [`Model::fit`], with Keras's defaults.
pub struct FitOptions<'a> {
    /// Train until this epoch (exclusive), counted from 0. Default 1.
    pub epochs: usize,
    /// Samples per replica per step; the global batch is this times the number of replicas.
    /// Default 32.
    pub batch_size_per_replica: usize,
    /// Data evaluated after each epoch (every `validation_freq` epochs), logged with a `val_`
    /// prefix.
    pub validation: Option<&'a dyn Dataset>,
    /// Fraction of the training data, taken from its end before shuffling, held out for
    /// validation instead of `validation`. Default 0.
    pub validation_split: f64,
    /// Validate after every this many epochs (after epochs `f - 1`, `2f - 1`, ...; Keras's
    /// integer `validation_freq`). Default 1.
    pub validation_freq: usize,
    /// Shuffle the training data each epoch. Default true.
    pub shuffle: bool,
    /// Seed for shuffling; the model's seed when `None`.
    pub seed: Option<u64>,
    /// Callbacks, run in order after the built-in history.
    pub callbacks: Vec<Box<dyn Callback>>,
    /// The first epoch to run, to resume training. Default 0.
    pub initial_epoch: usize,
    /// Drop a short last batch instead of training on it. Default false: the short batch is
    /// used and weighted by its true size.
    pub drop_remainder: bool,
    /// Stop each epoch after this many steps (smoke runs). Default: the whole dataset.
    pub steps_per_epoch: Option<usize>,
    /// What to print. Default [`Verbosity::Auto`].
    pub verbosity: Verbosity,
    /// A random transform of each training sample (e.g. [`RandomShiftFlip`]), applied in the
    /// loader's parallel batch assembly, seeded per sample so runs repeat exactly. Validation
    /// and evaluation data are never augmented. Default none.
    ///
    /// [`RandomShiftFlip`]: crate::data::RandomShiftFlip
    pub augment: Option<Arc<dyn Augment>>,
    /// One weight per training sample, in the dataset's order (Keras's `sample_weight`): each
    /// sample's loss is multiplied by it. The loss stays divided by the number of samples, as
    /// Keras's `sum_over_batch_size`. Default none.
    pub sample_weight: Option<&'a [f32]>,
    /// A weight per class (Keras's `class_weight`): each training sample's loss is multiplied
    /// by its class's weight (classes not listed weigh 1). Works with class-index and one-hot
    /// targets. Default none.
    pub class_weight: Option<HashMap<usize, f32>>,
}

impl Default for FitOptions<'_> {
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size_per_replica: 32,
            validation: None,
            validation_split: 0.0,
            validation_freq: 1,
            shuffle: true,
            seed: None,
            callbacks: Vec::new(),
            initial_epoch: 0,
            drop_remainder: false,
            steps_per_epoch: None,
            verbosity: Verbosity::Auto,
            augment: None,
            sample_weight: None,
            class_weight: None,
        }
    }
}

/// Options of [`Model::evaluate`]. A plain number converts into options with that batch size.
pub struct EvaluateOptions<'a> {
    /// Samples per replica per step, as in [`FitOptions`]. Default 32.
    pub batch_size_per_replica: usize,
    /// Callbacks; their `on_test_*` hooks run. Default none.
    pub callbacks: Vec<Box<dyn Callback>>,
    /// One weight per sample, in the dataset's order, for the loss. Default none.
    pub sample_weight: Option<&'a [f32]>,
}

impl Default for EvaluateOptions<'_> {
    fn default() -> Self {
        Self {
            batch_size_per_replica: 32,
            callbacks: Vec::new(),
            sample_weight: None,
        }
    }
}

impl From<usize> for EvaluateOptions<'_> {
    fn from(batch_size_per_replica: usize) -> Self {
        Self {
            batch_size_per_replica,
            ..Default::default()
        }
    }
}

/// Options of [`Model::predict`]. A plain number converts into options with that batch size.
pub struct PredictOptions {
    /// Samples per replica per step, as in [`FitOptions`]. Default 32.
    pub batch_size_per_replica: usize,
    /// Callbacks; their `on_predict_*` hooks run. Default none.
    pub callbacks: Vec<Box<dyn Callback>>,
}

impl Default for PredictOptions {
    fn default() -> Self {
        Self {
            batch_size_per_replica: 32,
            callbacks: Vec::new(),
        }
    }
}

impl From<usize> for PredictOptions {
    fn from(batch_size_per_replica: usize) -> Self {
        Self {
            batch_size_per_replica,
            ..Default::default()
        }
    }
}

/// The model once built: its replicas and the shapes it was built for.
struct BuiltModel {
    input_shape: Vec<usize>,
    output_shape: Vec<usize>,
    replicas: Box<dyn DistributedModel>,
}

/// A compiled model.
pub struct Model {
    network: Sequential,
    optimizer: Box<dyn OptimizerConfig>,
    loss: Arc<dyn Loss>,
    metrics: Metrics,
    strategy: Arc<dyn Strategy>,
    seed: u64,
    compute_path: ComputePath,
    built: Option<BuiltModel>,
    learning_rate: f64,
    stop_training: bool,
    requests: FitRequests,
}

impl Sequential {
    /// Compiles the network with an optimizer, a loss, metrics and a strategy. The model is
    /// built now if an input shape was declared, otherwise on first use.
    ///
    /// `loss` is any [`Loss`] (Keras's built-ins live in [`crate::losses`]); `metrics` is an
    /// array (`[Accuracy]`), a tuple of different metrics, `()`, or anything else that
    /// converts into [`Metrics`].
    pub fn compile<S, O, L, M>(
        self,
        optimizer: O,
        loss: L,
        metrics: M,
        strategy: &S,
    ) -> Result<Model>
    where
        S: Strategy + Clone + 'static,
        O: OptimizerConfig,
        L: Loss + 'static,
        M: Into<Metrics>,
    {
        let learning_rate = optimizer.learning_rate();
        let metrics = metrics.into();
        let mut names = vec!["loss"];
        for m in metrics.iter() {
            let reserved = ["lr", "batch_loss"].contains(&m.name()) || m.name().starts_with("val_");
            if reserved || names.contains(&m.name()) {
                return Err(Error::invalid(format!(
                    "metric name `{}` is taken or reserved: every metric needs its own log key, \
                     not `loss`, `lr`, `batch_loss` or a `val_` prefix",
                    m.name()
                )));
            }
            names.push(m.name());
        }
        let mut model = Model {
            network: self,
            optimizer: Box::new(optimizer),
            loss: Arc::new(loss),
            metrics,
            strategy: Arc::new(strategy.clone()),
            seed: 0,
            compute_path: ComputePath::from_env(),
            built: None,
            learning_rate,
            stop_training: false,
            requests: FitRequests::default(),
        };
        if let Some(shape) = model.network.declared_input_shape().map(<[usize]>::to_vec) {
            model.build(&shape)?;
        }
        Ok(model)
    }
}

impl Model {
    /// Seeds the initial weights (default 0) and rebuilds the model if it was built.
    pub fn with_seed(mut self, seed: u64) -> Result<Self> {
        self.seed = seed;
        if let Some(shape) = self.built.take().map(|b| b.input_shape) {
            self.build(&shape)?;
        }
        Ok(self)
    }

    /// Chooses the code the model runs (default: [`ComputePath::from_env`], so
    /// [`ComputePath::Auto`] unless `KANDLE_COMPUTE` says otherwise) and rebuilds the model if
    /// it was built. [`ComputePath::DeviceGeneric`] runs on the CPU the candle ops a GPU runs.
    pub fn with_compute_path(mut self, path: ComputePath) -> Result<Self> {
        self.compute_path = path;
        if let Some(shape) = self.built.take().map(|b| b.input_shape) {
            self.build(&shape)?;
        }
        Ok(self)
    }

    /// The code the model runs.
    pub fn compute_path(&self) -> ComputePath {
        self.compute_path
    }

    /// Builds the model for inputs of `input_shape` (without the batch dimension) on the
    /// strategy's devices. Building again for the same shape does nothing; another shape is an
    /// error.
    pub fn build(&mut self, input_shape: &[usize]) -> Result<()> {
        if let Some(b) = &self.built {
            if b.input_shape == input_shape {
                return Ok(());
            }
            return Err(Error::Shape {
                layer: "model".into(),
                expected: crate::error::shape_with_batch(&b.input_shape),
                got: crate::error::shape_with_batch(input_shape),
            });
        }
        let spec = ModelSpec {
            network: self.network.clone(),
            input_shape: input_shape.to_vec(),
            optimizer: self.optimizer.clone(),
            loss: Arc::clone(&self.loss),
            metrics: self.metrics.clone(),
            seed: self.seed,
            compute_path: self.compute_path,
        };
        let replicas = self.strategy.distribute(&spec)?;
        let output_shape = replicas
            .summary()
            .rows
            .last()
            .map(|r| r.output_shape.clone())
            .unwrap_or_default();
        self.built = Some(BuiltModel {
            input_shape: input_shape.to_vec(),
            output_shape,
            replicas,
        });
        Ok(())
    }

    /// Whether the model has been built.
    pub fn is_built(&self) -> bool {
        self.built.is_some()
    }

    fn built(&self) -> Result<&BuiltModel> {
        self.built.as_ref().ok_or_else(|| {
            Error::NotReady(
                "the model is not built yet: call build(input_shape), declare \
                 Sequential::input_shape, or fit it first"
                    .into(),
            )
        })
    }

    fn built_mut(&mut self) -> Result<&mut BuiltModel> {
        self.built()?;
        self.built
            .as_mut()
            .ok_or_else(|| Error::NotReady("the model is not built".into()))
    }

    fn replicas(&mut self) -> Result<&mut dyn DistributedModel> {
        Ok(self.built_mut()?.replicas.as_mut())
    }

    /// Builds for `data`'s sample shape if needed, and checks that its targets fit the loss,
    /// the metrics and the model's output.
    fn prepare_for(&mut self, data: &dyn Dataset) -> Result<()> {
        if data.is_empty() {
            return Err(Error::EmptyDataset(data.name().to_string()));
        }
        let shape = data.sample_shape().to_vec();
        self.build(&shape).map_err(|e| match e {
            Error::Shape { expected, got, .. } => Error::Shape {
                layer: format!("model (input from `{}`)", data.name()),
                expected,
                got,
            },
            other => other,
        })?;
        let output_shape = self.built()?.output_shape.clone();
        let targets = data.targets();
        self.loss.check_targets(&targets, &output_shape)?;
        for m in self.metrics.iter() {
            m.check_targets(&targets, &output_shape)?;
        }
        Ok(())
    }

    /// The layer table: output shapes and trainable / non-trainable parameter counts.
    pub fn summary(&self) -> Result<&Summary> {
        Ok(self.built()?.replicas.summary())
    }

    /// The strategy's name and size, this worker's rank.
    pub fn worker(&self) -> WorkerInfo {
        self.strategy.worker()
    }

    /// Whether this process is the chief worker (always, outside multi-worker training).
    pub fn is_chief(&self) -> bool {
        self.strategy.worker().is_chief()
    }

    /// Replicas taking part in each step, across all workers.
    pub fn num_replicas_in_sync(&self) -> usize {
        self.strategy.num_replicas_in_sync()
    }

    /// The learning rate the next step uses.
    pub fn learning_rate(&self) -> f64 {
        self.learning_rate
    }

    /// Sets the learning rate for the following steps. It must be finite and non-negative.
    pub fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        if !lr.is_finite() || lr < 0.0 {
            return Err(Error::invalid(format!(
                "learning rate must be finite and >= 0, got {lr}"
            )));
        }
        self.learning_rate = lr;
        Ok(())
    }

    /// Asks `fit` to stop after the current step (Keras's `model.stop_training = True`).
    pub fn stop_training(&mut self) {
        self.stop_training = true;
    }

    /// Asks `fit` to write a backup (the training state and where `fit` is) to `path` once the
    /// current step's or epoch's callbacks have run, moving the backup already there to
    /// `previous` first when given. Under multi-worker training only the chief writes. For
    /// callbacks such as [`BackupAndRestore`](crate::callbacks::BackupAndRestore).
    pub fn request_backup(
        &mut self,
        path: std::path::PathBuf,
        previous: Option<std::path::PathBuf>,
    ) {
        self.requests.backup = Some((path, previous));
    }

    /// Asks `fit`, from `on_train_begin`, to resume from the first of `candidates` that is a
    /// readable backup of this run, at the exact step where it was taken. For callbacks such as
    /// [`BackupAndRestore`](crate::callbacks::BackupAndRestore).
    pub fn request_resume(&mut self, candidates: Vec<std::path::PathBuf>) {
        self.requests.resume = Some(candidates);
    }

    /// Whether a stop was requested during the current `fit`.
    pub fn stop_requested(&self) -> bool {
        self.stop_training
    }

    /// The current weights by canonical name, on the CPU.
    pub fn get_weights(&self) -> Result<Weights> {
        self.built()?.replicas.weights()
    }

    /// Replaces every weight on every replica. Names and shapes must match exactly; otherwise
    /// nothing changes.
    pub fn set_weights(&mut self, weights: &Weights) -> Result<()> {
        self.replicas()?.set_weights(weights)
    }

    /// Saves the weights as safetensors at `path`, atomically. Under multi-worker training only
    /// the chief writes.
    pub fn save_weights(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let weights = self.get_weights()?;
        if self.is_chief() {
            crate::checkpoint::save(&weights, path)?;
        }
        Ok(())
    }

    /// Loads weights saved by [`Model::save_weights`] under any strategy, onto this model's
    /// devices. A missing or corrupt file, or one whose names or shapes differ from the model,
    /// is an error naming the differences, and the model is left unchanged.
    pub fn load_weights(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        let weights = crate::checkpoint::load(path)?;
        self.set_weights(&weights).map_err(|e| match e {
            Error::InvalidInput(reason) => Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!("does not match the model: {reason}"),
            },
            other => other,
        })
    }

    /// The whole training state: every weight, the optimizer's state (by canonical variable
    /// name, the same under every strategy) and the learning rate, on the CPU. `extra` is
    /// empty. Fails if the model is not built.
    pub fn training_state(&mut self) -> Result<TrainingState> {
        let learning_rate = self.learning_rate;
        let replicas = self.replicas()?;
        // The optimizer state first: a model whose variables live elsewhere takes the weights
        // that go with it at the same time (see `DistributedModel::optimizer_state`).
        let optimizer = replicas.optimizer_state()?;
        Ok(TrainingState {
            weights: replicas.weights()?,
            optimizer,
            learning_rate,
            extra: serde_json::Map::new(),
        })
    }

    /// Restores a training state taken under any strategy: weights, optimizer state and
    /// learning rate, on every replica. Names and shapes must match the model and the optimizer
    /// must be of the same kind; otherwise the error says what differs and the model is left as
    /// it was. Fails if the model is not built.
    pub fn set_training_state(&mut self, state: &TrainingState) -> Result<()> {
        let lr = state.learning_rate;
        if !lr.is_finite() || lr < 0.0 {
            return Err(Error::invalid(format!(
                "learning rate must be finite and >= 0, got {lr}"
            )));
        }
        let replicas = self.replicas()?;
        let optimizer_before = replicas.optimizer_state()?;
        if optimizer_before.kind != state.optimizer.kind {
            return Err(Error::invalid(format!(
                "the state's optimizer is {}, but the model's is {}",
                crate::optimizers::describe_kind(&state.optimizer.kind),
                crate::optimizers::describe_kind(&optimizer_before.kind)
            )));
        }
        let weights_before = replicas.weights()?;
        // Each call checks before it changes anything; the weights are put back if the
        // optimizer state does not fit.
        replicas.set_weights(&state.weights)?;
        if let Err(e) = replicas.set_optimizer_state(&state.optimizer) {
            let restored = replicas
                .set_weights(&weights_before)
                .and_then(|()| replicas.set_optimizer_state(&optimizer_before));
            return Err(match restored {
                Ok(()) => e,
                Err(r) => Error::invalid(format!(
                    "{e}; putting the previous state back failed too, rebuild the model ({r})"
                )),
            });
        }
        self.learning_rate = lr;
        Ok(())
    }

    /// Saves the whole training state (weights, optimizer state, learning rate) to `path` as
    /// one versioned safetensors file, written atomically: see [`crate::training_state`]. Under
    /// multi-worker training every process calls it and only the chief writes (under parameter
    /// servers, the servers hand over their parts of the optimizer state). Fails if the model
    /// is not built.
    pub fn save(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let state = self.training_state()?;
        if self.is_chief() {
            state.save(path)?;
        }
        Ok(())
    }

    /// Loads a training state written by [`Model::save`] under any strategy: weights, optimizer
    /// state and learning rate, so that training continues as if it had not stopped. The model
    /// must be built (for the input shape the state was saved with). The whole file is checked
    /// before the model is touched: a missing, truncated, corrupt or foreign file, a newer
    /// format version, another optimizer, or names and shapes that differ from the model are an
    /// [`Error::Checkpoint`] naming the file and the problem, and the model is left unchanged.
    /// Under multi-worker training every worker reads the file.
    pub fn load(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        if !self.is_built() {
            return Err(Error::NotReady(format!(
                "Model::load(`{}`) needs a built model: build it first (Model::build with the \
                 input shape, Sequential::input_shape, or fit), then load the state",
                path.display()
            )));
        }
        let state = TrainingState::load(path)?;
        self.set_training_state(&state).map_err(|e| match e {
            Error::InvalidInput(reason) => Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!("does not fit the model: {reason}"),
            },
            Error::Replica { replica, reason } => Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!("does not fit the model ({replica}): {reason}"),
            },
            other => other,
        })
    }

    fn loader<'d>(
        &self,
        data: &'d dyn Dataset,
        batch_size_per_replica: usize,
        options: LoaderOptions,
    ) -> Result<Loader<'d>> {
        if batch_size_per_replica == 0 {
            return Err(Error::invalid("batch size must be positive, got 0"));
        }
        let worker = self.strategy.worker();
        Loader::new(
            data,
            LoaderOptions {
                batch_size: batch_size_per_replica * self.strategy.num_replicas_in_sync(),
                shard: (worker.size > 1).then_some((worker.rank, worker.size)),
                ..options
            },
        )
    }

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
        if self.replicas()?.serve()? {
            return Ok(History::new());
        }
        let loader = self.loader(
            data,
            options.batch_size_per_replica,
            LoaderOptions {
                shuffle: options.shuffle,
                seed: options.seed.unwrap_or(self.seed),
                drop_remainder: options.drop_remainder,
                augment: options.augment.clone(),
                sample_weight: sample_weights(data, options.sample_weight)?,
                class_weight: class_weights(data, options.class_weight.as_ref())?,
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
            };
            let mut totals = self.train_epoch(&run, from, &mut callbacks, &history)?;
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
            history.on_epoch_end(epoch, &logs, self)?;
            callbacks.on_epoch_end(epoch, &logs, self)?;
            let next = Position {
                epoch: epoch + 1,
                step: 0,
                totals: None,
            };
            self.write_requested_backup(&next, shape, &history, &callbacks)?;
            if self.stop_training {
                break;
            }
        }
        callbacks.on_train_end(&logs, self)?;
        self.replicas()?.end_call()?;
        Ok(history)
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
        from: (usize, Option<(usize, Vec<f64>)>),
        callbacks: &mut CallbackList,
        history: &History,
    ) -> Result<Totals> {
        let (first_step, totals_before) = from;
        let mut totals = Totals::new(&self.metrics);
        if let Some((samples, sums)) = totals_before {
            totals.samples = samples;
            totals.sums = sums;
        }
        let epoch = run.epoch;
        std::thread::scope(|scope| -> Result<()> {
            let batches = run.loader.spawn_from(scope, epoch, first_step);
            let steps = run.steps.saturating_sub(first_step);
            for (step, batch) in (first_step..).zip(batches.take(steps)) {
                let batch = batch?;
                callbacks.on_train_batch_begin(step, self)?;
                let lr = self.learning_rate;
                let stats = self.replicas()?.train_step(&batch, lr)?;
                if !stats.applied && stats.samples > 0 && self.is_chief() {
                    log::warn!(
                        "epoch {} step {}: the loss or a gradient is not finite; \
                         the update was skipped",
                        epoch + 1,
                        step + 1
                    );
                }
                totals.add_training_step(&stats);
                let mut logs = totals.logs();
                logs.set("batch_loss", batch_loss(&stats));
                callbacks.on_train_batch_end(step, &logs, self)?;
                let position = Position {
                    epoch,
                    step: step + 1,
                    totals: Some((totals.samples, totals.sums.clone())),
                };
                self.write_requested_backup(&position, run.shape, history, callbacks)?;
                if self.stop_training {
                    break;
                }
            }
            Ok(())
        })?;
        Ok(totals)
    }

    /// Loss and metrics over `data` in inference mode. `options` is a batch size per replica,
    /// or [`EvaluateOptions`] with callbacks and sample weights.
    pub fn evaluate<'a>(
        &mut self,
        data: &dyn Dataset,
        options: impl Into<EvaluateOptions<'a>>,
    ) -> Result<Logs> {
        let options = options.into();
        self.prepare_for(data)?;
        if self.replicas()?.serve()? {
            return Ok(Logs::new());
        }
        let loader = self.loader(
            data,
            options.batch_size_per_replica,
            LoaderOptions {
                sample_weight: sample_weights(data, options.sample_weight)?,
                ..LoaderOptions::default()
            },
        )?;
        let mut callbacks = CallbackList::new(options.callbacks, self.is_chief());
        let logs = self.run_evaluation(&loader, &mut callbacks)?;
        self.replicas()?.end_call()?;
        Ok(logs)
    }

    fn run_evaluation(
        &mut self,
        loader: &Loader<'_>,
        callbacks: &mut CallbackList,
    ) -> Result<Logs> {
        let mut totals = Totals::new(&self.metrics);
        callbacks.on_test_begin(self)?;
        std::thread::scope(|scope| -> Result<()> {
            for (step, batch) in loader.spawn(scope, 0).enumerate() {
                callbacks.on_test_batch_begin(step, self)?;
                totals.add(&self.replicas()?.test_step(&batch?)?);
                callbacks.on_test_batch_end(step, &totals.logs(), self)?;
            }
            Ok(())
        })?;
        let logs = totals.logs();
        callbacks.on_test_end(&logs, self)?;
        Ok(logs)
    }

    /// The model's outputs for `x` (`(n, input_shape...)`, any device) on the CPU, computed in
    /// global batches of `batch_size_per_replica * num_replicas_in_sync()` (each replica takes
    /// its part). `options` is that batch size, or [`PredictOptions`] with callbacks. Under
    /// multi-worker training each worker predicts all of `x` on its own replicas.
    pub fn predict(&mut self, x: &Tensor, options: impl Into<PredictOptions>) -> Result<Tensor> {
        let options = options.into();
        if options.batch_size_per_replica == 0 {
            return Err(Error::invalid("batch size must be positive, got 0"));
        }
        let n = self.prepare_inputs(x)?;
        if self.replicas()?.serve()? {
            return self.no_predictions();
        }
        let x = x.to_dtype(candle_core::DType::F32)?;
        let batch = options.batch_size_per_replica * self.strategy.local_replicas();
        let mut callbacks = CallbackList::new(options.callbacks, self.is_chief());
        callbacks.on_predict_begin(self)?;
        let mut outputs = Vec::with_capacity(n.div_ceil(batch));
        for (step, start) in (0..n).step_by(batch).enumerate() {
            callbacks.on_predict_batch_begin(step, self)?;
            let part = x.narrow(0, start, batch.min(n - start))?;
            let out = self.replicas()?.predict_step(&part)?;
            callbacks.on_predict_batch_end(step, &out, self)?;
            outputs.push(out);
        }
        callbacks.on_predict_end(self)?;
        self.replicas()?.end_call()?;
        Ok(Tensor::cat(&outputs, 0)?)
    }

    /// Checks that `x` has a batch dimension and samples, builds for its sample shape if
    /// needed, and returns its sample count.
    fn prepare_inputs(&mut self, x: &Tensor) -> Result<usize> {
        let dims = x.dims();
        let Some((&n, sample)) = dims.split_first() else {
            return Err(Error::invalid("the inputs need a batch dimension"));
        };
        if n == 0 {
            return Err(Error::EmptyDataset("the inputs".into()));
        }
        self.build(sample)?;
        Ok(n)
    }

    /// One batch as `fit` would see it: checked against the loss, on the CPU, `f32` inputs.
    fn one_batch(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        sample_weight: Option<&Tensor>,
    ) -> Result<Batch> {
        let n = self.prepare_inputs(x)?;
        let data = crate::data::InMemoryDataset::new(x.clone(), y.clone())?.named("the batch");
        let output_shape = self.built()?.output_shape.clone();
        self.loss.check_targets(&data.targets(), &output_shape)?;
        let (x, y) = data.to_tensors()?;
        let batch = Batch::new(x, y);
        Ok(match sample_weight {
            Some(w) if w.dims() != [n] => {
                return Err(Error::Shape {
                    layer: "sample_weight".into(),
                    expected: format!("({n},)"),
                    got: format!("{:?}", w.dims()),
                })
            }
            Some(w) => batch.with_weights(
                w.to_device(&candle_core::Device::Cpu)?
                    .to_dtype(candle_core::DType::F32)?,
            ),
            None => batch,
        })
    }

    /// One training step on this batch, as Keras's `train_on_batch`: the whole batch is the
    /// global batch (split across this process's replicas; under multi-worker training each
    /// worker passes its own part). Returns the batch's loss and metrics. An update whose loss
    /// or gradients are not finite is not applied, and the loss is then NaN. On a process that
    /// serves the others (a parameter server), it and the other `*_on_batch` methods serve that
    /// one batch and return nothing (empty logs, no rows), as `fit` does.
    pub fn train_on_batch(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        sample_weight: Option<&Tensor>,
    ) -> Result<Logs> {
        let batch = self.one_batch(x, y, sample_weight)?;
        if self.replicas()?.serve()? {
            return Ok(Logs::new());
        }
        let lr = self.learning_rate;
        let stats = self.replicas()?.train_step(&batch, lr)?;
        self.replicas()?.end_call()?;
        Ok(Totals::of(&self.metrics, &stats, true).logs())
    }

    /// Loss and metrics of this batch in inference mode, as Keras's `test_on_batch`.
    pub fn test_on_batch(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        sample_weight: Option<&Tensor>,
    ) -> Result<Logs> {
        let batch = self.one_batch(x, y, sample_weight)?;
        if self.replicas()?.serve()? {
            return Ok(Logs::new());
        }
        let stats = self.replicas()?.test_step(&batch)?;
        self.replicas()?.end_call()?;
        Ok(Totals::of(&self.metrics, &stats, false).logs())
    }

    /// The outputs for this batch in one step, as Keras's `predict_on_batch`.
    pub fn predict_on_batch(&mut self, x: &Tensor) -> Result<Tensor> {
        self.prepare_inputs(x)?;
        if self.replicas()?.serve()? {
            return self.no_predictions();
        }
        let x = x.to_dtype(candle_core::DType::F32)?;
        let out = self.replicas()?.predict_step(&x)?;
        self.replicas()?.end_call()?;
        Ok(out)
    }

    /// What `predict` returns on a process that serves the others: no rows.
    fn no_predictions(&self) -> Result<Tensor> {
        let mut empty = vec![0];
        empty.extend(&self.built()?.output_shape);
        Ok(Tensor::zeros(
            empty,
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )?)
    }
}

/// `sample_weight` checked against `data`: one finite, non-negative weight per sample.
fn sample_weights(data: &dyn Dataset, weights: Option<&[f32]>) -> Result<Option<Arc<[f32]>>> {
    let Some(weights) = weights else {
        return Ok(None);
    };
    if weights.len() != data.len() {
        return Err(Error::invalid(format!(
            "sample_weight has {} values but `{}` has {} samples",
            weights.len(),
            data.name(),
            data.len()
        )));
    }
    if let Some((i, w)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w >= 0.0))
    {
        return Err(Error::invalid(format!(
            "sample_weight[{i}] is {w}; weights must be finite and >= 0"
        )));
    }
    Ok(Some(weights.into()))
}

/// `class_weight` as one weight per class index (1 for classes not listed), checked against
/// `data`'s classes.
fn class_weights(
    data: &dyn Dataset,
    weights: Option<&HashMap<usize, f32>>,
) -> Result<Option<Arc<[f32]>>> {
    let Some(weights) = weights else {
        return Ok(None);
    };
    let classes = match data.targets() {
        crate::data::Targets::Classes(k) => k,
        crate::data::Targets::Values(shape) => shape.iter().product(),
    };
    let mut dense = vec![1f32; classes];
    for (&class, &w) in weights {
        if !(w.is_finite() && w >= 0.0) {
            return Err(Error::invalid(format!(
                "class_weight for class {class} is {w}; weights must be finite and >= 0"
            )));
        }
        let slot = dense.get_mut(class).ok_or_else(|| {
            Error::invalid(format!(
                "class_weight names class {class}, but `{}` has {classes} classes",
                data.name()
            ))
        })?;
        *slot = w;
    }
    Ok(Some(dense.into()))
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

/// One epoch of a `fit` run: its loader, number, steps and the run's shape.
struct EpochRun<'l, 'd> {
    loader: &'l Loader<'d>,
    epoch: usize,
    steps: usize,
    shape: RunShape,
}

/// Running sums of a pass over the data, turned into logs: the mean loss and each metric's
/// result from its summed state.
struct Totals {
    metrics: Metrics,
    samples: usize,
    sums: Vec<f64>,
}

impl Totals {
    fn new(metrics: &Metrics) -> Self {
        Self {
            sums: vec![0.0; 1 + metrics.state_size()],
            metrics: metrics.clone(),
            samples: 0,
        }
    }

    /// The totals of one step (a training step when `training`).
    fn of(metrics: &Metrics, stats: &StepStats, training: bool) -> Self {
        let mut totals = Self::new(metrics);
        if training {
            totals.add_training_step(stats);
        } else {
            totals.add(stats);
        }
        totals
    }

    fn add(&mut self, stats: &StepStats) {
        self.samples += stats.samples;
        for (total, s) in self.sums.iter_mut().zip(&stats.sums) {
            *total += s;
        }
    }

    /// Adds a training step. A step that could not be applied had a non-finite loss or
    /// gradient; the epoch's loss reports it as NaN, so `TerminateOnNaN` sees it even when the
    /// loss itself was finite (a NaN gradient behind a finite loss).
    fn add_training_step(&mut self, stats: &StepStats) {
        self.add(stats);
        if !stats.applied && stats.samples > 0 {
            if let Some(loss) = self.sums.first_mut() {
                *loss = f64::NAN;
            }
        }
    }

    fn logs(&self) -> Logs {
        let mut logs = Logs::new();
        logs.set("loss", self.sums[0] / self.samples.max(1) as f64);
        for (name, value) in self.metrics.results(&self.sums[1..]) {
            logs.set(name.to_string(), value);
        }
        logs
    }
}
