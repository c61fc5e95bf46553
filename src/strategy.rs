//! Distribution: the [`Strategy`] trait, [`OneDeviceStrategy`], and everything a strategy
//! author needs, in one place.
//!
//! A strategy owns placement, replication, reduction and where the update happens. It never
//! owns the epoch loop: `fit` is written once and drives any strategy through
//! [`DistributedModel`]. Mirrored, CentralStorage and MultiWorkerMirrored live in
//! `kandle-strategies` and are built from the parts below.
//!
//! The parts of a strategy:
//! - [`ModelSpec`] is what [`Strategy::distribute`] gets: the recipe, the input shape, the
//!   optimizer, loss and metrics, the seed;
//! - a [`Replica`] is one copy of the model on one device. Its part of a step becomes one
//!   [`StepBuffer`] ([`Replica::step_buffer`]); the buffers of all replicas (and workers) are
//!   summed by whatever means the strategy has; every replica that holds the variables then
//!   runs the step's final phase on the total ([`Replica::finish_step`], see [`step`]), which
//!   decides whether the step applies and how gradients and moving statistics are scaled, the
//!   same for every strategy;
//! - [`fused`] flattens many tensors into one buffer and back, so a step crosses devices and
//!   processes in one transfer;
//! - [`buckets`] cuts the gradients into buckets summed across replicas while the backward
//!   pass goes on ([`Replica::set_buckets`]), as PyTorch DDP overlaps its all-reduce;
//! - [`ReplicaGroup`] and [`ReplicaHandle`] let batch normalisation sum its statistics across
//!   replicas inside the forward pass (`SyncBatchNorm`).
//!
//! Contract every implementation keeps:
//! - **Equivalence**: for a model without per-replica batch statistics, a step at global batch
//!   `B` gives the weights one device would get at batch `B`;
//! - **Global statistics**: [`StepStats`] are summed over every replica and worker;
//! - **No bad update**: a step whose loss or gradients are not finite is not applied
//!   ([`StepStats::applied`] is false), so the last good weights survive;
//! - **Canonical weights**: [`DistributedModel::weights`] uses the recipe's names, whatever the
//!   strategy, so checkpoints move freely between strategies; so does
//!   [`DistributedModel::optimizer_state`].

mod one_device;

pub use one_device::OneDeviceStrategy;

pub use crate::cross_replica::{ReplicaGroup, ReplicaHandle};
pub use crate::error::panic_message;
pub use crate::layers::StagePlacement;
pub use crate::replica::step::StepStats;
pub use crate::replica::{buckets, fused, step};
pub use crate::replica::{ModelSpec, Replica, StageStep, StepBuffer};

use candle_core::{Device, Tensor};

use crate::data::Batch;
use crate::layers::Summary;
use crate::optimizers::NamedOptimizerState;
use crate::params::Weights;
use crate::{Error, Result};

/// This process's place among the workers of a multi-process job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerInfo {
    /// This worker's rank, from 0.
    pub rank: usize,
    /// Number of workers.
    pub size: usize,
}

impl Default for WorkerInfo {
    fn default() -> Self {
        Self { rank: 0, size: 1 }
    }
}

impl WorkerInfo {
    /// Whether this worker is the chief (rank 0), the one that logs and writes files.
    pub fn is_chief(&self) -> bool {
        self.rank == 0
    }
}

/// How a model is placed and trained. Implementations are cheap handles (`Clone`).
pub trait Strategy: Send + Sync {
    /// A short name for logs, e.g. `one_device` or `mirrored`.
    fn name(&self) -> &str;

    /// Replicas that each process a slice of every global batch, across all workers.
    fn num_replicas_in_sync(&self) -> usize;

    /// Replicas in this process: the local share of the global batch is
    /// `batch_size_per_replica * local_replicas()`.
    fn local_replicas(&self) -> usize {
        self.num_replicas_in_sync()
    }

    /// This process's rank among the workers (rank 0 of 1 for single-process strategies).
    fn worker(&self) -> WorkerInfo {
        WorkerInfo::default()
    }

    /// Which part of every global batch this process reads, as `(index, parts)`: the loader
    /// splits each global batch into `parts` near-equal parts and yields part `index`; `None`
    /// reads every batch whole. The default is this worker's rank among the workers when there
    /// are several; a strategy whose processes share samples (the stages of a pipeline) says
    /// otherwise.
    fn data_shard(&self) -> Option<(usize, usize)> {
        let worker = self.worker();
        (worker.size > 1).then_some((worker.rank, worker.size))
    }

    /// Builds the replicas of `spec`, all starting from the same weights.
    fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>>;
}

impl<S: Strategy + ?Sized> Strategy for std::sync::Arc<S> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn num_replicas_in_sync(&self) -> usize {
        (**self).num_replicas_in_sync()
    }
    fn local_replicas(&self) -> usize {
        (**self).local_replicas()
    }
    fn worker(&self) -> WorkerInfo {
        (**self).worker()
    }
    fn data_shard(&self) -> Option<(usize, usize)> {
        (**self).data_shard()
    }
    fn distribute(&self, spec: &ModelSpec) -> Result<Box<dyn DistributedModel>> {
        (**self).distribute(spec)
    }
}

/// The hooks by which the processes of a multi-process model keep in step: a parameter server
/// serving its workers through a whole call, workers agreeing on epoch totals and on the
/// backup to resume from, telling the servers a call ended. `fit`, `evaluate`, `predict` and
/// the `*_on_batch` methods call them; every default suits a model of one process.
pub trait WorkerHooks {
    /// Called by `fit`, `evaluate`, `predict` and the `*_on_batch` methods once the model is
    /// built, before anything else.
    /// A model whose process does not train but serves the others (a parameter server) serves
    /// them until every worker has ended the same call ([`WorkerHooks::end_call`]), then
    /// returns `true`, and the call returns at once with nothing (an empty history, empty logs,
    /// no predictions). The default returns `false`: this process trains.
    fn serve(&mut self) -> Result<bool> {
        Ok(false)
    }

    /// Called by `fit` at the end of every epoch, before validation, with the totals of the
    /// epoch's training steps as this process saw them (`samples`, `sums`; `applied` is
    /// unused): a strategy whose workers saw different steps replaces them with the totals
    /// over every worker, so that every worker's epoch logs (and the callbacks that read them)
    /// agree, and returns values to add to the logs (a parameter-server worker reports the
    /// staleness of its updates). A strategy may also make the workers wait for each other
    /// here. The default changes nothing and adds nothing.
    fn end_epoch(&mut self, totals: &mut StepStats) -> Result<Vec<(String, f64)>> {
        let _ = totals;
        Ok(Vec::new())
    }

    /// Called by the same methods as [`serve`](WorkerHooks::serve) when they end without
    /// error on a process that did not serve: lets a worker tell the processes serving it that
    /// it is done. The default does nothing.
    fn end_call(&mut self) -> Result<()> {
        Ok(())
    }

    /// Every worker's `values` (of one length on every worker), in rank order. `fit` uses it to
    /// check that all workers of a multi-process job resume from the same backup. The default,
    /// for a strategy of one process, returns `values`.
    fn all_gather_workers(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        Ok(values.to_vec())
    }
}

/// A model placed by a strategy: runs steps and exposes the weights by canonical name. How its
/// processes keep in step with each other is [`WorkerHooks`], which a model of one process
/// implements with no method (`impl WorkerHooks for MyModel {}`).
pub trait DistributedModel: WorkerHooks + Send {
    /// One training step on this worker's part of a global batch (CPU tensors, or on
    /// [`Self::input_device`]), at `lr`.
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<StepStats>;

    /// Where the steps want their batches: a device the loader's prefetch thread copies each
    /// batch to ahead of its step ([`LoaderOptions::device`](crate::data::LoaderOptions::device)),
    /// so that the copy runs while the step before it does. The default, `None`: batches come in
    /// host memory, and the model moves (or splits) them itself.
    fn input_device(&self) -> Option<Device> {
        None
    }

    /// Gradient accumulation: this worker's part of a global micro-batch (CPU tensors), whose
    /// gradients and sums each replica keeps (see [`Replica::accumulate`]) for the next
    /// [`train_step`](Self::train_step), which reduces them with its own batch's in its one
    /// reduction and applies one update. Nothing is reduced or applied here. Returns the
    /// micro-batch's sample count and sums over this process's replicas
    /// ([`StepStats::applied`] false). The default, for a strategy that cannot, is an error.
    fn accumulate(&mut self, batch: &Batch) -> Result<StepStats> {
        let _ = batch;
        Err(crate::Error::invalid(
            "this strategy does not support gradient accumulation",
        ))
    }

    /// Loss and metric sums of a batch in inference mode, over all workers.
    fn test_step(&mut self, batch: &Batch) -> Result<StepStats>;

    /// The model's outputs for `inputs` (one CPU tensor per model input, the same number of
    /// samples in each), one CPU tensor per output.
    fn predict_step(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>>;

    /// The current weights by canonical name, on the CPU.
    fn weights(&self) -> Result<Weights>;

    /// The layer table of the network the strategy built (its replicas' common recipe).
    fn summary(&self) -> &Summary;

    /// Replaces all weights on every replica. Fails without changing anything when the names or
    /// shapes do not match.
    fn set_weights(&mut self, weights: &Weights) -> Result<()>;

    /// The optimizer's state by canonical variable name, on the CPU: that of the replica that
    /// applies updates (every replica's is the same). [`Replica::optimizer_state`] gives it.
    /// A model whose variables live in other processes (a parameter-server worker) takes the
    /// weights that go with the state at the same time, so that [`weights`](Self::weights)
    /// called next gives them: `Model::training_state` calls this first.
    ///
    /// The default fails: a strategy whose model does not implement it cannot save a training
    /// state.
    fn optimizer_state(&mut self) -> Result<NamedOptimizerState> {
        Err(Error::invalid(
            "this strategy's model does not implement DistributedModel::optimizer_state, so its \
             optimizer state cannot be saved",
        ))
    }

    /// Replaces the optimizer's state on every replica that holds one
    /// ([`Replica::load_optimizer_state`]). Fails without changing anything when the kind,
    /// names or shapes do not match.
    ///
    /// The default fails, as [`DistributedModel::optimizer_state`] does.
    fn set_optimizer_state(&mut self, state: &NamedOptimizerState) -> Result<()> {
        let _ = state;
        Err(Error::invalid(
            "this strategy's model does not implement DistributedModel::set_optimizer_state, \
             so an optimizer state cannot be loaded",
        ))
    }
}
