//! `Model`: a compiled network. It owns the epoch loop (`fit`), `evaluate`, `predict`, and
//! weight I/O; the strategy it was compiled with owns placement and the training step.
//!
//! `fit` stays short, as Keras's does: build the loader, wrap the callbacks, and for each epoch
//! run `train_step` per batch, average the statistics, validate, and hand the logs to the
//! callbacks. Everything observable happens in callbacks.

use std::sync::Arc;

use candle_core::Tensor;

use crate::callbacks::{Callback, CallbackList, FitInfo, History, Logs, ProgressBar, Verbosity};
use crate::data::{Augment, Dataset, Loader, LoaderOptions};
use crate::layers::{Sequential, Summary};
use crate::metrics::Metric;
use crate::optimizers::OptimizerConfig;
use crate::params::Weights;
use crate::replica::ModelSpec;
use crate::strategy::{DistributedModel, StepStats, Strategy, WorkerInfo};
use crate::{Error, Loss, Result};

/// Options of [`Model::fit`], with Keras's defaults.
pub struct FitOptions<'a> {
    /// Train until this epoch (exclusive), counted from 0. Default 1.
    pub epochs: usize,
    /// Samples per replica per step; the global batch is this times the number of replicas.
    /// Default 32.
    pub batch_size_per_replica: usize,
    /// Data evaluated after each epoch, logged with a `val_` prefix.
    pub validation: Option<&'a dyn Dataset>,
    /// Fraction of the training data, taken from its end before shuffling, held out for
    /// validation instead of `validation`. Default 0.
    pub validation_split: f64,
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
}

impl Default for FitOptions<'_> {
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size_per_replica: 32,
            validation: None,
            validation_split: 0.0,
            shuffle: true,
            seed: None,
            callbacks: Vec::new(),
            initial_epoch: 0,
            drop_remainder: false,
            steps_per_epoch: None,
            verbosity: Verbosity::Auto,
            augment: None,
        }
    }
}

/// The model once built: its replicas and the shapes it was built for.
struct BuiltModel {
    input_shape: Vec<usize>,
    output_shape: Vec<usize>,
    summary: Summary,
    replicas: Box<dyn DistributedModel>,
}

/// A compiled model.
pub struct Model {
    network: Sequential,
    optimizer: Box<dyn OptimizerConfig>,
    loss: Loss,
    metrics: Vec<Metric>,
    strategy: Arc<dyn Strategy>,
    seed: u64,
    built: Option<BuiltModel>,
    learning_rate: f64,
    stop_training: bool,
}

impl Sequential {
    /// Compiles the network with an optimizer, a loss, metrics and a strategy. The model is
    /// built now if an input shape was declared, otherwise on first use.
    pub fn compile<S, O, M>(
        self,
        optimizer: O,
        loss: Loss,
        metrics: M,
        strategy: &S,
    ) -> Result<Model>
    where
        S: Strategy + Clone + 'static,
        O: OptimizerConfig,
        M: IntoIterator<Item = Metric>,
    {
        let learning_rate = optimizer.learning_rate();
        let mut model = Model {
            network: self,
            optimizer: Box::new(optimizer),
            loss,
            metrics: metrics.into_iter().collect(),
            strategy: Arc::new(strategy.clone()),
            seed: 0,
            built: None,
            learning_rate,
            stop_training: false,
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
        let summary = self.network.summary(input_shape)?;
        let output_shape = summary
            .rows
            .last()
            .map(|r| r.output_shape.clone())
            .unwrap_or_default();
        let spec = ModelSpec {
            network: self.network.clone(),
            input_shape: input_shape.to_vec(),
            optimizer: self.optimizer.clone(),
            loss: self.loss,
            metrics: self.metrics.clone(),
            seed: self.seed,
        };
        let replicas = self.strategy.distribute(&spec)?;
        self.built = Some(BuiltModel {
            input_shape: input_shape.to_vec(),
            output_shape,
            summary,
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

    /// Builds for `data`'s sample shape if needed, and checks that its targets fit the loss and
    /// the model's output.
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
        self.loss.check_targets(&data.targets(), &output_shape)
    }

    /// The layer table: output shapes and trainable / non-trainable parameter counts.
    pub fn summary(&self) -> Result<&Summary> {
        Ok(&self.built()?.summary)
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
        self.built_mut()?.replicas.set_weights(weights)
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

    fn loader<'d>(
        &self,
        data: &'d dyn Dataset,
        batch_size_per_replica: usize,
        shuffle: bool,
        seed: u64,
        drop_remainder: bool,
        augment: Option<Arc<dyn Augment>>,
    ) -> Result<Loader<'d>> {
        if batch_size_per_replica == 0 {
            return Err(Error::invalid("batch size must be positive, got 0"));
        }
        let worker = self.strategy.worker();
        Loader::new(
            data,
            LoaderOptions {
                batch_size: batch_size_per_replica * self.strategy.num_replicas_in_sync(),
                shuffle,
                seed,
                drop_remainder,
                shard: (worker.size > 1).then_some((worker.rank, worker.size)),
                augment,
                ..LoaderOptions::default()
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
            return self.fit(
                &train,
                FitOptions {
                    validation: Some(&held_out),
                    validation_split: 0.0,
                    ..options
                },
            );
        }
        if options.steps_per_epoch == Some(0) {
            return Err(Error::invalid("steps_per_epoch must be positive"));
        }
        self.prepare_for(data)?;
        if let Some(val) = options.validation {
            self.prepare_for(val)?;
        }
        let seed = options.seed.unwrap_or(self.seed);
        let loader = self.loader(
            data,
            options.batch_size_per_replica,
            options.shuffle,
            seed,
            options.drop_remainder,
            options.augment.clone(),
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
        callbacks.on_train_begin(&info, self)?;
        let mut logs = Logs::new();
        for epoch in options.initial_epoch..options.epochs {
            callbacks.on_epoch_begin(epoch, self)?;
            logs = self.train_epoch(&loader, epoch, steps, &mut callbacks)?;
            if let Some(val) = options.validation {
                let val_logs = self.evaluate(val, options.batch_size_per_replica)?;
                for (k, v) in &val_logs {
                    logs.set(format!("val_{k}"), v);
                }
            }
            logs.set("lr", self.learning_rate);
            history.on_epoch_end(epoch, &logs, self)?;
            callbacks.on_epoch_end(epoch, &logs, self)?;
            if self.stop_training {
                break;
            }
        }
        callbacks.on_train_end(&logs, self)?;
        Ok(history)
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

    fn train_epoch(
        &mut self,
        loader: &Loader<'_>,
        epoch: usize,
        steps: usize,
        callbacks: &mut CallbackList,
    ) -> Result<Logs> {
        let mut totals = Totals::new(&self.metrics);
        std::thread::scope(|scope| -> Result<()> {
            for (step, batch) in loader.spawn(scope, epoch).take(steps).enumerate() {
                let batch = batch?;
                callbacks.on_train_batch_begin(step, self)?;
                let lr = self.learning_rate;
                let stats = self.built_mut()?.replicas.train_step(&batch, lr)?;
                if !stats.applied && self.is_chief() {
                    eprintln!(
                        "warning: epoch {} step {}: the loss or a gradient is not finite; \
                         the update was skipped",
                        epoch + 1,
                        step + 1
                    );
                }
                totals.add_training_step(&stats);
                callbacks.on_train_batch_end(step, &totals.logs(), self)?;
                if self.stop_training {
                    break;
                }
            }
            Ok(())
        })?;
        Ok(totals.logs())
    }

    /// Loss and metrics over `data` in inference mode.
    pub fn evaluate(&mut self, data: &dyn Dataset, batch_size_per_replica: usize) -> Result<Logs> {
        self.prepare_for(data)?;
        let loader = self.loader(data, batch_size_per_replica, false, 0, false, None)?;
        let mut totals = Totals::new(&self.metrics);
        let replicas = &mut self.built_mut()?.replicas;
        std::thread::scope(|scope| -> Result<()> {
            for batch in loader.spawn(scope, 0) {
                totals.add(&replicas.test_step(&batch?)?);
            }
            Ok(())
        })?;
        Ok(totals.logs())
    }

    /// The model's outputs for `x` (`(n, input_shape...)`, any device), in batches of
    /// `batch_size`, on the CPU.
    pub fn predict(&mut self, x: &Tensor, batch_size: usize) -> Result<Tensor> {
        if batch_size == 0 {
            return Err(Error::invalid("batch size must be positive, got 0"));
        }
        let dims = x.dims();
        let Some((&n, sample)) = dims.split_first() else {
            return Err(Error::invalid("predict needs a batch dimension"));
        };
        if n == 0 {
            return Err(Error::EmptyDataset("predict input".into()));
        }
        self.build(sample)?;
        let x = x.to_dtype(candle_core::DType::F32)?;
        let replicas = &mut self.built_mut()?.replicas;
        let outputs = (0..n)
            .step_by(batch_size)
            .map(|start| replicas.predict_step(&x.narrow(0, start, batch_size.min(n - start))?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&outputs, 0)?)
    }
}

/// Running sums of a pass over the data, turned into mean logs.
struct Totals {
    names: Vec<String>,
    samples: usize,
    sums: Vec<f64>,
}

impl Totals {
    fn new(metrics: &[Metric]) -> Self {
        let names: Vec<String> = std::iter::once("loss".to_string())
            .chain(metrics.iter().map(|m| m.name()))
            .collect();
        Self {
            sums: vec![0.0; names.len()],
            names,
            samples: 0,
        }
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
        for (name, sum) in self.names.iter().zip(&self.sums) {
            logs.set(name.clone(), sum / self.samples.max(1) as f64);
        }
        logs
    }
}
