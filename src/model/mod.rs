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
//!
//! This file holds the type, `compile`, building and the small queries and requests; the rest
//! is split by concern: `options` (`FitOptions`, `EvaluateOptions`, `PredictOptions`), `fit`
//! (the epoch loop, resuming and backups), `inference` (`evaluate`, `predict`, the `*_on_batch`
//! methods), `state` (weights and training-state I/O) and `totals` (running sums into logs).
//! Every public call that runs steps goes through [`Model::strategy_call`], which brackets it
//! with the strategy's `serve` and `end_call`. Sample and class weights are checked and applied
//! in `crate::data::weighting`.

use std::sync::Arc;

use crate::data::{Dataset, Loader, LoaderOptions};
use crate::functional::PerOutput;
use crate::layers::Summary;
use crate::losses::Loss;
use crate::metrics::Metrics;
use crate::network::Network;
use crate::objective::Objective;
use crate::optimizers::OptimizerConfig;
use crate::strategy::{DistributedModel, ModelSpec, Strategy, WorkerInfo};
use crate::{ComputePath, DTypePolicy, Error, Result};
use resume::FitRequests;

mod fit;
mod inference;
mod inputs;
mod options;
pub(crate) mod resume;
mod state;
mod totals;

pub use options::{EvaluateOptions, FitOptions, PredictOptions};

/// The model once built: its replicas and the shapes it was built for.
struct BuiltModel {
    input_shapes: Vec<Vec<usize>>,
    output_shapes: Vec<Vec<usize>>,
    replicas: Box<dyn DistributedModel>,
}

/// A compiled model.
pub struct Model {
    network: Network,
    optimizer: Box<dyn OptimizerConfig>,
    loss: Objective,
    metrics: Metrics,
    strategy: Arc<dyn Strategy>,
    seed: u64,
    compute_path: ComputePath,
    dtype_policy: DTypePolicy,
    built: Option<BuiltModel>,
    learning_rate: f64,
    stop_training: bool,
    requests: FitRequests,
    /// Batches whose gradients the replicas hold for the next update (gradient accumulation).
    accumulated: usize,
}

/// Compiling a model's recipe (a [`Sequential`](crate::layers::Sequential), a
/// [`Functional`](crate::functional::Functional) or a [`Network`]) into a [`Model`] with an
/// optimizer, a loss, metrics and a strategy: one `compile` for every kind of recipe, as
/// Keras's `model.compile`. It is in the [prelude](crate::prelude).
///
/// The model is built now when the recipe declares its inputs (a functional model, or a
/// `Sequential` with [`input_shape`](crate::layers::Sequential::input_shape)), otherwise on
/// first use. `loss` is any
/// [`Loss`] (Keras's built-ins live in [`crate::losses`]), or [`PerOutput`] losses for a
/// functional model of several outputs; `metrics` is an array (`[Accuracy]`), a tuple of
/// different metrics, `()`, or anything else that converts into [`Metrics`].
///
/// ```
/// use kandle::prelude::*;
///
/// let model = Sequential::new()
///     .add(Dense::new(2))
///     .input_shape(&[3])
///     .compile(Sgd::new(0.1), MeanSquaredError, (), &OneDeviceStrategy::cpu())?;
/// assert!(model.is_built());
/// # Ok::<(), kandle::Error>(())
/// ```
pub trait Compile: Into<Network> {
    /// The compiled model.
    fn compile<S, O, L, M>(self, optimizer: O, loss: L, metrics: M, strategy: &S) -> Result<Model>
    where
        Self: Sized,
        S: Strategy + Clone + 'static,
        O: OptimizerConfig,
        L: Loss + 'static,
        M: Into<Metrics>,
    {
        Model::compile(self.into(), optimizer, loss, metrics, strategy)
    }
}

impl<T: Into<Network>> Compile for T {}

impl Model {
    /// [`Compile::compile`].
    fn compile<S, O, L, M>(
        network: Network,
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
        let (loss, metrics) = network.bind_outputs(loss, metrics.into())?;
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
            network,
            optimizer: Box::new(optimizer),
            loss,
            metrics,
            strategy: Arc::new(strategy.clone()),
            seed: 0,
            compute_path: ComputePath::from_env(),
            dtype_policy: DTypePolicy::default(),
            built: None,
            learning_rate,
            stop_training: false,
            requests: FitRequests::default(),
            accumulated: 0,
        };
        let declared: Vec<Vec<usize>> = model
            .network
            .declared_inputs()
            .into_iter()
            .map(|i| i.shape)
            .collect();
        if !declared.is_empty() {
            model.build_inputs(&declared)?;
        }
        Ok(model)
    }
}

impl Network {
    /// The loss and metrics `compile` keeps: as given, or, for a functional model of several
    /// outputs (or a [`PerOutput`] loss), bound to the outputs.
    fn bind_outputs<L: Loss + 'static>(
        &self,
        loss: L,
        metrics: Metrics,
    ) -> Result<(Objective, Metrics)> {
        let loss: Box<dyn std::any::Any> = Box::new(loss);
        let outputs = self.output_names();
        let per_output = match loss.downcast::<PerOutput>() {
            Ok(per_output) => Some(*per_output),
            Err(other) => match other.downcast::<L>() {
                Ok(loss) => {
                    let loss: Arc<dyn Loss> = Arc::new(*loss);
                    match &outputs {
                        Some(names) if names.len() > 1 => Some(PerOutput::for_all(loss, names)),
                        _ => return Ok((Objective::from(loss), metrics)),
                    }
                }
                Err(_) => return Err(Error::invalid("compile: the loss is of an unknown type")),
            },
        };
        let (Some(names), Some(per_output)) = (outputs, per_output) else {
            return Err(Error::invalid(
                "compile: per-output losses (PerOutput) need a functional model; a Sequential \
                 has one output, which takes a loss as it is",
            ));
        };
        per_output.bind(&names, &metrics)
    }
}

impl Model {
    /// Seeds the initial weights (default 0) and rebuilds the model if it was built.
    pub fn with_seed(mut self, seed: u64) -> Result<Self> {
        self.seed = seed;
        if let Some(shapes) = self.built.take().map(|b| b.input_shapes) {
            self.build_inputs(&shapes)?;
        }
        Ok(self)
    }

    /// Chooses the code the model runs (default: [`ComputePath::from_env`], so
    /// [`ComputePath::Auto`] unless `KANDLE_COMPUTE` says otherwise) and rebuilds the model if
    /// it was built. [`ComputePath::DeviceGeneric`] runs on the CPU the candle ops a GPU runs.
    pub fn with_compute_path(mut self, path: ComputePath) -> Result<Self> {
        self.compute_path = path;
        if let Some(shapes) = self.built.take().map(|b| b.input_shapes) {
            self.build_inputs(&shapes)?;
        }
        Ok(self)
    }

    /// Chooses the dtypes the model computes in, as Keras's
    /// `keras.mixed_precision.set_global_policy` (default [`DTypePolicy::float32`]), and
    /// rebuilds the model if it was built. Under `mixed_float16` or `mixed_bfloat16`,
    /// convolutions and dense layers compute in half precision on the device-generic path (a
    /// GPU's); variables, optimizer state, batch-norm statistics, the loss and the final
    /// softmax stay `float32`. A policy that scales the loss (`mixed_float16`) skips a step
    /// whose scaled gradients are not finite and halves the scale; the epoch's logs give it as
    /// `loss_scale`. A policy the device cannot run is an error here, naming the op.
    ///
    /// ```
    /// use kandle::prelude::*;
    /// use kandle::DTypePolicy;
    ///
    /// let model = Sequential::new()
    ///     .input_shape(&[4])
    ///     .add(Dense::new(3))
    ///     .add(Activation::Softmax)
    ///     .compile(Sgd::new(0.1), SparseCategoricalCrossentropy::new(), [Accuracy], &OneDeviceStrategy::cpu())?
    ///     .with_dtype_policy(DTypePolicy::mixed_float16())?;
    /// assert_eq!(model.dtype_policy().to_string(), "mixed_float16");
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn with_dtype_policy(mut self, policy: DTypePolicy) -> Result<Self> {
        self.dtype_policy = policy;
        if let Some(shapes) = self.built.take().map(|b| b.input_shapes) {
            self.build_inputs(&shapes)?;
        }
        Ok(self)
    }

    /// The dtypes the model computes in.
    pub fn dtype_policy(&self) -> DTypePolicy {
        self.dtype_policy
    }

    /// The code the model runs.
    pub fn compute_path(&self) -> ComputePath {
        self.compute_path
    }

    /// Builds the model for inputs of `input_shape` (without the batch dimension) on the
    /// strategy's devices. Building again for the same shape does nothing; another shape is an
    /// error. A model of several inputs is built for the shapes its inputs declare when it is
    /// compiled.
    pub fn build(&mut self, input_shape: &[usize]) -> Result<()> {
        self.build_inputs(&[input_shape.to_vec()])
    }

    /// [`Self::build`] for one shape per input. A model that takes images of any size
    /// ([`Network::any_size`]) built for another size is built again for these, with its
    /// weights and optimizer state.
    fn build_inputs(&mut self, input_shapes: &[Vec<usize>]) -> Result<()> {
        if let Some(b) = &self.built {
            if b.input_shapes == input_shapes {
                return Ok(());
            }
            if self.network.takes_any_size() {
                return self.rebuild_for(input_shapes);
            }
            let show = |shapes: &[Vec<usize>]| {
                let each: Vec<String> = shapes
                    .iter()
                    .map(|s| crate::error::shape_with_batch(s))
                    .collect();
                each.join(", ")
            };
            return Err(Error::Shape {
                layer: "model".into(),
                expected: show(&b.input_shapes),
                got: show(input_shapes),
            });
        }
        let spec = ModelSpec {
            network: self.network.clone(),
            input_shapes: input_shapes.to_vec(),
            optimizer: self.optimizer.clone(),
            loss: self.loss.clone(),
            metrics: self.metrics.clone(),
            seed: self.seed,
            compute_path: self.compute_path,
            dtype_policy: self.dtype_policy,
        };
        let replicas = self.strategy.distribute(&spec)?;
        let output_shapes = match self.network.output_shapes_for(input_shapes)? {
            Some(shapes) => shapes,
            None => vec![replicas
                .summary()
                .rows
                .last()
                .map(|r| r.output_shape.clone())
                .unwrap_or_default()],
        };
        self.built = Some(BuiltModel {
            input_shapes: input_shapes.to_vec(),
            output_shapes,
            replicas,
        });
        Ok(())
    }

    /// Builds the model again for `input_shapes` with the weights and the optimizer state it
    /// has; on an error it stays as it was.
    fn rebuild_for(&mut self, input_shapes: &[Vec<usize>]) -> Result<()> {
        let Some(mut built) = self.built.take() else {
            return self.build_inputs(input_shapes);
        };
        let weights = built.replicas.weights();
        let state = built.replicas.optimizer_state();
        let rebuilt = (|| {
            self.build_inputs(input_shapes)?;
            self.set_weights(&weights?)?;
            self.replicas()?.set_optimizer_state(&state?)
        })();
        if rebuilt.is_err() {
            self.built = Some(built);
        }
        rebuilt
    }

    /// Makes the layers under each of `names` trainable (`true`) or frozen, as Keras's
    /// `layer.trainable = ...` followed by `compile`. A name is a layer's full dotted name
    /// (`layer4`, `layer4.1.conv2`) and covers every layer inside it; `""` covers the whole
    /// model. It overrides the recipe's `.trainable(...)` and earlier calls for the layers it
    /// names.
    ///
    /// A built model is rebuilt on the strategy's devices with its current weights, so every
    /// replica's optimizer then updates exactly the variables that train, from a fresh state
    /// (as recompiling does in Keras); the learning rate stays as it is. A frozen
    /// `BatchNormalization` normalises with its moving statistics and leaves them unchanged;
    /// unfrozen, it uses batch statistics again unless built in inference mode
    /// ([`LayerSpecExt::inference_mode`](crate::layers::LayerSpecExt::inference_mode)). A name
    /// that covers no variable of the built model is an error, and the model is left as it
    /// was.
    ///
    /// ```
    /// use kandle::layers::{Dense, LayerSpecExt, Sequential};
    /// use kandle::losses::MeanSquaredError;
    /// use kandle::optimizers::Sgd;
    /// use kandle::{Compile, OneDeviceStrategy};
    ///
    /// let mut model = Sequential::new()
    ///     .input_shape(&[3])
    ///     .add(Dense::new(4).named("base").trainable(false))
    ///     .add(Dense::new(1).named("head"))
    ///     .compile(Sgd::new(0.1), MeanSquaredError, (), &OneDeviceStrategy::cpu())?;
    /// assert_eq!(model.summary()?.trainable, 4 + 1);
    /// model.set_trainable(&["base"], true)?;
    /// assert_eq!(model.summary()?.trainable, 3 * 4 + 4 + 4 + 1);
    /// assert!(model.set_trainable(&["bsae"], true).is_err());
    /// # Ok::<(), kandle::Error>(())
    /// ```
    pub fn set_trainable(&mut self, names: &[&str], trainable: bool) -> Result<()> {
        let network = self.network.clone().with_trainable(names, trainable);
        let Some(built) = self.built.take() else {
            self.network = network;
            return Ok(());
        };
        let rebuilt = (|| {
            let weights = built.replicas.weights()?;
            let unknown: Vec<&str> = names
                .iter()
                .copied()
                .filter(|n| {
                    let rule = crate::params::TrainableRule::new(*n, trainable);
                    !weights.keys().any(|k| rule.covers(k))
                })
                .collect();
            if !unknown.is_empty() {
                return Err(Error::invalid(format!(
                    "set_trainable: no layer of the model is named {}",
                    crate::params::list(&unknown)
                )));
            }
            let saved = std::mem::replace(&mut self.network, network);
            let result = self
                .build_inputs(&built.input_shapes)
                .and_then(|()| self.set_weights(&weights));
            if result.is_err() {
                self.network = saved;
            }
            result
        })();
        if rebuilt.is_err() {
            self.built = Some(built);
        }
        rebuilt
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

    /// Checks `data`'s inputs against the model's (by name where it names them, else in
    /// order), builds for them if needed, and checks that its targets fit the losses, the
    /// metrics and the model's outputs.
    fn prepare_for(&mut self, data: &dyn Dataset) -> Result<()> {
        if data.is_empty() {
            return Err(Error::EmptyDataset(data.name().to_string()));
        }
        let given = data.inputs();
        let order = inputs::match_inputs(&self.network.declared_inputs(), &given, data.name())?;
        let shapes: Vec<Vec<usize>> = match &order {
            Some(order) => order.iter().map(|&i| given[i].shape.clone()).collect(),
            None => given.iter().map(|g| g.shape.clone()).collect(),
        };
        self.build_inputs(&shapes).map_err(|e| match e {
            Error::Shape { expected, got, .. } => Error::Shape {
                layer: format!("model (input from `{}`)", data.name()),
                expected,
                got,
            },
            other => other,
        })?;
        self.check_targets(&data.targets())
    }

    /// Checks targets against the losses, the metrics and the model's outputs.
    fn check_targets(&self, targets: &crate::data::Targets) -> Result<()> {
        let output_shapes = &self.built()?.output_shapes;
        self.loss.check_targets(targets, output_shapes)?;
        for (m, output) in self.metrics.iter_outputs() {
            if let (Some(target), Some(shape)) = (targets.part(output), output_shapes.get(output)) {
                m.check_targets(target, shape)?;
            }
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

    /// Where `fit` writes a backup of its own accord (when a stop signal ends it; see
    /// [`crate::preemption`]): `path`, after moving the backup already there to `previous` when
    /// given, as [`Self::request_backup`]. Set from `on_train_begin` by callbacks such as
    /// [`BackupAndRestore`](crate::callbacks::BackupAndRestore); without one, a preempted `fit`
    /// stops without a backup.
    pub fn set_backup_target(
        &mut self,
        path: std::path::PathBuf,
        previous: Option<std::path::PathBuf>,
    ) {
        self.requests.backup_target = Some((path, previous));
    }

    /// Where the current (or last) `fit` stopped for a stop signal, once it did: callbacks'
    /// `on_train_end` reads it to tell a preemption from the end of training.
    pub fn preempted(&self) -> Option<&crate::preemption::Preempted> {
        self.requests.preempted.as_ref()
    }

    /// Whether a stop was requested during the current `fit`.
    pub fn stop_requested(&self) -> bool {
        self.stop_training
    }

    /// A loader over `data` in global batches of `batch_size_per_replica` times the replicas in
    /// sync, yielding this worker's part of each under multi-worker training, with each
    /// batch's inputs in the model's order (the data checked by `prepare_for`).
    fn loader<'d>(
        &self,
        data: &'d dyn Dataset,
        batch_size_per_replica: usize,
        options: LoaderOptions,
    ) -> Result<Loader<'d>> {
        if batch_size_per_replica == 0 {
            return Err(Error::invalid("batch size must be positive, got 0"));
        }
        let order =
            inputs::match_inputs(&self.network.declared_inputs(), &data.inputs(), data.name())?;
        Loader::new(
            data,
            LoaderOptions {
                batch_size: batch_size_per_replica * self.strategy.num_replicas_in_sync(),
                shard: self.strategy.data_shard(),
                input_order: order.map(Arc::from),
                device: self.built.as_ref().and_then(|b| b.replicas.input_device()),
                ..options
            },
        )
    }

    /// Runs `call`, one call of the strategy (`fit`, `evaluate`, `predict` or a `*_on_batch`
    /// method, the model built), between [`WorkerHooks::serve`](crate::strategy::WorkerHooks::serve) and
    /// [`WorkerHooks::end_call`](crate::strategy::WorkerHooks::end_call). Returns `None`, without running `call`, on a process
    /// that served the others (the caller then returns its empty result); otherwise `call`'s
    /// result once the call is ended. An error from `call` is returned as is, without ending
    /// the call.
    fn strategy_call<T>(&mut self, call: impl FnOnce(&mut Self) -> Result<T>) -> Result<Option<T>> {
        if self.replicas()?.serve()? {
            return Ok(None);
        }
        let result = call(self)?;
        self.replicas()?.end_call()?;
        Ok(Some(result))
    }
}
